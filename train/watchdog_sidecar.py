"""The host watchdog's sidecar: a small process per rank that ends the rank, with the line, where the rank's own
watchdog thread cannot run.

Why: the host watchdog (train/watchdog.py) is a Python thread, so it needs the interpreter's lock. A call that
blocks without releasing it holds every thread of the process: on NCCL, ``new_group`` on a rank that is not a
member of the new group calls ``perform_nocolor_split`` (``distributed_c10d._new_process_group_helper``, whenever
the default group is bound to a device, as the trainer's is), and torch binds it without
``py::call_guard<py::gil_scoped_release>()`` (``torch/csrc/distributed/c10d/init.cpp``, the ``ProcessGroupNCCL``
class: ``.def("perform_nocolor_split", &::c10d::ProcessGroupNCCL::performNocolorSplit)``, where the members'
``eager_connect_single_device`` and ``abort`` release it). ``ncclCommSplit`` then waits for every rank of the
parent group with the lock held: with a peer stalled before the split, the rank's watchdog never runs, and the
rank stays for ever while its peers exit 3. The same for a rank that is stopped whole (SIGSTOP, a frozen host).

How: the rank and this process share one page (`Board`, a ``memfd`` mapped by both). The rank's main thread
writes each mark there as it makes it (`train.watchdog.HostWatchdog.mark`: what, since when, its deadline); the
rank's watchdog thread writes the time of each of its wake-ups (``beat``); the rank's way out writes the time by
which it must have ended (``exit_by``). Every ``TICK_S`` this process reads the page, and ends the rank when, twice
in a row for the same mark:

- the mark is watched, its deadline passed ``GRACE_S`` ago, and the watchdog thread has not woken since the
  deadline (it wakes at the deadline when it can run): the rank's own watchdog could not run;
- or the mark's deadline passed ``GRACE_S`` + ``PEERS_S`` + the way out's own bound ago (the watchdog ran, but the
  rank is still there);
- or the way out's ``exit_by`` passed ``GRACE_S`` ago (the exit timer could not run either).

Ending it: the line, written as the way out writes it (`train.exit_path.write_line`, to the same stderr, which this
process inherits), then SIGQUIT, whose handler in the rank is libc's ``_exit`` itself (`install_quit_exit`: the
kernel calls it with the signal's number, 3, so the rank leaves with exit status 3 without its interpreter, like
the rank's own way out), and SIGKILL if the rank is still there ``KILL_AFTER_S`` later (a stopped rank, or where the
handler could not be installed). This process leaves as soon as the rank has gone (its parent changes).

Only the standard library (and train/exit_path.py): it starts in a few milliseconds, with no torch.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import time
from pathlib import Path

GRACE_S = 1.0
"""How long after a mark's deadline the sidecar lets the rank's own watchdog act (it wakes at the deadline: this is
its scheduling's slack) before it ends the rank itself."""
TICK_S = 0.1
KILL_AFTER_S = 2.0
PEERS_S = 5.0  # the watchdog's bounded look-up of the peers before its way out (train.watchdog._peers_within)

# The page: fixed fields, then the mark between two copies of its sequence number (a read that finds them unequal
# caught a write half done; one that sees a write's fields mixed is out-voted by the next read, 0.1 s later: the
# sidecar acts only on two reads that agree)
_FIXED = struct.Struct("<ddqqddd")  # T, exit_bound_s, rank, quit_exits_3, beat, exit_by, watching
_MARK = struct.Struct("<Qddqq160s96sQ")  # seq, since, deadline (<= 0: not watched), step, kind (1: collective), seq
_MARK_AT = _FIXED.size
_SIZE = 4096
_BEAT_AT, _EXIT_BY_AT, _WATCHING_AT = 32, 40, 48


class Board:
    """The page the rank writes and the sidecar reads (module docstring); each write is a few ``pack_into`` calls."""

    def __init__(self, fd: int):
        import mmap

        self.fd = fd
        self.page = mmap.mmap(fd, _SIZE)
        self.seq = 0
        self.encoded: dict[str, bytes] = {}  # the names seen, encoded once (a mark costs a few microseconds)

    @classmethod
    def create(cls) -> Board:
        fd = os.memfd_create("cerar-host-watchdog", os.MFD_CLOEXEC)
        os.ftruncate(fd, _SIZE)
        return cls(fd)

    def describe(self, T: float, exit_bound_s: float, rank: int, quit_exits_3: bool) -> None:
        struct.pack_into("<ddqq", self.page, 0, float(T), float(exit_bound_s), int(rank), int(quit_exits_3))

    def mark(self, name: str, kind: str, since: float, deadline_s: float | None, phase: str, step: int) -> None:
        self.seq += 1
        _MARK.pack_into(
            self.page, _MARK_AT, self.seq, since, -1.0 if deadline_s is None else deadline_s, step,
            kind == "collective", self._bytes(name), self._bytes(phase), self.seq,
        )  # fmt: skip

    def _bytes(self, text: str) -> bytes:
        if (known := self.encoded.get(text)) is None:
            if len(self.encoded) > 4096:  # names with a step or a size in them: keep the cache small
                self.encoded.clear()
            known = self.encoded[text] = text.encode("utf-8", "replace")[:160]
        return known

    def beat(self, now: float) -> None:
        struct.pack_into("<d", self.page, _BEAT_AT, now)

    def watching(self, on: bool) -> None:
        struct.pack_into("<d", self.page, _WATCHING_AT, 1.0 if on else 0.0)

    def leaving(self, by: float, bound_s: float) -> None:
        struct.pack_into("<d", self.page, 8, bound_s)
        struct.pack_into("<d", self.page, _EXIT_BY_AT, by)

    def read(self) -> dict | None:
        """What the rank wrote, or None while its mark is being written."""
        T, exit_bound_s, rank, quit_exits_3, beat, exit_by, watching = _FIXED.unpack_from(self.page, 0)
        seq, since, deadline, step, kind, name, phase, seq_end = _MARK.unpack_from(self.page, _MARK_AT)
        if seq_end != seq:  # 0 and 0 before the first mark
            return None
        name, phase = (b.rstrip(b"\0").decode("utf-8", "replace") for b in (name, phase))
        return dict(name=name, phase=phase, T=T, exit_bound_s=exit_bound_s, rank=rank, quit_exits_3=bool(quit_exits_3),
                    beat=beat, exit_by=exit_by, watching=watching > 0, seq=seq, since=since, deadline=deadline,
                    step=step, collective=bool(kind))  # fmt: skip


def verdict(seen: dict, now: float, grace_s: float = GRACE_S, peers_s: float = PEERS_S) -> str | None:
    """The line that ends the rank now, or None (module docstring's three rules)."""
    rank, T = seen["rank"], seen["T"]
    what = f"{'collective' if seen['collective'] else 'phase'} '{seen['name']}'"
    if seen["exit_by"] > 0:
        if now < seen["exit_by"] + grace_s:
            return None
        held = f" (it was last in {what}, phase: {seen['phase']})" if seen["name"] else ""
        return (
            f"error: host watchdog: rank {rank} did not end within its way out's bound of {seen['exit_bound_s']:g}s "
            f"after a failure{held}: ended by its watchdog's sidecar process (docs/failures.md)"
        )
    if not seen["watching"] or seen["deadline"] <= 0:
        return None
    due = seen["since"] + seen["deadline"]
    if now >= due + grace_s and seen["beat"] < due:
        why = (
            f"its watchdog thread did not run for {now - seen['beat']:.1f}s (the process held whole: a call that "
            "keeps the interpreter's lock, as a non-member's subgroup split does on NCCL, or a stopped process)"
        )
    elif now >= due + grace_s + peers_s + seen["exit_bound_s"]:
        why = "its watchdog fired but the process did not end"
    else:
        return None
    return (
        f"error: host watchdog: rank {rank} held {now - seen['since']:.1f}s in {what} at step {seen['step']} "
        f"(phase: {seen['phase']}), past its deadline of {seen['deadline']:g}s (T = trainer.collective_timeout_s = "
        f"{T:g}s; docs/failures.md): {why}; ended by its watchdog's sidecar process; peers: unknown"
    )


def install_quit_exit() -> bool:
    """Make SIGQUIT end this process with exit status 3 without its interpreter: libc's ``_exit`` installed as the
    handler (same signature as a handler; called with the signal's number, 3 on Linux). False where it cannot be
    (no libc through ctypes): the sidecar then ends the rank with SIGKILL."""
    if signal.SIGQUIT != 3:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        install = libc.signal
        install.restype, install.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p]
        previous = install(signal.SIGQUIT, ctypes.cast(libc["_exit"], ctypes.c_void_p))
        return previous != ctypes.c_void_p(-1).value  # SIG_ERR
    except (OSError, AttributeError, TypeError):
        return False


