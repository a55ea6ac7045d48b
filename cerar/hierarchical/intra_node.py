"""Tier 1, inside a node: exact ring reduce-scatter and all-gather over the node's G ranks.

The node's vector is padded to G shards of s = ceil(d/G) values, ``shards`` [G, s]. Local rank i
keeps shard i: after ``reduce_scatter`` it holds the node's sum of shard i (the G ranks' shards
added in ring order), and ``all_gather`` then hands every rank every shard. Each is G - 1 rounds of
one shard to the next local rank and one from the previous, driven by cerar's round driver
(``cerar.ring.transport._Rounds`` on the node's ``_Ring``), as ``cerar.ring_all_reduce`` is: the same
per-round deadlines, byte counts and backends' contracts (gloo: the host waits for each round; NCCL:
the rounds and the additions are ordered on the CUDA streams, the host polls a round now and then
and the last one). The caller ends each tier with ``rounds.finish()``.

Per call and rank: 2 (G - 1) rounds, (G - 1) s values sent by each of the two, (G - 1) s additions.
"""

from __future__ import annotations

import torch

from cerar.ring.rounds import PhaseTimer
from cerar.ring.transport import _Rounds


def reduce_scatter(shards: torch.Tensor, rounds: _Rounds, incoming: torch.Tensor, timer: PhaseTimer) -> None:
    """Leave shards[i] at local rank i holding the sum of every local rank's shards[i].

    Step k (0-based) sends shard i - k - 1 (which holds k + 1 ranks' values after the previous
    additions) and adds the incoming shard i - k - 2 into place: shard i arrives complete at the
    last step."""
    G, i = rounds.ring.size, rounds.ring.rank

    def add(target: torch.Tensor) -> None:
        with timer.phase("decode"):
            target += incoming

    for step in range(G - 1):
        what = f"reduce-scatter step {step + 1}/{G - 1}"
        rounds.arrive(rounds.post(shards[(i - step - 1) % G], incoming, what), what)
        rounds.issue(add, shards[(i - step - 2) % G])


def all_gather(shards: torch.Tensor, rounds: _Rounds) -> None:
    """Give every local rank every shard, local rank i contributing shards[i]: step k sends shard
    i - k (its own, then the last one received) and receives shard i - k - 1 in place. On a 16-bit
    wire (``rounds.wire``) rank i's own shard is rounded as it is first sent, so that every rank
    of the node holds the same bits."""
    G, i = rounds.ring.size, rounds.ring.rank
    for step in range(G - 1):
        what = f"all-gather step {step + 1}/{G - 1}"
        # step 1 sends this rank's own complete shard: on a 16-bit wire it keeps what its receivers get
        sent = rounds.post(shards[(i - step) % G], shards[(i - step - 1) % G], what, round_sent=step == 0)
        rounds.arrive(sent, what)
