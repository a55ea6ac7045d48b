"""Hierarchical CERAR: exact inside a node, coded between nodes.

Real clusters have two tiers: fast links between the G ranks of a node, a slower network between
the n nodes. The two-tier all-reduce reduce-scatters exactly inside each node, all-reduces each
1/G shard across the nodes on its own "rail" (the n ranks with the same local rank), with CERAR
for n workers or the exact ring, and all-gathers exactly inside each node:

    layout = NodeLayout.from_env()                     # torchrun's LOCAL_WORLD_SIZE; or local_size=...
    code = cerar.make_code(layout.nodes, 16, "optimized")   # a code for the NODES
    stats = hierarchical_all_reduce(grad, code, layout, op="avg", timeout=60)
    stats.intra_node.bytes_sent, stats.inter_node.bytes_sent, stats.inter_node_method
    hierarchical_ring_all_reduce(grad, layout, op="avg")    # the exact baseline on the same tiers
    method_between_nodes(layout.nodes, coded=True)          # "cerar", "exact ring" (2 nodes) or "none" (1)

    from cerar.hierarchical import HierarchicalHookState, hierarchical_hook   # as a DDP communication hook
    ddp_model.register_comm_hook(HierarchicalHookState(c=16, construction="optimized"), hierarchical_hook)

Per node, the bytes between nodes are (1 + (n-2)/c) d against 2 (n-1)/n d for the exact hierarchy:
the code pays for c > n and n > 2. On one node the call is exact; on two it runs the exact ring
between the nodes (both send d) unless ``coded_on_two_nodes=True``; with G = 1 it is flat CERAR.

The 8-bit all-reduce on the rails instead (issue 25) lives with the other 8-bit collectives:
``cerar.int8.two_tier.hierarchical_quantized_all_reduce(grad, layout, op="avg", block=128)``, exact inside
each node on these tiers (docs/int8.md).

Modules, one per tier: ``layout`` (where the ranks sit, the groups of both tiers), ``intra_node``
(tier 1), ``inter_node`` (tier 2), ``collective`` (the two together), ``hook`` (DDP).
"""

from cerar.hierarchical.collective import HierarchicalStats, hierarchical_all_reduce, hierarchical_ring_all_reduce
from cerar.hierarchical.hook import HierarchicalHookState, hierarchical_hook
from cerar.hierarchical.inter_node import HierarchicalWarning, method_between_nodes
from cerar.hierarchical.layout import NodeLayout, TierGroups, new_tier_groups, tier_groups

__all__ = [
    "HierarchicalHookState",
    "HierarchicalStats",
    "HierarchicalWarning",
    "NodeLayout",
    "TierGroups",
    "hierarchical_all_reduce",
    "hierarchical_hook",
    "hierarchical_ring_all_reduce",
    "method_between_nodes",
    "new_tier_groups",
    "tier_groups",
]
