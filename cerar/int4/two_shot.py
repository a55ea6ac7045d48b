"""The two shots of a quantized all-reduce, for any block format (``cerar.int4.codecs``): partial sums never travel.

For N ranks, rank j owning shard j of ``rows`` [N, s]:

1. ``scatter_reduce``: rank i writes each shard j != i into a message (the format's rounding, once) and sends it to
   rank j, in N - 1 pairwise steps (step k: to rank i + k, from rank i - k); rank j decodes the N - 1 messages it
   receives and adds them, in float32, to its own shard, which never travels and so is never rounded;
2. ``gather_reduced``: rank j writes its reduced shard into one message (the second and last rounding of a value),
   decodes it back into its own shard (so that it holds what every other rank will), and the N messages go round
   a ring all-gather verbatim, each rank decoding the same bytes: every rank ends with the same result, bit for bit.

``two_shot_all_reduce`` is the flat call of both shots for any codec: the 4-bit all-reduce
(``cerar.int4.all_reduce``), the 8-bit one (``cerar.int8.all_reduce``, with ``Int8Codec``) and either fed back. The
rounds run on cerar's ring plumbing (``cerar.ring.transport._Rounds``: ``batch_isend_irecv`` batches, per-round
deadlines, the gloo and NCCL contracts) over the all-to-all's peer ring (``_PeerRing``). Each message's dither key is
the caller's ``key(shard, phase)`` (the flat call's: its codec's hash of the seed, the call, the sender's global rank,
the shard and the phase); ``next_call`` numbers the calls, one count for every quantized all-reduce of the process
(``dither_calls``), which the trainer sets at a run's start and keeps in its checkpoints.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from cerar.formats.int4_blocks import dither_key
from cerar.ring.checks import check_agreement
from cerar.ring.protocol import AllReduceStats, as_equal_shards
from cerar.ring.rounds import PhaseTimer
from cerar.ring.transport import _bytes, _Ring, _Rounds

INT4_PROTOCOL_VERSION = 1
"""Bumped whenever the 4-bit calls' rounds, the shard assignment, the keys or the format change: ranks of different
versions refuse to mix (the 8-bit call names its own: ``cerar.int8.all_reduce.QUANTIZED_PROTOCOL_VERSION``)."""

PHASE_CONTRIBUTION = 0
"""The key's phase of a contribution's message (shot 1)."""
PHASE_REDUCED = 1
"""The key's phase of a reduced shard's message (shot 2)."""
PHASE_NODE = 2
"""The key's phase of a contribution inside a node (the two-tier call's 8-bit reduce-scatter)."""


_calls = {"count": 0}
"""This process's count of quantized all-reduces (8- and 4-bit, flat and on two tiers): a key of each message's
dither, so that stochastic rounding draws a new dither every call and the same sequence of calls gives the same
bytes. Every rank makes the same calls, so every rank holds the same count; a trainer resets it at the start of a
run and keeps it in its checkpoints (`dither_calls`, `set_dither_calls`), so that a run repeats its bytes whatever
the process ran before it and a resumed run continues the dither of the run it resumes."""


def dither_calls() -> int:
    """How many quantized all-reduces this process has made since the count was last set: the next call's key."""
    return _calls["count"]


