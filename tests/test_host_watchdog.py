"""The host watchdog (train/watchdog.py) on two real gloo processes: it leaves a slow but live rank alone (every
phase under its deadline, however long the phases take together; a collective under its own, longer poll) and ends
a rank that overstays one phase with exit status 3 and one line naming the rank, the phase and how long, within
the phase's deadline plus the exit's slack. The stall cases (tests/test_stall_phases.py) hold it to NCCL's places
where the host is held inside a call; this holds it to its own contract, in seconds."""

from __future__ import annotations

import time

import pytest

from tests.distributed import ProcessExit, held_store, run_workers, shared_store

T_S = 0.5  # the deadline the worker gives the trainer: a phase's is 4T = 2 s, a collective's its poll's + T
STEPS, STEP_S = 8, 1.0  # 8 s of phases, each 1 s: under the 2 s deadline every time
SLOW_POLL_S, SLOW_COLLECTIVE_S = 2.0, 1.5  # a collective polled up to 2 s (deadline 2.5 s) that takes 1.5 s
EXIT_SLACK_S = 8.0  # the watchdog's sleep granularity, its peers lookup (at most 5 s) and a loaded host


def _watched(rank, world_size, overstay):
    from train import distributed, watchdog

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
    if overstay and rank == 1:
        distributed.set_phase("optimizer")
        shared_store().set("overstaying", repr(time.time()))
        time.sleep(30)
    watchdog.stop()
    return "lived"


@pytest.mark.timeout(120)
def test_the_host_watchdog_leaves_a_slow_live_rank_alone_and_ends_one_that_overstays_a_phase():
    assert run_workers(_watched, 2, args=(False,), timeout_s=60) == ["lived", "lived"]
    store = held_store()
    results = run_workers(_watched, 2, args=(True,), timeout_s=60, exits=[1], store=store)
    assert results == ["lived", ProcessExit(3)], results
    said, line = store.get("line/1").decode().split(" ", 1)
    held = float(said) - float(store.get("overstaying").decode())
    assert line.startswith("host watchdog: rank 1 held ") and "in phase 'optimizer'" in line, line
    assert "past its deadline of 2s" in line, line
    assert 4 * T_S <= held < 4 * T_S + EXIT_SLACK_S, held
