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


@pytest.mark.parametrize(("codec_name", "N"), [("int4", 3), ("int8", 2)])
def test_the_summed_error_of_fed_back_calls_is_the_last_residual(codec_name, N):
    results = run_workers(_flat_worker, N, args=(codec_name, True, False), timeout_s=120)
    outs = results[0][0]
    assert all(torch.equal(outs, r[0]) for r in results)  # every rank, every call, the same bytes
    exact = torch.stack([torch.stack([contribution(r, t) for r in range(N)]).double().mean(0) for t in range(T)])
    summed_error = (outs.double() - exact).sum(0).numpy()
    E = flat_residual_mean([r[1] for r in results], N, D)
    magnitude = sum(contribution(r, t).double().abs() for r in range(N) for t in range(T)).numpy() / N
    slack = 8 * T * U * (magnitude + np.abs(outs.double().numpy()).sum(0))
    assert np.all(np.abs(summed_error + E) <= slack), float(np.max(np.abs(summed_error + E) - slack))
    plain = run_workers(_flat_worker, N, args=(codec_name, False, False), timeout_s=120)[0][0]
    plain_error = (plain.double() - exact).sum(0).norm()
    assert np.linalg.norm(summed_error) < 0.5 * float(plain_error), (np.linalg.norm(summed_error), plain_error)
    one_call = float((outs[0].double() - exact[0]).norm())  # the first call's error: its residuals' alone
    assert np.linalg.norm(summed_error) < 2 * one_call * math.sqrt(2), (np.linalg.norm(summed_error), one_call)


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