def spawn(board: Board, rank_pid: int | None = None):
    """Start this rank's sidecar (a child of the rank, sharing the board's page and the rank's stderr)."""
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    code = "import sys; sys.path.insert(0, sys.argv[1]); from train.watchdog_sidecar import main; main(sys.argv[2:])"
    return subprocess.Popen(
        [sys.executable, "-S", "-E", "-c", code, root, str(rank_pid or os.getpid()), str(board.fd)],
        pass_fds=(board.fd,),
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )


def main(argv: list[str]) -> None:
    """The sidecar's loop (module docstring): ``argv`` is the rank's pid and the board's descriptor."""
    rank_pid, fd = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the rank's to handle, not ours
    board = Board(fd)
    previous = None
    while os.getppid() == rank_pid:
        seen = board.read()
        line = None if seen is None else verdict(seen, time.monotonic())
        key = None if line is None else (seen["seq"], seen["exit_by"])
        if key is not None and key == previous:
            _end(rank_pid, line, seen["quit_exits_3"])
            return
        previous = key
        time.sleep(TICK_S)


def _end(rank_pid: int, line: str, quit_exits_3: bool) -> None:
    from train.exit_path import write_line

    write_line(line)
    try:
        os.kill(rank_pid, signal.SIGQUIT if quit_exits_3 else signal.SIGKILL)
        deadline = time.monotonic() + KILL_AFTER_S
        while os.getppid() == rank_pid and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.getppid() == rank_pid:
            os.kill(rank_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