def set_dither_calls(count: int) -> None:
    """Continue the count from ``count`` (0 at the start of a run; a checkpoint's count when resuming)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"set_dither_calls: count must be an integer >= 0, got {count!r}")
    _calls["count"] = count


def next_call() -> int:
    """This call's number in the process's count of quantized all-reduces, and the count moved on: every rank makes
    the same calls, so every rank numbers them alike."""
    call = dither_calls()
    set_dither_calls(call + 1)
    return call


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


def message_key(seed: int, call: int, sender: int, shard: int, phase: int) -> int:
    """The dither key of one 4-bit message (``Int4Codec.key``): a hash of the seed, the call, the sender's global
    rank (distinct on every rail of a two-tier call), the shard and the phase."""
    return dither_key(seed, call, sender, shard, phase)


def _encode_fed(codec, message: torch.Tensor, x: torch.Tensor, key: int, residual: torch.Tensor | None) -> None:
    """Write x into ``message``; with error feedback (``residual``: what the last message of this shard dropped),
    x + residual, and keep in ``residual`` what this message drops (``cerar.int4.feedback``)."""
    if residual is None:
        codec.encode(message, x, key)
        return
    residual.add_(x)
    codec.encode(message, residual, key)
    sent = torch.empty_like(residual)
    codec.decode(message, residual.numel(), sent)
    residual.sub_(sent)


def scatter_reduce(
    rows: torch.Tensor, rounds: _Rounds, codec, key, timer: PhaseTimer, residual: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Shot 1 on ``rows`` [N, s] (module docstring): rank i ends with rows[i] its own shard plus the decoded
    messages of the others' shard i. ``key(shard, phase)``: each message's dither key; ``residual`` [N, s]: error
    feedback's (row j != i: what this rank's last message of shard j dropped), or None. Returns the N message
    buffers (``messages[j]``: the one sent to rank j; ``messages[i]``, free, for shot 2) and the N - 1 received."""
    ring = rounds.ring
    N, i, s = ring.size, ring.rank, rows.shape[1]
    messages = [codec.new_message(s, rows.device) for _ in range(N)]
    incoming = [codec.new_message(s, rows.device) for _ in range(N - 1)]
    at = ring.global_rank

    def encode(j: int) -> None:
        with timer.phase("encode"):
            fed = None if residual is None else residual[j]
            _encode_fed(codec, messages[j], rows[j], key(j, PHASE_CONTRIBUTION), fed)

    def accumulate(message: torch.Tensor) -> None:
        with timer.phase("decode"):
            codec.decode(message, s, rows[i], add=True)

    posted = []
    for k in range(1, N):  # every message on the wire before the first is decoded
        to, frm = (i + k) % N, (i - k) % N
        rounds.issue(encode, to)
        what = f"all-to-all step {k}/{N - 1} (to rank {at(to)}, from rank {at(frm)})"
        posted.append((rounds.post((messages[to], at(to)), (incoming[k - 1], at(frm)), what), what))
    for k, (handle, what) in enumerate(posted):
        rounds.arrive(handle, what)
        rounds.issue(accumulate, incoming[k])
    return messages + incoming


def gather_reduced(
    rows: torch.Tensor,
    rounds: _Rounds,
    codec,
    key,
    timer: PhaseTimer,
    messages: list[torch.Tensor],
    residual: torch.Tensor | None = None,
) -> None:
    """Shot 2 on ``rows`` [N, s] whose row i (this rank's) holds the reduced shard: one message of it, decoded back
    into row i, and the ring all-gather of the N messages (``messages``, one buffer per shard), each decoded into
    its row. ``residual`` [N, s]: error feedback's, whose row i is what this rank's last reduced message dropped.
    N > 1 (``two_shot_all_reduce`` returns before it for one rank).

    Each step's message is forwarded as it arrived, so the next step is posted before the one that arrived is
    decoded: the decoding (and the decoding back of this rank's own message) runs while the next message is on the
    wire, instead of between the two. Both only read a message the post also only reads."""
    ring = rounds.ring
    N, i, s = ring.size, ring.rank, rows.shape[1]
    at = ring.global_rank

    def encode_result() -> None:
        with timer.phase("encode"):
            if residual is not None:
                residual[i].add_(rows[i])
            codec.encode(messages[i], rows[i] if residual is None else residual[i], key(i, PHASE_REDUCED))

    def decode_own() -> None:
        with timer.phase("decode"):
            codec.decode(messages[i], s, rows[i])  # the bytes every other rank decodes
            if residual is not None:
                residual[i].sub_(rows[i])

    def decode(j: int) -> None:
        with timer.phase("decode"):
            codec.decode(messages[j], s, rows[j])

    to, frm = at((i + 1) % N), at((i - 1) % N)

    def post(k: int):
        """Step k: sends shard i - k (this rank's, then each as it arrived), receives shard i - k - 1."""
        send, recv = (i - k) % N, (i - k - 1) % N
        what = f"all-gather step {k + 1}/{N - 1} (to rank {to}, from rank {frm})"
        return rounds.post((messages[send], to), (messages[recv], frm), what), what

    rounds.issue(encode_result)
    posted = post(0)
    rounds.issue(decode_own)
    for k in range(N - 1):
        rounds.arrive(*posted)
        if k + 1 < N - 1:
            posted = post(k + 1)
        rounds.issue(decode, (i - k - 1) % N)


