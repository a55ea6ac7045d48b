"""The ring transport and its round driver, on ``torch.distributed`` point-to-point: ``_Ring`` (a group's ring:
neighbours, posts, waits and failures) and ``_Rounds`` (rounds issued, ordered and polled against the deadline),
under the contract of the group's backend. The collectives built on them: ``cerar.ring.protocol``; the argument and
agreement checks before a call: ``cerar.ring.checks``.

One code path for gloo (CPU tensors) and NCCL (CUDA tensors): every round is one
``dist.batch_isend_irecv`` of a send to the next rank and a receive from the previous one in the
group's rank order.

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
own timeout (and in torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` takes the process down).

The first operation on an NCCL communicator must involve every rank of the group: each call
starts with an all-gather (the agreement check, cached per group and length), and every round
involves every rank.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from cerar.formats.wire import Wire
from cerar.ring.rounds import PhaseTimer

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""How long the host waits for one round (gloo) or one look-behind round (NCCL) before the call fails."""

LOOK_BEHIND_POSTS = 8
"""Under the stream-ordered contract the host checks one posted round per this many posts: small
enough that a stall is noticed after a few rounds' worth of enqueueing, large enough that the host
stays several rounds ahead of the GPU (which then never idles while the host sleeps between polls)."""


class CollectiveError(RuntimeError):
    """A collective could not complete: a peer died, stalled past the timeout, or disagreed."""


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


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
    is issued (``ImmediateDeviceQueue``). ``host_polls=False``: a stream-ordered call issued while
    its stream is captured into a CUDA graph (``cerar.ring.graphs``), where nothing runs yet and asking a
    work whether it completed is an error: the host issues and orders the rounds and polls none of
    them; the graph's replay is bounded instead (an event after it, polled against the deadline)."""

    name: str
    stream_ordered: bool
    look_behind: int = LOOK_BEHIND_POSTS
    device_queue: object = field(default_factory=ImmediateDeviceQueue, compare=False)
    host_polls: bool = True


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
            raise ValueError(
                f"contract must be a cerar.ring.transport.TransportContract, got {type(contract).__name__}"
            )
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
        return self.post_between(send, self.next_rank, recv, self.prev_rank)

    def post_between(self, send: torch.Tensor, to_rank: int, recv: torch.Tensor, from_rank: int) -> list:
        """``post`` with the peers given (global ranks): one batch of a send to ``to_rank`` and a receive from
        ``from_rank``, counted in the ring's bytes; a failure to post raises CollectiveError."""
        ops = [
            dist.P2POp(dist.isend, send, to_rank, self.group),
            dist.P2POp(dist.irecv, recv, from_rank, self.group),
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
        (``cerar.formats.wire``: scaled, cast) and the message received is decoded into ``recv`` when the
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
        if self.contract.stream_ordered and self.contract.host_polls:
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
