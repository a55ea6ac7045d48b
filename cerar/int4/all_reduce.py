"""A 4-bit all-reduce: every contribution rounded once to 4 bits, the sums taken in float32, every rank the same result.

    stats = int4_all_reduce(grad, group, op="avg", timeout=60, block=128)   # in place, float32

The 8-bit all-reduce's two shots (``cerar.int4.two_shot``, as ``cerar.int8.all_reduce``) with the 4-bit format of
``cerar.formats.int4_blocks`` (two values per byte, a float32 scale per block of B, each full block rotated by a
random-signed Walsh-Hadamard transform unless ``rotate=False``, stochastic rounding unless
``rounding="nearest"``). For a float32 tensor of d values on N ranks (shards of s = ceil(d/N) values, the tensor
zero-padded to N s; rank j owns shard j):

    S_j = x_j^(j) + sum_{i != j} Q(x_j^(i))        (divided by N for op="avg"),   every rank receives Q(S_j)

so each value meets two roundings at most, whatever N. Per value of block b of shard j, with k = 1 (stochastic) or
1/2 (nearest) and scale_b the block's step (absmax / 7 of the block, of its rotation where rotated), for the mean:

    |out - mean| <= (1/N) sum_{i != j} k scale_b(x_j^(i))  +  k scale_b(S_j)    (+ float32's rounding)

``tests/test_int4_all_reduce.py`` holds every value to it against a float64 oracle.

The dither of each message is keyed by (seed, the call's count, the sender's global rank, the shard, the shot):
independent across positions, senders, rails and calls (``cerar.formats.int4_blocks``). The rotation's signs are
derived from ``seed`` alone, on every rank alike; the ranks check, before the first round, that they agree on N,
d, B, the format (rounding, rotation), the seed where rotated, the op and this module's protocol version.

Costs per rank and call (s = ceil(d/N), nb = ceil(s/B), a message 4 nb + ceil(s/2) bytes):

- rounds: 2 (N - 1), as the float32 ring;
- bytes sent: 2 (N - 1) (ceil(s/2) + 4 nb) ~ 2 (N-1)/N d (1/2 + 4/B): 0.133 of the float32 ring's 2 (N - 1) s x 4
  at B = 128 (the 8-bit call: 0.258);
- arithmetic: N - 1 quantizations and dequantize-adds of s values, one quantization of the reduced shard and N
  dequantizations; rotated, each of them one log2 B-stage transform more;
- extra storage: 2N - 1 messages, about d (1 + 8/B) bytes, and the quantizer's float32 scratch of s values.
"""

from __future__ import annotations

import torch

from cerar.formats.int4_blocks import DEFAULT_BLOCK, DEFAULT_ROTATE, DEFAULT_ROUNDING, check_format, message_bytes
from cerar.int4.codecs import Int4Codec
from cerar.int4.feedback import ErrorFeedback
from cerar.int4.two_shot import INT4_PROTOCOL_VERSION, two_shot_all_reduce
from cerar.int8.all_reduce import check_quantized_call
from cerar.ring.protocol import AllReduceStats


def check_int4_call(tensor, op: str, block, rounding, rotate, seed, operation: str) -> Int4Codec:
    """The arguments of a 4-bit all-reduce (flat or two-tier), checked on this rank before any collective: a
    ValueError naming the call and the bad argument; the call's format."""
    check_quantized_call(tensor, op, block, operation, rounding, seed)
    check_format(block, rounding, rotate, operation)
    return Int4Codec(block, rounding, rotate, seed, operation)


def int4_bytes_sent(d: int, N: int, block: int = DEFAULT_BLOCK) -> int:
    """What one rank sends in one call: 2 (N - 1) messages of ceil(d/N) values, scales included."""
    return 2 * (N - 1) * message_bytes(-(-d // N), block) if N > 1 and d > 0 else 0


def int4_all_reduce(
    tensor: torch.Tensor,
    group=None,
    op: str = "avg",
    timeout=None,
    block: int = DEFAULT_BLOCK,
    *,
    rounding: str = DEFAULT_ROUNDING,
    rotate: bool = DEFAULT_ROTATE,
    seed: int = 0,
    timed: bool = True,
    feedback: ErrorFeedback | None = None,
) -> AllReduceStats:
    """All-reduce ``tensor`` (float32, any shape, contiguity and length) in place over ``group`` with 4-bit messages
    (module docstring): every rank gets the same approximation of the sum, or with ``op="avg"`` the mean, within
    two block roundings per value. ``block``: values per float32 scale (a power of two when rotated);
    ``rounding``: "stochastic" (the default: zero on average over calls) or "nearest"; ``rotate``: rotate each full
    block first (the signs from ``seed``, which also keys the dither); ``feedback``: this rank's error feedback
    (``cerar.int4.feedback``), or None. ``timeout`` (seconds or timedelta, default 5 minutes) bounds every round as
    in ``cerar.all_reduce``. Raises ValueError for bad input and CollectiveError when a peer fails, stalls past the
    timeout or disagrees on the call (on every rank). ``stats.bytes_sent`` counts the scales:
    ``int4_bytes_sent(d, N, B)``."""
    operation = "cerar.int4_all_reduce"
    codec = check_int4_call(tensor, op, block, rounding, rotate, seed, operation)
    return two_shot_all_reduce(tensor, codec, group, op, timeout, seed=seed, timed=timed, feedback=feedback,
                               operation=operation)  # fmt: skip


__all__ = ["INT4_PROTOCOL_VERSION", "check_int4_call", "int4_all_reduce", "int4_bytes_sent", "two_shot_all_reduce"]
