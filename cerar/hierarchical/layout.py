"""Where the ranks sit: nodes of G ranks each, and the process groups of the two tiers.

A job of N = n x G ranks runs on n nodes with G ranks each. torchrun numbers them node-major: its
agents assign every worker the global rank GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK
(``torch/distributed/elastic/agent/server/api.py``, ``_assign_worker_ranks``: each agent's workers
get the ranks [base, base + local_world_size), the bases in the order of the agents' group ranks),
so node k holds ranks kG .. kG + G - 1 and local rank l of every node is l modulo G.

The tiers:

- inside a node, a ring of its G ranks (``intra_node``): exact reduce-scatter and all-gather;
- between nodes, G "rails", one per local rank l: the ring of the n ranks l, G + l, ..., (n-1)G + l,
  whose group rank is their node (rail rank i = node i: ``dist.new_group`` numbers a group's members in
  ascending global rank, torch 2.4 and later alike). Each rail carries one 1/G shard.

``NodeLayout`` is the pure layout; ``tier_groups`` makes its process groups once per process (a
collective call: every rank must make it, and ``dist.new_group`` is collective over all ranks, so
every rank creates every group, in one fixed order) after checking that all ranks agree on the
layout and, where it came from the launcher, that the ranks really are node-major.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from cerar.ring.checks import check_agreement
from cerar.ring.transport import _as_timedelta, _Ring

LAYOUT_VERSION = 1
"""Bumped whenever the tiers' rounds or the shard assignment change: ranks of different versions refuse to mix."""


