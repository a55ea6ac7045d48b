"""The transports the multi-process tests run on (``tests/distributed.py`` ``run_workers(..., contract=...)``):
gloo's, under the contract the code under test is given.

``contract`` chooses what the transport promises the code under test. The transport is gloo's
either way; only the contract around it changes:

- ``"gloo"``: gloo's own: one work per op, and ``Work.wait(timeout)`` blocks the host up to the timeout;
- ``"nccl"``: NCCL's, as torch implements it (``torch/distributed/distributed_c10d.py``,
  ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``):

  - ``batch_isend_irecv`` runs the batch in a coalescing manager and returns ONE work for the whole
    batch (``NcclContractWork``), whose transfers run off the calling thread (NCCL's stream), bounded
    only by the group's timeout (NCCL's watchdog);
  - ``wait()`` without a timeout (``WorkNCCL::wait`` -> ``synchronize()``) orders what follows after
    the transfer and bounds nothing: on the CPU, where there is no stream, ordering means blocking
    the calling thread until the data is there; a batch that failed raises;
  - ``wait(timeout)`` ("in case of blockingWait or a timeout value is specified by the user, we
    block the CPU thread until the work is completed or timed out") blocks up to the timeout; on
    expiry, or on a failed batch, it leaves the group aborted, as ``WorkNCCL::wait`` aborts the
    communicators before it throws: later batches on the group fail;
  - ``is_completed()`` tells whether the batch is done (or failed);
  - the first send or receive to each peer on a group connects to it inside the call (NCCL's
    ``taskAppend`` marks the peer's channels, ``ncclGroupEnd`` connects them, whatever
    ``NCCL_RUNTIME_CONNECT`` says): the host is held there, with no work, until the peer makes its own
    first call on the pair, however long that takes (`_hold_until`); then the first batch on each group
    must involve every rank of the group (NCCL's first-call rule, held here to every group's first batch
    whatever came before): a rank whose peers do not all join within ``FIRST_BATCH_TIMEOUT_S`` raises;
  - the first collective of each kind and size class on a group (``LARGE_BYTES``: NCCL picks its algorithm per
    collective and size,
    and with ``NCCL_RUNTIME_CONNECT=1``, its default, connects an algorithm's channels at the first
    collective that uses it, ``initTransportsRank``/``ncclPrepareTasks``) holds the host inside the call,
    with no work, until every rank of the group has made it, however long that takes;
  - ``new_group`` for an NCCL group holds the host until every rank of the default group has reached the
    same ``new_group`` call (``ncclCommSplit`` over every rank of the parent, members by
    ``eager_connect_single_device``, the others by ``perform_nocolor_split``; ``_new_process_group_helper``),
    however long that takes, with no work. A member waits with the interpreter's lock released, as torch binds
    ``eager_connect_single_device`` (``py::call_guard<py::gil_scoped_release>()``); a rank that is not a member
    waits with the lock held, as torch binds ``perform_nocolor_split`` without that guard
    (``torch/csrc/distributed/c10d/init.cpp``, the ``ProcessGroupNCCL`` class), so no other thread of its
    process runs until the split is done (`_hold_holding_the_gil`);
  - ``_abort_process_group`` leaves the groups it aborts aborted, and records their names in the
    store under ``nccl-contract/aborted/<rank>``, which outlives the process;
  - collectives (``all_reduce``, ``all_gather``, ``broadcast``, ``barrier``) on any group not created
    with ``backend="gloo"`` are NCCL's too: with ``async_op=True`` they return an ``NcclContractWork``
    at once; without, they return once the result is there, unbounded, as the host read that follows
    them on a GPU (``.item()``, ``.tolist()``, ``torch.cuda.synchronize``) blocks until the NCCL
    kernel has run, whatever the time;
  - torch's watchdog (``ProcessGroupNCCL::Watchdog::run`` -> ``watchdogHandler``): a thread checks
    every ``WATCHDOG_PERIOD_S`` every work of the process against its group's timeout, timed from the
    work's creation (``WorkNCCL::checkTimeout`` compares ``now - workStartTime_`` with the timeout);
    on expiry it records ``nccl-contract/watchdog/<rank>`` in the store (what it timed out on), fails
    the group's works, signals its debug dump and sleeps four times the dump's wait before it aborts
    (``Watchdog::runLoop``: ``broadcastDumpSignal()``, then ``sleep_for(heartbeatMonitor_->getDumpTimeout() *
    4)``; ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``, torch's default 15 s, so a minute) and ends the process
    with SIGABRT (the rethrow on the
    watchdog's thread: ``std::terminate``), exit status -6 as ``multiprocessing`` reports it, 134 from
    a shell. Before it sleeps it signals the dump to every rank through the store (``broadcastDumpSignal``).
    ``group_timeout_s`` (and a ``new_group``'s ``timeout``) is that watchdog's timeout; gloo's
    own waits under the groups are given longer (``transport_timeout_s``), so that, as on NCCL, a work
    a stalled peer holds up is ended by the watchdog or by the code's own deadline, never by gloo;
  - torch's heartbeat monitor (``HeartbeatMonitor::runLoop``, default group only): every
    ``TORCH_NCCL_COORD_CHECK_MILSEC`` (1 s) it checks the store for another rank's dump signal; on one it dumps
    (up to the dump wait), sleeps ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (480 s by default) and ends the process
    (``terminateProcess``: ``LOG(FATAL)``, SIGABRT), whether or not this rank has a work: the only end torch
    gives a rank held inside a call with no work, and only when another rank's watchdog fired;
  - a ``DistributedDataParallel`` built on such a group reaches it through ``NcclContractProcessGroup`` (its
    C++ reducer calls the group directly, past the functions above): a bucket's all-reduce returns a work whose
    future is complete at once, as ``ProcessGroupNCCL::collective`` marks it (so ``finalize_backward`` does not
    wait on the host), while DDP's broadcasts and gathers hold the host until their data is there, as the host
    reads that follow them in DDP do; on the CPU the reducer copies a bucket before its transfer lands, so such
    runs show who ends a stall, not the numbers;
  - cerar's calls follow their stream-ordered contract (``cerar.ring.transport.set_transport_contract``)
    with an ``EmulatedStream`` as the device queue: their device work runs in order on a thread of
    its own, as a CUDA stream runs kernels, so the host only enqueues and is held up only where the
    code polls a work's completion, as on a GPU.

In both contracts ``transport_log()`` records, per process, what was handed to ``batch_isend_irecv``
(bytes of the tensors given to isend and to irecv, batches, the groups used) and, under ``"nccl"``,
how the code waited: ``wait()`` and ``wait(timeout)`` calls, ``is_completed()`` calls and the distinct
batches they were made on, for tests that compare a count with a measurement.

``install(contract, group_timeout_s, store)`` puts the contract in place in a worker, after its gloo process group
exists; ``store`` is the run's shared TCPStore, where the emulated watchdog and abort leave their records.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import os
import queue
import sys
import threading
import time
import weakref
from datetime import timedelta

CONTRACTS = ("gloo", "nccl")
FIRST_BATCH_TIMEOUT_S = 30.0
LARGE_BYTES = 64 * 1024  # a collective of at least this many bytes is of the "large" size class (another algorithm)
HELD_FOR_S = 24 * 3600.0  # a hold inside a call: as long as the peer takes (a day stands for ever here)
CONNECT_KEY = "nccl-contract/connect/"
SPLIT_KEY = "nccl-contract/split/"
DUMP_SIGNAL_KEY = "nccl-contract/dump-signal"
HEARTBEAT_KILL_KEY = "nccl-contract/heartbeat-kill/"
HEARTBEAT_VARIABLE = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
HEARTBEAT_DEFAULT_S = 480
COORD_CHECK_S = 1.0  # TORCH_NCCL_COORD_CHECK_MILSEC's default
ABORTED_KEY = "nccl-contract/aborted/"
WATCHDOG_KEY = "nccl-contract/watchdog/"
WATCHDOG_PERIOD_S = 0.1  # torch's watchdog sleeps kWatchdogThreadSleepMillis (100 ms) between checks
DUMP_WAIT_VARIABLE = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
DUMP_WAIT_DEFAULT_MS = 15_000

_log = {
    "bytes_isend": 0,
    "bytes_irecv": 0,
    "batches": 0,
    "groups": set(),
    "waits": 0,
    "waits_with_timeout": 0,
    "polls": 0,
    "polled_batches": set(),
    "aborted": [],
}
_store = {"store": None, "holds": None}  # the run's shared store (``install``): the records; and a connection of
# its own for the holds inside calls
_aborted_groups: set[str] = set()
_live_works: dict[str, weakref.WeakSet] = {}
_group_timeouts: dict[str, float] = {}  # the emulated NCCL groups' own timeouts (the watchdog's), seconds
_gloo_groups: set[str] = set()  # groups created with backend="gloo": gloo's contract, not NCCL's
_serial = itertools.count()
_connected: set[tuple] = set()  # (group, size class) or (group, "p2p", pair) this process has connected
_splits = itertools.count()  # the NCCL new_group calls of this process, in order (the same on every rank)


def _hold_until(prefix: str, ranks) -> None:
    """NCCL's host-side hold inside a call (a connect, a split): record this rank's arrival under ``prefix`` and
    block, with no work and no bound of its own, until every rank of ``ranks`` has arrived. The store's wait
    releases the GIL, as NCCL's C++ does: another thread of the process (a watchdog) keeps running. It waits on
    a connection of its own (``_store["holds"]``), as NCCL waits on its bootstrap sockets: the run's store stays
    free for the process's other threads (the trainer's heartbeat keys, the test's records)."""
    import torch.distributed as dist

    store = _store["holds"]
    store.set(f"{prefix}{dist.get_rank()}", "arrived")
    store.wait([f"{prefix}{r}" for r in ranks], timedelta(seconds=HELD_FOR_S))


