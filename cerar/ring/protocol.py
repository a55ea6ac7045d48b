"""CERAR and the exact ring all-reduce between processes: ``all_reduce`` and ``ring_all_reduce``, on the ring
transport of ``cerar.ring.transport`` (one code path for gloo and NCCL; the contracts and what bounds a stall are
there) after the checks of ``cerar.ring.checks``. Encoding and decoding are batched matrix products on the tensor's
device (``cerar.ring.rounds``), in full float32 whatever the TF32 settings (``cerar.ring.precision``).

Costs per call, for a tensor of d values (m = ceil(d/c)):

=================  =========================  ==============================
                   ``all_reduce`` (CERAR)     ``ring_all_reduce`` (exact)
=================  =========================  ==============================
rounds             L = c + N - 2              2 (N - 1)
values sent        L m ~ (1 + (N-2)/c) d      2 (N - 1) ceil(d/N)
extra storage      (c+N) m ~ (1 + N/c) d     ceil(d/N), plus a padded copy
                   (storage="spec"); (c+L)    when N does not divide d
                   m ("messages")
arithmetic         (3c + N - 2) d mult-adds   (N - 1) ceil(d/N) additions
                   in ~20 ("spec") or ~10
                   ("messages") passes over
                   d, one operation per round
                   and chunk (``cerar.ring.
                   rounds``)
error              the code's (0 for exact)   none
host waits         gloo: every round; NCCL:   the same
                   one poll per
                   LOOK_BEHIND_POSTS posts
                   and one at the end
=================  =========================  ==============================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cerar.coding.codes import Code
from cerar.coding.matrices import device_matrices
from cerar.formats.wire import transport_name, wire_for
from cerar.ring.checks import _check_op, _check_tensor, check_agreement, check_coded_call, check_transport
from cerar.ring.fp32_products import check_no_tf32_override, full_fp32_products
from cerar.ring.rounds import DEFAULT_STORAGE, CodedRingRank, PhaseTimer, check_chunks, default_pipeline_chunks
from cerar.ring.transport import _bytes, _Ring, _Rounds
from cerar.ring.workspace import POOL

PROTOCOL_VERSION = 1
"""Bumped whenever the rounds or the code matrices change: ranks of different versions refuse to mix."""


@dataclass
class AllReduceStats:
    """What one call cost this rank. Times are this rank's wall-clock seconds per phase (on CUDA:
    the compute stream's time, from events; ``seconds_comm`` is then the time the stream waited
    for transfers)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    seconds_encode: float = 0.0
    seconds_comm: float = 0.0
    seconds_decode: float = 0.0
    peak_extra_bytes: int = 0

    @property
    def seconds_total(self) -> float:
        return self.seconds_encode + self.seconds_comm + self.seconds_decode


