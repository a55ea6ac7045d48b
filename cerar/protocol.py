"""CERAR and the exact ring all-reduce between processes, on ``torch.distributed`` point-to-point.

One code path for gloo (CPU tensors) and NCCL (CUDA tensors): every round is one
``dist.batch_isend_irecv`` of a send to the next rank and a receive from the previous one in the
group's rank order. Encoding and decoding are batched matrix products on the tensor's device (see
``cerar.rounds``), in full float32 whatever the TF32 settings (``cerar.precision``).

The two backends keep different contracts, and the code is written against both:

- what ``batch_isend_irecv`` returns: gloo one work per op; NCCL, which coalesces the batch, one
  work for the whole batch;
- what ``Work.wait(timeout)`` does: gloo blocks the host up to the timeout; NCCL (without
  ``TORCH_NCCL_BLOCKING_WAIT``) only makes the current CUDA stream wait and returns at once. So
  each round first waits (gloo: bounded there; NCCL: the current stream is ordered after the
  transfer), then, if the work has not completed, polls ``Work.is_completed()`` until the round's
  deadline (NCCL: the host-side bound; gloo's point-to-point works only report completion once
  waited for, so the poll alone would not do there);
- the first operation on an NCCL communicator must involve every rank of the group: each call
  starts with an all-gather (the agreement check), and every round involves every rank.

After a CollectiveError on NCCL the communicator is in an unknown state (a kernel may still wait for
the missing peer): the group must not be used again; NCCL's watchdog aborts it at the group's own
timeout.

Costs per call, for a tensor of d values (m = ceil(d/c)):

=================  =========================  ==============================
                   ``all_reduce`` (CERAR)     ``ring_all_reduce`` (exact)
=================  =========================  ==============================
rounds             L = c + N - 2              2 (N - 1)
values sent        L m ~ (1 + (N-2)/c) d      2 (N - 1) ceil(d/N)
extra storage      (c+N+1) m ~ (1 + N/c) d   ceil(d/N), plus a padded copy
                   (storage="spec"); (c+L+1)  when N does not divide d
                   m ("messages")
arithmetic         (3c + N - 2) d mult-adds   (N - 1) ceil(d/N) additions
                   in ~22 ("spec") or ~12
                   ("messages") passes over
                   d (``cerar.rounds``)
error              the code's (0 for exact)   none
=================  =========================  ==============================
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cerar.codes import Code
from cerar.matrices import check_transport_dtype, device_matrices
from cerar.precision import check_no_tf32_override, full_fp32_products
from cerar.rounds import DEFAULT_STORAGE, CodedRingRank, PhaseTimer, check_storage
from cerar.workspace import POOL

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""How long one round may wait for its peers before the call fails."""

OPS = ("sum", "avg")

PROTOCOL_VERSION = 1
"""Bumped whenever the rounds or the code matrices change: ranks of different versions refuse to mix."""


class CollectiveError(RuntimeError):
    """A collective could not complete: a peer died, stalled past the timeout, or disagreed."""


@dataclass
class AllReduceStats:
    """What one call cost this rank. Times are this rank's wall-clock seconds per phase."""

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


# ------------------------------------------------------------------------------------------------
# Ring plumbing shared by both protocols
# ------------------------------------------------------------------------------------------------