def _hold_holding_the_gil(prefix: str, ranks, members) -> None:
    """``_hold_until`` for a split on a rank that is not a member of the new group (``perform_nocolor_split``):
    the wait itself is one blocking call made with the interpreter's lock held (``recv`` on a socket of its own,
    through ``ctypes.PyDLL``, whose calls keep the lock), as ``ncclCommSplit`` waits inside torch's binding. Every
    rank of the split counts its arrival in the store; the last one to arrive (whichever it is) sets its key for
    the members, who wait in the store as in ``_hold_until``, and sends one datagram to each waiting non-member's
    socket (an abstract Unix socket named by the run's store and the split: gone with the process)."""
    import ctypes
    import socket

    import torch.distributed as dist

    store, me = _store["holds"], dist.get_rank()
    run = _store["store"].port

    def address(rank: int) -> str:
        return f"\0cerar-nccl-emulation/{run}/{prefix}{rank}"

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address(me))  # bound before counted: the last arrival finds every waiter's socket
        if store.add(f"{prefix}count", 1) == len(ranks):
            _release_split(store, prefix, ranks, members, address)
            return
        if me in members:
            store.set(f"{prefix}{me}", "arrived")
            store.wait([f"{prefix}{r}" for r in ranks], timedelta(seconds=HELD_FOR_S))
            return
        byte = ctypes.create_string_buffer(1)
        recv = ctypes.PyDLL(None).recv  # a PyDLL call keeps the interpreter's lock for its whole length
        while recv(sock.fileno(), byte, 1, 0) < 0:  # EINTR: again, still holding it
            pass


