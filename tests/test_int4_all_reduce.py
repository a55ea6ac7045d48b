"""The 4-bit all-reduce (cerar.int4.all_reduce) against a float64 oracle, with the bound that follows from the format.

The bound. Rank j's shard (s = ceil(d/N) values, the tensor zero-padded to N s, blocks of B from the shard's first
value) is formed as R_j = (x^(j) + sum_{i != j} Q(x^(i))) / N and every rank receives Q(R_j). A block's step is
absmax / 7 of the block, or of its rotation y = H (sigma x) where rotated (full blocks; H the Walsh-Hadamard
matrix, sigma the seed's signs); a rounding errs by at most k steps (k = 1/2 nearest, 1 stochastic) in the rotated
domain and so, every decoded value being a mean of the block's rotated errors, by at most k steps per value. In the
rotated domain the contributions' errors are those rotated errors themselves (H sigma sigma H / B = I), so the
reduced block's step is at most (absmax(H sigma mean) + sum_{i != j} k step_i / N) / 7. Per value:

    |out - mean| <= sum_{i != j} k step_i / N  +  k step(R_j)  +  float32's rounding (N u sum_i |x^(i)| / N)

each step widened by the format's float32 slack 2 u (40 + 8 m sqrt(B)) (tests/test_int4_format.py). The error must
also be near what happens: per value (sum_{i != j} step_i^2 / N^2 + step_R^2) t, t = 1/12 (nearest) or 1/6
(stochastic), over B for a rotated value, and the measured squared error must reach a quarter of it (the exact
mean, error 0, fails that; so does an 8-bit format, 18x finer).

The oracle's rotation is the explicit Hadamard matrix (Sylvester's, by Kronecker products), not the butterflies;
the signs are the ones written from the format's docstring in tests/test_int4_format.py. Bytes are counted on the
wire: what each process handed to batch_isend_irecv (tests/nccl_emulation.py's transport log).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from cerar.planning.costmodel import two_tier_features
from tests.distributed import run_workers
from tests.test_int4_format import signs

U = 2.0**-24


def hadamard(B: int) -> np.ndarray:
    H = np.ones((1, 1))
    while H.shape[0] < B:
        H = np.kron(H, np.array([[1.0, 1.0], [1.0, -1.0]]))
    return H


def slack(B: int, rotate: bool) -> float:
    """The format's float32 slack per step (its docstring's bound)."""
    return 2 * U * (40 + 8 * (math.log2(B) if rotate else 0) * math.sqrt(B))


def steps(v: np.ndarray, B: int, rotate: bool, seed: int, spread: np.ndarray | None = None) -> np.ndarray:
    """Per value of a shard v (float64, its padded length), the step of its block: absmax / 7 of the block's exact
    rotation (full blocks, when rotated) or of the block. ``spread``: a bound on how far each value of v may lie
    from the values the format sees; the step is then the most it may be (a rotated block's absmax moves by at
    most the sum of its values' moves, a plain block's by the largest)."""
    s = v.size
    spread = np.zeros(s) if spread is None else spread
    full = s // B * B if rotate else 0
    out = np.empty(s)
    if full:
        y = (v[:full].reshape(-1, B) * signs(seed, B)) @ hadamard(B)
        moved = spread[:full].reshape(-1, B).sum(axis=1)
        out[:full] = np.repeat((np.abs(y).max(axis=1) + moved) / 7, B)
    for lo in range(full, s, B):
        out[lo : lo + B] = (np.abs(v[lo : lo + B]).max() + spread[lo : lo + B].max()) / 7
    return out


def rotated_share(s: int, B: int, rotate: bool) -> np.ndarray:
    """1/B where a value of a shard of s values is rotated, 1 elsewhere."""
    share = np.ones(s)
    if rotate:
        share[: s // B * B] = 1.0 / B
    return share


def oracle(contributions: np.ndarray, B: int, rounding: str, rotate: bool, seed: int, spread=None):
    """(mean, bound per value, typical squared error per value) for contributions [n, m] (float64). ``spread``
    [n, m]: where the contributions the call sees may differ from these (the two-tier call's rounding inside the
    nodes), a bound per value on how much; the bound then holds against these contributions' mean."""
    n, m = contributions.shape
    s = -(-m // n)
    x, moved = np.zeros((n, n * s)), np.zeros((n, n * s))
    x[:, :m] = contributions
    if spread is not None:
        moved[:, :m] = spread
    mean = x.mean(axis=0)
    k = 0.5 if rounding == "nearest" else 1.0
    t = 1 / 12 if rounding == "nearest" else 1 / 6
    widen = k + slack(B, rotate)
    bound, typical = np.zeros(n * s), np.zeros(n * s)
    for j in range(n):
        shard = slice(j * s, (j + 1) * s)
        own = [steps(x[i, shard], B, rotate, seed, moved[i, shard]) for i in range(n) if i != j]
        e1 = sum(own) * (widen + 8 * B * U) / n
        add = n * U * (np.abs(x[:, shard]) + moved[:, shard]).sum(axis=0) / n
        pulled = moved[:, shard].mean(axis=0)  # the contributions' own moves, averaged
        reduced_exact = steps(mean[shard], B, rotate, seed)
        # in the rotated domain each contribution's rounding errs by at most its k steps (H sigma sigma H / B = I):
        # the reduced block's absmax moves by the largest e1 of the block, and by the float32 and node moves
        block_e1 = np.array([e1[lo : lo + B].max() for lo in range(0, s, B)]).repeat(B)[:s]
        reduced = steps(mean[shard], B, rotate, seed, pulled + add) + block_e1 / 7
        bound[shard] = pulled + e1 + add + reduced * widen + 16 * 2.0**-149
        typical[shard] = (sum(o**2 for o in own) / n**2 + reduced_exact**2) * t * rotated_share(s, B, rotate)
    return mean[:m], bound[:m], typical[:m]


def check_against_oracle(out, contributions, B, rounding, rotate, seed, label, spread=None) -> float:
    mean, bound, typical = oracle(contributions.double().numpy(), B, rounding, rotate, seed, spread)
    error = np.abs(out.double().numpy() - mean)
    worst = int(np.argmax(error - bound))
    assert np.all(error <= bound), (label, worst, error[worst], bound[worst])
    if contributions.shape[1] >= 16 * B:
        assert error @ error >= 0.25 * typical.sum(), (label, "error far below a 4-bit quantizer's", error @ error)
    return float(np.linalg.norm(error) / np.linalg.norm(mean))


def gradient_like(rank: int, d: int) -> torch.Tensor:
    """Normal values times a log-normal magnitude per 64 values, a mean shared by the ranks (data-parallel gradients
    correlate), and a spike of 30x every 500 values (the outliers the rotation spreads)."""
    g = torch.Generator().manual_seed(2000 + rank)
    shared = torch.randn(d, generator=torch.Generator().manual_seed(9))
    spread = torch.exp(1.5 * torch.randn(-(-d // 64), generator=g)).repeat_interleave(64)[:d]
    x = (0.5 * shared + torch.randn(d, generator=g)) * spread
    x[rank::500] *= 30
    return x


SIZES = (3, 1, 389, 4099)  # d < N, d = 1, neither a multiple of N nor of B


def _flat_worker(rank, N, B, rounding, rotate, stall_timeout):
    from cerar.int4.all_reduce import int4_all_reduce, int4_bytes_sent
    from cerar.ring.transport import CollectiveError
    from tests.nccl_emulation import transport_log

    def call(x, **kwargs):
        kwargs = {"op": "avg", "timeout": 30, "block": B, "rounding": rounding, "rotate": rotate, "seed": 5, **kwargs}
        return int4_all_reduce(x, **kwargs)

    results = {}
    for d in SIZES:
        x = gradient_like(rank, d)
        before = transport_log()["bytes_isend"]
        stats = call(x)
        results[d] = (x, stats.bytes_sent, transport_log()["bytes_isend"] - before, int4_bytes_sent(d, N, B))
    strided = gradient_like(rank, 2 * 389).view(389, 2)[:, 0]  # not contiguous: written back in place
    call(strided, op="sum")
    results["sum, strided"] = strided.clone()
    other_format = {"rounding": "nearest" if rounding == "stochastic" else "stochastic"}
    for d, (name, change) in enumerate(
        (("block size B", {"block": B * 2}), ("format", other_format), ("rotation seed", {"seed": 6})), start=40
    ):  # a length of its own each: a call all ranks agreed on before is not checked again
        try:  # rank 1 asks for something else: refused on every rank, the field named
            call(torch.ones(d), **(change if rank == 1 else {}))
            results[name] = None
        except CollectiveError as error:
            results[name] = str(error)
    if stall_timeout:  # the last rank stalls: every other rank raises within the timeout, naming it
        if rank == N - 1:
            time.sleep(stall_timeout + 0.7)
            results["stall"] = None
        else:
            start = time.monotonic()
            try:
                call(torch.ones(389), timeout=stall_timeout)
                results["stall"] = ("returned", 0.0)
            except CollectiveError as error:
                results["stall"] = (str(error), time.monotonic() - start)
    return results


@pytest.mark.parametrize(
    ("contract", "N", "B", "rounding", "rotate"),
    [("gloo", 4, 16, "stochastic", True), ("nccl", 3, 32, "nearest", True), ("gloo", 2, 12, "stochastic", False)],
)
def test_flat_all_reduce_is_within_the_bound_the_same_on_every_rank_and_sends_the_formula(
    contract, N, B, rounding, rotate
):
    stall = 1.5 if contract == "nccl" else 0.0
    results = run_workers(_flat_worker, N, args=(B, rounding, rotate, stall), contract=contract, timeout_s=120)
    for d in SIZES:
        outs = [r[d][0] for r in results]
        assert all(torch.equal(outs[0], o) for o in outs), (d, "ranks differ")
        contributions = torch.stack([gradient_like(r, d) for r in range(N)])
        check_against_oracle(outs[0], contributions, B, rounding, rotate, 5, f"{contract} N={N} d={d}")
        s = math.ceil(d / N)
        formula = 2 * (N - 1) * (math.ceil(s / 2) + 4 * math.ceil(s / B)) if N > 1 else 0
        assert all(r[d][1] == r[d][2] == r[d][3] == formula for r in results), (d, results[0][d][1:], formula)
        assert two_tier_features("int4", d, 1, N, block=B, rotate=rotate)[1] == formula  # the cost model's count
    strided = torch.stack([gradient_like(r, 2 * 389).view(389, 2)[:, 0] for r in range(N)])
    check_against_oracle(results[0]["sum, strided"] / N, strided, B, rounding, rotate, 5, "sum, strided")
    for r in results:
        for field in ("block size B", "format", "rotation seed"):
            if field == "rotation seed" and not rotate:  # the seed keys only the dither then: free to differ
                assert r[field] is None, r[field]
            else:
                assert f"ranks disagree on {field}" in r[field], (field, r[field])
    if stall:
        for r in results[:-1]:
            message, seconds = r["stall"]
            assert f"rank {N - 1}" in message and "did not complete within the timeout" in message, message
            assert seconds < stall + 1.5, seconds


def _repeated_worker(rank, N, calls, rotate):
    """``calls`` all-reduces of the same contribution on every rank: blocks of one 1.0 and 127 values of
    0.02-0.06, below half a step (1/14) of the plain format."""
    from cerar.int4.all_reduce import int4_all_reduce

    g = torch.Generator().manual_seed(11)
    x = 0.02 + 0.04 * torch.rand(16 * 128, generator=g)
    x[::128] = 1.0
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(calls):
        y = x.clone()
        int4_all_reduce(y, op="avg", timeout=30, block=128, rounding="stochastic", rotate=rotate, seed=3)
        total += y.double()
    return x, total / calls


@pytest.mark.parametrize(("N", "rotate"), [(2, True), (3, False)])
def test_identical_contributions_average_out_over_calls(N, rotate):
    """Every rank contributes the same values (the worst case for a bias) T times. Each of a value's two roundings
    is unbiased to b = step (2^-16 + slack) and, rotated back, has variance at most step^2 / 4B (plain: step^2 /
    4); the N - 1 contributions' roundings are independent (distinct keys: their senders differ) and weigh 1/N.
    Held: every value's mean over T calls within 2 b + 6 sigma / sqrt(T), sigma^2 = step^2 / 4 ((N-1)/N^2 + 1)
    (over B rotated), step the reduced block's (a bound on the contributions' too: they are the same values). The
    ranks hold the same bytes at every call."""
    T, B = 40, 128
    x, mean = run_workers(_repeated_worker, N, args=(T, rotate), timeout_s=240)[0]
    x64 = x.double().numpy()
    step = steps(x64, B, rotate, 3) * (1 + 1 / 7)  # the reduced block's absmax may exceed x's by one step / N
    b = step * (2.0**-16 + slack(B, rotate))
    sigma = step / 2 * math.sqrt((N - 1) / N**2 + 1) / (math.sqrt(B) if rotate else 1)
    band = 2 * b + 6 * sigma / math.sqrt(T)
    error = np.abs(mean.numpy() - x64)
    worst = int(np.argmax(error - band))
    assert np.all(error <= band), (N, rotate, worst, error[worst], band[worst])
    assert error.max() > 0.05 * band.max()  # an error is there, within its band


def test_bad_arguments_are_refused_before_any_collective():
    """A rotation needs B a power of two; the tensor, op, block and rounding as for the 8-bit call: each refused on
    this rank, naming the argument, before any process group is touched."""
    from cerar.int4.all_reduce import int4_all_reduce

    with pytest.raises(ValueError, match="block must be a power of two to be rotated"):
        int4_all_reduce(torch.ones(8), block=96)
    with pytest.raises(ValueError, match="rotate must be true or false"):
        int4_all_reduce(torch.ones(8), rotate="yes")
    with pytest.raises(ValueError, match="must be float32"):
        int4_all_reduce(torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="rounding must be one of"):
        int4_all_reduce(torch.ones(8), rounding="up")


def _same_shard_worker(rank, N):
    """Shot 1 of the two-shot skeleton alone, on rows that are the same on every rank: the messages rank 0 receives
    (the same shard 0 from each sender)."""
    from cerar.int4.codecs import Int4Codec
    from cerar.int4.two_shot import _PeerRing, message_key, scatter_reduce
    from cerar.ring.rounds import PhaseTimer
    from cerar.ring.transport import _Rounds

    rows = gradient_like(0, N * 256).view(N, 256)
    ring = _PeerRing.of(None, 30, "test")
    timer = PhaseTimer(rows.device, enabled=False)
    rounds = _Rounds(ring, timer)
    codec = Int4Codec(128, "stochastic", True, 0)
    buffers = scatter_reduce(rows, rounds, codec, lambda j, phase: message_key(0, 0, rank, j, phase), timer)
    rounds.finish()
    return [b.clone() for b in buffers[N:]]


def test_the_senders_of_one_shard_dither_it_independently():
    """Three ranks send rank 0 the same values of shard 0: their messages differ (each sender's key holds its global
    rank), where one key for all would make them identical (and their errors add up instead of averaging)."""
    received = run_workers(_same_shard_worker, 3, timeout_s=60)[0]
    assert len(received) == 2 and not torch.equal(received[0], received[1])


def _order_worker(rank, N):
    """One flat 4-bit call with its posts (``_PeerRing.post_between``) and the codec's decodings recorded in the order
    this process made them: ("post", _) or ("decode", add)."""
    from cerar.int4 import codecs, two_shot
    from cerar.int4.all_reduce import int4_all_reduce

    events = []
    post, decode = two_shot._PeerRing.post_between, codecs.Int4Codec.decode

    def recorded_post(self, *args):
        events.append(("post", None))
        return post(self, *args)

    def recorded_decode(self, message, s, out, add=False):
        events.append(("decode", add))
        return decode(self, message, s, out, add)

    two_shot._PeerRing.post_between, codecs.Int4Codec.decode = recorded_post, recorded_decode
    int4_all_reduce(gradient_like(rank, 3 * 512), block=128, timeout=30)
    return events


def test_the_all_gather_posts_each_step_before_decoding_the_last_one():
    """Shot 2 forwards each message as it arrived, so the next step is on the wire while the last is decoded: after
    shot 1's N - 1 posts, the order is post 1, decode of this rank's own message, post 2, decode of step 1's, ...,
    decode of step N - 1's. Decoding first (the order before) puts every decoding between two transfers."""
    N = 4
    for events in run_workers(_order_worker, N, timeout_s=60):
        posts = [k for k, (what, _) in enumerate(events) if what == "post"]
        assert len(posts) == 2 * (N - 1), events
        shot2 = [what for what, add in events[posts[N - 1] :] if what == "post" or add is False]
        assert shot2 == ["post", "decode"] * (N - 1) + ["decode"], shot2
