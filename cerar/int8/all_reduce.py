"""An 8-bit quantized all-reduce: every contribution quantized once, the sums taken in float32.

    stats = quantized_all_reduce(grad, group, op="avg", timeout=60, block=128)   # in place, float32

The plain way to send fewer bits, a ring whose every hop carries a low-precision partial sum, rounds
the running sum again at each of its N - 1 reduce-scatter hops, so its error grows with N (the issue's
plain e4m3 ring: 3.9e-2 at N=4, 5.3e-2 at N=8). This call is built the way DeepSpeed ZeRO++'s qgZ
builds its gradient averaging: an all-to-all based reduce-scatter, so that no partial sum is ever
requantized. For a float32 tensor of d values on N ranks (shards of s = ceil(d/N) values, the tensor
zero-padded to N s; rank j owns shard j):

1. rank i quantizes each shard j != i, x_j^(i), to the block format of ``cerar.formats.int8_blocks`` (int8
   values, one float32 scale absmax/127 per block of B values) and sends it to rank j: N - 1 steps,
   step k sending to rank i + k and receiving from rank i - k (a pairwise all-to-all);
2. rank j dequantizes the N - 1 shards it received and adds them, in float32, to its own shard, which
   never travels and so is not quantized: S_j = x_j^(j) + sum_{i != j} Q(x_j^(i)) (divided by N for
   ``op="avg"``);
3. rank j quantizes S_j once and the N messages are all-gathered on the ring (N - 1 steps, each
   message forwarded verbatim), every rank, rank j included, decoding the SAME bytes: every rank ends
   with the same result, bit for bit (the replicas of a data-parallel job stay identical).

Every value therefore meets at most two roundings: its contribution's (at most scale/2 of its block,
``int8_blocks.error_bound``) and the reduced shard's. For the mean,

    |out - mean| <= (1/N) sum_{i != j} scale_b(x_j^(i)) / 2 + scale_b(S_j) / 2     per value of block b

(plus float32's own rounding of the N additions), whatever N: the first term averages N - 1
independent errors (their root mean square falls as 1/sqrt(N) relative to one contribution's), the
second is one rounding of the result. ``tests/test_quantized.py`` holds the result to this bound
against a float64 oracle.

The two shots are ``cerar.int4.two_shot``'s, written once for any block format and run here with the 8-bit
codec (``cerar.int4.codecs.Int8Codec``, each message keyed by the 8-bit format's hash); they run on cerar's ring
plumbing (``cerar.ring.transport``: ``batch_isend_irecv`` batches, the transport contracts of gloo and NCCL,
per-round deadlines), the all-to-all steps on ``two_shot._PeerRing``. Before the first round the ranks check, over
an all-gather, that they agree on N, d, B, the format, the op and this module's protocol version: a rank that
differs is refused on every rank, the field named.

Costs per rank and call (s = ceil(d/N), nb = ceil(s/B), message = 4 nb + s bytes):

=================  ===========================================  ===============================
                   ``quantized_all_reduce``                     ``ring_all_reduce`` (float32)
=================  ===========================================  ===============================
rounds             2 (N - 1)                                    2 (N - 1)
bytes sent         2 (N - 1) (s + 4 nb) ~ 2 (N-1)/N d (1 + 4/B)  2 (N - 1) s x 4
                   (0.258 of float32's at B = 128)
arithmetic         N - 1 quantizations and dequantize-adds of   (N - 1) s additions
                   s values; one quantization of the reduced
                   shard; N dequantizations in the all-gather
extra storage      (2N - 1) messages ~ 2 d (1 + 4/B) bytes       s values (and a padded copy
                   (and a padded float32 copy when N s != d)    when N s != d)
error              the bound above (two roundings per value)    none
=================  ===========================================  ===============================
"""

from __future__ import annotations

import torch

