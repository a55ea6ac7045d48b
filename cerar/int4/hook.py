"""The 4-bit all-reduce (``cerar.int4.all_reduce``) and its two-tier 8/4 variant as DDP communication hooks.

    state = Int4HookState(block=128)                                # flat, over DDP's ranks
    ddp_model.register_comm_hook(state, int4_hook)
    state = HierarchicalInt4HookState(block=128, intra="int8")      # two tiers, torchrun's layout (or layout=...)
    ddp_model.register_comm_hook(state, hierarchical_int4_hook)

They run as the 8-bit hooks do (``cerar.int8.hook``): each bucket averaged in place on the hook's own thread and
process groups, one bucket at a time in DDP's order; every rank receives the same bytes, so the replicas stay
identical; ``last_stats`` collects each bucket's stats. The CERAR fields the states inherit are not used. With
``error_feedback=True`` each bucket's roundings are fed back, as the 8-bit hooks' (``cerar.int8.hook``).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cerar.ddp import CerarHookState, transport_group
from cerar.formats.int4_blocks import DEFAULT_BLOCK, DEFAULT_ROTATE, DEFAULT_ROUNDING, check_format
from cerar.formats.int8_blocks import DEFAULT_BLOCK as DEFAULT_INTRA_BLOCK
from cerar.hierarchical.hook import HierarchicalHookState
from cerar.int4.all_reduce import int4_all_reduce
from cerar.int4.feedback import BucketFeedback, ErrorFeedback, bucket_feedback
from cerar.int4.two_tier import check_intra, hierarchical_int4_all_reduce
from cerar.ring.protocol import AllReduceStats
from cerar.ring.transport import _as_timedelta


@dataclass
class Int4HookState(CerarHookState):
    """Configuration and per-step record of the flat 4-bit hook: ``block``, ``rounding``, ``rotate`` and ``seed``
    (``int4_all_reduce``), ``error_feedback`` (module docstring), the timeout, DDP's process group and the group the
    messages travel on (made when not given)."""

    block: int = DEFAULT_BLOCK
    rounding: str = DEFAULT_ROUNDING
    rotate: bool = DEFAULT_ROTATE
    seed: int = 0
    error_feedback: bool = False

    def __post_init__(self):
        check_format(self.block, self.rounding, self.rotate, "Int4HookState")
        _as_timedelta(self.timeout)
        if self.transport is None and dist.is_initialized():
            self.transport = transport_group(self.process_group, self.timeout)
        self.feedback = BucketFeedback() if self.error_feedback else None

    def _reduce(self, tensor: torch.Tensor, feedback: ErrorFeedback | None = None) -> AllReduceStats:
        group = self.transport if self.transport is not None else self.process_group
        return int4_all_reduce(tensor, group, "avg", self.timeout, self.block, rounding=self.rounding,
                               rotate=self.rotate, seed=self.seed, timed=False, feedback=feedback)  # fmt: skip


@dataclass
class HierarchicalInt4HookState(HierarchicalHookState):
    """Configuration and per-step record of the two-tier 8/4 hook: ``block``, ``rounding``, ``rotate``, ``seed``,
    ``intra`` and ``intra_block`` (``hierarchical_int4_all_reduce``), ``error_feedback`` (module docstring), the node
    layout (default: from the launcher), the timeout and the hook's own tier groups (made when not given). DDP's
    process group must be the default group: the layout spans every rank."""

    block: int = DEFAULT_BLOCK
    rounding: str = DEFAULT_ROUNDING
    rotate: bool = DEFAULT_ROTATE
    seed: int = 0
    intra: str = "exact"
    intra_block: int = DEFAULT_INTRA_BLOCK
    error_feedback: bool = False

    def __post_init__(self):
        check_format(self.block, self.rounding, self.rotate, "HierarchicalInt4HookState")
        check_intra(self.intra, self.intra_block, "HierarchicalInt4HookState")
        self._take_layout()
        self._make_groups()
        self.feedback = BucketFeedback() if self.error_feedback else None

    def _reduce(self, tensor: torch.Tensor, feedback: ErrorFeedback | None = None):
        return hierarchical_int4_all_reduce(
            tensor, self.groups, "avg", self.timeout, self.block, intra=self.intra, intra_block=self.intra_block,
            rounding=self.rounding, rotate=self.rotate, seed=self.seed, timed=False, feedback=feedback,
        )  # fmt: skip


def int4_hook(state: Int4HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket with the 4-bit all-reduce."""
    return state.submit(bucket.buffer(), feedback=bucket_feedback(state.feedback, bucket))


def hierarchical_int4_hook(
    state: HierarchicalInt4HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket with the two-tier 8/4 all-reduce."""
    return state.submit(bucket.buffer(), feedback=bucket_feedback(state.feedback, bucket))


__all__ = ["HierarchicalInt4HookState", "Int4HookState", "hierarchical_int4_hook", "int4_hook"]
