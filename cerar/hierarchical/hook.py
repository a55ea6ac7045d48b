"""Hierarchical CERAR (or the exact hierarchy) as a DDP communication hook.

    state = HierarchicalHookState(c=16, construction="optimized")   # layout: torchrun's, or layout=...
    ddp_model.register_comm_hook(state, hierarchical_hook)

Each gradient bucket is averaged with ``hierarchical_all_reduce`` (a code for n = nodes, built once
per bucket length) or, with ``exact_ring=True``, ``hierarchical_ring_all_reduce``. It runs as the
flat hook does (``cerar.ddp``): on a thread of its own, one bucket at a time in DDP's order, on CUDA
on a stream of its own after the bucket's gradients are written, with the rounds' deadlines kept on
the hook's thread. Its messages travel on process groups of its own (``new_tier_groups``, made when
the state is created: a collective call on every rank), so they never mix with the collectives
other threads issue meanwhile. ``last_stats`` collects each bucket's ``HierarchicalStats``. With
``equilibrate=True`` a coded bucket's parameter tensors are first scaled to a common root mean square by
powers of two agreed over every rank and unscaled after (``cerar.ring.equilibrate``, as the flat hook does;
the scales' all-reduce is counted in ``inter_node.bytes_sent``: it spans every rank). Either way a coded bucket's
tensors that are zero on every rank come back as exact zeros (``CerarHookState._coded``): equilibrated, from the
scales' statistics at no extra cost; without, at the cost of one all-reduce over every rank per coded bucket of
T >= 2 tensors, of their T largest magnitudes (MAX, float32: 2 (N-1)/N x 4 T bytes with N every rank, counted in
``inter_node.bytes_sent``), a pass to take them and one multiply per tensor after the call (``cerar.ddp``'s
docstring: why no collective the hook already makes can carry them, and how it keeps to the stream).
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cerar.coding.codes import Code, make_code
from cerar.ddp import CerarHookState, bucket_sizes
from cerar.formats.wire import transport_name
from cerar.hierarchical.collective import HierarchicalStats, hierarchical_all_reduce, hierarchical_ring_all_reduce
from cerar.hierarchical.layout import NodeLayout, TierGroups, new_tier_groups
from cerar.ring.transport import _as_timedelta


@dataclass
class HierarchicalHookState(CerarHookState):
    """Configuration and per-step record of the hierarchical hook: ``CerarHookState``'s fields (c,
    construction, eps, kappa_max, exact_ring, timeout, transport_dtype: both tiers' wire) plus the
    node layout (default: from the launcher), ``coded_on_two_nodes`` (as for
    ``hierarchical_all_reduce``) and the hook's own groups (made at creation when not given).
    DDP's process group must be the default group: the layout spans every rank."""

    layout: NodeLayout | None = None
    coded_on_two_nodes: bool = False
    groups: TierGroups | None = field(default=None, repr=False)

    def __post_init__(self):
        self.transport_dtype = transport_name(self.transport_dtype)  # a ValueError naming the choices
        self._take_layout()
        if not self.exact_ring:
            self.code_for(1)  # validate the arguments now, not inside backward
        self._make_groups()

    def _take_layout(self) -> None:
        """The node layout: the given groups', else the given one, else the launcher's; it must span DDP's group."""
        if self.groups is not None:
            self.layout = self.groups.layout
        elif self.layout is None:
            self.layout = NodeLayout.from_env()
        if self.process_group is not None and dist.get_world_size(self.process_group) != self.layout.world_size:
            raise ValueError(
                f"{type(self).__name__}: DDP's process group has {dist.get_world_size(self.process_group)} ranks "
                f"but the layout ({self.layout}) spans {self.layout.world_size}"
            )

    def _make_groups(self) -> None:
        """The tier groups, made now (once the timeout is checked) unless given or no process group exists yet."""
        _as_timedelta(self.timeout)
        if self.groups is None and dist.is_initialized():
            self.groups = new_tier_groups(self.layout, self.timeout)

    def code_for(self, bucket_numel: int) -> Code:
        """The code for a bucket of this length: one for n = nodes workers (one per length, cached)."""
        if bucket_numel not in self._codes:
            self._codes[bucket_numel] = make_code(
                self.layout.nodes, self.c, self.construction, eps=self.eps, kappa_max=self.budget
            )
        return self._codes[bucket_numel]

    def _reduce(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> HierarchicalStats:
        if self.exact_ring:
            return hierarchical_ring_all_reduce(
                tensor, self.groups, op="avg", timeout=self.timeout, timed=False, transport=self.transport_dtype
            )
        code = self.code_for(tensor.numel())

        def run() -> HierarchicalStats:
            return hierarchical_all_reduce(
                tensor,
                code,
                self.groups,
                op="avg",
                timeout=self.timeout,
                coded_on_two_nodes=self.coded_on_two_nodes,
                timed=False,
                transport=self.transport_dtype,
            )

        stats, agreed = self._coded(tensor, sizes, run, self.groups.all_ranks, "hierarchical_hook")
        stats.inter_node.bytes_sent += agreed  # the agreement spans every rank: counted between the nodes
        return stats


def hierarchical_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket with hierarchical CERAR (or the exact hierarchy), its
    tensors equilibrated first when ``state.equilibrate``; coded, its tensors zero on every rank stay zero."""
    sizes = None if state.exact_ring else bucket_sizes(bucket)
    return state.submit(bucket.buffer(), sizes)