def divide(timer: PhaseTimer, shard: torch.Tensor, n: int) -> None:
    """shard /= n: the sum of n contributions made their mean (device work, issued between the shots)."""
    with timer.phase("decode"):
        shard.div_(n)


def copy_back(timer: PhaseTimer, tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """The caller's tensor from the padded copy it was reduced in (device work, issued last)."""
    with timer.phase("decode"):
        tensor.copy_(flat[: tensor.numel()].view(tensor.shape))


def two_shot_all_reduce(
    tensor: torch.Tensor, codec, group, op: str, timeout, *, seed: int, timed: bool, feedback=None,
    feedback_name: str = "flat", operation: str = "cerar.int4.two_shot_all_reduce", protocol: dict | None = None,
) -> AllReduceStats:  # fmt: skip
    """The flat two-shot call of any codec (``cerar.int4.codecs``: the 4-bit format, the 8-bit one), arguments checked
    by the caller: shot 1, the mean's division (``op="avg"``), shot 2, the copy back into a tensor that was not
    already N equal shards. Each message keyed by ``codec.key(seed, call, sender's global rank, shard, phase)``.
    ``feedback``: the residuals are kept under ``feedback_name`` (the padded [N, s] shards of this call's tensor).
    ``protocol``: the version field(s) the ranks agree on with the format, the op and d (default: the 4-bit
    calls' ``INT4_PROTOCOL_VERSION``)."""
    ring = _PeerRing.of(group, timeout, operation)
    N, d = ring.size, tensor.numel()
    check_agreement(
        ring,
        {
            "N": N,
            **({"int4 protocol version": INT4_PROTOCOL_VERSION} if protocol is None else protocol),
            **codec.agreement(),
            "op": op,
            "tensor length d": d,
            "dtype": str(tensor.dtype),
            "error feedback": feedback is not None,
        },
    )
    call = next_call()
    stats = AllReduceStats(rounds=2 * (N - 1) if N > 1 else 0)
    if N == 1 or d == 0:
        return stats
    timer = PhaseTimer(tensor.device, enabled=timed)
    flat, in_place = as_equal_shards(tensor, N)
    rows = flat.view(N, -1)
    residual = None if feedback is None else feedback.rows(feedback_name, N, rows.shape[1], flat)
    sender = ring.global_rank(ring.rank)

    def key(shard: int, phase: int) -> int:
        return codec.key(seed, call, sender, shard, phase)

    with torch.no_grad():
        rounds = _Rounds(ring, timer)
        buffers = scatter_reduce(rows, rounds, codec, key, timer, residual)
        if op == "avg":
            rounds.issue(divide, timer, rows[ring.rank], N)
        gather_reduced(rows, rounds, codec, key, timer, buffers[:N], residual)
        if not in_place:
            rounds.issue(copy_back, timer, tensor, flat)
        rounds.finish()
    return call_stats([ring], timer, stats.rounds, _bytes(*buffers) + (0 if in_place else _bytes(flat)))


def call_stats(rings: list, timer: PhaseTimer, rounds: int, peak_extra_bytes: int) -> AllReduceStats:
    """A finished call's record: the bytes its ``rings`` (the ``_Ring``s it posted on) counted, its rounds, the
    seconds of each phase of ``timer``, its peak extra storage."""
    seconds = timer.totals()
    return AllReduceStats(
        bytes_sent=sum(ring.bytes_sent for ring in rings),
        bytes_received=sum(ring.bytes_received for ring in rings),
        rounds=rounds,
        seconds_encode=seconds.get("encode", 0.0),
        seconds_comm=seconds.get("comm", 0.0),
        seconds_decode=seconds.get("decode", 0.0),
        peak_extra_bytes=peak_extra_bytes,
    )


__all__ = [
    "INT4_PROTOCOL_VERSION",
    "call_stats",
    "copy_back",
    "dither_calls",
    "divide",
    "PHASE_CONTRIBUTION",
    "PHASE_NODE",
    "PHASE_REDUCED",
    "gather_reduced",
    "message_key",
    "next_call",
    "scatter_reduce",
    "set_dither_calls",
    "two_shot_all_reduce",
]