@dataclass(frozen=True)
class NodeLayout:
    """n nodes of G ranks each, ranks numbered node-major (node k holds ranks kG .. kG + G - 1).

    ``NodeLayout(nodes=4, local_size=2)`` declares a layout; ``NodeLayout.from_env()`` takes it from
    the launcher (torchrun's LOCAL_WORLD_SIZE), and ``NodeLayout.from_env(local_size=2)`` overrides
    the launcher's local size (e.g. to emulate two nodes on one machine)."""

    nodes: int
    local_size: int
    from_launcher: bool = field(default=False, compare=False)
    """True when ``local_size`` is torchrun's LOCAL_WORLD_SIZE: the groups then also check, on every
    rank, that rank = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK."""

    def __post_init__(self):
        for name in ("nodes", "local_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NodeLayout: {name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_env(cls, local_size: int | None = None, world_size: int | None = None, environ=None) -> NodeLayout:
        """The layout of this job: ``world_size`` (default: the default process group's size, or
        $WORLD_SIZE) split into nodes of ``local_size`` ranks (default: $LOCAL_WORLD_SIZE, which
        torchrun sets to --nproc_per_node). Raises ValueError naming what is missing or does not divide."""
        environ = os.environ if environ is None else environ
        if world_size is None:
            if dist.is_available() and dist.is_initialized():
                world_size = dist.get_world_size()
            elif "WORLD_SIZE" in environ:
                world_size = _env_int(environ, "WORLD_SIZE")
            else:
                raise ValueError(
                    "NodeLayout.from_env: the world size is unknown: initialise torch.distributed, "
                    "launch with torchrun (which sets WORLD_SIZE) or pass world_size"
                )
        from_launcher = local_size is None
        if from_launcher:
            if "LOCAL_WORLD_SIZE" not in environ:
                raise ValueError(
                    "NodeLayout.from_env: LOCAL_WORLD_SIZE is not set (torchrun sets it to --nproc_per_node): "
                    "launch with torchrun or pass local_size, the number of ranks per node"
                )
            local_size = _env_int(environ, "LOCAL_WORLD_SIZE")
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
            raise ValueError(f"NodeLayout.from_env: the local size must be an integer >= 1, got {local_size!r}")
        if world_size % local_size:
            source = "LOCAL_WORLD_SIZE" if from_launcher else "local_size"
            raise ValueError(
                f"NodeLayout.from_env: the world size {world_size} is not a multiple of {source}={local_size}: "
                f"every node must run the same number of ranks"
            )
        return cls(world_size // local_size, local_size, from_launcher)

    @property
    def world_size(self) -> int:
        return self.nodes * self.local_size

    def node_of(self, rank: int) -> int:
        return self._checked(rank) // self.local_size

    def local_rank_of(self, rank: int) -> int:
        return self._checked(rank) % self.local_size

    def node_ranks(self, node: int) -> list[int]:
        """The global ranks of ``node``, in local-rank order."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"NodeLayout: node {node} is not in [0, {self.nodes})")
        return [node * self.local_size + local for local in range(self.local_size)]

    def rail_ranks(self, local_rank: int) -> list[int]:
        """The global ranks of rail ``local_rank``, in node order (rail rank i is node i)."""
        if not 0 <= local_rank < self.local_size:
            raise ValueError(f"NodeLayout: local rank {local_rank} is not in [0, {self.local_size})")
        return [node * self.local_size + local_rank for node in range(self.nodes)]

    def __str__(self) -> str:
        return f"{self.nodes} nodes x {self.local_size} ranks"

    def _checked(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"NodeLayout: rank {rank} is not in [0, {self.world_size}) ({self})")
        return rank


def _env_int(environ, name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"NodeLayout.from_env: ${name}={environ[name]!r} is not an integer") from None


@dataclass(frozen=True)
class TierGroups:
    """The process groups of a layout, as this rank sees them.

    ``intra_node`` is this rank's node (None when G = 1), ``rail`` this rank's rail (None when
    n = 1), ``all_ranks`` a group of every rank for the agreement checks (its own, so that the checks
    never mix with collectives other code issues on the default group meanwhile)."""

    layout: NodeLayout
    node: int
    local_rank: int
    intra_node: dist.ProcessGroup | None
    rail: dist.ProcessGroup | None
    all_ranks: dist.ProcessGroup
    timeout: timedelta


_cached: dict[tuple[NodeLayout, bool], tuple[object, TierGroups]] = {}
_builds = itertools.count()


def tier_groups(layout: NodeLayout | None = None, timeout=None) -> TierGroups:
    """The layout's process groups, made on the first call in this process and cached (per layout and
    default process group). The first call is collective: every rank must make it, with the same
    layout. ``timeout`` (seconds or timedelta; default cerar's 5 minutes) sets the groups' own backstop
    timeout to three times it, at least 60 s (past the rounds' own per-call deadlines at T and a host watchdog
    at 2T)."""
    layout = NodeLayout.from_env() if layout is None else layout
    world = dist.group.WORLD if dist.is_initialized() else None
    key = (layout, layout.from_launcher)  # a launcher's layout is checked for placement, a declared one is not
    held = _cached.get(key)
    if held is not None and held[0] is world:
        return held[1]
    groups = new_tier_groups(layout, timeout)
    _cached[key] = (world, groups)  # holding the default group keeps its id from being reused
    return groups


def new_tier_groups(layout: NodeLayout | None = None, timeout=None) -> TierGroups:
    """A fresh set of the layout's process groups, e.g. for a thread of its own (the DDP hook). A
    collective call on every rank of the default group. Checks first, over all ranks, that every rank
    passes the same layout and (for a launcher's layout) that the ranks are node-major; a
    disagreement raises CollectiveError on every rank instead of creating mismatched groups."""
    operation = "cerar.hierarchical: building the node and rail groups"
    layout = NodeLayout.from_env() if layout is None else layout
    if not isinstance(layout, NodeLayout):
        raise ValueError(f"{operation}: layout must be a NodeLayout, got {type(layout).__name__}")
    round_timeout = _as_timedelta(timeout)
    ring = _Ring.of(None, round_timeout, operation)
    check_agreement(  # every build checks (its number makes the fields new): a cached answer would let one
        ring,  # rank whose fields changed gather alone while the others skip the check
        {
            "number of group builds before this one": next(_builds),
            "hierarchical layout version": LAYOUT_VERSION,
            "node layout (nodes x local size)": str(layout),
            "node-major placement (rank = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK)": placement(layout, ring.rank),
        },
    )
    if layout.world_size != ring.size:
        raise ValueError(
            f"{operation}: the layout ({layout}) has {layout.world_size} ranks but the default process group "
            f"has {ring.size}"
        )
    backstop = max(3 * round_timeout, timedelta(seconds=60))  # past T (the rounds) and 2T (a host watchdog)
    rank, node, local_rank = ring.rank, layout.node_of(ring.rank), layout.local_rank_of(ring.rank)

    def new_group(ranks: list[int], description: str):
        group = dist.new_group(ranks, timeout=backstop, group_desc=description)
        return group if rank in ranks else None

    all_ranks = new_group(list(range(layout.world_size)), "cerar_hierarchical_all_ranks")
    intra = rail = None
    if layout.local_size > 1:
        for k in range(layout.nodes):
            group = new_group(layout.node_ranks(k), f"cerar_hierarchical_node_{k}")
            intra = group if k == node else intra
    if layout.nodes > 1:
        for local in range(layout.local_size):
            group = new_group(layout.rail_ranks(local), f"cerar_hierarchical_rail_{local}")
            rail = group if local == local_rank else rail
    return TierGroups(layout, node, local_rank, intra, rail, all_ranks, round_timeout)


def placement(layout: NodeLayout, rank: int, environ=None) -> str:
    """'node-major' when this rank sits where the layout says, else what the launcher told it.

    Only a launcher's layout is checked (an explicit local size declares the placement): rank must
    equal GROUP_RANK x G + LOCAL_RANK, torchrun's assignment, which makes it local rank
    rank mod G of node rank // G."""
    environ = os.environ if environ is None else environ
    if not layout.from_launcher:
        return "node-major"
    group_rank, local_rank = environ.get("GROUP_RANK"), environ.get("LOCAL_RANK")
    if local_rank is not None and int(local_rank) != rank % layout.local_size:
        return f"not node-major: rank {rank} has LOCAL_RANK={local_rank}"
    if group_rank is not None and int(group_rank) != rank // layout.local_size:
        return f"not node-major: rank {rank} has GROUP_RANK={group_rank}"
    return "node-major"


__all__ = ["LAYOUT_VERSION", "NodeLayout", "TierGroups", "new_tier_groups", "tier_groups"]