def _release_split(store, prefix: str, ranks, members, address) -> None:
    """The last rank to reach a split: every member's key (their store wait ends), a datagram to every non-member."""
    import socket

    for r in ranks:
        store.set(f"{prefix}{r}", "arrived")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        for r in sorted(set(ranks) - set(members)):
            with contextlib.suppress(OSError):  # a non-member that has gone (or is this rank)
                sender.sendto(b"x", address(r))


def _connect_collective(group, op: str, nbytes: int) -> None:
    """The first collective ``op`` of its size class on ``group`` connects inside the call (module docstring):
    NCCL chooses an algorithm per collective and size (a large all-reduce may take NVLS or Tree where a
    broadcast or a small all-reduce takes Ring), so each (op, size class) is a first use of its own."""
    import torch.distributed as dist

    size_class = "large" if nbytes >= LARGE_BYTES else "small"
    key = (group.group_name, op, size_class)
    if key in _connected:
        return
    _connected.add(key)
    _hold_until(f"{CONNECT_KEY}{group.group_name}/{op}/{size_class}/", dist.get_process_group_ranks(group))


def _connect_peers(group, peers) -> None:
    """The first send or receive to each peer on ``group`` connects to it inside the call (module docstring)."""
    import torch.distributed as dist

    me = dist.get_rank()
    for peer in sorted(set(peers) - {me}):
        pair = (min(me, peer), max(me, peer))
        key = (group.group_name, "p2p", pair)
        if key not in _connected:
            _connected.add(key)
            _hold_until(f"{CONNECT_KEY}{group.group_name}/p2p/{pair[0]}-{pair[1]}/", pair)


