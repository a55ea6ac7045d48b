"""The host watchdog (train/watchdog.py) on real gloo processes: it leaves a slow but live rank alone (every phase
under its deadline, however long the phases take together; a collective under its own, longer poll) and ends a rank
that overstays one mark (a phase between collectives, a collective) with exit status 3 and one line naming the rank,
the mark and how long, at the mark's deadline and not later than WAKE_SLACK_S after it. Each deadline is the one
docs/failures.md states (a table of them, checked value by value). The sweep's process group (train/sweep.py) is
started and torn down under it, with the phases' deadlines. The stall cases (tests/test_stall_phases.py) hold it to
NCCL's places where the host is held inside a call; this holds it to its own contract, in seconds.

Slack, stated: the thread sleeps until the deadline of the mark it saw (a newer, shorter mark is seen within the
shortest deadline in use), so it fires at the deadline plus a sleeping thread's wake-up on a loaded host: the line's
``held`` is within WAKE_SLACK_S of the deadline. The rank's exit follows within the way out's bounds (EXIT_SLACK_S:
the peers' look-up in a live store, the abort, the line, the parent's join).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from tests.distributed import ProcessExit, held_store, run_workers, shared_store
from train import watchdog
from train.distributed import ABORT_WAIT_S

T_S = 0.5  # the deadline the worker gives the trainer: a phase's is 4T = 2 s, a collective's its poll's + T
STEPS, STEP_S = 8, 1.0  # 8 s of phases, each 1 s: under the 2 s deadline every time
SLOW_POLL_S, SLOW_COLLECTIVE_S = 2.0, 1.5  # a collective polled up to 2 s (deadline 2.5 s) that takes 1.5 s
WAKE_SLACK_S = 1.0  # the thread's lateness past a deadline: a sleeping thread's wake-up on a loaded host
EXIT_SLACK_S = 8.0  # from the deadline to the recorded line: wake-up, the peers' look-up (at most 5 s), the store


@pytest.mark.quick
def test_every_mark_has_the_deadline_the_failures_doc_states():
    """docs/failures.md's table, T = 3 s: a collective its poll's timeout + T; a phase of a step or of the start-up
    between collectives 4T; eval 4T per micro-batch; a checkpoint and reading one write_timeout + T; the process
    group its own timeout + T; the teardown T; the way out ABORT_WAIT_S + 10 s (the exit timer's); not watched:
    the fused kernels, the model."""
    T = 3.0
    d = watchdog.Deadlines(T=T, group_timeout_s=9.0, write_timeout_s=30.0, eval_micro_batches=4)
    assert d.collective() == 6.0 and d.collective(10.0) == 13.0 and d.collective_s == 6.0
    for phase in ("forward", "aggregate", "after backward", "start-up", "start-up: subgroups", "start-up: DDP"):
        assert d.phase(phase) == 12.0, phase
    assert d.phase("eval") == 48.0
    assert d.phase("checkpoint") == 33.0 and d.phase("start-up: reading the checkpoint") == 33.0
    assert d.phase("start-up: process group") == 12.0
    assert d.phase(watchdog.DESTROY) == 3.0 and watchdog.DESTROY == "exit: destroy_process_group"
    for unwatched in ("start-up: fused kernels", "start-up: model"):  # (data and the logger: issue 51's items 2, 3)
        assert d.phase(unwatched) is None, unwatched
    assert d.exit_s == ABORT_WAIT_S + 10.0 == 20.0
    assert d.poll_s == 3.0  # the shortest deadline in use: the teardown's


def _watched(rank, world_size, overstay):
    from train import distributed

    recorded = distributed.exit_after_collective_failure

    def recording_exit(error, code=3):
        shared_store().set(f"line/{rank}", f"{time.time()!r} " + " ".join(str(error).split()))
        recorded(error, code)

    distributed.exit_after_collective_failure = recording_exit
    distributed.set_deadline(T_S)
    watchdog.start(watchdog.Deadlines(T=T_S, group_timeout_s=T_S), rank)
    for _ in range(STEPS):
        distributed.set_phase("forward")
        time.sleep(STEP_S)
    with distributed.guarded("a slow collective", SLOW_POLL_S):
        time.sleep(SLOW_COLLECTIVE_S)
    if overstay and rank == 1:  # between collectives: the phase's 4T
        distributed.set_phase("optimizer")
        shared_store().set(f"overstaying/{rank}", repr(time.time()))
        time.sleep(30)
    if overstay and rank == 0:  # inside a collective that never returns: its poll's T + T
        with distributed.guarded("a stuck collective"):
            shared_store().set(f"overstaying/{rank}", repr(time.time()))
            time.sleep(30)
    watchdog.stop()
    return "lived"


@pytest.mark.timeout(120)
def test_the_host_watchdog_leaves_a_slow_live_rank_alone_and_ends_one_that_overstays_a_mark():
    assert run_workers(_watched, 2, args=(False,), timeout_s=60) == ["lived", "lived"]
    store = held_store()
    results = run_workers(_watched, 2, args=(True,), timeout_s=60, exits=[0, 1], store=store)
    assert results == [ProcessExit(3), ProcessExit(3)], results
    for rank, what, deadline in ((0, "collective 'a stuck collective'", 2 * T_S), (1, "phase 'optimizer'", 4 * T_S)):
        said, line = store.get(f"line/{rank}").decode().split(" ", 1)
        assert line.startswith(f"host watchdog: rank {rank} held ") and f"in {what}" in line, line
        assert f"past its deadline of {deadline:g}s" in line, line
        held = float(re.search(r"held (\d+\.\d)s", line).group(1))
        assert deadline - 0.05 <= held < deadline + WAKE_SLACK_S, (held, line)
        recorded = float(said) - float(store.get(f"overstaying/{rank}").decode())
        assert deadline <= recorded < deadline + EXIT_SLACK_S, recorded


# ------------------------------------------------------------------ the sweep's process group, started and torn down

SWEEP_T_S = 1.0
SWEEP_JOB = [
    "model=tiny",
    "data.seq_len=32",
    "trainer.micro_batch_size=4",
    "trainer.max_steps=1",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
    f"trainer.collective_timeout_s={SWEEP_T_S}",
]


def _sweep_stalled_in(call, out, cache, environ, err_path, stalled_path):
    """train/sweep.py's main with ``torch.distributed.<call>`` held past any deadline (a hang inside it, as NCCL's
    eager connect or its flush can hang), in a plain single process. ``resume=true`` on an empty folder stops the
    run with a one-line refusal once the group exists, so the teardown comes soon."""
    import torch.distributed as dist

    from tests.distributed import _redirect_output, _take_environment

    _take_environment(environ)
    _redirect_output(os.devnull, err_path)
    original = getattr(dist, call)

    def stalled(*args, **kwargs):
        Path(stalled_path).write_text(repr(time.time()))
        time.sleep(60)
        return original(*args, **kwargs)

    setattr(dist, call, stalled)
    from train import sweep

    sweep.main([out, "one: aggregator=ring resume=true", "--", *SWEEP_JOB, f"data.cache_dir={cache}"])


SWEEP_STALLS = {  # the call held, the phase the line names, its deadline (gloo: the group's timeout is T)
    "start": ("init_process_group", "start-up: process group", 2 * SWEEP_T_S),
    "teardown": ("destroy_process_group", watchdog.DESTROY, SWEEP_T_S),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("call", "phase", "deadline"), list(SWEEP_STALLS.values()), ids=list(SWEEP_STALLS))
def test_the_sweeps_process_group_is_started_and_torn_down_under_the_host_watchdog(
    tmp_path, cache_dir, call, phase, deadline
):
    """A hang inside the sweep's start of the process group (its deadline: the group's timeout + T, gloo's T here)
    or inside its teardown (T) ends the process with exit 3 and the watchdog's line naming the phase, at the
    deadline (before, neither was watched: the sweep hung)."""
    from tests.distributed import start_forkserver

    err, stalled = tmp_path / "stderr", tmp_path / "stalled"
    args = (str(tmp_path / "out"), str(cache_dir), dict(os.environ), str(err), str(stalled))
    process = start_forkserver().Process(target=_sweep_stalled_in, args=(call, *args))
    process.start()
    process.join(120)
    ended = time.time()
    if process.is_alive():
        process.kill()
        process.join(5)
        pytest.fail(f"the sweep hung in {call}: {err.read_text()[-2000:] if err.exists() else ''}")
    assert isinstance(process.exitcode, int) and process.exitcode == 3, (process.exitcode, err.read_text()[-3000:])
    line = err.read_text().strip().splitlines()[-1]
    assert line.startswith("error: host watchdog: rank 0 held ") and f"in phase '{phase}'" in line, line
    assert f"past its deadline of {deadline:g}s" in line, line
    held = float(re.search(r"held (\d+\.\d)s", line).group(1))
    assert deadline - 0.05 <= held < deadline + WAKE_SLACK_S, (held, line)
    assert ended - float(stalled.read_text()) < deadline + EXIT_SLACK_S