def as_equal_shards(tensor: torch.Tensor, parts: int) -> tuple[torch.Tensor, bool]:
    """``tensor`` as one flat buffer that ``parts`` equal shards of ceil(d / parts) values tile, and
    whether that buffer is the tensor itself (contiguous, d a multiple of ``parts``); otherwise it is
    a zero-padded copy, whose first d values the caller copies back."""
    d = tensor.numel()
    shard = -(-d // parts)
    in_place = tensor.is_contiguous() and d == parts * shard
    flat = tensor.view(-1) if in_place else tensor.new_zeros(parts * shard)
    if not in_place:
        flat[:d] = tensor.reshape(-1)
    return flat, in_place


# ------------------------------------------------------------------------------------------------
# CERAR
# ------------------------------------------------------------------------------------------------

_device_codes: dict[tuple, dict[str, torch.Tensor]] = {}


def _cached_device_matrices(code: Code, i: int, dtype, device) -> dict[str, torch.Tensor]:
    """Worker i's matrices on the device, cached per (code, worker, dtype, device)."""
    key = (id(code), i, dtype, str(device))
    if key not in _device_codes:
        _device_codes[key] = device_matrices(code, i, dtype, device)
    return _device_codes[key]


def coded_call_fields(code: Code, tensor: torch.Tensor, transport, chunks: int) -> dict[str, object]:
    """What every rank of a CERAR call must agree on (``check_agreement``), and so what makes two calls
    the same graph (``cerar.ring.graphs``): the code, the protocol's version, the length, the dtype, the
    wire and the chunking of the blocks."""
    return {
        "N": code.N,
        "c": code.c,
        "construction": code.construction,
        "eps": code.eps,
        "kappa_max": code.kappa_max,
        "cerar protocol version": PROTOCOL_VERSION,
        "tensor length d": tensor.numel(),
        "dtype": str(tensor.dtype),
        "transport": transport_name(transport),
        "pipeline chunks": chunks,
    }


def check_group_size(ring: _Ring, code: Code, operation: str) -> None:
    if ring.size != code.N:
        raise ValueError(
            f"{operation}: the code was built for N={code.N} workers but the group has {ring.size} ranks; "
            f"use cerar.make_code({ring.size}, c, ...)"
        )


def coded_rounds(
    ring: _Ring, code: Code, flat: torch.Tensor, timer: PhaseTimer, storage: str, wire, chunks: int, workspace, op: str
) -> tuple[CodedRingRank, _Rounds]:
    """Issue one CERAR call's rounds on ``flat`` (contiguous, in place) under ``ring``'s contract: x(1),
    every round's post, its arrival and its one operation, the decoding and the result (scaled by 1/N for
    ``op="avg"``) into ``flat``. Returns the rank and the rounds, which the caller finishes
    (``_Rounds.finish``); ``all_reduce`` does it eagerly, ``cerar.ring.graphs`` while capturing a graph."""
    c, m, N, L = code.c, code.m_for(flat.numel()), code.N, code.L
    matrices = _cached_device_matrices(code, ring.rank, flat.dtype, flat.device)
    me = CodedRingRank(matrices, flat, c, m, N, timer, storage, workspace, chunks, start=False)
    rounds = _Rounds(ring, timer, wire)
    rounds.issue(me.start)  # x(1), after whatever the device queue holds before the call (a graph's copy in)
    handles = [rounds.post(w.message(1), w.receive_buffer(1), f"round 1/{L}") for w in me.workers]
    for worker in me.workers:  # every chunk's round 1 is on the link before the rest of the encoding
        rounds.issue(worker.while_in_flight, 1)
    for t in range(1, L + 1):
        for p, worker in enumerate(me.workers):
            # chunk p's round t arrives while the later chunks' round t and the earlier chunks' round
            # t+1 travel: chunk p's arithmetic runs beside the transfers of its neighbours
            rounds.arrive(handles[p], f"round {t}/{L}")
            rounds.issue(worker.receive, t, worker.receive_buffer(t))
            if t < L:
                handles[p] = rounds.post(worker.message(t + 1), worker.receive_buffer(t + 1), f"round {t + 1}/{L}")
                rounds.issue(worker.while_in_flight, t + 1)
    rounds.issue(me.write_result, flat, 1.0 / N if op == "avg" else None)
    return me, rounds


def all_reduce(
    tensor: torch.Tensor,
    code: Code,
    group=None,
    op: str = "sum",
    timeout=None,
    storage: str = DEFAULT_STORAGE,
    *,
    timed: bool = True,
    transport=None,
    chunks: int | None = None,
) -> AllReduceStats:
    """Approximate all-reduce of ``tensor`` in place with the CERAR code ``code``.

    Like ``dist.all_reduce``: every rank of ``group`` calls it with a tensor of the same shape and
    gets (approximately) the sum, or with ``op="avg"`` the mean, of all of them. Rank i of the
    group plays worker i of the code; the last rank gets the exact result for the closed-form
    constructions. Any shape and contiguity; float32/float64, and float16/bfloat16 only for codes
    admissible in 16 bits (``cerar.ring.precision.check_admissible``). ``transport``: the wire dtype,
    "float32" (default), "float16" or "bfloat16" (``cerar.formats.wire``): with 16 bits the tensor must be
    float32 and stays so, the arithmetic is float32, and only the messages are cast (each with its
    power-of-two scale), for a code admissible on that wire; stats count the wire's bytes (element
    size x (values + one scale per message)). Raises ValueError for bad input and
    CollectiveError when a peer fails, stalls past ``timeout`` (seconds or timedelta, default 5
    minutes: on gloo per round, on NCCL per look-behind round; module docstring) or disagrees on
    the code or the length. On NCCL the call returns once its last round has completed; the
    final decoding may still run on the current stream, which orders whatever the caller does
    next. The products run in full float32 whatever the TF32 settings (``cerar.ring.precision``); on
    CUDA with ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE`` set the call refuses (``PrecisionError``).
    ``timed=False`` skips the per-phase timers (on CUDA their read-out synchronises with the
    device once per call).
    ``storage``: ``"spec"`` (default)
    keeps N message blocks and decodes while blocks travel, in the spec's (1 + N/c) d;
    ``"messages"`` keeps all L and decodes once at the end, about half the passes over the
    gradient (for fast links), in (2 + (N-2)/c) d (``cerar.ring.rounds`` counts both). On CPU that
    storage is kept for the next call (``cerar.ring.workspace``; ``cerar.release_workspaces()`` frees it).
    ``chunks``: the most column chunks a round's block travels in (``cerar.ring.rounds.pipeline_chunks``;
    default 2 on a CPU, 1 on CUDA: ``cerar.ring.rounds.CUDA_PIPELINE_MAX_CHUNKS``); every rank must pass
    the same. Where a call's shapes repeat on CUDA, ``cerar.ring.graphs.GraphedAllReduce`` replays it
    from a CUDA graph.
    """
    operation = "cerar.all_reduce"
    check_coded_call(tensor, code, op, storage, operation, transport)
    check_chunks(chunks, operation)
    wire = wire_for(transport)
    check_no_tf32_override(tensor.device)
    ring = _Ring.of(group, timeout, operation)
    d = tensor.numel()
    chunks = default_pipeline_chunks(tensor.device) if chunks is None else chunks
    # first, so that a rank whose code is for another N stops its peers too, at once
    check_agreement(ring, coded_call_fields(code, tensor, transport, chunks))
    check_group_size(ring, code, operation)
    stats = AllReduceStats(rounds=code.L)
    if code.N == 1 or d == 0:
        return stats

    timer = PhaseTimer(tensor.device, enabled=timed)
    c, m, N, L = code.c, code.m_for(d), code.N, code.L
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    with torch.no_grad(), full_fp32_products(tensor.device):
        needed = CodedRingRank.workspace_numel(d, c, m, N, L, storage)
        workspace = POOL.take(needed, flat.dtype, flat.device)  # back to the pool only after a clean call:
        me, rounds = coded_rounds(ring, code, flat, timer, storage, wire, chunks, workspace, op)  # a failed one
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():  # may still be written
            rounds.issue(tensor.copy_, flat.view(tensor.shape))
        rounds.finish()
    stats.peak_extra_bytes = me.extra_bytes() + (_bytes(flat) if flat.data_ptr() != tensor.data_ptr() else 0)
    stats.peak_extra_bytes += rounds.peak_wire_bytes
    POOL.give(workspace)

    seconds = timer.totals()
    stats.bytes_sent, stats.bytes_received = ring.bytes_sent, ring.bytes_received
    stats.seconds_encode = seconds.get("encode", 0.0)
    stats.seconds_comm = seconds.get("comm", 0.0)
    stats.seconds_decode = seconds.get("decode", 0.0)
    return stats


# ------------------------------------------------------------------------------------------------
# The exact ring baseline
# ------------------------------------------------------------------------------------------------


def ring_all_reduce(
    tensor: torch.Tensor, group=None, op: str = "sum", timeout=None, *, timed: bool = True, transport=None
) -> AllReduceStats:
    """Exact ring all-reduce in place (reduce-scatter, then all-gather) on the same point-to-point
    rounds, contracts and deadlines as ``all_reduce``: the apples-to-apples baseline for CERAR.

    Each rank sends 2 (N - 1) ceil(d/N) values in 2 (N - 1) rounds. ``transport`` as for
    ``all_reduce``: with 16 bits the partial sums travel cast (sums in float32), and the owner of
    each complete chunk rounds it as it sends it round, so every rank ends with the same bits (within
    ``cerar.ring.precision.sum_rounding_bound(N, float32, wire)`` of the exact sum, not exact).
    """
    operation = "cerar.ring_all_reduce"
    _check_tensor(tensor, operation)
    _check_op(op, operation)
    wire_dtype = check_transport(tensor, transport, operation)
    wire = wire_for(wire_dtype)
    ring = _Ring.of(group, timeout, operation)
    N, d = ring.size, tensor.numel()
    check_agreement(ring, {"tensor length d": d, "dtype": str(tensor.dtype), "transport": transport_name(wire_dtype)})
    stats = AllReduceStats(rounds=2 * (N - 1) if N > 1 else 0)
    if N == 1 or d == 0:
        return stats

    timer = PhaseTimer(tensor.device, enabled=timed)
    flat, in_place = as_equal_shards(tensor, N)
    chunks = flat.view(N, -1)
    incoming = flat.new_empty(chunks.shape[1])
    i = ring.rank

    def add(target: torch.Tensor) -> None:
        with timer.phase("decode"):
            target += incoming

    def scale_and_copy_back() -> None:
        with timer.phase("decode"):
            if op == "avg":
                flat.div_(N)
            if not in_place:
                tensor.copy_(flat[:d].view(tensor.shape))

    with torch.no_grad():
        rounds = _Rounds(ring, timer, wire)
        for step in range(N - 1):  # reduce-scatter: chunk (i + 1) ends up complete at rank i
            what = f"reduce-scatter step {step + 1}/{N - 1}"
            rounds.arrive(rounds.post(chunks[(i - step) % N], incoming, what), what)
            rounds.issue(add, chunks[(i - step - 1) % N])
        for step in range(N - 1):  # all-gather: pass the complete chunks round
            what = f"all-gather step {step + 1}/{N - 1}"
            sent = rounds.post(chunks[(i + 1 - step) % N], chunks[(i - step) % N], what, round_sent=step == 0)
            rounds.arrive(sent, what)
        rounds.issue(scale_and_copy_back)
        rounds.finish()

    seconds = timer.totals()
    stats.bytes_sent, stats.bytes_received = ring.bytes_sent, ring.bytes_received
    stats.seconds_comm = seconds.get("comm", 0.0)
    stats.seconds_decode = seconds.get("decode", 0.0)
    stats.peak_extra_bytes = _bytes(incoming) + (0 if in_place else _bytes(flat)) + rounds.peak_wire_bytes
    return stats
