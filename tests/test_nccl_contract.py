"""NCCL's point-to-point contract, emulated on gloo; CERAR held to it; the trainer's NCCL failure path.

The emulation (``tests.nccl_emulation``, ``contract="nccl"``) is what lets the protocol and hook tests
catch NCCL-only defects on a CPU machine, so it is held here to the contract it claims to keep (as
torch's ``ProcessGroupNCCL.cpp`` implements it): one work for a batch; ``wait()`` without a timeout
orders what follows after the transfer and bounds nothing; ``wait(timeout)`` blocks and, on expiry,
leaves the group aborted; the first batch on a group involves all of its ranks. Then CERAR under
it: no ``wait(timeout)``, one completion poll per look-behind window instead of one per round, and
every survivor of a stalled peer raises within the timeout plus a stated slack. Then the trainer's
way out: abort the groups with torch's abort, one line, exit status 3.
"""

import os
import signal
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cerar
from cerar.ring.precision import rounding_bound
from cerar.ring.rounds import pipeline_chunks
from cerar.ring.transport import LOOK_BEHIND_POSTS
from tests.distributed import ProcessExit, WorkerError, run_workers, shared_store, stop_one_rank
from tests.nccl_emulation import ABORTED_KEY, transport_log
from tests.spec_reference import spec_all_reduce
from tests.test_spec_reference import spec_code_matrices
from train.config import ConfigError
from train.distributed import NCCL_BLOCKING_WAIT_VARIABLES, NCCL_ERROR_HANDLING_VARIABLE, configure_nccl_watchdog

STALL_SLACK_S = 3.0
"""What a survivor may take beyond the timeout to raise: the rounds it completes before it reaches
the stalled peer, enqueueing up to 2 x LOOK_BEHIND_POSTS posts, the poll's last pause (under a
millisecond), building the message, and a loaded 2-core CI machine's scheduling (seconds)."""


def _exchange(peer, value):
    send, recv = torch.full((4,), float(value)), torch.zeros(4)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
    return works, recv


# --- the emulation keeps NCCL's contract -------------------------------------------------------------


def _ordering_wait_worker(rank, N):
    """Rank 1 posts its batch only once rank 0 has posted and seen its batch incomplete, so rank
    0's wait() demonstrably waits for the data (there is no other way it could see it)."""
    store, peer = shared_store(), 1 - rank
    first, _ = _exchange(peer, 0)  # the group's first batch, which every rank joins
    for work in first:
        work.wait()
    if rank == 1:
        store.wait(["rank0-posted"], timedelta(seconds=30))
        works, recv = _exchange(peer, 2)
        works[0].wait()
        return len(works), recv[0].item()
    works, recv = _exchange(peer, 1)
    incomplete_before = not works[0].is_completed()
    store.set("rank0-posted", "1")
    works[0].wait()  # no timeout: orders what follows after the transfer, on the CPU by blocking
    return len(works), incomplete_before, works[0].is_completed(), recv[0].item(), transport_log()


def test_under_nccls_contract_a_batch_is_one_work_whose_untimed_wait_orders_what_follows():
    (works, incomplete_before, completed, received, log), (peer_works, peer_received) = run_workers(
        _ordering_wait_worker, 2, contract="nccl"
    )
    assert works == peer_works == 1  # one work for the send and the receive
    assert incomplete_before and completed and received == 2.0 and peer_received == 1.0
    assert log["waits"] == 2 and log["waits_with_timeout"] == 0


def _timed_wait_worker(rank, N, wait_s):
    """Rank 1 joins the second batch only after rank 0's wait(timeout) has given up."""
    store, peer = shared_store(), 1 - rank
    first, _ = _exchange(peer, 0)
    for work in first:
        work.wait()
    if rank == 1:
        store.wait(["rank0-gave-up"], timedelta(seconds=60))
        return "late"
    works, _ = _exchange(peer, 1)
    start = time.monotonic()
    try:
        works[0].wait(timedelta(seconds=wait_s))
        outcome = "no error"
    except RuntimeError as error:
        outcome = str(error)
    waited = time.monotonic() - start
    store.set("rank0-gave-up", "1")
    try:  # the expired wait aborted the communicator: the group takes no more work
        _exchange(peer, 3)
        later = "accepted"
    except RuntimeError as error:
        later = str(error)
    return outcome, waited, later


