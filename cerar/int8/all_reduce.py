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

The rounds run on cerar's ring plumbing (``cerar.ring.transport``: ``batch_isend_irecv`` batches, the
transport contracts of gloo and NCCL, per-round deadlines); only the peers of the all-to-all steps
differ from the ring's (``_PeerRing``). Before the first round the ranks check, over an all-gather,
that they agree on N, d, B, the format, the op and this module's protocol version: a rank that differs
is refused on every rank, the field named.

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

import time

import torch
import torch.distributed as dist

from cerar.formats.int8_blocks import (
    DEFAULT_BLOCK,
    DEFAULT_ROUNDING,
    check_block,
    check_rounding,
    dequantize,
    dither_key,
    format_name,
    message_bytes,
    new_message,
    quantize_into,
)
from cerar.ring.checks import _check_op, check_agreement
from cerar.ring.protocol import AllReduceStats, as_equal_shards
from cerar.ring.rounds import PhaseTimer
from cerar.ring.transport import _bytes, _Ring, _Rounds

QUANTIZED_PROTOCOL_VERSION = 3
"""Bumped whenever the rounds, the shard assignment or the format change: ranks of different versions refuse to
mix. 2: the rounding is chosen (nearest or stochastic) and tiny scales are prescaled (issues 33 and 35). 3: the
dither's chunks of 2^16 values each read the table from their own shift, and its key names the sender by its
global rank (issue 51); the scale is absmax / 127 by IEEE division on every device (issue 52)."""

_calls = {"count": 0}
"""This process's count of 8-bit all-reduces: a key of each message's dither (``int8_blocks.dither_key``), so
that stochastic rounding draws a new dither every call and the same sequence of calls gives the same bytes.
Every rank makes the same calls, so every rank holds the same count; a trainer resets it at the start of a run
and keeps it in its checkpoints (`dither_calls`, `set_dither_calls`), so that a run repeats its bytes whatever
the process ran before it and a resumed run continues the dither of the run it resumes."""


def dither_calls() -> int:
    """How many 8-bit all-reduces this process has made since the count was last set: the next call's key."""
    return _calls["count"]


def set_dither_calls(count: int) -> None:
    """Continue the count from ``count`` (0 at the start of a run; a checkpoint's count when resuming)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"set_dither_calls: count must be an integer >= 0, got {count!r}")
    _calls["count"] = count


class _PeerRing(_Ring):
    """cerar's ring plumbing with the peers of each post chosen by the caller: ``post((send, to_rank),
    (recv, from_rank))`` with global ranks (the all-to-all steps send to rank i + k, not to the next rank).
    The failure messages name the peers through each round's ``what``, which the caller writes."""

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    @property
    def peers(self) -> str:
        return ""  # each round's description names its own peers

    def post(self, send, recv) -> list:
        (send_tensor, to_rank), (recv_tensor, from_rank) = send, recv
        return self.post_between(send_tensor, to_rank, recv_tensor, from_rank)

    def complete(self, works: list, what: str) -> None:
        deadline = time.monotonic() + self.timeout.total_seconds()
        if len(works) == 2:  # one work per op, in the order posted: the send, then the receive
            self.await_works(works[1:], f"{what}: receive", "", deadline)
            self.await_works(works[:1], f"{what}: send", "", deadline)
        else:
            self.await_works(works, f"{what}: receive and send", "", deadline)


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
    version (on every rank). ``stats.bytes_sent`` counts the scales: ``quantized_bytes_sent(d, N, B)``."""
    operation = "cerar.quantized_all_reduce"
    check_quantized_call(tensor, op, block, operation, rounding, seed)
    ring = _PeerRing.of(group, timeout, operation)
    N, d, i = ring.size, tensor.numel(), ring.rank
    check_agreement(
        ring,
        {
            "N": N,
            "quantized protocol version": QUANTIZED_PROTOCOL_VERSION,
            "format": format_name(rounding),
            "block size B": block,
            "op": op,
            "tensor length d": d,
            "dtype": str(tensor.dtype),
        },
    )
    call = _calls["count"]
    _calls["count"] = call + 1
    stats = AllReduceStats(rounds=2 * (N - 1) if N > 1 else 0)
    if N == 1 or d == 0:
        return stats

    timer = PhaseTimer(tensor.device, enabled=timed)
    flat, in_place = as_equal_shards(tensor, N)
    rows = flat.view(N, -1)
    s = rows.shape[1]
    # messages[j]: first shard j for rank j (step 1), then rank j's reduced shard (step 3): once the
    # all-to-all has completed, the buffer that carried shard j to rank j receives rank j's result
    messages = [new_message(s, block, flat.device) for _ in range(N)]
    incoming = [new_message(s, block, flat.device) for _ in range(N - 1)]
    at = ring.global_rank
    sender = at(i)  # the global rank: unique in the job, so calls on different groups (the rails) draw apart

    def offset(shard: int, reduced: bool) -> int:
        return dither_key(seed, call, sender, shard, reduced) if rounding == "stochastic" else 0

    def encode(j: int) -> None:
        with timer.phase("encode"):
            quantize_into(messages[j], rows[j], block, rounding, offset(j, False))

    def accumulate(message: torch.Tensor) -> None:
        with timer.phase("decode"):
            dequantize(message, s, block, rows[i], add=True)

    def encode_result() -> None:
        with timer.phase("encode"):
            if op == "avg":
                rows[i].div_(N)
            quantize_into(messages[i], rows[i], block, rounding, offset(i, True))
            dequantize(messages[i], s, block, rows[i])  # the bytes every other rank decodes

    def decode(j: int) -> None:
        with timer.phase("decode"):
            dequantize(messages[j], s, block, rows[j])

    def copy_back() -> None:
        with timer.phase("decode"):
            tensor.copy_(flat[:d].view(tensor.shape))

    with torch.no_grad():
        rounds = _Rounds(ring, timer)
        posted = []
        for k in range(1, N):  # every step on the wire before the first dequantization
            to, frm = (i + k) % N, (i - k) % N
            rounds.issue(encode, to)
            what = f"all-to-all step {k}/{N - 1} (to rank {at(to)}, from rank {at(frm)})"
            posted.append((rounds.post((messages[to], at(to)), (incoming[k - 1], at(frm)), what), what))
        for k, (handle, what) in enumerate(posted):
            rounds.arrive(handle, what)
            rounds.issue(accumulate, incoming[k])
        rounds.issue(encode_result)
        next_rank, prev_rank = at((i + 1) % N), at((i - 1) % N)
        for k in range(N - 1):  # ring all-gather of the reduced shards' messages, forwarded verbatim
            send, recv = (i - k) % N, (i - k - 1) % N
            what = f"all-gather step {k + 1}/{N - 1} (to rank {next_rank}, from rank {prev_rank})"
            rounds.arrive(rounds.post((messages[send], next_rank), (messages[recv], prev_rank), what), what)
            rounds.issue(decode, recv)
        if not in_place:
            rounds.issue(copy_back)
        rounds.finish()

    seconds = timer.totals()
    stats.bytes_sent, stats.bytes_received = ring.bytes_sent, ring.bytes_received
    stats.seconds_encode = seconds.get("encode", 0.0)
    stats.seconds_comm = seconds.get("comm", 0.0)
    stats.seconds_decode = seconds.get("decode", 0.0)
    stats.peak_extra_bytes = _bytes(*messages, *incoming) + (0 if in_place else _bytes(flat))
    return stats


__all__ = [
    "QUANTIZED_PROTOCOL_VERSION",
    "check_quantized_call",
    "quantized_all_reduce",
    "quantized_bytes_sent",
]