@dataclass
class _Ring:
    group: dist.ProcessGroup | None
    size: int
    rank: int
    next_rank: int  # global ranks, as P2POp wants them
    prev_rank: int
    timeout: timedelta
    operation: str
    bytes_sent: int = 0  # of the tensors this ring handed to isend / irecv
    bytes_received: int = 0

    @classmethod
    def of(cls, group, timeout, operation: str) -> _Ring:
        if not dist.is_available() or not dist.is_initialized():
            raise CollectiveError(f"{operation}: torch.distributed is not initialised (call init_process_group)")
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"{operation}: this process is not a member of the given group")

        def global_rank(r):
            return r if group is None else dist.get_global_rank(group, r)

        return cls(
            group,
            size,
            rank,
            global_rank((rank + 1) % size),
            global_rank((rank - 1) % size),
            _as_timedelta(timeout),
            operation,
        )

    def wait(self, work, what: str, peers: str = "", deadline: float | None = None) -> None:
        """Wait for ``work`` until the deadline (default: the timeout from now), turning a failure or
        a stall into a CollectiveError that names the operation, ``what`` and the peers.

        ``Work.wait(timeout)`` blocks the host up to the timeout on gloo, but on NCCL (without
        blocking wait) it only makes the current CUDA stream wait and returns at once, bounding
        nothing; and gloo's point-to-point works report ``is_completed()`` only once waited for. So:
        wait (gloo: the bound; NCCL: the stream order), then poll ``is_completed()`` against the
        deadline (NCCL: the bound), then wait once more if it was polled, to raise a failed work's error."""
        seconds = self.timeout.total_seconds()
        deadline = time.monotonic() + seconds if deadline is None else deadline
        peer_text = f" {peers}" if peers else ""
        try:
            work.wait(timedelta(seconds=max(deadline - time.monotonic(), _LAST_POLL_PAUSE)))
            if work.is_completed():
                return
            pause = _FIRST_POLL_PAUSE
            while not work.is_completed():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveError(
                        f"{self.operation}: {what}{peer_text} did not complete within the timeout "
                        f"({seconds:g}s): a peer died or stalled"
                    )
                time.sleep(min(pause, left))
                pause = min(2 * pause, _LAST_POLL_PAUSE)
            work.wait(timedelta(seconds=_LAST_POLL_PAUSE))
        except CollectiveError:
            raise
        except Exception as error:  # gloo/NCCL raise RuntimeError or DistBackendError
            raise CollectiveError(
                f"{self.operation}: {what}{peer_text} failed or timed out (timeout {seconds:g}s): {error}"
            ) from error

    def post(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        """Start sending to the next rank and receiving from the previous one. Returns what
        ``batch_isend_irecv`` returns: one work per op (gloo), or one for the whole batch (NCCL,
        which coalesces the batch)."""
        ops = [
            dist.P2POp(dist.isend, send, self.next_rank, self.group),
            dist.P2POp(dist.irecv, recv, self.prev_rank, self.group),
        ]
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as error:
            raise CollectiveError(f"{self.operation}: could not post messages: {error}") from error
        self.bytes_sent += _bytes(send)
        self.bytes_received += _bytes(recv)
        return works

    def complete(self, works: list, what: str) -> None:
        """Wait for a ``post``'s messages, within one timeout for the round, whatever form
        ``batch_isend_irecv`` returned them in."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        if len(works) == 2:  # one work per op, in the order posted: the send, then the receive
            self.wait(works[1], f"{what}: receive", f"from rank {self.prev_rank}", deadline)
            self.wait(works[0], f"{what}: send", f"to rank {self.next_rank}", deadline)
        else:  # one work for the batch (or none, where a backend returns nothing to wait for)
            peers = f"from rank {self.prev_rank} / to rank {self.next_rank}"
            for work in works:
                self.wait(work, f"{what}: receive and send", peers, deadline)

    def shift(self, send: torch.Tensor, recv: torch.Tensor, what: str) -> None:
        """Send to the next rank and receive from the previous one, concurrently, and wait."""
        self.complete(self.post(send, recv), what)


_FIRST_POLL_PAUSE = 20e-6
_LAST_POLL_PAUSE = 1e-3
"""Bounds of the pause between two polls of a work's completion (doubling from the first)."""


def _as_timedelta(timeout) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"timeout must be seconds or a timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {seconds}")
    return timedelta(seconds=seconds)


def _check_tensor(tensor, operation: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{operation}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"{operation}: tensor must be floating point (float32 or float64), got dtype {tensor.dtype}")


def _check_op(op: str, operation: str) -> None:
    if op not in OPS:
        raise ValueError(f"{operation}: op must be one of {OPS}, got {op!r}")


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------------------------------
# Agreement before the first round
# ------------------------------------------------------------------------------------------------

_agreed: set[tuple] = set()


def _agreement_key(ring: _Ring, fields: tuple) -> tuple:
    return (id(ring.group), ring.size, fields)


