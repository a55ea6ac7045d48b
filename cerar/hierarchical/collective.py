"""The two-tier all-reduce: exact inside each node, CERAR (or the exact ring) between the nodes.

For a tensor of d values on N = n G ranks (n nodes of G ranks, ``NodeLayout``):

1. inside each node, an exact ring reduce-scatter: local rank l ends with the node's sum of shard
   l, s = ceil(d/G) values (the tensor zero-padded to G s);
2. between the nodes, rail l (local rank l of every node, rail rank i = node i) all-reduces shard l:
   CERAR with a code for n workers, or the exact ring;
3. inside each node, an exact ring all-gather: every rank of a node ends with the same vector.

Each tier keeps the flat calls' per-round deadlines and backends' contracts: on NCCL its rounds and
arithmetic are ordered on the CUDA streams and the host polls a round now and then and at each tier's
end (after the reduce-scatter, the rail, the all-gather); on gloo the host waits for every round.

So node i holds what the spec's protocol gives worker i on the node sums, shard by shard; the
last node's ranks hold the exact sum under the closed-form constructions. With G = 1 there is
nothing to do inside a node and the call is today's flat ``cerar.all_reduce`` on a ring of every
rank in rank order (the same code, the same operations, bit for bit); with n = 1 the call is
exact.

Per rank and call (s = ceil(d/G), m = ceil(s/c), L = c + n - 2):

===========================  ===========================  =========================
                             ``hierarchical_all_reduce``  ``hierarchical_ring_all_reduce``
===========================  ===========================  =========================
rounds inside the node       2 (G - 1)                    2 (G - 1)
values sent inside the node  2 (G - 1) s                  2 (G - 1) s
rounds between nodes         L                            2 (n - 1)
values sent between nodes    L m ~ (1 + (n-2)/c) s        2 (n - 1) ceil(s/n)
per node, between nodes      ~ (1 + (n-2)/c) d            ~ 2 (n-1)/n d
===========================  ===========================  =========================
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cerar.coding.codes import Code
from cerar.formats.wire import transport_name, wire_for
from cerar.hierarchical.inter_node import RAIL_METHODS, rail_method, reduce_on_rail
from cerar.hierarchical.intra_node import all_gather, reduce_scatter
from cerar.hierarchical.layout import LAYOUT_VERSION, NodeLayout, TierGroups, tier_groups
from cerar.ring.checks import _check_op, _check_tensor, check_agreement, check_coded_call, check_transport
from cerar.ring.protocol import PROTOCOL_VERSION, AllReduceStats, as_equal_shards
from cerar.ring.rounds import DEFAULT_STORAGE, PhaseTimer
from cerar.ring.transport import _as_timedelta, _Ring, _Rounds


@dataclass
class HierarchicalStats:
    """What one call cost this rank, per tier. ``intra_node``: the reduce-scatter and all-gather
    inside the node (its seconds_decode: the additions); ``inter_node``: the rail's call, as
    ``cerar.all_reduce`` or ``cerar.ring_all_reduce`` reports it. ``inter_node_method`` says what ran
    between the nodes ("cerar", "exact ring", or "none" on one node)."""

    layout: NodeLayout
    inter_node_method: str
    exact: bool
    """Whether every rank received the exact result (up to float32 rounding; never on a 16-bit wire)."""
    intra_node: AllReduceStats = field(default_factory=AllReduceStats)
    inter_node: AllReduceStats = field(default_factory=AllReduceStats)

    @property
    def bytes_sent(self) -> int:
        return self.intra_node.bytes_sent + self.inter_node.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.intra_node.bytes_received + self.inter_node.bytes_received

    @property
    def rounds(self) -> int:
        return self.intra_node.rounds + self.inter_node.rounds

    @property
    def seconds_total(self) -> float:
        return self.intra_node.seconds_total + self.inter_node.seconds_total


def hierarchical_all_reduce(
    tensor: torch.Tensor,
    code: Code,
    layout: NodeLayout | TierGroups | None = None,
    op: str = "sum",
    timeout=None,
    storage: str = DEFAULT_STORAGE,
    *,
    coded_on_two_nodes: bool = False,
    timed: bool = True,
    transport=None,
) -> HierarchicalStats:
    """Approximate all-reduce of ``tensor`` in place: exact inside each node, CERAR between nodes.

    Like ``dist.all_reduce`` and ``cerar.all_reduce``: every rank calls it with a tensor of the same
    shape; op "sum" or "avg"; any shape, contiguity and length. ``code`` is built for the number of
    NODES, ``cerar.make_code(layout.nodes, c, ...)``. ``layout``: a ``NodeLayout`` (its groups are made
    on first use and cached: a collective call), the ``TierGroups`` to use, or None for
    ``NodeLayout.from_env()`` (torchrun's LOCAL_WORLD_SIZE). ``timeout`` bounds every round, as for
    ``cerar.all_reduce``; ``storage`` and ``timed`` are passed to it.

    On one node the call is exact, and on two nodes it runs the exact ring between them (CERAR would
    send the same bytes and add its error), each said once by a ``HierarchicalWarning``;
    ``coded_on_two_nodes=True`` runs the code on two nodes anyway. ``HierarchicalStats`` records
    what ran. Raises ValueError for bad input and CollectiveError when a peer fails, stalls past the
    timeout, or disagrees on the layout, the code, the op, the length or the transport (on every rank).

    ``transport``: the wire dtype of BOTH tiers (``cerar.formats.wire``): "float32" (default), "float16" or
    "bfloat16": every block inside the node and on the rail travels cast (with its power-of-two
    scale), sums and coding in float32; the code must be admissible on it."""
    operation = "cerar.hierarchical_all_reduce"
    check_coded_call(tensor, code, op, storage, operation, transport)
    groups = _groups(layout, timeout, operation)
    nodes = groups.layout.nodes
    if nodes != code.N:
        raise ValueError(
            f"{operation}: the code was built for N={code.N} workers but the layout has {nodes} nodes "
            f"({groups.layout}): the code runs between the nodes, use cerar.make_code({nodes}, c, ...)"
        )
    method = rail_method(nodes, True, coded_on_two_nodes, operation)
    code_fields = (
        {"c": code.c, "construction": code.construction, "eps": code.eps, "kappa_max": code.kappa_max}
        if method == "cerar"
        else {}
    )
    return _two_tiers(tensor, groups, method, code, code_fields, op, timeout, storage, timed, operation, transport)


def hierarchical_ring_all_reduce(
    tensor: torch.Tensor,
    layout: NodeLayout | TierGroups | None = None,
    op: str = "sum",
    timeout=None,
    *,
    timed: bool = True,
    transport=None,
) -> HierarchicalStats:
    """Exact all-reduce of ``tensor`` in place on the same two tiers: reduce-scatter inside each node,
    the exact ring (``cerar.ring_all_reduce``) on the rails, all-gather inside each node. The
    baseline hierarchical CERAR is measured against. Arguments as for ``hierarchical_all_reduce``.
    With a 16-bit ``transport`` it is the 16-bit exact hierarchy: every rank ends with the same
    bits, within ``cerar.ring.precision.sum_rounding_bound(N, float32, wire)`` of the exact sum."""
    operation = "cerar.hierarchical_ring_all_reduce"
    _check_tensor(tensor, operation)
    _check_op(op, operation)
    check_transport(tensor, transport, operation)
    groups = _groups(layout, timeout, operation)
    method = rail_method(groups.layout.nodes, False, False, operation)
    return _two_tiers(tensor, groups, method, None, {}, op, timeout, DEFAULT_STORAGE, timed, operation, transport)


def _groups(layout, timeout, operation: str) -> TierGroups:
    if isinstance(layout, TierGroups):
        return layout
    if layout is None or isinstance(layout, NodeLayout):
        return tier_groups(layout, timeout)
    raise ValueError(f"{operation}: layout must be a NodeLayout, TierGroups or None, got {type(layout).__name__}")


def _two_tiers(
    tensor: torch.Tensor,
    groups: TierGroups,
    method: str,
    code: Code | None,
    code_fields: dict,
    op: str,
    timeout,
    storage: str,
    timed: bool,
    operation: str,
    transport=None,
) -> HierarchicalStats:
    assert method in RAIL_METHODS
    wire = wire_for(transport)
    layout, d = groups.layout, tensor.numel()
    check_agreement(
        _Ring.of(groups.all_ranks, _as_timedelta(timeout), operation),
        {
            "hierarchical layout version": LAYOUT_VERSION,
            "cerar protocol version": PROTOCOL_VERSION,
            "node layout (nodes x local size)": str(layout),
            "method between the nodes": method,
            **code_fields,
            "op": op,
            "tensor length d": d,
            "dtype": str(tensor.dtype),
            "transport": transport_name(transport),
        },
    )
    exact = (method != "cerar" or code.is_exact) and wire is None
    stats = HierarchicalStats(layout, method, exact)
    if d == 0:
        return stats
    rail_args = (method, code, groups.rail, op, timeout, storage, timed, operation, groups.local_rank, transport)

    def on_rail(shard: torch.Tensor) -> AllReduceStats:
        return reduce_on_rail(shard, *rail_args)

    run_tiers(tensor, groups, stats, op, timeout, timed, operation, on_rail, wire)
    return stats


def run_tiers(
    tensor: torch.Tensor,
    groups: TierGroups,
    stats: HierarchicalStats,
    op: str,
    timeout,
    timed: bool,
    operation: str,
    on_rail,
    wire=None,
) -> None:
    """Steps 1-3 of the module docstring on ``tensor`` (d > 0, the call's agreement already checked), for any
    rail method: ``on_rail(shard)`` all-reduces one shard in place over this rank's rail and returns its
    ``AllReduceStats``. With G = 1 the rail is every rank in rank order and ``on_rail`` gets the whole tensor.
    Fills ``stats.inter_node`` (the rail's) and ``stats.intra_node`` (the two exact tiers inside the node, their
    messages on ``wire``: None for float32, or a 16-bit ``cerar.formats.wire.Wire``)."""
    G, d = groups.layout.local_size, tensor.numel()
    if G == 1:  # nothing inside a node: the rail is every rank in rank order, the call the flat one
        stats.inter_node = on_rail(tensor)
        return

    timer = PhaseTimer(tensor.device, enabled=timed)
    ring = _Ring.of(groups.intra_node, _as_timedelta(timeout), f"{operation}: inside node {groups.node}")
    flat, in_place = as_equal_shards(tensor, G)
    shards = flat.view(G, -1)
    incoming = flat.new_empty(shards.shape[1])
    mine = shards[groups.local_rank]

    def divide() -> None:  # the rail divides by n, for 1 / (n G) in all
        with timer.phase("decode"):
            mine.div_(G)

    def copy_back() -> None:
        with timer.phase("decode"):
            tensor.copy_(flat[:d].view(tensor.shape))

    with torch.no_grad():
        rounds = _Rounds(ring, timer, wire)
        reduce_scatter(shards, rounds, incoming, timer)
        if op == "avg":
            rounds.issue(divide)
        rounds.finish()  # each tier ends with its deadline kept: a stall inside the node is reported here
        stats.inter_node = on_rail(mine)
        rounds = _Rounds(ring, timer, wire)
        all_gather(shards, rounds)
        if not in_place:
            rounds.issue(copy_back)
        rounds.finish()
    seconds = timer.totals()
    stats.intra_node = AllReduceStats(
        bytes_sent=ring.bytes_sent,
        bytes_received=ring.bytes_received,
        rounds=2 * (G - 1),
        seconds_comm=seconds.get("comm", 0.0),
        seconds_decode=seconds.get("decode", 0.0),
        peak_extra_bytes=(incoming.numel() + (0 if in_place else flat.numel())) * flat.element_size()
        + rounds.peak_wire_bytes,
    )
