"""The two-tier 8/4 all-reduce: exact or 8-bit inside each node, 4 bits on the rails between the nodes.

For a float32 tensor of d values on N = n G ranks (``NodeLayout``), as ``cerar.int8.two_tier`` runs its tiers:

1. inside each node, a reduce-scatter: local rank l ends with the node's sum of shard l (s = ceil(d/G) values),
   either exactly (``intra="exact"``: the float32 ring reduce-scatter of ``cerar.hierarchical.intra_node``) or with
   8-bit messages (``intra="int8"``: the first of the two shots, ``cerar.int4.two_shot.scatter_reduce`` with the
   8-bit format, each rank's shard l rounded once, the sums in float32, local rank l's own part never rounded);
2. on rail l (local rank l of every node), the flat 4-bit all-reduce of that shard over the n nodes
   (``cerar.int4.all_reduce.int4_all_reduce``): each node's sum rounded once to 4 bits, the sums in float32, the
   reduced shard rounded once and all-gathered, so every rank of the rail holds the same bytes;
3. inside each node, the exact float32 ring all-gather.

So every rank of the job ends with the same result, and the slow tier carries 4-bit messages: per rank, between the
nodes, 2 (n-1) (ceil(s'/2) + 4 ceil(s'/B)) bytes, s' = ceil(s/n) (0.133 of the exact hierarchy's at B = 128;
``hier_int8``: 0.258). The error is the flat call's bound with the node means as the n contributions, plus, with
``intra="int8"``, the node's 8-bit rounding of the G - 1 other ranks' shards (k scale8 / G per rank and value, k = 1
stochastic, 1/2 nearest), which the rail then carries. With G = 1 the call is the flat ``int4_all_reduce``; with
n = 1 it is exact (``intra="exact"``) or the 8-bit reduce-scatter alone.

Costs per rank and call (s = ceil(d/G), s' = ceil(s/n)):

- inside the node: 2 (G - 1) rounds; 2 (G - 1) s x 4 bytes exact, or (G - 1) (s + 4 ceil(s/B8)) + (G - 1) s x 4
  with ``intra="int8"`` (the reduce-scatter in 8 bits, the all-gather in float32);
- between the nodes: 2 (n - 1) rounds, 2 (n - 1) (ceil(s'/2) + 4 ceil(s'/B)) bytes.
"""

from __future__ import annotations

import torch

from cerar.formats.int4_blocks import DEFAULT_BLOCK, DEFAULT_ROTATE, DEFAULT_ROUNDING
from cerar.formats.int8_blocks import DEFAULT_BLOCK as DEFAULT_INTRA_BLOCK
from cerar.formats.int8_blocks import message_bytes as int8_message_bytes
from cerar.hierarchical.collective import HierarchicalStats, _groups, run_tiers
from cerar.hierarchical.intra_node import all_gather
from cerar.hierarchical.layout import LAYOUT_VERSION, NodeLayout, TierGroups
from cerar.int4.all_reduce import INT4_PROTOCOL_VERSION, check_int4_call, int4_bytes_sent, two_shot_all_reduce
from cerar.int4.codecs import Int8Codec
from cerar.int4.feedback import ErrorFeedback
from cerar.int4.two_shot import (
    PHASE_NODE,
    _PeerRing,
    call_stats,
    copy_back,
    divide,
    message_key,
    next_call,
    scatter_reduce,
)
from cerar.ring.checks import check_agreement
from cerar.ring.protocol import AllReduceStats, as_equal_shards
from cerar.ring.rounds import PhaseTimer
from cerar.ring.transport import CollectiveError, _as_timedelta, _bytes, _Ring, _Rounds

RAIL_METHOD = "int4 quantized"
INTRA_METHODS = ("exact", "int8")
"""What runs inside a node: the exact float32 reduce-scatter, or the 8-bit one."""


def check_intra(intra, intra_block, operation: str) -> tuple[str, int]:
    """``intra`` one of ``INTRA_METHODS`` and ``intra_block`` the 8-bit format's block (an integer >= 1); else
    ValueError naming it."""
    if intra not in INTRA_METHODS:
        raise ValueError(f"{operation}: intra must be one of {INTRA_METHODS} (inside a node), got {intra!r}")
    Int8Codec(intra_block, DEFAULT_ROUNDING, operation)
    return intra, intra_block


def hierarchical_int4_all_reduce(
    tensor: torch.Tensor,
    layout: NodeLayout | TierGroups | None = None,
    op: str = "avg",
    timeout=None,
    block: int = DEFAULT_BLOCK,
    *,
    intra: str = "exact",
    intra_block: int = DEFAULT_INTRA_BLOCK,
    rounding: str = DEFAULT_ROUNDING,
    rotate: bool = DEFAULT_ROTATE,
    seed: int = 0,
    timed: bool = True,
    feedback: ErrorFeedback | None = None,
) -> HierarchicalStats:
    """All-reduce ``tensor`` (float32) in place: ``intra`` ("exact" or "int8", blocks of ``intra_block``) inside each
    node, 4 bits on the rails (module docstring); every rank gets the same result. ``layout`` as for
    ``hierarchical_all_reduce``; ``op``, ``timeout``, ``block``, ``rounding``, ``rotate``, ``seed``, ``feedback``
    as for ``int4_all_reduce`` (the rounding is the 8-bit tier's too; the feedback keeps the rail's residual and the
    8-bit tier's). Raises ValueError for bad input and CollectiveError when a peer fails, stalls past the timeout or
    disagrees on the call (on every rank). ``HierarchicalStats`` records each tier's bytes; ``inter_node_method`` is
    "int4 quantized", or "none" on one node."""
    operation = "cerar.hierarchical_int4_all_reduce"
    codec = check_int4_call(tensor, op, block, rounding, rotate, seed, operation)
    check_intra(intra, intra_block, operation)
    inside = Int8Codec(intra_block, rounding) if intra == "int8" else None
    return two_tier_all_reduce(tensor, codec, layout, op, timeout, inside=inside, seed=seed, timed=timed,
                               feedback=feedback, operation=operation)  # fmt: skip


