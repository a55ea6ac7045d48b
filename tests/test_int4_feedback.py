"""Error feedback in the two-shot all-reduces (cerar.int4.feedback), held to the identity that defines it.

Each rank sends Q(x + e) for every shard it rounds and keeps e' = (x + e) - Q(x + e). Written from that: the mean's
shard j after call t is out_t = g_bar_t + E_t - E_{t+1}, with E = sum_{i != j} c_i,j / N + r_j (the senders'
residuals of shard j over N, and its owner's residual of the reduced shard), so the sum of T consecutive aggregates
errs by exactly E_1 - E_{T+1} = -E_{T+1}: the test rebuilds E_{T+1} from every rank's returned residuals and holds
the summed error to it, within float32's rounding of the sums (T u per value of the magnitudes summed). Two tiers:
E also holds the node tier's residuals, sum_{g != l} c_g / G over the node's other ranks, averaged over the nodes
(each node sum then enters the rail's mean with weight 1/n).

Against no feedback: the summed error of T calls grows as sqrt(T) (stochastic rounding's errors are independent
across calls) while the fed-back one stays that of one call's residual; T = 16 makes it 4x, held at 2x.

The DDP hooks (trainer.overlap=true) keep one such state per bucket: two buckets' interleaved calls each obey the
identity on their own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.distributed import run_workers
from tests.test_int4_all_reduce import U

T, D = 16, 1000


def contribution(rank: int, t: int, d: int = D) -> torch.Tensor:
    """Rank r's gradient at call t: a shared drift plus its own noise, magnitudes spread over decades per 50 values."""
    g = torch.Generator().manual_seed(7000 + 131 * t + rank)
    shared = torch.randn(d, generator=torch.Generator().manual_seed(3 + t))
    spread = torch.exp(torch.randn(-(-d // 50), generator=torch.Generator().manual_seed(5))).repeat_interleave(50)[:d]
    return (shared + 0.5 * torch.randn(d, generator=g)) * spread


def _flat_worker(rank, N, codec_name, fed, split):
    """T calls of the flat two-shot all-reduce with error feedback (or without); with ``split``, the feedback and the
    call count saved after T/2 calls and restored into fresh objects, as a resumed run would."""
    from cerar.int4.all_reduce import two_shot_all_reduce
    from cerar.int4.codecs import Int4Codec, Int8Codec
    from cerar.int4.feedback import ErrorFeedback
    from cerar.int8.all_reduce import dither_calls, set_dither_calls

    codec = Int4Codec(64, "stochastic", True, 2) if codec_name == "int4" else Int8Codec(64, "stochastic")
    set_dither_calls(0)
    feedback = ErrorFeedback() if fed else None
    outs = []
    for t in range(T):
        if split and t == T // 2:  # a checkpoint and a resume
            saved, count = feedback.state_dict(), dither_calls()
            feedback = ErrorFeedback()
            feedback.load_state_dict(saved)
            set_dither_calls(count)
        x = contribution(rank, t)
        two_shot_all_reduce(x, codec, None, "avg", 30, seed=2, timed=False, feedback=feedback)
        outs.append(x)
    return torch.stack(outs), (feedback.state_dict() if fed else {})


def flat_residual_mean(states: list[dict], N: int, d: int, name: str = "flat") -> np.ndarray:
    """E: per value of the mean, sum_{i != j} c_i,j / N + r_j, from every rank's residual [N, s] (row j != i: what
    rank i's messages of shard j dropped; row i: its reduced shard's)."""
    s = -(-d // N)
    E = np.zeros(N * s)
    for i, state in enumerate(states):
        rows = state[name].double().numpy().reshape(N, s)
        for j in range(N):
            E[j * s : (j + 1) * s] += rows[j] if j == i else rows[j] / N
    return E[:d]


def check_summed_error_is_the_last_residual(outs, plain, states, N, d, seed_offset=0):
    """The identity of the module docstring for T calls on values ``contribution(r, seed_offset + t, d)``: every
    rank's ``outs`` the same bytes; their summed error -E_{T+1} from every rank's residuals ``states`` (name
    "flat"), within float32's rounding of the sums; below half the unfed calls' (``plain``) and within 2 sqrt(2) of
    one call's error."""
    outs = outs[0]
    given = [[contribution(r, seed_offset + t, d) for r in range(N)] for t in range(T)]
    exact = torch.stack([torch.stack(values).double().mean(0) for values in given])
    summed_error = (outs.double() - exact).sum(0).numpy()
    E = flat_residual_mean(states, N, d)
    magnitude = sum(x.double().abs() for values in given for x in values).numpy() / N
    slack = 8 * T * U * (magnitude + np.abs(outs.double().numpy()).sum(0))
    assert np.all(np.abs(summed_error + E) <= slack), float(np.max(np.abs(summed_error + E) - slack))
    plain_error = (plain.double() - exact).sum(0).norm()
    assert np.linalg.norm(summed_error) < 0.5 * float(plain_error), (np.linalg.norm(summed_error), plain_error)
    one_call = float((outs[0].double() - exact[0]).norm())  # the first call's error: its residuals' alone
    assert np.linalg.norm(summed_error) < 2 * one_call * math.sqrt(2), (np.linalg.norm(summed_error), one_call)


@pytest.mark.parametrize(("codec_name", "N"), [("int4", 3), ("int8", 2)])
def test_the_summed_error_of_fed_back_calls_is_the_last_residual(codec_name, N):
    results = run_workers(_flat_worker, N, args=(codec_name, True, False), timeout_s=120)
    assert all(torch.equal(results[0][0], r[0]) for r in results)  # every rank, every call, the same bytes
    plain = run_workers(_flat_worker, N, args=(codec_name, False, False), timeout_s=120)[0][0]
    check_summed_error_is_the_last_residual([r[0] for r in results], plain, [r[1] for r in results], N, D)


BUCKETS = {0: (D, 0), 1: (D // 3, 500)}
"""Two DDP buckets of different lengths: index -> (values, the offset of their calls' seeds)."""


def _hook_worker(rank, N, kind, fed):
    """T steps of two buckets, one call each a step in DDP's order, through a quantized hook's state: each call given
    its bucket's residuals (``state.feedback.of(index)``, what the hooks pass for ``bucket.index()``), or none."""
    from cerar.int4.hook import Int4HookState
    from cerar.int8.all_reduce import set_dither_calls
    from cerar.int8.hook import QuantizedHookState

    set_dither_calls(0)
    if kind == "int4":
        state = Int4HookState(block=64, seed=2, timeout=30, error_feedback=fed)
    else:
        state = QuantizedHookState(block=64, timeout=30, error_feedback=fed)
    assert (state.feedback is None) != fed
    outs = {index: [] for index in BUCKETS}
    for t in range(T):
        for index, (d, offset) in BUCKETS.items():
            x = contribution(rank, offset + t, d)
            state.submit(x, feedback=None if state.feedback is None else state.feedback.of(index)).wait()
            outs[index].append(x)
    return {index: torch.stack(v) for index, v in outs.items()}, state.feedback.state_dict() if fed else {}


@pytest.mark.parametrize(("kind", "N"), [("int4", 3), ("int8", 2)])
def test_a_hook_feeds_each_bucket_back_on_its_own(kind, N):
    """trainer.overlap=true: the 4-bit and 8-bit hooks keep one residual per DDP bucket (``BucketFeedback``), so each
    bucket's calls obey the identity alone; the residuals are kept under the buckets' indices (a checkpoint's)."""
    results = run_workers(_hook_worker, N, args=(kind, True), timeout_s=120)
    plain = run_workers(_hook_worker, N, args=(kind, False), timeout_s=120)[0][0]
    assert all(sorted(r[1]) == sorted(BUCKETS) for r in results)
    for index, (d, offset) in BUCKETS.items():
        assert all(torch.equal(results[0][0][index], r[0][index]) for r in results)
        states = [r[1][index] for r in results]
        assert all("flat" in state for state in states), f"bucket {index}: no residual kept"
        check_summed_error_is_the_last_residual([r[0][index] for r in results], plain[index], states, N, d, offset)


def test_feedback_saved_and_restored_mid_run_repeats_the_run_bit_for_bit():
    """The residuals' state_dict and the call count, restored into fresh objects after T/2 calls, give the same
    bytes as the uninterrupted calls."""
    whole = run_workers(_flat_worker, 3, args=("int4", True, False), timeout_s=120)
    resumed = run_workers(_flat_worker, 3, args=("int4", True, True), timeout_s=120)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole, resumed, strict=True))
    assert all(torch.equal(a[1]["flat"], b[1]["flat"]) for a, b in zip(whole, resumed, strict=True))


def _two_tier_worker(rank, N):
    from cerar.hierarchical import NodeLayout
    from cerar.int4.feedback import ErrorFeedback
    from cerar.int4.two_tier import hierarchical_int4_all_reduce
    from cerar.int8.all_reduce import set_dither_calls

    set_dither_calls(0)
    feedback, outs = ErrorFeedback(), []
    for t in range(T):
        x = contribution(rank, t)
        hierarchical_int4_all_reduce(x, NodeLayout(nodes=2, local_size=N // 2), timeout=30, block=32, intra="int8",
                                     intra_block=16, seed=4, feedback=feedback)  # fmt: skip
        outs.append(x)
    return torch.stack(outs), feedback.state_dict()


def test_two_tiers_feed_back_both_their_roundings():
    """2 nodes of 2: the summed error of T calls is -E_{T+1}, E now the rail's residual mean over the node sums' shard
    plus the node tier's (each node: the other local rank's residual of shard l over G, averaged over the nodes)."""
    N, G, n = 4, 2, 2
    results = run_workers(_two_tier_worker, N, args=(), timeout_s=120)
    outs = results[0][0]
    assert all(torch.equal(outs, r[0]) for r in results)
    exact = torch.stack([torch.stack([contribution(r, t) for r in range(N)]).double().mean(0) for t in range(T)])
    summed_error = (outs.double() - exact).sum(0).numpy()
    s = -(-D // G)
    E = np.zeros(G * s)
    for l in range(G):
        rail_ranks = [a * G + l for a in range(n)]  # node-major: rank = node x G + local rank
        E[l * s : (l + 1) * s] = flat_residual_mean([results[r][1] for r in rail_ranks], n, s, "rail")
        for a in range(n):
            for g in range(G):
                if g != l:
                    node = results[a * G + g][1]["node"].double().numpy().reshape(G, s)
                    E[l * s : (l + 1) * s] += node[l] / G / n
    magnitude = sum(contribution(r, t).double().abs() for r in range(N) for t in range(T)).numpy() / N
    slack = 16 * T * U * (magnitude + np.abs(outs.double().numpy()).sum(0))
    assert np.all(np.abs(summed_error + E[:D]) <= slack), float(np.max(np.abs(summed_error + E[:D]) - slack))


@pytest.mark.quick
def test_a_residual_kept_for_another_length_is_refused_naming_the_place():
    from cerar.int4.feedback import ErrorFeedback

    feedback = ErrorFeedback()
    assert feedback.rows("flat", 2, 5, torch.zeros(1)).shape == (2, 5)
    with pytest.raises(ValueError, match="the residual of 'flat' holds 10 values, but this call rounds 2 x 6"):
        feedback.rows("flat", 2, 6, torch.zeros(1))
    with pytest.raises(ValueError, match="a state must map names to tensors"):
        feedback.load_state_dict({"flat": [1.0]})


def _window_worker(rank, N, steps):
    from train.aggregation.feedback_window import FeedbackWindow
    from train.aggregation.tensor_errors import TensorLayout

    window = FeedbackWindow(TensorLayout(("a", "b"), (3, 5)), 3)
    records = {}
    for step in steps:
        local, exact, aggregated = window_case(rank, step, N)
        records[step] = window.add(step, local, aggregated, exact)
    return records


def window_case(rank: int, step: int, N: int):
    """Rank r's gradient at a step, the exact mean and an aggregate (the mean plus an error that is the same on every
    rank), 8 values in two tensors of 3 and 5."""
    grads = [torch.randn(8, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(N)]
    exact = torch.stack(grads).mean(0)
    error = torch.randn(8, generator=torch.Generator().manual_seed(999 + step)) * 0.1
    return grads[rank], exact, exact + error


@pytest.mark.quick
def test_the_window_criterion_is_the_summed_error_over_the_summed_noise_per_tensor():
    """FeedbackWindow over windows of 3 steps on 2 ranks, against the docstring's formula written here: per tensor,
    ||sum_steps error|| / sqrt(sum_steps sigma^2), sigma^2 = sum_r ||g_r - g_bar||^2 / (N (N - 1)). Steps 1-4, 6-9:
    windows (1, 2, 3) and (7, 8, 9) are reported at their last step; (4, 5, 6) is broken by the missing step 5."""
    N, steps = 2, (1, 2, 3, 4, 6, 7, 8, 9)
    records = run_workers(_window_worker, N, args=(steps,), timeout_s=60)
    assert records[0] == records[1]
    assert [s for s in steps if records[0][s]] == [3, 9]
    for last in (3, 9):
        error, noise = torch.zeros(8, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        for step in (last - 2, last - 1, last):
            cases = [window_case(r, step, N) for r in range(N)]
            exact, aggregated = cases[0][1].double(), cases[0][2].double()
            error += aggregated - exact
            for part, (lo, hi) in enumerate(((0, 3), (3, 8))):
                noise[part] += sum(float((c[0].double() - exact)[lo:hi].square().sum()) for c in cases) / (N * (N - 1))
        want = [float(error[:3].norm() / noise[0].sqrt()), float(error[3:].norm() / noise[1].sqrt())]
        got = records[0][last]
        assert [got["window/a"], got["window/b"]] == pytest.approx(want, rel=1e-5)
        assert got["feedback/window_error_to_noise_max"] == max(got["window/a"], got["window/b"])
        assert got["feedback/window_worst_tensor"] == ("a" if want[0] >= want[1] else "b")


@pytest.mark.quick
def test_a_sparser_measurement_under_feedback_measures_whole_windows_only():
    """trainer.measure_error_every=M under windows of W steps: the W steps that end at each multiple of M, so every
    measured step belongs to a window measured whole (written out here for W = 3, M = 6 and M = 9 over 20 steps);
    M = 1 (and M = W) measures every step, M = 0 none, and without windows each M-th step, as without feedback."""
    from train.aggregation.feedback_window import measured_step

    def steps(every, window):
        return [s for s in range(1, 21) if measured_step(s, every, window)]

    assert steps(6, 3) == [4, 5, 6, 10, 11, 12, 16, 17, 18]
    assert steps(9, 3) == [7, 8, 9, 16, 17, 18]
    assert steps(3, 3) == steps(1, 3) == list(range(1, 21)) and steps(0, 3) == []  # M = W: every window
    assert steps(6, None) == [6, 12, 18] and steps(1, None) == list(range(1, 21))