def check_agreement(ring: _Ring, fields: dict[str, object]) -> None:
    """Check once per (group, fields) that every rank holds the same ``fields``; a disagreement
    raises on every rank, naming the field and the ranks, instead of hanging in the rounds."""
    key = _agreement_key(ring, tuple(fields.items()))
    if key in _agreed:
        return
    digests = [_digest(value) for value in fields.values()]
    mine = torch.tensor(digests, dtype=torch.int64)
    device = _group_device(ring.group)
    gathered = [torch.empty_like(mine, device=device) for _ in range(ring.size)]
    ring.wait(
        dist.all_gather(gathered, mine.to(device), group=ring.group, async_op=True),
        "checking that all ranks agree on the call",
        "(all ranks of the group)",
    )
    table = torch.stack([g.cpu() for g in gathered])
    for column, name in enumerate(fields):
        values = table[:, column]
        if not torch.all(values == values[0]):
            disagreeing = [r for r in range(ring.size) if values[r] != values[ring.rank]]
            raise CollectiveError(
                f"{ring.operation}: ranks disagree on {name} (this rank, {ring.rank}, has "
                f"{fields[name]!r}; ranks {disagreeing} differ): every rank must pass the same {name}"
            )
    _agreed.add(key)


def _digest(value) -> int:
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, float):
        data = struct.pack("<d", value)
    else:
        data = repr(value).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:7], "little")


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def all_reduce(
    tensor: torch.Tensor,
    code: Code,
    group=None,
    op: str = "sum",
    timeout=None,
    storage: str = DEFAULT_STORAGE,
    *,
    timed: bool = True,
) -> AllReduceStats:
    """Approximate all-reduce of ``tensor`` in place with the CERAR code ``code``.

    Like ``dist.all_reduce``: every rank of ``group`` calls it with a tensor of the same shape and
    gets (approximately) the sum, or with ``op="avg"`` the mean, of all of them. Rank i of the
    group plays worker i of the code; the last rank gets the exact result for the closed-form
    constructions. Any shape and contiguity; float32/float64, and float16/bfloat16 only for codes
    with kappa <= ``cerar.LOW_PRECISION_KAPPA_LIMIT``. Raises ValueError for bad input and
    CollectiveError when a peer fails, stalls past ``timeout`` (seconds or timedelta, per round,
    default 5 minutes; kept on the host on every backend) or disagrees on the code or the length.
    The products run in full float32 whatever the TF32 settings (``cerar.precision``); on CUDA with
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE`` set the call refuses (``PrecisionError``). ``timed=False``
    skips the per-phase timers (on CUDA their read-out synchronises with the device once per call).
    ``storage``: ``"spec"`` (default)
    keeps N message blocks and decodes while blocks travel, in the spec's (1 + N/c) d plus one
    block; ``"messages"`` keeps all L and decodes once at the end, about half the passes over the
    gradient (for fast links), in (2 + (N-1)/c) d (``cerar.rounds`` counts both). On CPU that
    storage is kept for the next call (``cerar.workspace``; ``cerar.release_workspaces()`` frees it).
    """
    operation = "cerar.all_reduce"
    _check_tensor(tensor, operation)
    _check_op(op, operation)
    if not isinstance(code, Code):
        raise ValueError(f"{operation}: code must be a cerar.Code from cerar.make_code, got {type(code).__name__}")
    check_transport_dtype(tensor.dtype, code, "tensor")
    check_storage(storage)
    check_no_tf32_override(tensor.device)
    ring = _Ring.of(group, timeout, operation)
    d = tensor.numel()
    check_agreement(  # first, so that a rank whose code is for another N stops its peers too, at once
        ring,
        {
            "N": code.N,
            "c": code.c,
            "construction": code.construction,
            "eps": code.eps,
            "kappa_max": code.kappa_max,
            "cerar protocol version": PROTOCOL_VERSION,
            "tensor length d": d,
            "dtype": str(tensor.dtype),
        },
    )
    if ring.size != code.N:
        raise ValueError(
            f"{operation}: the code was built for N={code.N} workers but the group has {ring.size} ranks; "
            f"use cerar.make_code({ring.size}, c, ...)"
        )
    stats = AllReduceStats(rounds=code.L)
    if code.N == 1 or d == 0:
        return stats

    timer = PhaseTimer(tensor.device, enabled=timed)
    c, m, N = code.c, code.m_for(d), code.N
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    matrices = _cached_device_matrices(code, ring.rank, tensor.dtype, tensor.device)
    with torch.no_grad(), full_fp32_products(tensor.device):
        needed = CodedRingRank.workspace_numel(d, c, m, N, code.L, storage)
        workspace = POOL.take(needed, flat.dtype, flat.device)  # back to the pool only after a clean call:
        me = CodedRingRank(matrices, flat, c, m, N, timer, storage, workspace)  # a failed one may still be written
        works = []
        for worker in me.workers:  # round 1 of every chunk on the link before any encoding
            with timer.phase("comm"):
                works.append(ring.post(worker.message(), worker.receive_buffer(1)))
        for worker in me.workers:
            worker.while_in_flight(1)
        for t in range(1, code.L + 1):
            for p, worker in enumerate(me.workers):
                with timer.phase("comm"):
                    ring.complete(works[p], f"round {t}/{code.L}")
                worker.receive(t, worker.receive_buffer(t))
                if t < code.L:  # chunk p's next round goes out behind the rest of this one
                    with timer.phase("comm"):
                        works[p] = ring.post(worker.message(), worker.receive_buffer(t + 1))
                    worker.while_in_flight(t + 1)
        me.write_result(flat, 1.0 / N if op == "avg" else None)
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    stats.peak_extra_bytes = me.extra_bytes() + (_bytes(flat) if flat.data_ptr() != tensor.data_ptr() else 0)
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
    tensor: torch.Tensor, group=None, op: str = "sum", timeout=None, *, timed: bool = True
) -> AllReduceStats:
    """Exact ring all-reduce in place (reduce-scatter, then all-gather) on the same point-to-point
    rounds as ``all_reduce``: the apples-to-apples baseline for CERAR.

    Each rank sends 2 (N - 1) ceil(d/N) values in 2 (N - 1) rounds.
    """
    operation = "cerar.ring_all_reduce"
    _check_tensor(tensor, operation)
    _check_op(op, operation)
    ring = _Ring.of(group, timeout, operation)
    N, d = ring.size, tensor.numel()
    check_agreement(ring, {"tensor length d": d, "dtype": str(tensor.dtype)})
    stats = AllReduceStats(rounds=2 * (N - 1) if N > 1 else 0)
    if N == 1 or d == 0:
        return stats

    timer = PhaseTimer(tensor.device, enabled=timed)
    chunk = -(-d // N)
    in_place = tensor.is_contiguous() and d == N * chunk
    flat = tensor.view(-1) if in_place else tensor.new_zeros(N * chunk)
    if not in_place:
        flat[:d] = tensor.reshape(-1)
    chunks = flat.view(N, chunk)
    incoming = flat.new_empty(chunk)
    i = ring.rank
    with torch.no_grad():
        for step in range(N - 1):  # reduce-scatter: chunk (i + 1) ends up complete at rank i
            with timer.phase("comm"):
                ring.shift(chunks[(i - step) % N], incoming, f"reduce-scatter step {step + 1}/{N - 1}")
            with timer.phase("decode"):
                chunks[(i - step - 1) % N] += incoming
        for step in range(N - 1):  # all-gather: pass the complete chunks round
            with timer.phase("comm"):
                ring.shift(chunks[(i + 1 - step) % N], chunks[(i - step) % N], f"all-gather step {step + 1}/{N - 1}")
        with timer.phase("decode"):
            if op == "avg":
                flat.div_(N)
            if not in_place:
                tensor.copy_(flat[:d].view(tensor.shape))

    seconds = timer.totals()
    stats.bytes_sent, stats.bytes_received = ring.bytes_sent, ring.bytes_received
    stats.seconds_comm = seconds.get("comm", 0.0)
    stats.seconds_decode = seconds.get("decode", 0.0)
    stats.peak_extra_bytes = _bytes(incoming) + (0 if in_place else _bytes(flat))
    return stats
