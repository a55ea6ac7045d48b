"""CERAR and the exact ring all-reduce between processes, on ``torch.distributed`` point-to-point.

One code path for gloo (CPU tensors) and NCCL (CUDA tensors): every round is one
``dist.batch_isend_irecv`` of a send to the next rank and a receive from the previous one in the
group's rank order. Encoding and decoding are batched matrix products on the tensor's device (see
``cerar.rounds``), in full float32 whatever the TF32 settings (``cerar.precision``).

The backends keep different contracts, and a call follows the one of its group's backend (a
``TransportContract``, chosen by ``transport_contract(group)`` from the backend's name;
``set_transport_contract`` maps another backend, or lets a test harness run the NCCL path on gloo):

- **host-waited** (gloo): ``batch_isend_irecv`` returns one work per op, and its point-to-point
  works complete only once waited for. The host drives the rounds: each round it waits with
  ``Work.wait(timeout)``, which blocks up to the time left of the round's timeout and raises on
  expiry: that wait is the bound.
- **stream-ordered** (NCCL): ``batch_isend_irecv`` coalesces the batch into ONE work. torch's
  ``ProcessGroupNCCL::WorkNCCL::wait`` (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp) first
  calls ``synchronize()``, which makes the current CUDA stream wait for the NCCL stream, and only
  "in case of blockingWait or a timeout value is specified by the user" blocks the host thread,
  polling ``isCompleted()`` until completion or expiry; on expiry (or any exception) it aborts the
  communicators and throws (``handleException(TearDown)``). So ``wait()`` without a timeout orders
  the stream and returns at once, and ``wait(timeout)`` would make every round a host round trip
  and abort the communicator on a stall. Under this contract a call never passes a timeout to
  ``wait``: the host enqueues the rounds (encode, post, stream-only ``wait()``, decode), the CUDA
  streams order round t+1's send after round t's receive, and the host bounds the call by polling
  ``Work.is_completed()`` of an already-posted round against the deadline, once every
  ``LOOK_BEHIND_POSTS`` posts (the look-behind window, which also keeps the host at most
  2 x ``LOOK_BEHIND_POSTS`` posts ahead of the GPU) and once at the end, then calls ``wait()``
  on it (which, on a work that failed, raises its error). ``TORCH_NCCL_BLOCKING_WAIT=1`` would make
  every ``wait()`` block the host again: leave it unset.

What bounds a stall: on gloo, a round whose messages have not arrived ``timeout`` seconds after
the host began to wait for it raises ``CollectiveError``. On NCCL, a look-behind round (at most
2 x ``LOOK_BEHIND_POSTS`` posts behind the newest) that has not completed ``timeout`` seconds after
the host began to poll it raises ``CollectiveError``; since posting is fast, every rank whose
rounds stop (a peer died or stalled) raises within about ``timeout`` of the stall. After a
CollectiveError on NCCL the communicator still holds kernels that wait for the missing peer: the
group must not be used again. Abort it (``torch.distributed.distributed_c10d._abort_process_group``)
before the process exits, as the trainer does; otherwise NCCL's watchdog aborts it at the group's
own timeout (and with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` takes the process down).

The first operation on an NCCL communicator must involve every rank of the group: each call
starts with an all-gather (the agreement check, cached per group and length), and every round
involves every rank.

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
host waits         gloo: every round; NCCL:   the same
                   one poll per
                   LOOK_BEHIND_POSTS posts
                   and one at the end
=================  =========================  ==============================
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from cerar.codes import Code
from cerar.matrices import check_transport_dtype, device_matrices
from cerar.precision import check_no_tf32_override, full_fp32_products
from cerar.rounds import DEFAULT_STORAGE, CodedRingRank, PhaseTimer, check_storage
from cerar.wire import Wire, transport_dtype, transport_name, wire_for
from cerar.workspace import POOL

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""How long the host waits for one round (gloo) or one look-behind round (NCCL) before the call fails."""

OPS = ("sum", "avg")

PROTOCOL_VERSION = 1
"""Bumped whenever the rounds or the code matrices change: ranks of different versions refuse to mix."""