def transport_log() -> dict:
    """What this process handed to ``batch_isend_irecv`` so far, and how it waited (module docstring)."""
    return {
        **_log,
        "groups": set(_log["groups"]),
        "polled_batches": set(_log["polled_batches"]),
        "aborted": list(_log["aborted"]),
    }


def _refuse_if_aborted(name: str) -> None:
    """An aborted NCCL communicator takes no more work: new work on the group raises at once."""
    if name in _aborted_groups:
        raise RuntimeError(f"NCCL contract: group {name!r} was aborted; it takes no more work")


def _abort_group(name: str, reason: str) -> None:
    """NCCL's abort as its works see it: every batch still in flight on the group fails, later ones refuse."""
    _aborted_groups.add(name)
    for work in list(_live_works.get(name, ())):
        work.fail(RuntimeError(f"NCCL contract: the communicator of group {name!r} was aborted ({reason})"))


class NcclContractWork:
    """One work for a whole batch, kept as ``WorkNCCL`` keeps it (module docstring). The batch's
    gloo works are driven to completion off the calling thread, up to the group's timeout."""

    def __init__(self, works, group_name: str, what: str = "batch_isend_irecv", result=None):
        self.created = time.monotonic()  # the watchdog's clock starts here, as WorkNCCL's workStartTime_
        self.works = list(works)
        self.result = result  # the tensors the collective writes: its future's value
        self.group_name = group_name
        self.what = what
        self.serial = next(_serial)
        self.error: BaseException | None = None
        self.done = threading.Event()  # completed, failed, or failed by an abort
        self.transferred = threading.Event()  # the transfer itself ended (what a host read of the result waits for)
        _live_works.setdefault(group_name, weakref.WeakSet()).add(self)
        threading.Thread(target=self._run, name="nccl-contract-transfer", daemon=True).start()

    def _run(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except BaseException as error:  # reported by wait(), as NCCL reports a failed work
            self.fail(error)
        finally:
            self.done.set()
            self.transferred.set()

    def fail(self, error: BaseException) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()

    def is_completed(self) -> bool:
        if self.what == "batch_isend_irecv":  # the log counts point-to-point batches only
            _log["polls"] += 1
            _log["polled_batches"].add(self.serial)
        return self.done.is_set()

    def get_future(self):
        """``WorkNCCL::getFuture``: ``ProcessGroupNCCL::collective`` marks the work's future completed right
        after it enqueues the kernel (``work->future_->markCompleted(at::IValue(*work->outputs_))``, under a
        stream guard on NCCL's stream), so the future is done at once; what reads its value is ordered after the
        kernel by CUDA events, not by the host. On the CPU nothing orders those reads: a DDP hook's callback
        (``fp16_compress_hook``'s decompress) reads the tensor before the transfer lands, so runs through this
        future measure who ends a stall, not the numbers."""
        import torch

        if self.result is None:
            raise RuntimeError(f"NCCL contract: {self.what} gives no future here")
        future = torch.futures.Future()
        future.set_result(self.result)
        return future

    def wait(self, timeout=None) -> bool:
        if timeout is None or timeout == timedelta(0):  # NCCL's kNoTimeout: order, bound nothing
            _log["waits"] += self.what == "batch_isend_irecv"
            self.done.wait()
        else:
            _log["waits_with_timeout"] += 1  # any work's: NCCL's contract never wants one
            if not self.done.wait(timeout.total_seconds()):
                _abort_group(self.group_name, f"a wait({timeout}) expired")
                raise RuntimeError(
                    f"NCCL contract: Work timed out in blocking wait after {timeout}; the communicator is aborted"
                )
        if self.error is not None:
            _abort_group(self.group_name, "a failed work was waited for")
            raise RuntimeError(f"NCCL contract: the batch failed: {self.error}") from self.error
        return True


def _connect_before_posting(fn, args=()) -> None:
    """On a GPU cerar's stream-ordered rounds post on the host thread (``ImmediateDeviceQueue`` runs a submitted
    post there and then), so NCCL's first connect to a peer holds the host inside ``ncclGroupEnd``. Here a post
    runs later on the stream's thread: its connects are made now, on the submitting (host) thread, as on a GPU
    (``_connect_peers``; the post itself then finds them made)."""
    import torch.distributed as dist

    ring = getattr(getattr(fn, "__self__", None), "ring", None)
    name = getattr(fn, "__name__", "")
    if name in ("_post", "_post_wire") and hasattr(ring, "next_rank"):
        group = ring.group or dist.distributed_c10d._get_default_group()
        peers = [ring.next_rank, ring.prev_rank]
        if name == "_post" and len(args) == 2 and all(isinstance(a, tuple) for a in args):
            peers = [args[0][1], args[1][1]]  # the 8-bit all-to-all's _PeerRing: (tensor, global rank) per op
        _connect_peers(group, peers)


class EmulatedStream:
    """A CUDA stream's order, on the CPU: the device queue of cerar's stream-ordered contract.
    ``submit`` returns at once with a future; one thread runs the work in order (torch's
    ``no_grad`` there, as cerar's calls run their arithmetic under it). After the first failure the
    rest fail with it, as work queued on a stream behind a fault never runs."""

    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.failure: BaseException | None = None
        self.backlog = 0  # submitted, not yet run
        self.max_backlog = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="nccl-contract-stream", daemon=True).start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        _connect_before_posting(fn, args)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self.backlog += 1
            self.max_backlog = max(self.max_backlog, self.backlog)
        self._tasks.put((future, fn, args))
        return future

    def _run(self) -> None:
        import torch

        with torch.no_grad():
            while True:
                future, fn, args = self._tasks.get()
                try:
                    if self.failure is not None:
                        future.set_exception(self.failure)
                        continue
                    try:
                        future.set_result(fn(*args))
                    except BaseException as error:
                        self.failure = error
                        future.set_exception(error)
                finally:
                    with self._lock:
                        self.backlog -= 1

    def drain(self, deadline: float) -> None:
        """Return once everything submitted so far has run (raising the stream's failure, if any)."""
        marker = self.submit(lambda: None)
        try:
            marker.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise TimeoutError("the emulated stream did not run its queued work by the deadline") from None