def test_under_nccls_contract_a_timed_wait_blocks_up_to_its_timeout_and_leaves_the_group_aborted():
    wait_s = 1.5
    (outcome, waited, later), _ = run_workers(_timed_wait_worker, 2, args=(wait_s,), contract="nccl")
    assert "timed out" in outcome and "aborted" in outcome
    assert wait_s <= waited < wait_s + 2  # it blocked the host for the timeout, not less
    assert "aborted" in later


def test_under_gloos_contract_a_batch_is_one_work_per_op_and_wait_blocks_up_to_its_timeout():
    wait_s = 1.5
    (outcome, waited, later), _ = run_workers(_timed_wait_worker_gloo, 2, args=(wait_s,), contract="gloo")
    assert outcome[0] == 2  # one work per op
    assert "timed out" in outcome[1].lower() or "timeout" in outcome[1].lower()
    assert wait_s <= waited < wait_s + 2


def _timed_wait_worker_gloo(rank, N, wait_s):
    store, peer = shared_store(), 1 - rank
    if rank == 1:
        store.wait(["rank0-gave-up"], timedelta(seconds=60))
        return None, 0.0, None
    works, _ = _exchange(peer, 1)
    start = time.monotonic()
    try:
        works[1].wait(timedelta(seconds=wait_s))  # the receive, whose sender never sends
        outcome = "no error"
    except RuntimeError as error:
        outcome = str(error)
    waited = time.monotonic() - start
    store.set("rank0-gave-up", "1")
    return (len(works), outcome), waited, None


def _first_batch_without_rank_2_worker(rank, N):
    import tests.nccl_emulation

    tests.nccl_emulation.FIRST_BATCH_TIMEOUT_S = 3.0
    store = shared_store()
    if rank == 2:  # never takes part in the group's first batch; stays until the others are through
        store.wait(["done/0", "done/1"], timedelta(seconds=60))
        return "absent"
    peer = 1 - rank
    try:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.ones(2), peer), dist.P2POp(dist.irecv, torch.zeros(2), peer)]
        )
        for work in works:
            work.wait()
        return len(works)
    finally:
        store.set(f"done/{rank}", "1")


def test_under_nccls_contract_the_first_batch_on_a_group_must_involve_all_of_its_ranks():
    with pytest.raises(WorkerError, match=r"first batch_isend_irecv on group .* ranks \[2\] never joined"):
        run_workers(_first_batch_without_rank_2_worker, 3, contract="nccl")
    assert run_workers(_first_batch_without_rank_2_worker, 3, contract="gloo") == [2, 2, "absent"]  # gloo allows it


def _held_inside_calls_worker(rank, N, hold_s):
    """Rank 2 joins the split, the first large all-reduce and its first point-to-point with rank 0 only after
    ``hold_s``: ranks 0 and 1 must be held inside each call that long, with no work to poll (the call returns no
    sooner than rank 2 arrives); the first point-to-point's connect holds the pair (0, 2), not rank 1."""
    store = shared_store()
    if rank == 2:
        time.sleep(hold_s)
    start = time.monotonic()
    pair = dist.new_group([0, 2])  # ncclCommSplit: every rank of the parent, rank 1 too
    split_s = time.monotonic() - start
    if rank == 2:
        time.sleep(hold_s)
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(2**15), async_op=True)  # 128 KiB: the first large all-reduce
    connect_s = time.monotonic() - start
    work.wait()
    pair_s = None
    if rank in (0, 2):  # rank 1 makes no point-to-point call: ranks 0 and 2 connect without it
        if rank == 2:
            time.sleep(hold_s)
        start = time.monotonic()
        peer = 2 - rank
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.ones(2), peer, pair), dist.P2POp(dist.irecv, torch.zeros(2), peer, pair)]
        )
        pair_s = time.monotonic() - start
        for work in works:
            work.wait()
    store.set(f"done/{rank}", "1")
    return split_s, connect_s, pair_s


def test_under_nccls_contract_a_split_and_a_first_connect_hold_the_host_inside_the_call_until_the_peers_come():
    hold_s = 2.0
    (split0, connect0, pair0), (split1, connect1, pair1), _ = run_workers(
        _held_inside_calls_worker, 3, args=(hold_s,), contract="nccl"
    )
    assert min(split0, split1, connect0, connect1, pair0) >= 0.9 * hold_s, (split0, split1, connect0, connect1, pair0)
    assert pair1 is None
    gloo = run_workers(_held_inside_calls_worker, 3, args=(0.0,), contract="gloo")  # gloo holds nothing here
    assert all(seconds < hold_s for result in gloo for seconds in result if seconds is not None), gloo


