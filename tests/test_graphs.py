"""CERAR replayed from a graph where a call's shapes repeat (``cerar.ring.graphs``), held on the CPU to what CUDA and
NCCL need of it. No graph runs here: ``HostGraphs`` stands in for CUDA's (its "capture" keeps the host function,
its replay calls it), so these tests hold the logic: the plan every rank follows (eager, then one capture, then
replays, decided by the sequence of calls alone, since NCCL wants every rank to capture and launch together), the
graph's own buffer (the caller's values copied in and the result out, whatever its address, shape or strides),
no host poll of a work inside the captured call (on CUDA an error), and the deadline after a replay (the only
bound: a captured work is not torch's watchdog's). The GPU check replays real graphs on an H200
(``scripts.checks.gpu.throughput``: ``one_rank_arithmetic(..., graph=True)`` and ``captured_selfloop``)."""

from __future__ import annotations

import time

import pytest
import torch

import cerar
from cerar.ring.graphs import CAPTURE, EAGER, REPLAY, CapturePlan, GraphedAllReduce, GraphKey, HostGraphs
from cerar.ring.precision import rounding_bound
from tests.distributed import run_workers, stop_one_rank
from tests.nccl_emulation import transport_log

STALL_SLACK_S = 3.0  # as tests/test_nccl_contract.py: beyond the timeout, the poll's pause and a loaded machine


def key(d: int, group: int = 0) -> GraphKey:
    return GraphKey((("tensor length d", d),), "sum", "spec", group, "cpu")


@pytest.mark.quick
def test_the_plan_warms_up_captures_once_and_replays_per_key():
    plan = CapturePlan(warmup=2, max_graphs=2)
    steps = [plan.next(key(d)) for d in (10, 10, 10, 20, 10, 20, 20, 30, 30, 30, 20)]
    assert steps == [EAGER, EAGER, CAPTURE, EAGER, REPLAY, EAGER, CAPTURE, EAGER, EAGER, EAGER, REPLAY]
    # a third key finds the two graphs taken and stays eager for good; ranks making the same calls decide alike
    other = CapturePlan(warmup=2, max_graphs=2)
    assert [other.next(key(d)) for d in (10, 10, 10, 20, 10, 20, 20, 30, 30, 30, 20)] == steps


@pytest.mark.quick
@pytest.mark.parametrize("warmup, max_graphs", [(0, 4), (1.5, 4), (True, 4), (1, -1)])
def test_the_plan_refuses_what_cannot_be_captured_safely(warmup, max_graphs):
    with pytest.raises(ValueError, match="warmup|max_graphs"):
        CapturePlan(warmup, max_graphs)


def _graphed_worker(rank, N, c, d, calls):
    code = cerar.make_code(N, c, "perturbation", eps=0.3)
    graphed = GraphedAllReduce(backend=HostGraphs())
    out = []
    for k in range(calls):
        G = torch.randn(N, d, generator=torch.Generator().manual_seed(k), dtype=torch.float64).float()
        mine = G[rank].clone() if k % 2 == 0 else G[rank].clone().view(d // 7, 7).t()  # another address, strides
        before = transport_log()
        stats = graphed(mine, code, op="avg", timeout=60)
        after = transport_log()
        out.append((
            mine.reshape(-1),  # in the order the call sees the values (the view's, for the transposed one)
            stats.bytes_sent,
            after["polls"] - before["polls"],
            after["waits_with_timeout"] - before["waits_with_timeout"],
            after["batches"] - before["batches"],
        ))  # fmt: skip
    small = torch.ones(14)  # another length: another key, eager first
    graphed(small, code, timeout=60)
    return graphed.steps, out


def test_every_rank_captures_the_same_call_and_replays_it_with_no_host_poll_to_the_protocols_result():
    """Three ranks under NCCL's contract (emulated on gloo), four calls of one length on fresh tensors (every
    other one a transposed view): eager, captured, replayed, replayed, each result within twice the rounding
    bound of the protocol's own (``cerar.simulate``), bytes as the eager call's; the captured call polls no work
    and never waits with a timeout (CUDA refuses a query of a captured event), the eager one polls."""
    # d: a multiple of 7 (the transposed view), not of c (a partial row); L = 18 posts: an eager call polls
    N, c, d, calls = 3, 17, 7 * 4099, 4
    results = run_workers(_graphed_worker, N, args=(c, d, calls), contract="nccl", timeout_s=300)
    code = cerar.make_code(N, c, "perturbation", eps=0.3)
    for rank, (steps, out) in enumerate(results):
        assert steps == [EAGER, CAPTURE, REPLAY, REPLAY, EAGER]
        eager_bytes = out[0][1]
        for k, (mine, sent, polls, timed_waits, batches) in enumerate(out):
            G = torch.randn(N, d, generator=torch.Generator().manual_seed(k), dtype=torch.float64).float()
            if k % 2:  # the transposed view's values, in its order
                G = G.view(N, d // 7, 7).transpose(1, 2).reshape(N, d)
            expected = cerar.simulate(G, code)[rank] / N
            bound = 2 * rounding_bound(code, torch.float32) * G.double().norm().item()
            assert (mine.double() - expected.double()).norm().item() <= bound, (rank, k)
            assert sent == eager_bytes and timed_waits == 0 and batches == code.L
            assert (polls > 0) if k == 0 else (polls == 0), (rank, k, polls)


def _stalled_replay_worker(rank, N, victim, timeout_s):
    code = cerar.make_code(N, 5, "perturbation", eps=0.05)
    graphed = GraphedAllReduce(backend=HostGraphs())
    tensor = torch.ones(5 * 4096)
    for _ in range(2):  # eager, then captured and replayed: everyone connected, the graph made
        graphed(tensor, code, timeout=timeout_s)
    stop_one_rank(rank, N, victim)
    start = time.monotonic()
    try:
        graphed(tensor, code, timeout=timeout_s)
    except cerar.CollectiveError as error:
        return str(error), time.monotonic() - start, graphed.steps[-1]
    return "no error", time.monotonic() - start, graphed.steps[-1]


def test_a_replay_whose_peer_stalls_raises_within_the_timeout():
    """The replay's only bound is the event after it, polled against the deadline: every survivor of a
    stopped peer raises CollectiveError within the timeout plus the slack, naming the replayed call."""
    N, victim, timeout_s = 3, 1, 3.0
    survivors = [r for r in range(N) if r != victim]
    results = run_workers(
        _stalled_replay_worker, N, args=(victim, timeout_s), expect=survivors, timeout_s=120, contract="nccl"
    )
    for rank in survivors:
        message, seconds, step = results[rank]
        assert step == REPLAY
        assert "cerar.GraphedAllReduce" in message and "replayed" in message and "did not complete" in message
        assert seconds <= timeout_s + STALL_SLACK_S, (rank, seconds)


@pytest.mark.quick
def test_bad_chunks_are_refused_before_any_work():
    graphed = GraphedAllReduce()
    code = cerar.make_code(2, 2, "exact")
    with pytest.raises(ValueError, match="chunks"):
        graphed(torch.ones(8), code, chunks=0)
    assert graphed.steps == []