LOOK_BEHIND_POSTS = 8
"""Under the stream-ordered contract the host checks one posted round per this many posts: small
enough that a stall is noticed after a few rounds' worth of enqueueing, large enough that the host
stays several rounds ahead of the GPU (which then never idles while the host sleeps between polls)."""


class CollectiveError(RuntimeError):
    """A collective could not complete: a peer died, stalled past the timeout, or disagreed."""


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


# ------------------------------------------------------------------------------------------------
# Transport contracts: how a backend's works complete, and so how the host bounds them
# ------------------------------------------------------------------------------------------------


class _Ran:
    """The handle of device work that ran when it was issued (a finished future)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def done(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self):
        return self.value


class ImmediateDeviceQueue:
    """Where a call's device work is issued: at once, by the calling thread. On CUDA the kernels
    go on the current stream, which orders them (the host does not wait for them); on the CPU they
    run there and then. A CPU emulation of a stream substitutes a queue whose ``submit`` runs the
    work later, in order, on a thread of its own (``tests/nccl_emulation.py``)."""

    def submit(self, fn, *args):
        return _Ran(fn(*args))

    def drain(self, deadline: float) -> None:  # noqa: ARG002  nothing is left to run
        return None


@dataclass(frozen=True)
class TransportContract:
    """What a backend's point-to-point promises, which decides how a call waits for its rounds.

    ``stream_ordered=False`` (gloo): the host waits for each round with ``Work.wait(timeout)``.
    ``stream_ordered=True`` (NCCL): the host only orders the device after each round
    (``Work.wait()``), and bounds the call by polling ``Work.is_completed()`` once per
    ``look_behind`` posts and at the end (module docstring). ``device_queue``: where device work
    is issued (``ImmediateDeviceQueue``)."""

    name: str
    stream_ordered: bool
    look_behind: int = LOOK_BEHIND_POSTS
    device_queue: object = field(default_factory=ImmediateDeviceQueue, compare=False)


HOST_WAITED = TransportContract("host-waited (gloo)", stream_ordered=False)
STREAM_ORDERED = TransportContract("stream-ordered (NCCL)", stream_ordered=True)

_CONTRACTS: dict[str, TransportContract] = {"nccl": STREAM_ORDERED}


def transport_contract(group=None) -> TransportContract:
    """The contract a call on ``group`` follows: the one registered for its backend's name
    (NCCL: stream-ordered), else host-waited."""
    return _CONTRACTS.get(str(dist.get_backend(group)), HOST_WAITED)


def set_transport_contract(backend: str, contract: TransportContract | None) -> TransportContract | None:
    """Make calls on groups of ``backend`` follow ``contract`` (None: the default again); returns
    the previous one. For backends that behave like NCCL, and for a harness that emulates NCCL's
    contract on gloo to test the stream-ordered path on a CPU."""
    previous = _CONTRACTS.get(backend)
    if contract is None:
        _CONTRACTS.pop(backend, None)
    else:
        if not isinstance(contract, TransportContract):
            raise ValueError(f"contract must be a cerar.protocol.TransportContract, got {type(contract).__name__}")
        _CONTRACTS[backend] = contract
    return previous


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
    contract: TransportContract = HOST_WAITED
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
            transport_contract(group),
        )

    @property
    def peers(self) -> str:
        return f"from rank {self.prev_rank} / to rank {self.next_rank}"

    def _failure(self, what: str, peers: str, error: BaseException | None = None) -> CollectiveError:
        seconds = self.timeout.total_seconds()
        peer_text = f" {peers}" if peers else ""
        if error is None:
            return CollectiveError(
                f"{self.operation}: {what}{peer_text} did not complete within the timeout ({seconds:g}s): "
                "a peer died or stalled"
            )
        return CollectiveError(
            f"{self.operation}: {what}{peer_text} failed or timed out (timeout {seconds:g}s): {error}"
        )

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

    def await_works(self, works: list, what: str, peers: str = "", deadline: float | None = None) -> None:
        """Return once ``works`` have completed, on the host, by ``deadline`` (``time.monotonic()``
        seconds; default one timeout from now); a failure or a stall raises CollectiveError naming
        the operation, ``what`` and the peers.

        Host-waited (gloo): ``Work.wait(timeout)`` with the time left, which blocks and raises on
        expiry. Stream-ordered (NCCL): ``Work.is_completed()`` polled against the deadline, then
        ``Work.wait()`` without a timeout, which orders the current stream after the work and
        raises the work's error if it failed (never ``wait(timeout)``: module docstring)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout.total_seconds()
        try:
            if not self.contract.stream_ordered:
                for work in works:
                    work.wait(timedelta(seconds=max(deadline - time.monotonic(), _LAST_POLL_PAUSE)))
                return
            pause = _FIRST_POLL_PAUSE
            for work in works:
                while not work.is_completed():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._failure(what, peers)
                    time.sleep(min(pause, left))
                    pause = min(2 * pause, _LAST_POLL_PAUSE)
                work.wait()
        except CollectiveError:
            raise
        except Exception as error:  # gloo/NCCL raise RuntimeError or DistBackendError
            raise self._failure(what, peers, error) from error

    def complete(self, works: list, what: str) -> None:
        """Wait on the host for a ``post``'s messages, within one timeout, whatever form
        ``batch_isend_irecv`` returned them in (``await_works``)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        if len(works) == 2:  # one work per op, in the order posted: the send, then the receive
            self.await_works(works[1:], f"{what}: receive", f"from rank {self.prev_rank}", deadline)
            self.await_works(works[:1], f"{what}: send", f"to rank {self.next_rank}", deadline)
        else:  # one work for the batch (or none, where a backend returns nothing to wait for)
            self.await_works(works, f"{what}: receive and send", self.peers, deadline)

    def shift(self, send: torch.Tensor, recv: torch.Tensor, what: str) -> None:
        """Send to the next rank and receive from the previous one, concurrently, and wait on the host."""
        self.complete(self.post(send, recv), what)


_FIRST_POLL_PAUSE = 20e-6
_LAST_POLL_PAUSE = 2e-4
"""Bounds of the pause between two polls of a work's completion (doubling from the first): short
enough that the host wakes before the rounds it queued ahead of the GPU run out."""


class _Rounds:
    """The rounds of one call, as the ring's contract wants them issued, ordered and bounded.

    ``post`` starts a round's messages and returns its handle; ``arrive(handle)`` makes the device
    work issued after it (``issue``) see the round's received data; ``finish`` returns once every
    round has completed (or raises). Host-waited (gloo): ``arrive`` waits on the host, bounded by
    ``Work.wait(timeout)``. Stream-ordered (NCCL): ``arrive`` only orders the device queue after the
    round (``Work.wait()``); every ``look_behind`` posts the host polls the round posted
    ``look_behind`` posts earlier until it completes or its deadline passes, and ``finish`` polls
    the last one. Written once, for ``all_reduce`` and ``ring_all_reduce`` alike.
    """

    def __init__(self, ring: _Ring, timer: PhaseTimer, wire: Wire | None = None):
        self.ring, self.timer = ring, timer
        self.contract = ring.contract
        self.queue = self.contract.device_queue
        self.posted: deque = deque()  # (handle, what) of the rounds posted and not yet seen complete
        self.posts = 0
        self.wire = wire
        self.in_transit: dict[int, tuple] = {}  # id(handle): (wire message in, float32 block it decodes into, out)
        self.wire_bytes = 0  # of the wire messages alive now, and their peak
        self.peak_wire_bytes = 0

    def issue(self, fn, *args):
        """Device work, after everything issued or arrived before it."""
        return self.queue.submit(fn, *args)

    def post(self, send: torch.Tensor, recv: torch.Tensor, what: str, *, round_sent: bool = False):
        """Start a round: ``send`` (float32) to the next rank, ``recv`` (float32) from the previous
        one. With a 16-bit ``wire`` the block is encoded into a wire message just before it is sent
        (``cerar.wire``: scaled, cast) and the message received is decoded into ``recv`` when the
        round arrives; ``round_sent=True`` also leaves ``send`` holding what its receivers get (the
        exact collectives' owner of a complete chunk, so that every rank holds the same bits)."""
        if self.wire is None:
            handle = self.queue.submit(self._post, send, recv)
        else:
            out, into = self.wire.empty(send.numel(), send), self.wire.empty(recv.numel(), recv)
            handle = self.queue.submit(self._post_wire, send, out, into, round_sent)
            self.in_transit[id(handle)] = (into, recv, out)
            self.wire_bytes += _bytes(out, into)
            self.peak_wire_bytes = max(self.peak_wire_bytes, self.wire_bytes)
        if self.contract.stream_ordered:
            self.posted.append((handle, what))
            self.posts += 1
            if self.posts % self.contract.look_behind == 0 and len(self.posted) > self.contract.look_behind:
                while len(self.posted) > self.contract.look_behind + 1:
                    self.posted.popleft()  # completed before the round polled next (one stream, in order)
                self._await(*self.posted.popleft())
        return handle

    def _post(self, send, recv):
        with self.timer.phase("comm"):
            return self.ring.post(send, recv)

    def _post_wire(self, send, out, into, round_sent: bool):
        with self.timer.phase("encode"):
            if round_sent:
                self.wire.round_trip(send, out)
            else:
                self.wire.encode(send, out)
        return self._post(out, into)

    def _decode(self, message, block) -> None:
        with self.timer.phase("decode"):
            self.wire.decode(message, block)

    def arrive(self, handle, what: str) -> None:
        if self.contract.stream_ordered:
            self.queue.submit(self._order, handle, what)
        else:
            with self.timer.phase("comm"):
                self.ring.complete(handle.result(), what)
        if self.wire is not None:  # the message, decoded into the float32 block, before the work issued next
            into, recv, out = self.in_transit.pop(id(handle))
            self.issue(self._decode, into, recv)
            self.wire_bytes -= _bytes(out, into)

    def _order(self, handle, what: str) -> None:
        """Make the device work issued next wait for the round: ``Work.wait()`` without a timeout
        (NCCL: the current stream waits for the NCCL stream; the host does not)."""
        try:
            with self.timer.phase("comm"):
                for work in handle.result():
                    work.wait()
        except CollectiveError:
            raise
        except Exception as error:
            raise self.ring._failure(f"{what}: receive and send", self.ring.peers, error) from error

    def _completed(self, handle, what: str) -> bool:
        if not handle.done():  # only under an emulated device queue: not even posted yet
            return False
        error = handle.exception()
        if error is not None:
            if isinstance(error, CollectiveError):
                raise error
            raise self.ring._failure(f"{what}: receive and send", self.ring.peers, error) from error
        return all(work.is_completed() for work in handle.result())

    def _await(self, handle, what: str) -> None:
        """Poll one posted round until it completes or its deadline (``timeout`` from now) passes,
        then ``wait()`` on it, which raises the error of a failed work (NCCL: and aborts it)."""
        deadline = time.monotonic() + self.ring.timeout.total_seconds()
        pause = _FIRST_POLL_PAUSE
        while not self._completed(handle, what):
            left = deadline - time.monotonic()
            if left <= 0:  # the rounds run in order on the stream: this one or one before it is stuck
                raise self.ring._failure(f"{what} (or a round before it): receive and send", self.ring.peers)
            time.sleep(min(pause, left))
            pause = min(2 * pause, _LAST_POLL_PAUSE)
        try:
            for work in handle.result():
                work.wait()
        except Exception as error:
            raise self.ring._failure(f"{what}: receive and send", self.ring.peers, error) from error

    def finish(self) -> None:
        """Return once every round has completed and the device work issued so far has run
        (stream-ordered: the last round polled against its deadline; the rest was before it)."""
        if self.posted:
            self._await(*self.posted.pop())
            self.posted.clear()
        try:
            self.queue.drain(time.monotonic() + self.ring.timeout.total_seconds())
        except CollectiveError:
            raise
        except Exception as error:
            raise self.ring._failure("finishing the device work", "", error) from error


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


def check_coded_call(tensor: torch.Tensor, code, op: str, storage: str, operation: str, transport=None) -> None:
    """The arguments of a coded all-reduce (flat or hierarchical), checked on this rank before any
    collective: a ValueError naming the call and the bad argument. A 16-bit ``transport`` needs a
    float32 tensor (the arithmetic stays float32) and a code admissible on it (``cerar.precision``)."""
    _check_tensor(tensor, operation)
    _check_op(op, operation)
    if not isinstance(code, Code):
        raise ValueError(f"{operation}: code must be a cerar.Code from cerar.make_code, got {type(code).__name__}")
    wire = check_transport(tensor, transport, operation)
    check_transport_dtype(tensor.dtype, code, operation, wire)
    check_storage(storage)


def check_transport(tensor: torch.Tensor, transport, operation: str) -> torch.dtype:
    """The wire dtype ``transport`` names (``cerar.wire``); 16-bit messages need a float32 tensor."""
    try:
        wire = transport_dtype(transport)
    except ValueError as error:
        raise ValueError(f"{operation}: {error}") from None
    if wire != torch.float32 and tensor.dtype != torch.float32:
        raise ValueError(
            f"{operation}: transport={transport_name(wire)} carries float32 tensors (16-bit messages, float32 "
            f"arithmetic), got a tensor of dtype {tensor.dtype}"
        )
    return wire


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
    try:
        work = dist.all_gather(gathered, mine.to(device), group=ring.group, async_op=True)
    except Exception as error:
        raise ring._failure("checking that all ranks agree on the call", "(all ranks of the group)", error) from error
    ring.await_works([work], "checking that all ranks agree on the call", "(all ranks of the group)")
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
    transport=None,
) -> AllReduceStats:
    """Approximate all-reduce of ``tensor`` in place with the CERAR code ``code``.

    Like ``dist.all_reduce``: every rank of ``group`` calls it with a tensor of the same shape and
    gets (approximately) the sum, or with ``op="avg"`` the mean, of all of them. Rank i of the
    group plays worker i of the code; the last rank gets the exact result for the closed-form
    constructions. Any shape and contiguity; float32/float64, and float16/bfloat16 only for codes
    admissible in 16 bits (``cerar.precision.check_admissible``). ``transport``: the wire dtype,
    "float32" (default), "float16" or "bfloat16" (``cerar.wire``): with 16 bits the tensor must be
    float32 and stays so, the arithmetic is float32, and only the messages are cast (each with its
    power-of-two scale), for a code admissible on that wire; stats count the wire's bytes (element
    size x (values + one scale per message)). Raises ValueError for bad input and
    CollectiveError when a peer fails, stalls past ``timeout`` (seconds or timedelta, default 5
    minutes: on gloo per round, on NCCL per look-behind round; module docstring) or disagrees on
    the code or the length. On NCCL the call returns once its last round has completed; the
    final decoding may still run on the current stream, which orders whatever the caller does
    next. The products run in full float32 whatever the TF32 settings (``cerar.precision``); on
    CUDA with ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE`` set the call refuses (``PrecisionError``).
    ``timed=False`` skips the per-phase timers (on CUDA their read-out synchronises with the
    device once per call).
    ``storage``: ``"spec"`` (default)
    keeps N message blocks and decodes while blocks travel, in the spec's (1 + N/c) d plus one
    block; ``"messages"`` keeps all L and decodes once at the end, about half the passes over the
    gradient (for fast links), in (2 + (N-1)/c) d (``cerar.rounds`` counts both). On CPU that
    storage is kept for the next call (``cerar.workspace``; ``cerar.release_workspaces()`` frees it).
    """
    operation = "cerar.all_reduce"
    check_coded_call(tensor, code, op, storage, operation, transport)
    wire = wire_for(transport)
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
            "transport": transport_name(transport),
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
    c, m, N, L = code.c, code.m_for(d), code.N, code.L
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    matrices = _cached_device_matrices(code, ring.rank, tensor.dtype, tensor.device)
    with torch.no_grad(), full_fp32_products(tensor.device):
        needed = CodedRingRank.workspace_numel(d, c, m, N, L, storage)
        workspace = POOL.take(needed, flat.dtype, flat.device)  # back to the pool only after a clean call:
        me = CodedRingRank(matrices, flat, c, m, N, timer, storage, workspace)  # a failed one may still be written
        rounds = _Rounds(ring, timer, wire)
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
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
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
    ``cerar.precision.sum_rounding_bound(N, float32, wire)`` of the exact sum, not exact).
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