def _heartbeat_worker(rank, N):
    """Rank 2 stalls; rank 0 leaves an all-reduce unpolled (its work times out: the emulated watchdog fires,
    signals the dump and SIGABRTs); rank 1 is held inside a split with no work: only the heartbeat monitor,
    on rank 0's dump signal, ends it (after the dump wait and TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)."""
    dist.all_reduce(torch.ones(1))  # the small all-reduce's connect made by every rank
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never polled: the emulated watchdog times it out
        time.sleep(120)
    dist.new_group()  # held: rank 2 never comes
    return "returned"


def test_under_nccls_contract_the_heartbeat_monitor_ends_a_rank_held_with_no_work_after_anothers_watchdog(
    monkeypatch,
):
    from tests.distributed import held_store
    from tests.nccl_emulation import DUMP_WAIT_VARIABLE, HEARTBEAT_KILL_KEY, HEARTBEAT_VARIABLE, WATCHDOG_KEY

    monkeypatch.setenv(DUMP_WAIT_VARIABLE, "200")
    monkeypatch.setenv(HEARTBEAT_VARIABLE, "2")
    store = held_store()
    start = time.monotonic()
    results = run_workers(
        _heartbeat_worker, 3, contract="nccl", group_timeout_s=2, expect=[], exits=[0, 1], store=store, timeout_s=60
    )
    elapsed = time.monotonic() - start
    assert results[:2] == [ProcessExit(-6), ProcessExit(-6)], results
    assert store.check([f"{WATCHDOG_KEY}0"]) and not store.check([f"{WATCHDOG_KEY}1"])  # rank 1 had no work
    assert store.check([f"{HEARTBEAT_KILL_KEY}1"]), "rank 1 was not ended by the heartbeat monitor"
    assert elapsed < 45, elapsed


# --- CERAR under NCCL's contract ----------------------------------------------------------------------


def _gradients(N, d, seed):
    return torch.randn(N, d, generator=torch.Generator().manual_seed(seed))


def _counted_calls_worker(rank, N, c, d):
    code = cerar.make_code(N, c, "perturbation", eps=0.05)
    mine = _gradients(N, d, seed=3)[rank].clone()
    cerar.all_reduce(torch.ones(8 * c), code, timeout=60)  # the agreement check's path, before counting
    before = transport_log()
    cerar.all_reduce(mine, code, timeout=60)
    after = transport_log()
    ring = _gradients(N, d, seed=3)[rank].clone()
    cerar.ring_all_reduce(ring, timeout=60)
    ring_log = transport_log()
    return mine, {
        "batches": after["batches"] - before["batches"],
        "waits_with_timeout": after["waits_with_timeout"],
        "polled": len(after["polled_batches"] - before["polled_batches"]),
        "ring_batches": ring_log["batches"] - after["batches"],
        "ring_polled": len(ring_log["polled_batches"] - after["polled_batches"]),
    }


def test_a_cerar_call_under_nccls_contract_never_waits_with_a_timeout_and_polls_once_per_window():
    """c = 15 at N = 3 with two pipeline chunks: 32 rounds' batches, so four look-behind windows.
    Today's NCCL path bounded every round with wait(timeout) and a poll: each would fail this."""
    N, c = 3, 15
    d = c * 2 * 2**16 + 5
    code = cerar.make_code(N, c, "perturbation", eps=0.05)
    posts = code.L * len(pipeline_chunks(code.m_for(d)))
    results = run_workers(_counted_calls_worker, N, args=(c, d), contract="nccl", timeout_s=600)
    G = _gradients(N, d, seed=3)
    expected = spec_all_reduce(G.double().numpy(), *spec_code_matrices(code))  # the spec's protocol, float64
    for rank, (mine, counts) in enumerate(results):
        assert counts["batches"] == posts == 32
        assert counts["waits_with_timeout"] == 0  # not one host-blocking wait, in any call
        # one poll per window (posts 16, 24, 32 and the last), not one per round, and not a single one
        assert posts // LOOK_BEHIND_POSTS - 1 <= counts["polled"] <= posts // LOOK_BEHIND_POSTS + 1, counts
        assert counts["ring_batches"] == 2 * (N - 1)
        assert 1 <= counts["ring_polled"] <= 2 * (N - 1) // LOOK_BEHIND_POSTS + 1, counts
        bound = rounding_bound(code, torch.float32) * G.double().norm().item()  # pinned in test_precision
        assert np.linalg.norm(mine.double().numpy() - expected[rank]) <= bound  # (kappa 5e7: a loose check)


