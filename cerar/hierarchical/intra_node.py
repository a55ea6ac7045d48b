"""Tier 1, inside a node: exact ring reduce-scatter and all-gather over the node's G ranks.

The node's vector is padded to G shards of s = ceil(d/G) values, ``shards`` [G, s]. Local rank i
keeps shard i: after ``reduce_scatter`` it holds the node's sum of shard i (the G ranks' shards
added in ring order), and ``all_gather`` then hands every rank every shard. Each is G - 1 rounds of
one shard to the next local rank and one from the previous, on cerar's ring plumbing
(``cerar.protocol._Ring``), so this tier keeps the deadlines, the backends' contracts and the byte
counts of the flat protocol.

Per call and rank: 2 (G - 1) rounds, (G - 1) s values sent by each of the two, (G - 1) s additions.
"""

from __future__ import annotations

import torch

from cerar.protocol import _Ring
from cerar.rounds import PhaseTimer


def reduce_scatter(shards: torch.Tensor, ring: _Ring, incoming: torch.Tensor, timer: PhaseTimer) -> None:
    """Leave shards[i] at local rank i holding the sum of every local rank's shards[i].

    Step k (0-based) sends shard i - k - 1 (which holds k + 1 ranks' values after the previous
    additions) and adds the incoming shard i - k - 2 into place: shard i arrives complete at the
    last step."""
    G, i = ring.size, ring.rank
    for step in range(G - 1):
        with timer.phase("comm"):
            ring.shift(shards[(i - step - 1) % G], incoming, f"reduce-scatter step {step + 1}/{G - 1}")
        with timer.phase("decode"):
            shards[(i - step - 2) % G] += incoming


def all_gather(shards: torch.Tensor, ring: _Ring, timer: PhaseTimer) -> None:
    """Give every local rank every shard, local rank i contributing shards[i]: step k sends shard
    i - k (its own, then the last one received) and receives shard i - k - 1 in place."""
    G, i = ring.size, ring.rank
    for step in range(G - 1):
        with timer.phase("comm"):
            ring.shift(shards[(i - step) % G], shards[(i - step - 1) % G], f"all-gather step {step + 1}/{G - 1}")
