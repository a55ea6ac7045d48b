"""A peer stalled in any phase of a training step, or of the start-up, under NCCL's contract with torch's watchdog
emulated (tests/nccl_emulation.py, ``contract="nccl"``): every survivor exits with status 3 and one line naming
the collective or phase, the step and the peer, and before the emulated watchdog fires (which would end it with
SIGABRT, exit status -6, at the group's timeout plus 4 x its dump wait).

Who ends it, and so the bound (T = T_S, the trainer's deadline):

- ``"poll"``: the trainer's polling (`train.distributed.bounded`, CERAR's rounds), T after the survivor's post:
  the line is the collective's own (``error: collective '...'``), within T + SLACK_S of the stall;
- ``"host"``: the host watchdog (train/watchdog.py), where the emulation holds the host inside the call with
  no work (a subgroup's split, the first connect of a peer pair or of a collective's kind and size, as NCCL
  does) or in a host read outside the polling (DDP's constructor): ``error: host watchdog: rank r held ...``,
  naming the collective or phase, at its deadline, 2T after the survivor entered it (`Deadlines`: the poll's T
  + T), within 2T + SLACK_S + PEERS_S of the stall (PEERS_S: the watchdog's bounded look-up of the peers that
  never joined, `train.watchdog._peers_within`);
- ``"any"``: either, rank by rank (a stall where some survivors wait on a work and others inside a connect);
- ``"sidecar"`` (the ranks in SIDECAR_ENDED): the host watchdog's sidecar process (train/watchdog_sidecar.py), where
  the survivor is not a member of the group being split: the emulation holds it in ``perform_nocolor_split`` with
  the interpreter's lock held, as torch's binding does, so its own watchdog thread cannot run; the sidecar's line,
  GRACE_S after the collective's deadline.

Each survivor's end is pinned to its deadline by the number its line gives (a stated slack, not the launch's time):
the poll's ``after X s`` (from the collective's entry) below T + POLL_SLACK_S, and at least T for the first survivor
to end (its exit closes its connections, which may end the other survivors' waits sooner), the watchdog's ``held X s``
within [deadline, deadline + WAKE_SLACK_S), the sidecar's within [deadline + GRACE_S, + 2 ticks + WAKE_SLACK_S).
POLL_SLACK_S: the post before the wait (the heartbeat's ``store.set``, the post), the waiting thread's wake-up and,
for a hook, its thread's hand-back to the main thread. WAKE_SLACK_S: the watchdog thread sleeps to the deadline of
the mark it saw, so its lateness is a sleeping thread's wake-up on a loaded host.

The stalled rank stops itself (SIGSTOP) as it enters the phase at step STALL_STEP (the ``start-`` cases: as it
enters the start-up phase, or makes its first point-to-point call or first large all-reduce); the groups' own
timeout is the trainer's NCCL one (`train.distributed.watchdog_timeout_s`, 3T). Without the trainer's bounded
waits (the non-finite flag and train loss read on the host, the evaluation reductions, the object gathers) the
survivors block in the emulated host read until the watchdog's SIGABRT; without the host watchdog, the start-up
cases hang to the launch's limit (a hold inside a call has no work for any watchdog to time) or end in the
emulated watchdog's SIGABRT (DDP's constructor, which reads its all-gather on the host).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.distributed import ProcessExit, held_store, run_workers, shared_store
from tests.nccl_emulation import DUMP_WAIT_VARIABLE, LARGE_BYTES, WATCHDOG_KEY
from train.distributed import watchdog_timeout_s

T_S = 3.0  # trainer.collective_timeout_s: the trainer's deadline
WATCHDOG_S = watchdog_timeout_s(T_S)  # the NCCL groups' own timeout (torch's watchdog): 3T
HOST_S = 2 * T_S  # the host watchdog's deadline for a collective (train.watchdog.Deadlines.collective): T + T
PHASE_S = 4 * T_S  # its deadline between collectives (Deadlines.step_s)
SLACK_S = 6.0  # the rest of a step before the survivors reach the stuck collective, and the abort, on a loaded host
PEERS_S = 5.0  # the host watchdog's look-up of the missing peers, at most (train.watchdog._peers_within)
POLL_SLACK_S = 2.0  # the poll's line: its ``after`` past T (module docstring)
WAKE_SLACK_S = 1.0  # the watchdog's (and the sidecar's) line: its ``held`` past the deadline (module docstring)
GRACE_S, TICK_S = 1.0, 0.1  # the sidecar acts 1 s after a deadline, on two reads 0.1 s apart (docs/failures.md)
LAUNCH_S = {"poll": 240, "host": 240}  # each launch's limit, its start-up included (over 200 s at a load of 30)
STALL_STEP = 2
AT_ONCE = 3
"""Launches at a time while the cores are busy. Each mostly waits out a deadline (about 2 s of the cores' time in 6-10
s). Alone on an idle 2-core machine the 27 took 56 s three at a time, 40 s six at a time, 37 s nine (2026-12-04); but
in the suite, beside the other workers' modules, six at a time once took 196 s (each launch 31-54 s) and slowed the
modules beside it two- to threefold: the suite took 8 min 53 s against 6 min 26 s. Three is the measured safe number
beside other work; up to MOST_AT_ONCE while the cores are otherwise idle (`_admit`)."""
MOST_AT_ONCE = 6
IDLE_CORES = 1.0  # a launch beyond AT_ONCE starts only while at least this many cores' worth of time was idle


def _idle_cores(window_s: float = 1.0) -> float:
    """The cores' idle time over the next ``window_s`` seconds, in cores (Linux's /proc/stat); 0 where it cannot be
    read (no launch beyond AT_ONCE then)."""

    def idle_and_time() -> tuple[float, float]:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        return fields[3] + fields[4], time.monotonic()  # idle + iowait, in clock ticks

    try:
        (idle0, t0), _ = idle_and_time(), time.sleep(window_s)
        idle1, t1 = idle_and_time()
    except (OSError, ValueError, IndexError):
        return 0.0
    return (idle1 - idle0) / os.sysconf("SC_CLK_TCK") / (t1 - t0)


class _Admission:
    """Who may launch now: AT_ONCE launches at any time, up to MOST_AT_ONCE while the cores are otherwise idle (the
    module's end of the suite, once the other workers are done); a thread that may not waits and looks again."""

    def __init__(self):
        self.lock, self.running = threading.Lock(), 0

    @contextlib.contextmanager
    def slot(self):
        while True:
            with self.lock:
                if self.running < AT_ONCE:
                    self.running += 1
                    break
            if self.running < MOST_AT_ONCE and _idle_cores() >= IDLE_CORES:
                with self.lock:
                    if self.running < MOST_AT_ONCE:
                        self.running += 1
                        break
            time.sleep(0.5)
        try:
            yield
        finally:
            with self.lock:
                self.running -= 1


JOB = [
    "model=tiny",
    "data.seq_len=32",
    "trainer.micro_batch_size=4",
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "trainer.eval_every=2",
    "trainer.eval_batches=2",
    "trainer.drift_every=0",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
    "checkpoint.every=2",
    f"trainer.collective_timeout_s={T_S}",
]
FLAT = ["aggregator=cerar", "c=auto", f"aggregator.auto_warmup_steps={STALL_STEP}", "aggregator.auto_check_every=1"]
AUTO = [
    "aggregator=auto",
    f"aggregator.auto_warmup_steps={STALL_STEP}",
    "aggregator.auto_check_every=1",
    "aggregator.auto_aggregators=[ring16]",
    "aggregator.auto_links.intra_alpha_s=0.001",
    "aggregator.auto_links.intra_gbit_s=10",
    "aggregator.auto_links.memory_gbyte_s=10",
]  # declared: no probe
HIER = ["aggregator=hier_cerar", "aggregator.local_size=2", "c=4", "aggregator.coded_on_two_nodes=true"]

# phase the stalled rank stops in -> the collective (or start-up phase) every survivor reports, who ends the stall
CASES = {
    "flat-data": (2, FLAT, "data", "non-finite flag all_reduce"),
    "flat-forward": (2, FLAT, "forward", "non-finite flag all_reduce"),
    "flat-backward": (2, FLAT, "backward", "non-finite flag all_reduce"),
    "flat-auto_c": (3, FLAT, "auto_c", "exact all_reduce (g_bar)"),  # N = 2 has no inexact code to measure
    "flat-aggregate": (2, FLAT, "aggregate", "aggregate (cerar"),
    "nccl-aggregate": (2, ["aggregator=nccl"], "aggregate", "aggregate (nccl)"),  # torch's all-reduce, polled
    "int8-aggregate": (2, ["aggregator=int8"], "aggregate", "aggregate (int8)"),  # the 8-bit all-reduce's rounds
    "flat-auto": (2, AUTO, "auto", "exact all_reduce (g_bar)"),  # aggregator=auto's check
    # the next collective after the optimizer: step 2 evaluates (its log line waits for none: the train loss came
    # with the step's non-finite flag)
    "flat-optimizer": (2, FLAT, "optimizer", "evaluation all_reduce"),
    # a fixed code: the ranks' parameters differ from step 1, so each evaluates the whole set (c=auto's may still
    # agree at step 2, and split the set with one all_reduce)
    "flat-eval": (2, ["aggregator=cerar", "c=4"], "eval", "all_gather_object of the validation shares"),
    "flat-checkpoint": (2, FLAT, "checkpoint", "checkpoint all_gather_object"),
    # the reference replica (rank N-1 = 1) stops before it broadcasts its parameters
    "flat-drift": (2, [*FLAT, "trainer.drift_every=2"], "drift", "drift broadcast from rank 1"),
    "flat-resync": (2, [*FLAT, "trainer.resync_every=2"], "resync", "resync broadcast from rank 1"),
    # rank 0 stops as it reaches the checkpoint barrier while rank 1 writes: the writer waits at most T, not the
    # write's timeout (checkpoint.write_timeout_s, 30 min), for a rank that should already be there
    "flat-checkpoint-barrier": (2, FLAT, "checkpoint barrier", "checkpoint barrier"),
    # overlap: DDP's one-off bucket rebuild is done after step 1's bounded flag, so a peer stalled in step 2's data
    # meets CERAR's hook in backward, not the rebuild's host-blocking broadcast in forward (DDP's own place for it)
    "overlap-data": (2, ["aggregator=cerar", "c=4", "trainer.overlap=true"], "data", "backward with"),
    "overlap-backward": (2, ["aggregator=cerar", "c=4", "trainer.overlap=true"], "backward", "backward with"),
    # overlap with DDP's own all-reduce: its buckets' futures come back complete (NCCL's contract), so the first host
    # wait of the step is the bounded flag, on the buckets' own communicator
    "overlap-nccl-data": (2, ["aggregator=nccl", "trainer.overlap=true"], "data", "non-finite flag all_reduce"),
    "overlap-nccl-backward": (2, ["aggregator=nccl", "trainer.overlap=true"], "backward", "non-finite flag all_reduce"),
    # the 16-bit hook (cerar.ddp.cast16_hook) agrees on its per-tensor scales on its own thread, within the deadline,
    # as CERAR's hook runs its rounds: the stall ends there, surfaced from backward
    "overlap-fp16-backward": (2, ["aggregator=fp16", "trainer.overlap=true"], "backward", "backward with"),
    "hier-backward": (4, HIER, "backward", "non-finite flag all_reduce"),
    "hier-aggregate": (4, HIER, "aggregate", "aggregate (hier_cerar"),
    # start-up: the peer stops before the subgroups' new_group (ncclCommSplit over every rank), before DDP's
    # constructor (its shape all-gather, read on the host), before its first point-to-point call (CERAR's first
    # round: its peers' first connect to it) or before the first large all-reduce (nccl's first aggregation: a
    # new algorithm's channels connected inside the call)
    "start-subgroups": (2, FLAT, "start-up: subgroups", "new_group calls"),
    "start-ddp": (2, ["aggregator=nccl"], "start-up: DDP", "DDP constructor"),
    # overlap: the peer stops before DDP's bucket order pass (Trainer.settle_ddp_buckets), whose backward makes the
    # run's first large all-reduce (DDP's own, connected inside the call)
    "start-ddp-buckets": (
        2, ["aggregator=nccl", "trainer.overlap=true"], "start-up: DDP buckets", "DDP's bucket order pass"
    ),
    "start-first-p2p": (2, FLAT, "first point-to-point", "aggregate (cerar"),
    "start-first-large": (2, ["aggregator=nccl"], "first large all_reduce", "aggregate (nccl)"),
    "start-hier-subgroups": (4, HIER, "start-up: subgroups", "new_group calls"),
    "start-hier-first-p2p": (4, HIER, "first point-to-point", "aggregate (hier_cerar"),
    # the hook's own tier groups (trainer.overlap=true: HierarchicalHookState makes them in register_hook): the peer
    # stops before the second, the node group {0, 1}. Rank 0, a member, is held in its split and ended by its
    # watchdog under that split's own 2T (not DDP's phase, 4T), naming the peer; ranks 2 and 3 are not members:
    # held with the interpreter's lock (perform_nocolor_split), they are ended by their sidecars
    "start-hier-hook-split": (
        4, [*HIER, "trainer.overlap=true"], "hook's new_group 2", "new_group calls (the DDP hook's groups): new_group 2"
    ),
}
VICTIM = 1  # the stalled rank, unless a case names another (VICTIMS)
VICTIMS = {"flat-checkpoint-barrier": 0}
# who ends the stall (module docstring), and the phase the host watchdog's line names; "poll" unless named. c=auto's
# first check (g_bar) is the run's first large all-reduce (CERAR aggregated the warm-up steps by point-to-point):
# it connects inside the call, so that case ends by the host watchdog too (aggregator=auto's check does not: its
# warm-up aggregated by torch's all-reduce). A hierarchical start stalled before the subgroups is ended by the
# layout's own agreement check on the default group, polled, before any split.
ENDED_BY = {
    "start-hier-hook-split": "host",
    "flat-auto_c": "host",
    "start-subgroups": "host",
    "start-ddp": "host",
    "start-ddp-buckets": "host",
    "start-first-p2p": "host",
    "start-first-large": "host",
    "start-hier-first-p2p": "host",
}
HOST_PHASE = {"start-subgroups": "start-up: subgroups", "start-ddp": "start-up: DDP"}  # else the victim's phase
HOST_PHASE.update({case: "aggregate" for case in ("start-first-p2p", "start-first-large", "start-hier-first-p2p")})
HOST_PHASE["start-hier-hook-split"] = "start-up: DDP hook"
SIDECAR_ENDED = {"start-hier-hook-split": [2, 3]}  # survivors held with the interpreter's lock: the sidecar's line
NEVER_JOINED = {"start-hier-hook-split"}  # a split's own heartbeat: the line names the peer, not "no peer was behind"


def victim_of(case: str) -> int:
    return VICTIMS.get(case, VICTIM)


def _stop_on_entering(phase: str) -> None:
    """SIGSTOP this process as it enters ``phase`` at step STALL_STEP or later: a phase of the step timer
    (data, forward, backward, auto_c, auto, aggregate, optimizer), the evaluation, the checkpoint or its barrier,
    the replicas' drift measurement or the resync; or at once as it enters a start-up phase (train/run.py's
    ``set_phase``), or makes its first point-to-point call or first large all-reduce."""
    from train import distributed, loop

    def stop(at_once: bool = False) -> None:
        if at_once or distributed._progress["step"] >= STALL_STEP:
            shared_store().set("stalled_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)

    if phase == "hook's new_group 2":  # before the hook's second split: before the heartbeat the trainer gives it,
        import torch.distributed as dist  # or before the call itself (a trainer that gives it none)

        from cerar.hierarchical.hook import HierarchicalHookState

        beat, new_group, make_groups = distributed._beat, dist.new_group, HierarchicalHookState._make_groups
        hook = {"making": False, "splits": 0}

        def stopping_beat(operation):
            if operation.endswith("(the DDP hook's groups): new_group 2"):
                stop(at_once=True)
            beat(operation)

        def stopping_new_group(*args, **kwargs):
            if hook["making"]:
                hook["splits"] += 1
                if hook["splits"] == 2:
                    stop(at_once=True)
            return new_group(*args, **kwargs)

        def marking_make_groups(self):
            hook["making"] = True
            try:
                return make_groups(self)
            finally:
                hook["making"] = False

        distributed._beat, dist.new_group = stopping_beat, stopping_new_group
        HierarchicalHookState._make_groups = marking_make_groups
        return
    if phase.startswith("start-up: "):  # as train/run.py enters it
        from train import run

        set_phase = run.set_phase

        def stopping_set_phase(name):
            if name == phase:
                stop(at_once=True)
            set_phase(name)

        run.set_phase = stopping_set_phase
        return
    if phase == "first point-to-point":  # before its first connect to a peer, made where the host posts
        from tests import nccl_emulation

        connect = nccl_emulation._connect_peers

        def stopping_connect(group, peers):
            stop(at_once=True)
            return connect(group, peers)

        nccl_emulation._connect_peers = stopping_connect
        return
    if phase == "first large all_reduce":
        import torch.distributed as dist

        all_reduce = dist.all_reduce

        def stopping_all_reduce(tensor, *args, **kwargs):
            if tensor.numel() * tensor.element_size() >= LARGE_BYTES:
                stop(at_once=True)
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = stopping_all_reduce
        return

    if phase == "checkpoint barrier":  # after the checkpoint's gather, as it reaches the barrier
        bounded = loop.bounded

        def stopping_bounded(operation, *args, **kwargs):
            if operation.startswith(phase):
                stop()
            return bounded(operation, *args, **kwargs)

        loop.bounded = stopping_bounded
        return
    methods = {
        "eval": "evaluate",
        "checkpoint": "save_checkpoint",
        "drift": "replica_drift",
        "resync": "resync_from_exact_rank",
    }
    if phase in methods:
        name = methods[phase]
        method = getattr(loop.Trainer, name)

        def stopping(self, *args, **kwargs):
            stop()
            return method(self, *args, **kwargs)

        setattr(loop.Trainer, name, stopping)
        return
    timed = loop.PhaseTimer.phase

    @contextlib.contextmanager
    def phase_then_stop(self, name):
        if name == phase:
            stop()
        with timed(self, name):
            yield

    loop.PhaseTimer.phase = phase_then_stop


def _stalled_training(rank, world_size, phase, overrides, cache, run_dir, victim):
    """The trainer in this process, as train/main.py runs it (a collective failure: abort, one line, exit 3);
    rank ``victim`` stops itself on entering ``phase`` at step STALL_STEP."""
    from tests.runs import composed
    from train import distributed
    from train.main import is_collective_failure
    from train.run import run

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    if rank == victim:
        _stop_on_entering(phase)
    exit_after_collective_failure = distributed.exit_after_collective_failure

    def recording_exit(error, code=3):  # the one line it prints, kept for the test (the host watchdog calls it too)
        shared_store().set(f"line/{rank}", "error: " + " ".join(str(error).split()))
        exit_after_collective_failure(error, code)

    distributed.exit_after_collective_failure = recording_exit
    try:
        run(composed(*JOB, *overrides, f"data.cache_dir={cache}"), Path(run_dir))
    except RuntimeError as err:
        if is_collective_failure(err):
            distributed.exit_after_collective_failure(err, code=3)
        raise
    return "finished without a failure"


def _launch(case, cache, tmp, attempts: int = 3, record: dict | None = None):
    """One case's launch. At T = 3 s, a rank that a loaded machine holds 2T behind its peer before the stall is
    ended at start-up by the peer's deadline, as the trainer promises: not this case (the victim never reached its
    phase), so such a launch is started again, at most ``attempts`` launches; the last one's outcome is returned.
    ``record[case]`` gets each launch's seconds (the suite's time on a loaded machine hangs on them)."""
    seconds = []
    for attempt in range(attempts):
        start = time.monotonic()
        outcome = _launch_once(case, cache, tmp / f"{case}-{attempt}")
        seconds.append(time.monotonic() - start)
        _, stalled, _, _, lines = outcome
        if stalled is not None or not any("(phase: start-up" in line for line in lines.values()):
            break
    if record is not None:
        record[case] = seconds
    return outcome


def _launch_once(case, cache, run_dir):
    world, overrides, phase = CASES[case][:3]
    victim = victim_of(case)
    store, stderr = held_store(), {}
    survivors = [r for r in range(world) if r != victim]
    try:
        results = run_workers(
            _stalled_training,
            world,
            args=(phase, overrides, str(cache), str(run_dir), victim),
            timeout_s=LAUNCH_S["poll" if ENDED_BY.get(case, "poll") == "poll" else "host"],
            group_timeout_s=WATCHDOG_S,
            expect=[],
            exits=survivors,
            contract="nccl",
            store=store,
            stderr=stderr,
        )
    except Exception as error:  # a launch that hangs to its limit, or a worker's error: this case's failure
        results = f"{type(error).__name__}: {str(error)[-2000:]}"
    ended = time.time()
    stalled = float(store.get("stalled_at").decode()) if store.check(["stalled_at"]) else None
    lines = {r: store.get(f"line/{r}").decode() for r in range(world) if store.check([f"line/{r}"])}
    for r in set(survivors) - set(lines):  # ended by its sidecar: the line is on its stderr only
        said = [line for line in stderr.get(r, "").splitlines() if line.startswith("error: ")]
        if said:
            lines[r] = said[-1]
    fired = {r: store.get(f"{WATCHDOG_KEY}{r}").decode() for r in survivors if store.check([f"{WATCHDOG_KEY}{r}"])}
    return results, stalled, ended, fired, lines


@pytest.fixture(scope="module")
def stalls(tmp_path_factory, cache_dir):
    """Every case, ``AT_ONCE`` to ``MOST_AT_ONCE`` launches at a time (`_Admission`; a launch mostly waits out the
    deadline): each one's results, the times of the stall and of the survivors' exits, the watchdog's records and the
    survivors' lines."""
    tmp = tmp_path_factory.mktemp("stalls")
    mp = pytest.MonkeyPatch()
    mp.setenv(DUMP_WAIT_VARIABLE, "500")  # the emulated watchdog's dump wait (x 4): short, so a failing run ends soon
    mp.setenv("OMP_NUM_THREADS", "1")
    launches: dict = {}
    try:
        admission = _Admission()

        def launch(case):
            with admission.slot():
                return _launch(case, cache_dir, tmp, record=launches)

        with ThreadPoolExecutor(max_workers=MOST_AT_ONCE) as pool:
            outcomes = dict(zip(CASES, pool.map(launch, CASES), strict=True))
    finally:
        mp.undo()
    slow = {case: s for case, s in launches.items() if len(s) > 1 or s[0] > 30}
    if slow:  # not a failure: what a loaded machine cost, named in the warnings summary
        warnings.warn(
            "stall cases launched again or slow (seconds per launch): "
            + "; ".join(f"{case} {', '.join(f'{x:.0f}' for x in s)}" for case, s in slow.items()),
            stacklevel=1,
        )
    return outcomes


@pytest.mark.slow
@pytest.mark.timeout(900)  # the module fixture: 29 launches, AT_ONCE or more at a time; 415 s at a load average of 26
@pytest.mark.parametrize("case", list(CASES))
def test_a_peer_stalled_in_any_phase_ends_every_survivor_with_exit_3_before_the_watchdog(stalls, case):
    world, _, phase, operation = CASES[case]
    victim, ender = victim_of(case), ENDED_BY.get(case, "poll")
    results, stalled, ended, fired, lines = stalls[case]
    survivors = [r for r in range(world) if r != victim]
    assert not isinstance(results, str), results  # the launch itself failed: hung to its limit, or an error
    assert stalled is not None, (f"rank {victim} never entered phase {phase!r}", results, lines)
    assert not fired, f"the emulated watchdog fired first: {fired}"
    assert [results[r] for r in survivors] == [ProcessExit(3)] * len(survivors), results
    in_phase = any(" in phase '" in line for line in lines.values())  # held between collectives: the phase's 4T
    by_sidecar = SIDECAR_ENDED.get(case, [])
    bound = T_S + SLACK_S if ender == "poll" else (PHASE_S if in_phase else HOST_S) + SLACK_S + PEERS_S
    bound += GRACE_S + 2 * TICK_S if by_sidecar else 0.0
    assert ended - stalled < bound, (ended - stalled, bound, lines)
    waited = []  # the polls' waits: the first survivor to end waited its whole T; its exit may end the others sooner
    for r in survivors:
        line = lines[r]
        by_host = line.startswith(f"error: host watchdog: rank {r} held ")
        assert by_host == (ender == "host") or ender == "any", (ender, line)
        assert ("ended by its watchdog's sidecar process" in line) == (r in by_sidecar), line
        if by_host:  # the collective it was held in (or, between collectives, its phase) and past which deadline
            where = HOST_PHASE.get(case, phase)
            deadline = HOST_S if f"collective '{operation}" in line else PHASE_S
            assert f"past its deadline of {deadline:g}s" in line, line
            assert f"collective '{operation}" in line or f"in phase '{where}'" in line, line
            assert f"(phase: {where})" in line, line
            held, late = float(re.search(r" held (\d+\.\d)s ", line).group(1)), 0.0
            if r in by_sidecar:  # its own watchdog could not run: the sidecar, GRACE_S (and its two reads) later
                held, late = held - GRACE_S, 2 * TICK_S
            assert deadline - 0.05 <= held < deadline + late + WAKE_SLACK_S, (held, deadline, line)
            peers = line.split("past its deadline", 1)[1]
        else:
            assert line.startswith(f"error: collective '{operation}") and f"failed on rank {r} " in line, line
            after = float(re.search(rf"failed on rank {r} after (\d+\.\d)s", line).group(1))
            assert after < T_S + POLL_SLACK_S, (after, line)
            waited.append(after)
            peers = line.split("failed on rank", 1)[1]
        if r not in by_sidecar:  # the sidecar cannot ask the store which peer never came
            assert re.search(rf"\branks? (\d+, )*{victim}\b", peers), line  # the peer
            if case in NEVER_JOINED:  # the peer stopped before this collective: named as never having joined it
                assert f"peer(s) that never joined: rank {victim} " in line, line
        assert "(phase: " in line, line
    assert not waited or max(waited) >= T_S - 0.05, (waited, lines)