def _stalled_peer_worker(rank, N, victim, timeout_s, c, d):
    code = cerar.make_code(N, c, "perturbation", eps=0.05)
    tensor = torch.ones(d)
    cerar.all_reduce(tensor, code, timeout=timeout_s)  # everyone is connected and agreed
    stop_one_rank(rank, N, victim)
    start = time.monotonic()
    try:
        cerar.all_reduce(tensor, code, timeout=timeout_s)
    except cerar.CollectiveError as error:
        return str(error), time.monotonic() - start, transport_log()["waits_with_timeout"]
    return "no error", time.monotonic() - start, transport_log()["waits_with_timeout"]


@pytest.mark.parametrize("c, d", [(6, 4096), (15, 15 * 2 * 2**16)])  # one chunk, 7 rounds; two chunks, 32 rounds
def test_under_nccls_contract_every_survivor_of_a_stalled_peer_raises_within_the_timeout_plus_slack(c, d):
    N, victim, timeout_s = 3, 1, 3.0
    survivors = [r for r in range(N) if r != victim]
    results = run_workers(
        _stalled_peer_worker,
        N,
        args=(victim, timeout_s, c, d),
        expect=survivors,
        timeout_s=120,
        contract="nccl",
    )
    for rank in survivors:
        message, seconds, timed_waits = results[rank]
        assert "cerar.all_reduce" in message and "round" in message and "did not complete" in message, message
        assert seconds <= timeout_s + STALL_SLACK_S, (rank, seconds)  # the call's own deadline ended it
        assert timed_waits == 0
    assert f"rank {victim}" in results[(victim + 1) % N][0]  # the rank that waits on the victim names it


# --- the trainer's way out on NCCL: abort, one line, exit 3 ----------------------------------------------


def _trainer_failure_worker(rank, N, victim, timeout_s):
    from cerar.ddp import transport_group
    from train.distributed import TrainCollectiveError, exit_after_collective_failure

    group = transport_group(None, timeout_s)  # CERAR's own group, as the trainer's aggregator makes it
    code = cerar.make_code(N, 2 * N, "perturbation", eps=0.05)
    tensor = torch.ones(4096)
    cerar.all_reduce(tensor, code, group, timeout=timeout_s)
    store = shared_store()
    store.set(f"ready/{rank}", "1")
    store.set(f"group/{rank}", group.group_name)
    if rank == victim:
        store.wait([f"ready/{r}" for r in range(N)], timedelta(seconds=60))
        os.kill(os.getpid(), signal.SIGSTOP)
    store.wait([f"ready/{victim}"], timedelta(seconds=60))
    try:
        cerar.all_reduce(tensor, code, group, timeout=timeout_s)
    except cerar.CollectiveError as error:
        exit_after_collective_failure(
            TrainCollectiveError(f"collective 'aggregate (cerar)' failed on rank {rank}: {error}")
        )
    return "no error"


def test_after_a_collective_failure_the_trainer_aborts_the_groups_prints_one_line_and_exits_3(capfd):
    N, victim, timeout_s = 3, 1, 3.0
    survivors = [r for r in range(N) if r != victim]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    start = time.monotonic()
    results = run_workers(
        _trainer_failure_worker,
        N,
        args=(victim, timeout_s),
        expect=[],
        exits=survivors,
        timeout_s=120,
        contract="nccl",
        store=store,
    )
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    for rank in survivors:
        assert results[rank] == ProcessExit(3)
        aborted = store.get(f"{ABORTED_KEY}{rank}").decode().split(",")
        assert store.get(f"group/{rank}").decode() in aborted  # CERAR's transport group, by torch's abort
        lines = [line for line in err.splitlines() if line.startswith("error: ") and f"on rank {rank}:" in line]
        assert len(lines) == 1 and "did not complete within the timeout" in lines[0], err[-3000:]
    assert elapsed < 60  # not the groups' own (watchdog) timeouts


# --- the trainer's own waits (train.distributed.await_work) under each contract ------------------------------


class _CountedWork:
    """A collective's work that counts how the code waits for it (the test's measurement) and passes each call on."""

    def __init__(self, work):
        self.work, self.polls, self.waits = work, 0, []

    def is_completed(self) -> bool:
        self.polls += 1
        return self.work.is_completed()

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return self.work.wait() if timeout is None else self.work.wait(timeout)


