"""The way out of a rank that must end (train/exit_path.py, `train.distributed.exit_after_collective_failure`, the host
watchdog's sidecar train/watchdog_sidecar.py) never depends on a write succeeding or on the interpreter's lock:

- its line goes out through a bounded, non-blocking write: a pipe whose reader has gone is given up at once, a full
  one after ``LINE_WAIT_S``, and the line is whole when there is room (real pipes, in this process);
- through the real paths, on processes of their own whose stderr is such a pipe: the host watchdog's thread and the
  main thread's way out (after `run`'s end stopped the watchdog) end the rank with exit status 3 within the phase's
  deadline plus the write's bounds (before, the thread died of BrokenPipeError, or blocked in the write, and the
  rank ran on);
- the exit timer, armed first, ends a way out whose abort hangs, at ``EXIT_WAIT_S``;
- where the main thread keeps the interpreter's lock (a non-member's subgroup split on NCCL), the sidecar process
  ends the rank with exit 3 and its own line, ``GRACE_S`` after the mark's deadline; and a way out held the same
  way, ``GRACE_S`` after its bound.

Slack, stated: the watchdog wakes at the deadline, so its lateness is a sleeping thread's wake-up on a loaded host
and the peers' look-up in a live store (WAKE_SLACK_S); a process's exit is seen by the parent within its join's
poll (part of END_SLACK_S, with the abort of a group of one and the fork).
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time

import pytest

from tests.distributed import ProcessExit, held_store, run_workers, shared_store
from train.exit_path import write_line

FLUSH_WAIT_S, LINE_WAIT_S = 1.0, 2.0  # the way out's bounds on Python's buffers and on its line (docs/failures.md)
GRACE_S, TICK_S = 1.0, 0.1  # the sidecar acts 1 s after a deadline, on two reads 0.1 s apart (docs/failures.md)
T_S = 0.25  # the deadline the child gives the trainer: a phase's is 4T = 1 s, a collective's 2T = 0.5 s
WAKE_SLACK_S = 1.0  # a sleeping thread's (or the sidecar's) wake-up on a loaded host, and a live store's answer
END_SLACK_S = 3.0  # from the decision to the parent seeing the exit: the abort of a group of one, the join's poll


def _full_pipe() -> tuple[int, int]:
    """A pipe filled to the brim (its write end back in blocking mode, as an inherited stderr is): (read, write)."""
    r, w = os.pipe()
    flags = fcntl.fcntl(w, fcntl.F_GETFL)
    fcntl.fcntl(w, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        while True:
            os.write(w, b"x" * 65536)
    except BlockingIOError:
        pass
    fcntl.fcntl(w, fcntl.F_SETFL, flags)
    return r, w


# ------------------------------------------------------------------ the write itself, on real pipes


@pytest.mark.quick
def test_the_line_goes_out_whole_where_there_is_room():
    r, w = os.pipe()
    try:
        assert write_line("error: a line  with\ttabs kept", fd=w)
        assert os.read(r, 4096) == b"error: a line  with\ttabs kept\n"
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.quick
def test_a_pipe_whose_reader_has_gone_is_given_up_at_once():
    r, w = os.pipe()
    os.close(r)
    try:
        start = time.monotonic()
        assert not write_line("error: nobody reads this", fd=w)  # a plain print raises BrokenPipeError here
        assert time.monotonic() - start < 0.5
    finally:
        os.close(w)
    assert not write_line("error: nor this", fd=w)  # a closed descriptor: False, not an exception


@pytest.mark.quick
def test_a_full_pipe_costs_the_write_its_bound_and_no_more():
    r, w = _full_pipe()
    said = {}
    writing = threading.Thread(target=lambda: said.update(ok=write_line("error: no room", fd=w, within_s=0.3)))
    try:
        start = time.monotonic()
        writing.start()
        writing.join(5.0)  # a blocking write would still be in it (print's, before)
        assert not writing.is_alive(), "the write blocked on a full pipe"
        assert said == {"ok": False} and 0.3 <= time.monotonic() - start < 0.3 + WAKE_SLACK_S
        os.read(r, 65536)  # room again: the next line goes out
        assert write_line("error: room now", fd=w, within_s=0.3)
    finally:
        os.close(r)
        os.close(w)


# ------------------------------------------------------------------ the real paths, on processes of their own


def _stderr_into(kind: str) -> None:
    """This process's stderr (fd 2) becomes a pipe nobody reads (``closed``: its reader gone) or a full one that
    nobody drains (``full``)."""
    if kind == "closed":
        r, w = os.pipe()
        os.close(r)
    else:
        _, w = _full_pipe()  # its read end stays open in this process, and is never read
    os.dup2(w, 2)


def _watchdog_fires_into(rank, world_size, kind):
    """The host watchdog's thread ends this process, whose stderr is ``kind``, overstaying a phase (4T)."""
    from train import distributed, watchdog

    _stderr_into(kind)
    distributed.set_deadline(T_S)
    watchdog.start(watchdog.Deadlines(T=T_S, group_timeout_s=T_S), rank, sidecar=False)
    distributed.set_phase("optimizer")
    shared_store().set("entered", repr(time.time()))
    time.sleep(60)
    return "lived on"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["closed", "full"])