def two_tier_all_reduce(
    tensor: torch.Tensor, codec, layout, op: str, timeout, *, inside=None, seed: int, timed: bool, feedback=None,
    operation: str = "cerar.int4.two_tier_all_reduce",
) -> HierarchicalStats:  # fmt: skip
    """The two tiers with any codec on the rails (``cerar.int4.codecs``: 4 bits, or 8 where a caller wants the 8-bit
    hierarchy's error fed back) and, inside the nodes, the exact reduce-scatter (``inside`` None) or the codec
    ``inside``'s; arguments checked by the caller. ``feedback``: residuals kept under "node" and "rail"."""
    groups = _groups(layout, timeout, operation)
    layout = groups.layout
    method = f"int{codec.bits} quantized" if layout.nodes > 1 else "none"
    d = tensor.numel()
    lossy_inside = inside is not None and layout.local_size > 1
    check_agreement(
        _Ring.of(groups.all_ranks, _as_timedelta(timeout), operation),
        {
            "hierarchical layout version": LAYOUT_VERSION,
            "int4 protocol version": INT4_PROTOCOL_VERSION,
            "node layout (nodes x local size)": str(layout),
            "method between the nodes": method,
            **codec.agreement(),
            "method inside the nodes": "exact" if inside is None else inside.name,
            "block size inside the nodes": 0 if inside is None else inside.block,
            "op": op,
            "tensor length d": d,
            "dtype": str(tensor.dtype),
            "error feedback": feedback is not None,
        },
    )
    stats = HierarchicalStats(layout, method, exact=method == "none" and not lossy_inside)
    if d == 0:
        return stats

    def on_rail(shard: torch.Tensor) -> AllReduceStats:
        if method == "none":  # one node: nothing between nodes
            return AllReduceStats()
        try:
            return two_shot_all_reduce(shard, codec, groups.rail, op, timeout, seed=seed, timed=timed,
                                       feedback=feedback, feedback_name="rail", operation=operation)  # fmt: skip
        except CollectiveError as error:
            raise CollectiveError(f"{operation}: between the nodes, on rail {groups.local_rank}: {error}") from error

    if lossy_inside:
        _coded_inside(tensor, groups, stats, op, timeout, timed, operation, on_rail, inside, seed, feedback)
    else:
        run_tiers(tensor, groups, stats, op, timeout, timed, operation, on_rail)
    return stats


def _coded_inside(tensor, groups: TierGroups, stats, op, timeout, timed, operation, on_rail, codec, seed,
                  feedback) -> None:  # fmt: skip
    """Steps 1-3 with a rounded reduce-scatter inside the node (G > 1): shot 1 of ``two_shot`` with ``codec`` on the
    node's ``_PeerRing``, the rail, then the exact ring all-gather of ``cerar.hierarchical.intra_node`` on the node's
    ring. Fills ``stats.intra_node`` (both rings' bytes) and ``stats.inter_node`` (the rail's)."""
    G = groups.layout.local_size
    where = f"{operation}: inside node {groups.node}"
    peers = _PeerRing.of(groups.intra_node, _as_timedelta(timeout), where)
    ring = _Ring.of(groups.intra_node, _as_timedelta(timeout), where)
    timer = PhaseTimer(tensor.device, enabled=timed)
    flat, in_place = as_equal_shards(tensor, G)
    shards = flat.view(G, -1)
    mine = shards[groups.local_rank]
    residual = None if feedback is None else feedback.rows("node", G, shards.shape[1], flat)
    call, sender = next_call(), peers.global_rank(peers.rank)

    def key(shard: int, phase: int) -> int:
        return message_key(seed, call, sender, shard, phase + PHASE_NODE)

    with torch.no_grad():
        rounds = _Rounds(peers, timer)
        buffers = scatter_reduce(shards, rounds, codec, key, timer, residual)
        if op == "avg":
            rounds.issue(divide, timer, mine, G)  # the rail divides by n, for 1 / (n G) in all
        rounds.finish()  # a stall inside the node is reported here, before the rail
        stats.inter_node = on_rail(mine)
        rounds = _Rounds(ring, timer)
        all_gather(shards, rounds)
        if not in_place:
            rounds.issue(copy_back, timer, tensor, flat)
        rounds.finish()
    peak = _bytes(*buffers) + (0 if in_place else _bytes(flat))
    stats.intra_node = call_stats([peers, ring], timer, 2 * (G - 1), peak)


def hierarchical_int4_bytes(
    d: int, layout: NodeLayout, block: int = DEFAULT_BLOCK, intra: str = "exact", intra_block: int = DEFAULT_INTRA_BLOCK
) -> dict[str, int]:
    """What one rank sends per call and tier (module docstring's costs)."""
    G, n = layout.local_size, layout.nodes
    s = -(-d // G) if d else 0
    if G == 1 or d == 0:
        inside = 0
    elif intra == "int8":
        inside = (G - 1) * int8_message_bytes(s, intra_block) + (G - 1) * s * 4
    else:
        inside = 2 * (G - 1) * s * 4
    return {"intra_node": inside, "inter_node": int4_bytes_sent(s if G > 1 else d, n, block)}


__all__ = [
    "INTRA_METHODS",
    "RAIL_METHOD",
    "check_intra",
    "hierarchical_int4_all_reduce",
    "hierarchical_int4_bytes",
    "two_tier_all_reduce",
]
