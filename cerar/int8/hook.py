"""The 8-bit all-reduce (``cerar.int8.all_reduce``) and its two-tier variant as DDP communication hooks.

    state = QuantizedHookState(block=128)                          # flat, over DDP's ranks
    ddp_model.register_comm_hook(state, quantized_hook)
    state = HierarchicalQuantizedHookState(block=128)              # two tiers, torchrun's layout (or layout=...)
    ddp_model.register_comm_hook(state, hierarchical_quantized_hook)

Each gradient bucket is averaged in place with ``quantized_all_reduce`` (or
``hierarchical_quantized_all_reduce``). They run as the CERAR hooks do (``cerar.ddp``,
``cerar.hierarchical.hook``): on a thread of their own, one bucket at a time in DDP's order, on CUDA on
a stream of their own after the bucket's gradients are written, the rounds' deadlines kept on the
hook's thread, on process groups of their own made when the state is created (a collective call on
every rank). Every rank receives the same bytes, so the replicas stay identical. ``last_stats``
collects each bucket's stats. The CERAR fields the states inherit (c, construction, eps, kappa_max,
exact_ring) are not used.

With ``error_feedback=True`` each bucket's roundings are fed back (``cerar.int4.feedback``): each rank keeps, per
bucket, what its messages dropped and adds it back at the bucket's next call (``quantized_all_reduce``'s and
``hierarchical_quantized_all_reduce``'s ``feedback``); ``feedback`` holds them (a checkpoint keeps its
``state_dict``).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cerar.ddp import CerarHookState, transport_group
from cerar.formats.int8_blocks import DEFAULT_BLOCK, DEFAULT_ROUNDING, check_block, check_rounding
from cerar.hierarchical.hook import HierarchicalHookState
from cerar.int4.feedback import BucketFeedback, ErrorFeedback, bucket_feedback
from cerar.int8.all_reduce import quantized_all_reduce
from cerar.int8.two_tier import hierarchical_quantized_all_reduce
from cerar.ring.protocol import AllReduceStats
from cerar.ring.transport import _as_timedelta


@dataclass
class QuantizedHookState(CerarHookState):
    """Configuration and per-step record of the flat 8-bit hook: ``block`` (values per scale), ``rounding``
    and ``seed`` (``quantized_all_reduce``), ``error_feedback`` (module docstring), the timeout, DDP's process
    group and the group the messages travel on (made when not given)."""

    block: int = DEFAULT_BLOCK
    rounding: str = DEFAULT_ROUNDING
    seed: int = 0
    error_feedback: bool = False

    def __post_init__(self):
        check_block(self.block, "QuantizedHookState")
        check_rounding(self.rounding, "QuantizedHookState")
        _as_timedelta(self.timeout)
        if self.transport is None and dist.is_initialized():
            self.transport = transport_group(self.process_group, self.timeout)
        self.feedback = BucketFeedback() if self.error_feedback else None

    def _reduce(self, tensor: torch.Tensor, feedback: ErrorFeedback | None = None) -> AllReduceStats:
        group = self.transport if self.transport is not None else self.process_group
        return quantized_all_reduce(tensor, group, "avg", self.timeout, self.block, rounding=self.rounding,
                                    seed=self.seed, timed=False, feedback=feedback)  # fmt: skip


@dataclass
class HierarchicalQuantizedHookState(HierarchicalHookState):
    """Configuration and per-step record of the two-tier 8-bit hook: ``block``, ``rounding``, ``seed``,
    ``error_feedback`` (module docstring), the node layout (default: from the launcher), the timeout and the
    hook's own tier groups (made when not given). DDP's process group must be the default group: the layout
    spans every rank."""

    block: int = DEFAULT_BLOCK
    rounding: str = DEFAULT_ROUNDING
    seed: int = 0
    error_feedback: bool = False

    def __post_init__(self):
        check_block(self.block, "HierarchicalQuantizedHookState")
        check_rounding(self.rounding, "HierarchicalQuantizedHookState")
        self._take_layout()
        self._make_groups()
        self.feedback = BucketFeedback() if self.error_feedback else None

    def _reduce(self, tensor: torch.Tensor, feedback: ErrorFeedback | None = None):
        return hierarchical_quantized_all_reduce(tensor, self.groups, "avg", self.timeout, self.block,
                                                 rounding=self.rounding, seed=self.seed, timed=False,
                                                 feedback=feedback)  # fmt: skip


def quantized_hook(state: QuantizedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket with the 8-bit all-reduce."""
    return state.submit(bucket.buffer(), feedback=bucket_feedback(state.feedback, bucket))


def hierarchical_quantized_hook(
    state: HierarchicalQuantizedHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket with the two-tier 8-bit all-reduce."""
    return state.submit(bucket.buffer(), feedback=bucket_feedback(state.feedback, bucket))


__all__ = ["HierarchicalQuantizedHookState", "QuantizedHookState", "hierarchical_quantized_hook", "quantized_hook"]