def transport_timeout_s(group_timeout_s: float) -> float:
    """gloo's own timeout under NCCL's contract: past the emulated watchdog's (``group_timeout_s``) and its dump
    wait, so that, as on NCCL, only the watchdog ends a work that a stalled peer holds up."""
    return 2 * group_timeout_s + 30


def _watchdog() -> None:
    """torch's NCCL watchdog, emulated (module docstring): a work unfinished past its group's timeout, counted
    from its creation, takes the process down with SIGABRT after four times the dump wait."""
    import resource
    import signal

    while True:
        time.sleep(WATCHDOG_PERIOD_S)
        now = time.monotonic()
        for name, works in list(_live_works.items()):
            timeout_s = _group_timeouts.get(name)
            if timeout_s is None:
                continue
            late = [w for w in list(works) if not w.done.is_set() and now - w.created > timeout_s]
            if not late:
                continue
            work = late[0]
            reason = f"{work.what} on group {name!r} ran {now - work.created:.1f}s > the group's timeout {timeout_s:g}s"
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                _store["store"].set(f"{WATCHDOG_KEY}{dist.get_rank()}", reason)
            print(f"[emulated NCCL watchdog] {reason}: dumping, then SIGABRT", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):  # broadcastDumpSignal: every rank's heartbeat monitor sees it
                _store["store"].set(DUMP_SIGNAL_KEY, str(dist.get_rank()))
            _abort_group(name, "the watchdog's timeout")
            time.sleep(4 * int(os.environ.get(DUMP_WAIT_VARIABLE, DUMP_WAIT_DEFAULT_MS)) / 1e3)  # getDumpTimeout() * 4
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
            os.kill(os.getpid(), signal.SIGABRT)