from cerar.formats.int8_blocks import DEFAULT_BLOCK, DEFAULT_ROUNDING, check_block, check_rounding, message_bytes
from cerar.int4.codecs import Int8Codec
from cerar.int4.two_shot import dither_calls, set_dither_calls, two_shot_all_reduce
from cerar.ring.checks import _check_op
from cerar.ring.protocol import AllReduceStats

QUANTIZED_PROTOCOL_VERSION = 3
"""Bumped whenever the rounds, the shard assignment or the format change: ranks of different versions refuse to
mix. 2: the rounding is chosen (nearest or stochastic) and tiny scales are prescaled (issues 33 and 35). 3: the
dither's chunks of 2^16 values each read the table from their own shift, and its key names the sender by its
global rank (issue 51); the scale is absmax / 127 by IEEE division on every device (issue 52)."""


def check_quantized_call(tensor, op: str, block, operation: str, rounding: str = DEFAULT_ROUNDING, seed=0) -> None:
    """The arguments of a quantized all-reduce (flat or hierarchical), checked on this rank before any
    collective: a ValueError naming the call and the bad argument."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{operation}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32:
        raise ValueError(f"{operation}: tensor must be float32 (the sums are taken in float32), got {tensor.dtype}")
    _check_op(op, operation)
    check_block(block, operation)
    check_rounding(rounding, operation)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{operation}: seed must be an integer (the dither's key), got {seed!r}")


def quantized_bytes_sent(d: int, N: int, block: int = DEFAULT_BLOCK) -> int:
    """What one rank sends in one call: 2 (N - 1) messages of ceil(d/N) values, scales included."""
    return 2 * (N - 1) * message_bytes(-(-d // N), block) if N > 1 and d > 0 else 0


def quantized_all_reduce(
    tensor: torch.Tensor,
    group=None,
    op: str = "avg",
    timeout=None,
    block: int = DEFAULT_BLOCK,
    *,
    rounding: str = DEFAULT_ROUNDING,
    seed: int = 0,
    timed: bool = True,
    feedback=None,
) -> AllReduceStats:
    """All-reduce ``tensor`` (float32, any shape, contiguity and length) in place over ``group`` with
    8-bit messages (module docstring): every rank gets the same approximation of the sum, or with
    ``op="avg"`` (the default) the mean, within two block roundings per value. ``block``: values per
    float32 scale (``cerar.formats.int8_blocks``). ``rounding``: "nearest" (at most half a step per rounding) or
    "stochastic" (at most one step, zero on average over calls: ``cerar.formats.int8_blocks``), its dither keyed
    by ``seed``, this process's call count, the sender's global rank and the shard, so a run repeats its bytes
    and calls on different groups (the rails of ``hierarchical_quantized_all_reduce``) draw different dithers.
    ``timeout`` (seconds or timedelta, default 5 minutes)
    bounds every round as in ``cerar.all_reduce``. Raises ValueError for bad input and CollectiveError
    when a peer fails, stalls past the timeout or disagrees on N, d, B, the format, the op or the
    version (on every rank). ``stats.bytes_sent`` counts the scales: ``quantized_bytes_sent(d, N, B)``.
    ``feedback``: this rank's error feedback (``cerar.int4.feedback.ErrorFeedback``: each message carries what the
    last one of its shard dropped), or None; the same bytes either way."""
    operation = "cerar.quantized_all_reduce"
    check_quantized_call(tensor, op, block, operation, rounding, seed)
    return two_shot_all_reduce(tensor, Int8Codec(block, rounding, operation), group, op, timeout, seed=seed,
                               timed=timed, feedback=feedback, operation=operation,
                               protocol={"quantized protocol version": QUANTIZED_PROTOCOL_VERSION})  # fmt: skip


__all__ = [
    "QUANTIZED_PROTOCOL_VERSION",
    "check_quantized_call",
    "dither_calls",
    "set_dither_calls",
    "quantized_all_reduce",
    "quantized_bytes_sent",
]