def _trainer_wait_worker(rank, N, timeout_s):
    """Both ranks all-reduce once; then rank 1 holds back its second all-reduce until rank 0's wait for it has
    ended. Rank 0 returns how it waited for each, and the second's outcome and time."""
    from train.distributed import await_work

    store = shared_store()
    first = _CountedWork(dist.all_reduce(torch.ones(4), async_op=True))
    await_work(first, timeout_s)
    if rank == 1:
        store.wait(["rank0-waited"], timedelta(seconds=60))
        dist.all_reduce(torch.ones(4), async_op=True).wait()  # lets rank 0's pending work complete before the end
        return None
    second = _CountedWork(dist.all_reduce(torch.ones(4), async_op=True))
    start = time.monotonic()
    try:
        await_work(second, timeout_s)
        outcome = "completed"
    except TimeoutError as error:
        outcome = str(error)
    waited = time.monotonic() - start
    store.set("rank0-waited", "1")
    return (first.polls, first.waits), (second.polls, second.waits), outcome, waited


@pytest.mark.parametrize("contract", ["gloo", "nccl"])
def test_the_trainers_wait_blocks_on_gloo_polls_under_nccls_contract_and_ends_at_its_deadline(contract):
    """`train.distributed.await_work`, the trainer's wait for each collective (`bounded`), follows the backend's
    contract as CERAR's rounds do. gloo: one ``wait(timeout)`` and no polling (a poll every 0.2 ms cost a waiting
    rank about 11 % of a core, taken from the peers it waits for); NCCL: polls ``is_completed()`` and then an
    untimed ``wait()`` (a timed one would block the host and abort the communicator on expiry). Either way a
    collective a peer never joins raises TimeoutError at the deadline, not before and not at the group's timeout."""
    timeout_s = 1.0
    rank0, _ = run_workers(_trainer_wait_worker, 2, args=(timeout_s,), contract=contract)
    (polls, waits), (stalled_polls, stalled_waits), outcome, waited = rank0
    assert outcome.startswith(f"did not complete within {timeout_s:g}s"), outcome
    assert timeout_s <= waited < timeout_s + 2, waited
    if contract == "gloo":
        assert (polls, waits) == (0, [timedelta(seconds=timeout_s)])
        assert (stalled_polls, stalled_waits) == (0, [timedelta(seconds=timeout_s)])
    else:
        assert polls >= 1 and waits == [None]
        assert stalled_polls > 10 and stalled_waits == []  # polled to the deadline; never a timed wait


# --- the trainer's NCCL watchdog setting --------------------------------------------------------------


@pytest.mark.quick
def test_the_trainer_keeps_torchs_tear_down_mode_and_refuses_0_and_2_in_one_line():
    """torch's default 3 (tear down without the abort, ``SkipCleanUp``) when unset; 1 (abort, then tear down)
    kept when chosen; 0 (no tear-down: a stalled peer hangs the job) and 2 (abort without tear-down: an aborted
    work reads as completed, ``wait()`` returns garbage) refused in one line naming the variable and the value,
    before any group exists, as ``TORCH_NCCL_BLOCKING_WAIT`` is."""
    environ = {}
    assert configure_nccl_watchdog(environ) == "3" and environ[NCCL_ERROR_HANDLING_VARIABLE] == "3"
    assert configure_nccl_watchdog({NCCL_ERROR_HANDLING_VARIABLE: "1"}) == "1"
    assert configure_nccl_watchdog({NCCL_ERROR_HANDLING_VARIABLE: "3"}) == "3"
    for mode in ("0", "2", "4", "yes"):
        with pytest.raises(ConfigError, match=f"^{NCCL_ERROR_HANDLING_VARIABLE}={mode} ") as refused:
            configure_nccl_watchdog({NCCL_ERROR_HANDLING_VARIABLE: mode})
        assert "\n" not in str(refused.value) and "set 1 or 3" in str(refused.value)


@pytest.mark.quick
@pytest.mark.parametrize("name", NCCL_BLOCKING_WAIT_VARIABLES)
def test_the_trainer_refuses_nccls_blocking_wait_in_one_line(name):
    """TORCH_NCCL_BLOCKING_WAIT (or its old name) set: every wait() would block the host and no work would be
    on the watchdog's list (ProcessGroupNCCL::WorkNCCL::wait, workEnqueue). Refused before any group exists."""
    for value in ("1", "true"):
        with pytest.raises(ConfigError, match=f"^{name}={value} makes every NCCL wait block the host") as refused:
            configure_nccl_watchdog({name: value})
        assert "\n" not in str(refused.value)
    environ = {name: "0"}  # explicitly off: allowed
    assert configure_nccl_watchdog(environ) == "3" and environ[NCCL_ERROR_HANDLING_VARIABLE] == "3"