def test_the_watchdog_ends_the_rank_whatever_its_stderr_does(kind):
    store = held_store()
    results = run_workers(_watchdog_fires_into, 1, args=(kind,), timeout_s=40, exits=[0], store=store)
    ended = time.time()
    assert results == [ProcessExit(3)], results
    held = ended - float(store.get("entered").decode())
    writes = 0.0 if kind == "closed" else FLUSH_WAIT_S + LINE_WAIT_S  # a full pipe: each bound spent whole
    assert 4 * T_S <= held < 4 * T_S + WAKE_SLACK_S + writes + END_SLACK_S, held


def _leaves_after_the_run_into_full_pipes(rank, world_size):
    """The main thread's way out after `run`'s end stopped the watchdog (train/main.py's path), with stdout and
    stderr full pipes and a line of stdout still in Python's buffer."""
    import sys

    from train import distributed, watchdog

    watchdog.start(watchdog.Deadlines(T=T_S, group_timeout_s=T_S), rank, sidecar=False)
    watchdog.stop()  # run()'s finally
    _stderr_into("full")
    _, w = _full_pipe()
    os.dup2(w, 1)
    sys.stdout = open(1, "w", buffering=8192, closefd=False)  # noqa: SIM115 (buffered, whatever PYTHONUNBUFFERED says)
    sys.stdout.write("a line still in Python's buffer")  # the old way out flushed it first: blocked there
    shared_store().set("entered", repr(time.time()))
    distributed.exit_after_collective_failure(distributed.TrainCollectiveError("collective 'x' failed"), code=3)
    return "returned"


@pytest.mark.timeout(120)
def test_the_main_threads_way_out_ends_the_rank_with_full_pipes_after_the_watchdog_stopped():
    store = held_store()
    results = run_workers(_leaves_after_the_run_into_full_pipes, 1, timeout_s=40, exits=[0], store=store)
    ended = time.time()
    assert results == [ProcessExit(3)], results
    held = ended - float(store.get("entered").decode())
    assert held < FLUSH_WAIT_S + LINE_WAIT_S + END_SLACK_S, held


def _abort_hangs(rank, world_size, holding_the_gil):
    """The way out with torch's abort hanging past its own bound (``ABORT_WAIT_S`` made longer than the way out's),
    the abort's thread keeping the interpreter's lock or not."""
    import ctypes

    from train import distributed, watchdog

    distributed.ABORT_WAIT_S, distributed.EXIT_WAIT_S = 60.0, 1.0
    if holding_the_gil:
        watchdog.start(watchdog.Deadlines(T=T_S, group_timeout_s=T_S), rank, sidecar=True)
        distributed.abort_process_groups = lambda: ctypes.PyDLL(None).sleep(60)
    else:
        distributed.abort_process_groups = lambda: time.sleep(60)
    shared_store().set("entered", repr(time.time()))
    distributed.exit_after_collective_failure(RuntimeError("collective 'x' failed"), code=3)
    return "returned"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("holding_the_gil", [False, True], ids=["exit-timer", "sidecar"])
def test_a_way_out_whose_abort_hangs_ends_at_its_bound(holding_the_gil):
    """Released lock: the exit timer, armed before the abort, ends it at EXIT_WAIT_S (before, the way out waited the
    abort's own bound; the timer did not exist). Held lock: the timer cannot run; the sidecar ends it GRACE_S after
    the bound, with its own line."""
    store, stderr = held_store(), {}
    results = run_workers(_abort_hangs, 1, args=(holding_the_gil,), timeout_s=40, exits=[0], store=store,
                          stderr=stderr)  # fmt: skip
    ended = time.time()
    assert results == [ProcessExit(3)], (results, stderr)
    held = ended - float(store.get("entered").decode())
    bound = 1.0 + (GRACE_S + 2 * TICK_S if holding_the_gil else 0.0)
    assert bound <= held < bound + WAKE_SLACK_S + END_SLACK_S, held
    if holding_the_gil:
        last = stderr[0].strip().splitlines()[-1]
        assert last.startswith("error: host watchdog: rank 0 did not end within its way out's bound of 1s"), last
        assert "ended by its watchdog's sidecar process" in last, last


def _holds_the_gil_in_a_collective(rank, world_size):
    """A collective mark, then a call that keeps the interpreter's lock (a non-member's ncclCommSplit)."""
    import ctypes

    from train import distributed, watchdog

    distributed.set_deadline(T_S)
    watchdog.start(watchdog.Deadlines(T=T_S, group_timeout_s=T_S), rank, sidecar=True)
    watchdog.enter_collective("new_group calls: new_group 2")
    ctypes.PyDLL(None).sleep(60)
    return "lived on"


@pytest.mark.timeout(120)
def test_the_sidecar_ends_a_rank_whose_watchdog_thread_cannot_run():
    stderr = {}
    results = run_workers(_holds_the_gil_in_a_collective, 1, timeout_s=40, exits=[0], stderr=stderr)
    assert results == [ProcessExit(3)], (results, stderr)  # 3: SIGQUIT's handler is libc's _exit
    last = stderr[0].strip().splitlines()[-1]
    assert last.startswith("error: host watchdog: rank 0 held "), last
    assert "in collective 'new_group calls: new_group 2' at step 0" in last and "past its deadline of 0.5s" in last
    assert "its watchdog thread did not run" in last and "ended by its watchdog's sidecar process" in last, last
    held = float(re.search(r"held (\d+\.\d)s", last).group(1))
    assert 2 * T_S + GRACE_S <= held + 0.05 < 2 * T_S + GRACE_S + 2 * TICK_S + WAKE_SLACK_S, last
