"""The two-tier 8-bit all-reduce: exact float32 inside each node, ``cerar.int8.all_reduce`` on the rails.

For a float32 tensor of d values on N = n G ranks (``NodeLayout``), as ``hierarchical_all_reduce``
runs its tiers, with the 8-bit all-reduce where CERAR would run:

1. inside each node, the exact float32 ring reduce-scatter (``intra_node.reduce_scatter``): local rank
   l holds the node's sum of shard l (s = ceil(d/G) values);
2. on rail l (local rank l of every node), ``cerar.int8.all_reduce.quantized_all_reduce`` of that shard
   over the n nodes: each node's contribution quantized once, the sums in float32, the reduced shard
   quantized once and all-gathered, so every rank of the rail holds the same bytes; the rails' dithers
   differ (each message's key names its sender by its global rank: the ranks at one node index of two rails
   would otherwise share a key, and round identical shards identically);
3. inside each node, the exact float32 ring all-gather.

So every rank of the job ends with the same result (the rails agree bit for bit and the all-gather
copies exactly), and only the slow tier carries 8-bit messages: per node, between the nodes,
2 (n-1)/n d (1 + 4/B) bytes against the exact hierarchy's 2 (n-1)/n d x 4. The error is the flat
call's bound with the node sums as the contributions (n of them). With G = 1 the call is the flat
``quantized_all_reduce`` over every rank; with n = 1 it is exact.

Costs per rank and call (s = ceil(d/G), s' = ceil(s/n), nb = ceil(s'/B)):

=============================  =========================================
rounds inside the node         2 (G - 1)
bytes sent inside the node     2 (G - 1) s x 4
rounds between nodes           2 (n - 1)
bytes sent between nodes       2 (n - 1) (s' + 4 nb)
=============================  =========================================
"""

from __future__ import annotations

import torch

from cerar.formats.int8_blocks import DEFAULT_BLOCK, DEFAULT_ROUNDING, format_name
from cerar.hierarchical.collective import HierarchicalStats, _groups, run_tiers
from cerar.hierarchical.layout import LAYOUT_VERSION, NodeLayout, TierGroups
from cerar.int4.codecs import Int8Codec
from cerar.int4.two_tier import two_tier_all_reduce
from cerar.int8.all_reduce import QUANTIZED_PROTOCOL_VERSION, check_quantized_call, quantized_all_reduce
from cerar.ring.checks import check_agreement
from cerar.ring.protocol import AllReduceStats
from cerar.ring.transport import CollectiveError, _as_timedelta, _Ring

RAIL_METHOD = "int8 quantized"


def hierarchical_quantized_all_reduce(
    tensor: torch.Tensor,
    layout: NodeLayout | TierGroups | None = None,
    op: str = "avg",
    timeout=None,
    block: int = DEFAULT_BLOCK,
    *,
    rounding: str = DEFAULT_ROUNDING,
    seed: int = 0,
    timed: bool = True,
    feedback=None,
) -> HierarchicalStats:
    """All-reduce ``tensor`` (float32) in place: exact inside each node, 8-bit on the rails (module
    docstring); every rank gets the same result. ``layout`` as for ``hierarchical_all_reduce`` (a
    ``NodeLayout``, the ``TierGroups`` to use, or None: torchrun's LOCAL_WORLD_SIZE); ``op``,
    ``timeout``, ``block``, ``rounding``, ``seed`` as for ``quantized_all_reduce``. Raises ValueError for bad input and
    CollectiveError when a peer fails, stalls past the timeout, or disagrees on the layout, the
    format, B, the op or the length (on every rank). ``HierarchicalStats`` records each tier's bytes;
    ``inter_node_method`` is "int8 quantized", or "none" on one node. ``feedback``: this rank's error feedback
    (``cerar.int4.feedback``: residuals of the rail's messages), or None: the tiers then run as
    ``cerar.int4.two_tier.two_tier_all_reduce`` with the 8-bit codec, the same bytes."""
    operation = "cerar.hierarchical_quantized_all_reduce"
    check_quantized_call(tensor, op, block, operation, rounding, seed)
    if feedback is not None:  # the same tiers, written once for any format, with the residuals (cerar.int4.two_tier)
        return two_tier_all_reduce(tensor, Int8Codec(block, rounding, operation), layout, op, timeout, seed=seed,
                                   timed=timed, feedback=feedback, operation=operation)  # fmt: skip
    groups = _groups(layout, timeout, operation)
    layout = groups.layout
    method = RAIL_METHOD if layout.nodes > 1 else "none"
    d = tensor.numel()
    check_agreement(
        _Ring.of(groups.all_ranks, _as_timedelta(timeout), operation),
        {
            "hierarchical layout version": LAYOUT_VERSION,
            "quantized protocol version": QUANTIZED_PROTOCOL_VERSION,
            "node layout (nodes x local size)": str(layout),
            "method between the nodes": method,
            "format": format_name(rounding),
            "block size B": block,
            "op": op,
            "tensor length d": d,
            "dtype": str(tensor.dtype),
        },
    )
    stats = HierarchicalStats(layout, method, exact=method == "none")
    if d == 0:
        return stats

    def on_rail(shard: torch.Tensor) -> AllReduceStats:
        if method == "none":  # one node: nothing between nodes (as reduce_on_rail)
            return AllReduceStats()
        return _on_rail(shard, groups, op, timeout, block, rounding, seed, timed, operation)

    run_tiers(tensor, groups, stats, op, timeout, timed, operation, on_rail)
    return stats


def _on_rail(shard, groups: TierGroups, op, timeout, block, rounding, seed, timed, operation) -> AllReduceStats:
    """``shard`` all-reduced over this rank's rail with 8-bit messages; a failure re-raised naming the rail."""
    try:
        return quantized_all_reduce(
            shard, groups.rail, op=op, timeout=timeout, block=block, rounding=rounding, seed=seed, timed=timed
        )
    except CollectiveError as error:
        raise CollectiveError(f"{operation}: between the nodes, on rail {groups.local_rank}: {error}") from error


def hierarchical_quantized_bytes(d: int, layout: NodeLayout, block: int = DEFAULT_BLOCK) -> dict[str, int]:
    """What one rank sends per call and tier: {"intra_node": 2 (G-1) s x 4, "inter_node": 2 (n-1) (s' + 4 nb)}."""
    from cerar.int8.all_reduce import quantized_bytes_sent

    G, n = layout.local_size, layout.nodes
    s = -(-d // G) if d else 0
    return {
        "intra_node": 2 * (G - 1) * s * 4 if G > 1 else 0,
        "inter_node": quantized_bytes_sent(s if G > 1 else d, n, block),
    }


__all__ = ["hierarchical_quantized_all_reduce", "hierarchical_quantized_bytes"]