def _heartbeat_monitor() -> None:
    """torch's heartbeat monitor, emulated (module docstring): on another rank's dump signal, dump, sleep the
    heartbeat timeout and end the process with SIGABRT, work or no work."""
    import resource
    import signal

    import torch.distributed as dist

    while True:
        time.sleep(COORD_CHECK_S)
        with contextlib.suppress(Exception):
            if _store["store"].check([DUMP_SIGNAL_KEY]):
                break
    source = _store["store"].get(DUMP_SIGNAL_KEY).decode()
    heartbeat_s = float(os.environ.get(HEARTBEAT_VARIABLE, HEARTBEAT_DEFAULT_S))
    print(
        f"[emulated NCCL heartbeat monitor] dump signal from rank {source}: dumping, sleeping {heartbeat_s:g}s, "
        "then SIGABRT",
        file=sys.stderr,
        flush=True,
    )
    time.sleep(int(os.environ.get(DUMP_WAIT_VARIABLE, DUMP_WAIT_DEFAULT_MS)) / 1e3 + heartbeat_s)
    with contextlib.suppress(Exception):
        _store["store"].set(f"{HEARTBEAT_KILL_KEY}{dist.get_rank()}", f"after rank {source}'s dump signal")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), signal.SIGABRT)


def _install_collectives(group_timeout_s: float) -> None:
    """NCCL's collectives, their host reads and its watchdog, on gloo (module docstring)."""
    import inspect

    import torch.distributed as dist

    c10d = dist.distributed_c10d
    _group_timeouts[c10d._get_default_group().group_name] = float(group_timeout_s)
    original_new_group = c10d.new_group

    def new_group(*args, **kwargs):
        bound = inspect.signature(original_new_group).bind(*args, **kwargs)
        gloo = bound.arguments.get("backend") in ("gloo", dist.Backend.GLOO)
        timeout = bound.arguments.get("timeout")
        timeout_s = 600.0 if timeout is None else timeout.total_seconds()  # torch's default for NCCL groups
        if not gloo:  # the watchdog's timeout; the transport's own waits longer (_transport_timeout_s)
            bound.arguments["timeout"] = timedelta(seconds=transport_timeout_s(timeout_s))
            world = dist.get_process_group_ranks(c10d._get_default_group())
            members = world if bound.arguments.get("ranks") is None else list(bound.arguments["ranks"])
            # ncclCommSplit over every rank of the parent; a non-member's wait keeps the interpreter's lock
            _hold_holding_the_gil(f"{SPLIT_KEY}{next(_splits)}/", world, members)
        group = original_new_group(*bound.args, **bound.kwargs)
        if group is None or group == c10d.GroupMember.NON_GROUP_MEMBER:
            return group
        if gloo:
            _gloo_groups.add(group.group_name)
        else:
            _group_timeouts[group.group_name] = timeout_s
        return group

    dist.new_group = c10d.new_group = new_group

    def emulate(name: str) -> None:
        original = getattr(c10d, name)
        signature = inspect.signature(original)

        def collective(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            group = bound.arguments.get("group") or c10d._get_default_group()
            if group.group_name in _gloo_groups:
                return original(*args, **kwargs)
            _refuse_if_aborted(group.group_name)
            tensor = bound.arguments.get("tensor")
            _connect_collective(group, name, 0 if tensor is None else tensor.numel() * tensor.element_size())
            asynchronous = bound.arguments.get("async_op", False)
            bound.arguments["async_op"] = True
            result = [bound.arguments["tensor"]] if name in ("all_reduce", "broadcast") else None
            work = NcclContractWork([original(*bound.args, **bound.kwargs)], group.group_name, name, result)
            if asynchronous:
                return work
            work.transferred.wait()  # the host read of the result: unbounded; an abort does not release it
            if work.error is not None:
                raise RuntimeError(f"NCCL contract: {name} failed: {work.error}") from work.error
            return None

        setattr(c10d, name, collective)
        setattr(dist, name, collective)

    for name in ("all_reduce", "all_gather", "broadcast", "barrier"):
        emulate(name)
    _install_ddp_process_group()
    threading.Thread(target=_watchdog, name="nccl-contract-watchdog", daemon=True).start()
    threading.Thread(target=_heartbeat_monitor, name="nccl-contract-heartbeat-monitor", daemon=True).start()


def _install_ddp_process_group() -> None:
    """DDP's C++ reducer calls its process group's ``allreduce``/``broadcast``/``allgather`` directly, past the
    Python functions emulated above: a ``DistributedDataParallel`` built on an NCCL-contract group gets
    ``NcclContractProcessGroup`` in front of it, so that its buckets and its own host-blocking collectives
    follow NCCL's contract too (module docstring)."""
    import inspect

    import torch
    import torch.distributed as dist

    ddp_class = torch.nn.parallel.DistributedDataParallel
    original_init = ddp_class.__init__
    signature = inspect.signature(original_init)

    @functools.wraps(original_init)  # keeps DDP's signature: train.run.no_forward_buffer_sync reads it
    def init(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("process_group") or dist.distributed_c10d._get_default_group()
        if group.group_name not in _gloo_groups:
            bound.arguments["process_group"] = _nccl_contract_process_group(group)
        original_init(*bound.args, **bound.kwargs)

    ddp_class.__init__ = init


def _nccl_contract_process_group(group):
    """``group`` as DDP's reducer sees an NCCL group (``ProcessGroupNCCL``), on gloo's transport:

    - ``allreduce`` (a bucket, with no comm hook: ``Reducer::run_allreduce_hook`` -> ``_AllReduceBySumCommHook``)
      returns a work whose future is already complete (``ProcessGroupNCCL::collective`` marks it completed after
      enqueueing), so ``Reducer::finalize_backward``'s ``future_work->wait()`` does not hold the host: on a GPU it
      makes the current stream wait for NCCL's. The transfer runs on, under the watchdog, timed from its post.
      On the CPU the reducer then copies the bucket into the gradients before the transfer lands: a run through
      it measures who ends a stall, not the numbers;
    - ``broadcast`` and ``allgather`` (DDP's start-up checks, ``_broadcast_coalesced``, the bucket rebuild's
      ``sync_bucket_indices``, the buffers' broadcast) return a work whose ``wait()`` holds the host until the
      transfer ends, unbounded, as the host read of the result that follows each of them in DDP blocks on a GPU.
    Every transfer is an ``NcclContractWork`` of ``group``: the watchdog sees it and an abort fails it."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _create_work_from_future

    class NcclContractProcessGroup(dist.ProcessGroup):
        def __init__(self, inner):
            super().__init__(inner.rank(), inner.size())
            self.inner = inner

        def getBackendName(self) -> str:  # noqa: N802 (torch's name)
            return "nccl (emulated on gloo)"

        def _post(self, what: str, post, result, completed_at_once: bool):
            name = self.inner.group_name
            _refuse_if_aborted(name)
            tensors = result if isinstance(result, list) else [result]
            first = tensors[0][0] if tensors and isinstance(tensors[0], list) else tensors[0]
            _connect_collective(
                self.inner,
                what.split()[-1].replace("allreduce", "all_reduce").replace("allgather", "all_gather"),
                first.numel() * first.element_size(),
            )
            work = NcclContractWork([post()], name, what, result)
            if completed_at_once:  # as WorkNCCL's future (NcclContractWork.get_future)
                return _create_work_from_future(work.get_future())
            future = torch.futures.Future()

            def settle() -> None:
                work.transferred.wait()  # the host read: unbounded; an abort does not release it
                if work.error is not None:
                    future.set_exception(RuntimeError(f"NCCL contract: {what} failed: {work.error}"))
                else:
                    future.set_result(result)

            threading.Thread(target=settle, name="nccl-contract-host-read", daemon=True).start()
            return _create_work_from_future(future)

        def allreduce(self, tensors, opts=None):
            post = functools.partial(self.inner.allreduce, tensors, *_given(opts))
            return self._post("DDP bucket allreduce", post, tensors, completed_at_once=True)

        def broadcast(self, tensors, opts=None):
            post = functools.partial(self.inner.broadcast, tensors, *_given(opts))
            return self._post("DDP broadcast", post, tensors, completed_at_once=False)

        def allgather(self, outputs, inputs, opts=None):
            post = functools.partial(self.inner.allgather, outputs, inputs, *_given(opts))
            return self._post("DDP allgather", post, outputs, completed_at_once=False)

    return NcclContractProcessGroup(group)


def _given(opts) -> tuple:
    """The options argument as the caller gave it: none, or the one."""
    return () if opts is None else (opts,)


def install(contract: str, group_timeout_s: float, store) -> None:
    """Wrap ``dist.batch_isend_irecv`` for this process: log what is handed to it and, under
    ``"nccl"``, return one NcclContractWork for the batch after the first-batch check; under
    ``"nccl"`` also emulate NCCL's abort, its collectives and watchdog, DDP's process group, and give cerar its
    stream-ordered contract. ``store``: the run's shared store, for the watchdog's and the abort's records."""
    import torch.distributed as dist

    _store["store"] = store
    if contract == "nccl":
        _store["holds"] = dist.PrefixStore(
            "holds/", dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=60))
        )
    original = dist.batch_isend_irecv
    first_batch_seen: set[str] = set()

    def check_first_batch(group) -> None:
        name = group.group_name
        if name in first_batch_seen:
            return
        first_batch_seen.add(name)
        default_store = _store["holds"]  # a connection of its own: this wait must not hold the run's store
        me, members = dist.get_rank(), dist.get_process_group_ranks(group)
        default_store.set(f"nccl-contract/first-batch/{name}/{me}", "joined")
        keys = [f"nccl-contract/first-batch/{name}/{r}" for r in members]
        try:
            default_store.wait(keys, timedelta(seconds=FIRST_BATCH_TIMEOUT_S))
        except Exception as error:
            absent = [r for r, key in zip(members, keys, strict=True) if not default_store.check([key])]
            raise RuntimeError(
                f"NCCL contract: the first batch_isend_irecv on group {name!r} must involve all of its ranks "
                f"{members}; ranks {absent} never joined ({error})"
            ) from error

    def batch_isend_irecv(p2p_op_list):
        group = p2p_op_list[0].group or dist.distributed_c10d._get_default_group()
        for op in p2p_op_list:
            key = "bytes_isend" if op.op is dist.isend else "bytes_irecv"
            _log[key] += op.tensor.numel() * op.tensor.element_size()
        _log["batches"] += 1
        _log["groups"].add(group.group_name)
        if contract == "nccl":
            _refuse_if_aborted(group.group_name)
            _connect_peers(group, [op.peer for op in p2p_op_list])
            check_first_batch(group)
            return [NcclContractWork(original(p2p_op_list), group.group_name)]
        return original(p2p_op_list)

    dist.batch_isend_irecv = batch_isend_irecv
    if contract != "nccl":
        return

    original_abort = dist.distributed_c10d._abort_process_group

    def abort_process_group(group=None):
        world = dist.distributed_c10d._world
        names = sorted(world.pg_names.values()) if group is None else [group.group_name]
        for name in names:
            _abort_group(name, "_abort_process_group")
        _log["aborted"] += names
        with contextlib.suppress(Exception):  # observable after the process has ended
            _store["store"].set(f"{ABORTED_KEY}{dist.get_rank()}", ",".join(names))
        return original_abort(group)

    dist.distributed_c10d._abort_process_group = abort_process_group
    _install_collectives(group_timeout_s)

    try:
        from cerar.ring import transport
    except ImportError:  # a checkout from before the transport had a module of its own
        from cerar.ring import protocol as transport

    if hasattr(transport, "set_transport_contract"):  # (absent before issue 17: the old NCCL path ran as it was)
        transport.set_transport_contract(
            "gloo",
            transport.TransportContract("stream-ordered (NCCL, emulated on gloo)", True, device_queue=EmulatedStream()),
        )
