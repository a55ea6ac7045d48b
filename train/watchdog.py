"""The host watchdog: one daemon thread per rank that ends the process when the main thread overstays a phase.

Why: the trainer's polling (`train.distributed.bounded`, `await_work`, CERAR's rounds) bounds a collective only
once its ``Work`` exists. On NCCL the host can be held *inside* a call before any ``Work`` exists, where neither
the polling nor torch's watchdog (which times works only) sees it:

- ``new_group`` runs ``ncclCommSplit`` over every rank of the parent group, members and not
  (``distributed_c10d._new_process_group_helper``: ``eager_connect_single_device`` on members,
  ``perform_nocolor_split`` on the others; ``ProcessGroupNCCL::split``/``performNocolorSplit``);
- NCCL connects a communicator's channels lazily, at the first collective that uses an algorithm
  (``initTransportsRank``: ``comm->runtimeConn = comm->cuMemSupport && ncclParamRuntimeConnect()``, default 1) and a
  point-to-point peer at the first send or receive to it, whatever ``NCCL_RUNTIME_CONNECT`` says
  (``taskAppend``: ``connectSend[peer] |= ...; ncclGroupCommPreconnect(comm)``), inside ``ncclGroupEnd``;
- a host read of a result outside the polling (DDP's constructor: ``_verify_param_shape_across_processes``'s
  all-gather, its broadcasts), where torch's watchdog fires only at the group's timeout and SIGABRTs.

The main thread writes what it is doing (`mark`: a name, a deadline, the time; one tuple assignment, no lock, no
wake-up, and the same into the sidecar's page); the thread sleeps until the deadline of the mark it saw (at most
`poll_s`, the shortest deadline in use, so a newer mark with a shorter deadline is never overslept) and, when the
main thread still holds the same mark past its deadline, arms the exit timer (`train.exit_path.arm`), prints the
project's one line (rank, what, for how long, which peers never joined) and ends the process with exit status 3
through `train.distributed.exit_after_collective_failure` (``os._exit`` works while the main thread is inside
NCCL). Nothing here depends on the backend: gloo and NCCL runs are watched alike.

The thread needs the interpreter's lock; a call that keeps it (a non-member's subgroup split on NCCL) holds the
thread too. Each rank of a multi-rank run therefore has a sidecar process (train/watchdog_sidecar.py) that reads
the same marks and the thread's wake-ups from a shared page and ends the rank, with the line, when the thread did
not run by a mark's deadline.

The deadlines (`Deadlines`) follow from T = ``trainer.collective_timeout_s`` and the config, stated per phase; each
leaves the polling its better line first (a collective's mark is T longer than its poll) and ends the process
before torch's own watchdog times a work out (NCCL groups get ``train.distributed.WATCHDOG_FACTOR`` x T = 3T).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field

from train import exit_path, watchdog_sidecar

RUN = {
    "abort_wait_s": 10.0,
    "exit_s": 20.0,
    "step": lambda: 0,
    "peers": lambda: "peers: unknown",
    "fail": None,
}
"""What the watchdog asks of the run it watches, put here by `train.distributed` when it is imported (it imports this
module, never the other way): the exit path's own bound, the step, which peers never joined, and the way out
(`exit_after_collective_failure`, looked up when it fires: tests record the line there), and the way out's whole
bound (``exit_s``: the exit timer's)."""

DESTROY = "exit: destroy_process_group"
"""The phase of tearing the process group down at the end (`train.run.finish`, train/sweep.py)."""


COMPILE_PHASE = "start-up: compiling the model"
"""The phase in which the trainer compiles the model before its first step (train/loop.py)."""


class HostWatchdogError(RuntimeError):
    """The main thread held a phase past its deadline: the message is the line the process exits with."""


@dataclass
class Deadlines:
    """Seconds the main thread may spend in one mark, per phase, for T = ``trainer.collective_timeout_s``:

    - a collective (`train.distributed.guarded`/`bounded`, a start-up collective phase): its poll's timeout + T
      (2T for the trainer's own deadline): the poll ends a stall at T with its better line; the host watchdog ends
      what the poll cannot see (a connect or a split inside the call, a host read), T later, and T before torch's
      watchdog (the NCCL groups' timeout, 3T) would time the work out;
    - a phase of a step, or of the start-up, between its collectives (data, forward, backward, the checks,
      aggregation, optimizer, logging, drift, resync, and the interval after each; building the aggregator's codes):
      4T, twice a collective's: there the host waits for no peer (every collective it made has been waited for, so
      no work of it is left for torch's watchdog to time), and the deadline only ends a rank whose own work hangs,
      with room for a slow but live one;
    - evaluation: 4T per micro-batch it may run (``trainer.eval_batches`` x N: replicas that differ each evaluate
      the whole set);
    - a checkpoint, and reading one at start: ``checkpoint.write_timeout_s`` + T (the others wait that long for it);
    - creating the process group: the group's own timeout + T (its rendezvous waits that long for late ranks);
    - compiling the model before the first step (train/compiling.py): ``trainer.compile_timeout_s``, the bound the
      ranks then wait for each other with;
    - compiling the fused kernels (before the group: its rendezvous bounds the wait), building data, the model and
      the logger at start, closing the logger at the end: not watched (local work, or W&B's service; a peer
      stalled there is ended by the others' deadlines, and torchrun then stops it);
    - tearing the process group down at the end (`DESTROY`, also after an exception that was no collective's): T.
      On NCCL ``ProcessGroupNCCL::shutdown`` flushes first (``ncclComm->finalize()``, then ``waitReady(true)``
      until every operation in flight has completed) with torch's watchdog still running (it is joined only
      after): a work that waits for a peer that has gone is timed out there at the group's timeout, 3T after its
      creation (``Watchdog::runLoop`` -> ``WorkNCCL::checkTimeout``), and SIGABRTs 4 x the dump wait later
      (``sleep_for(getDumpTimeout() * 4)``, a minute, then the rethrow). Such a work was posted at most T before
      the exception (every wait of the trainer is bounded by T from its post), so torch's end comes at the
      earliest 2T + 4 x the dump wait into the teardown: at T = 300 s, 960 s after the work's creation, before
      the 4T (1200 s) this phase had as a phase of a step. T comes first; the heartbeat monitor
      (``HeartbeatMonitor::runLoop``, a watchdog thread with no progress for ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``,
      480 s, then as long again asleep before ``terminateProcess``) only after 960 s;
    - the way out after a failure: ``RUN["exit_s"]`` (``ABORT_WAIT_S`` + 10 s), kept by the exit timer
      (`train.exit_path`) and the sidecar, not by this thread, which the way out stops."""

    T: float
    group_timeout_s: float
    write_timeout_s: float = 1800.0
    eval_micro_batches: int = 1
    compile_timeout_s: float = 1800.0
    phases: dict[str, float | None] = field(init=False)

    def __post_init__(self):
        T = float(self.T)
        self.collective_s = self.collective()
        self.step_s = 4 * T
        self.exit_s = RUN["exit_s"]
        self.phases = {
            "start-up: process group": self.group_timeout_s + T,
            "start-up: fused kernels": None,
            "start-up: data": None,
            "start-up: model": None,
            "start-up: logger": None,
            "end: closing the logger": None,
            "start-up: reading the checkpoint": self.write_timeout_s + T,
            "eval": 4 * T * max(1, self.eval_micro_batches),
            "checkpoint": self.write_timeout_s + T,
            COMPILE_PHASE: self.compile_timeout_s,
            DESTROY: T,
        }

    @classmethod
    def of(cls, cfg, world_size: int, group_timeout_s: float) -> Deadlines:
        """The deadlines of a run: T from ``trainer.collective_timeout_s``, the rest from the config."""
        t = cfg.trainer
        return cls(
            T=t.collective_timeout_s,
            group_timeout_s=group_timeout_s,
            write_timeout_s=cfg.checkpoint.write_timeout_s,
            eval_micro_batches=t.eval_batches * world_size,
            compile_timeout_s=t.compile_timeout_s,
        )

    def phase(self, name: str) -> float | None:
        """A phase's deadline (None: not watched); any phase not named above is a phase of a step (4T)."""
        return self.phases.get(name, self.step_s)

    def collective(self, poll_timeout_s: float | None = None) -> float:
        """A collective's deadline: its poll's timeout (default T) + T."""
        return (self.T if poll_timeout_s is None else float(poll_timeout_s)) + self.T

    @property
    def poll_s(self) -> float:
        """The longest the thread sleeps without looking: the shortest deadline in use."""
        return min([self.collective_s, self.step_s] + [d for d in self.phases.values() if d])


_UNWATCHED = (None, "", 0.0, None, "")


class HostWatchdog:
    """The thread and the main thread's mark (module docstring). One per process: `start` makes it."""

    def __init__(self, deadlines: Deadlines, rank: int):
        self.deadlines = deadlines
        self.rank = rank
        # (name, kind, since, deadline, phase): one tuple, replaced whole by the main thread (atomic in CPython)
        self.current: tuple = _UNWATCHED
        self.phase_name = "start-up"
        self.stopped = False
        self._thread = threading.Thread(target=self._run, name="host-watchdog", daemon=True)

    def mark(self, name: str, deadline_s: float | None, kind: str = "phase") -> None:
        """The main thread enters ``name`` for at most ``deadline_s`` seconds (None: not watched); the sidecar's page
        gets the same."""
        if kind == "phase":
            self.phase_name = name
        self.current = (name, kind, time.monotonic(), deadline_s, self.phase_name)
        if (board := _sidecar["board"]) is not None:
            board.mark(name, kind, self.current[2], deadline_s, self.phase_name, RUN["step"]())

    def _run(self) -> None:
        while not self.stopped:
            if (board := _sidecar["board"]) is not None:
                board.beat(time.monotonic())  # the sidecar's evidence that this thread runs
            seen = self.current
            name, kind, since, deadline, phase = seen
            if deadline is None:
                time.sleep(self.deadlines.poll_s)
                continue
            left = since + deadline - time.monotonic()
            if left > 0:
                time.sleep(min(left, self.deadlines.poll_s))
                continue
            if self.current is not seen or self.stopped:  # the main thread moved on meanwhile
                continue
            self._fire(name, kind, time.monotonic() - since, deadline, phase)

    def _fire(self, name: str, kind: str, held_s: float, deadline_s: float, phase: str) -> None:
        exit_path.arm(3, PEERS_S + RUN["exit_s"])  # from here the process ends, whatever the look-up or the line do
        what = f"collective '{name}'" if kind == "collective" else f"phase '{name}'"
        error = HostWatchdogError(
            f"host watchdog: rank {self.rank} held {held_s:.1f}s in {what} at step {RUN['step']()} "
            f"(phase: {phase}), past its deadline of {deadline_s:g}s (T = trainer.collective_timeout_s = "
            f"{self.deadlines.T:g}s; docs/failures.md): {_peers_within(PEERS_S)}"
        )
        RUN["fail"](error, 3)

    def start(self) -> None:
        self._thread.start()


PEERS_S = watchdog_sidecar.PEERS_S
"""The longest the line waits for the peers' look-up (a dead store host must not hold the way out)."""


def _peers_within(seconds: float) -> str:
    """Which peers never joined (the heartbeat keys), asked on a thread of its own: a dead store host must not
    hold the way out."""
    answer = ["peers: unknown (the rendezvous store did not answer)"]

    def ask() -> None:
        with contextlib.suppress(Exception):
            answer[0] = RUN["peers"]()

    asking = threading.Thread(target=ask, name="host-watchdog-peers", daemon=True)
    asking.start()
    asking.join(seconds)
    return answer[0]


_watchdog: dict[str, HostWatchdog | None] = {"it": None}
_last: dict = {"deadlines": None, "rank": 0}
_sidecar: dict = {"board": None, "process": None, "pid": None}


def start(deadlines: Deadlines, rank: int, sidecar: bool | None = None) -> HostWatchdog:
    """Start this process's host watchdog (or give the running one the new deadlines: sweeps run several
    runs in one process), and its exit timer (`train.exit_path.prepare`). ``sidecar``: also start the sidecar
    process (train/watchdog_sidecar.py), once per process; None: where the launch has more than one rank
    (``WORLD_SIZE``: a group of one waits for no peer)."""
    exit_path.prepare()
    if sidecar is None:
        sidecar = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if sidecar:
        _start_sidecar(deadlines, rank)
    running = _watchdog["it"]
    if running is not None and not running.stopped:
        running.deadlines = deadlines
        _last.update(deadlines=deadlines)
        return running
    _last.update(deadlines=deadlines, rank=rank)
    dog = HostWatchdog(deadlines, rank)
    dog.start()
    _watchdog["it"] = dog
    if (board := _sidecar["board"]) is not None:
        board.watching(True)
    return dog


def _start_sidecar(deadlines: Deadlines, rank: int) -> None:
    """This process's sidecar and the page it reads (again in a forked child: the parent's is not its own)."""
    if _sidecar["pid"] != os.getpid():
        board = watchdog_sidecar.Board.create()
        quits = watchdog_sidecar.install_quit_exit()
        board.describe(deadlines.T, RUN["exit_s"], rank, quits)
        _sidecar.update(board=board, pid=os.getpid(), process=watchdog_sidecar.spawn(board))
    else:
        _sidecar["board"].describe(deadlines.T, RUN["exit_s"], rank, watchdog_sidecar.install_quit_exit())


def stop() -> None:
    """Stop watching (the run is over, or the process is leaving by a path that bounds itself). The sidecar
    stays, idle, for the next run of the process and its way out."""
    dog = _watchdog["it"]
    if dog is not None:
        dog.stopped = True
        dog.current = _UNWATCHED
        _watchdog["it"] = None
    if (board := _sidecar["board"]) is not None:
        board.watching(False)


def leaving(within_s: float) -> None:
    """The process is on its way out and ends within ``within_s`` (the exit timer is armed): stop watching, and
    tell the sidecar the time by which it must be gone."""
    stop()
    if (board := _sidecar["board"]) is not None:
        board.leaving(time.monotonic() + within_s, within_s)


def enter_phase(name: str) -> None:
    """The main thread enters a phase (`train.distributed.set_phase`): watched with the phase's deadline."""
    dog = _watchdog["it"]
    if dog is not None:
        dog.mark(name, dog.deadlines.phase(name))


def enter_collective(name: str, poll_timeout_s: float | None = None) -> None:
    """The main thread enters a collective polled with ``poll_timeout_s`` (default T): watched with that + T."""
    dog = _watchdog["it"]
    if dog is not None:
        dog.mark(name, dog.deadlines.collective(poll_timeout_s), kind="collective")


def resume_phase() -> None:
    """Back in the enclosing phase after a collective: its deadline again, counted from now."""
    dog = _watchdog["it"]
    if dog is not None:
        dog.mark(dog.phase_name, dog.deadlines.phase(dog.phase_name))


def running() -> HostWatchdog | None:
    """This process's watchdog while one is watching."""
    return _watchdog["it"]


@contextlib.contextmanager
def watching(deadlines: Deadlines, rank: int, name: str):
    """Watch the phase ``name`` with ``deadlines``: in the running watchdog, or in one started for the block and
    stopped after it (what happens outside a run: train/sweep.py's process group)."""
    started = running() is None
    if started:
        start(deadlines, rank)
    enter_phase(name)
    try:
        yield
    finally:
        if started:
            stop()


@contextlib.contextmanager
def watching_again(name: str):
    """Watch ``name`` (a phase of the way out, e.g. tearing the process group down) with the deadlines of the
    last run, after `stop`; stop again after it."""
    last = _last["deadlines"], _last["rank"]
    if last[0] is None or running() is not None:
        yield
        return
    with watching(*last, name):
        yield
