"""Errors judged per parameter tensor, as Adam sees them (train/aggregation/tensor_errors.py).

The story: a small tensor beside a large one carries an aggregation error that the whole gradient's figure
cannot see, and the trainer's per-tensor figures name it, each held to a float64 reference computed here from
the per-rank gradients; the autos estimate each tensor's error from a sample that draws units for every tensor,
and the estimate plus two standard errors covers the true worst tensor's error (computed here on every column
with the spec's protocol) in at least 90 % of draws, also when a few columns hold large values that cancel
across ranks, where a uniform sample of the same size misses most of them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.distributed import run_workers
from tests.spec_reference import spec_all_reduce
from tests.test_spec_reference import spec_code_matrices

N = 4
SIZES = (30_000, 64, 5_000, 200, 12_000)  # a matrix, a norm's gains, a matrix, a bias, an embedding
SCALES = (1.0, 1e-3, 0.3, 1e-2, 1.0)  # decades apart, as a model's tensors are


def layout():
    from train.aggregation.tensor_errors import TensorLayout

    return TensorLayout(tuple(f"t{i}" for i in range(len(SIZES))), SIZES)


def per_rank_gradients(seed: int = 0, heavy: float = 0.0) -> np.ndarray:
    """N gradients mu + noise, each tensor at its own scale; with `heavy`, 1 in 2,000 positions holds +heavy on
    rank 0 and -heavy on rank 1: large values that cancel in the sum."""
    rng = np.random.default_rng(seed)

    def draw():
        return np.concatenate([s * rng.standard_normal(n) for s, n in zip(SCALES, SIZES, strict=True)])

    mu = draw()
    G = np.stack([mu + 0.5 * draw() for _ in range(N)])
    if heavy:
        positions = rng.choice(G.shape[1], size=G.shape[1] // 2000, replace=False)
        G[0, positions] += heavy
        G[1, positions] -= heavy
    return G.astype(np.float32)


def reference_ratios(G: np.ndarray, aggregated: np.ndarray) -> np.ndarray:
    """rho_t per rank [N, T] from the definition (float64): ||g_hat_t - g_bar_t|| / sigma_t, sigma_t^2 =
    sum_r ||g_r,t - g_bar_t||^2 / (N (N - 1))."""
    G, aggregated = G.astype(np.float64), aggregated.astype(np.float64)
    mean = G.mean(0)
    bounds = np.cumsum((0, *SIZES))
    out = np.zeros((G.shape[0], len(SIZES)))
    for t, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        sigma = math.sqrt(((G[:, lo:hi] - mean[lo:hi]) ** 2).sum() / (N * (N - 1)))
        out[:, t] = np.linalg.norm(aggregated[:, lo:hi] - mean[lo:hi], axis=1) / sigma
    return out


# ------------------------------------------------------------------ the trainer's figures


def _figures_worker(rank, world_size, aggregated):
    from train.aggregation.tensor_errors import per_tensor_figures
    from train.loop import error_and_noise

    local = torch.from_numpy(per_rank_gradients()[rank])
    exact = local.clone()
    torch.distributed.all_reduce(exact)
    exact /= world_size
    mine = torch.from_numpy(aggregated[rank])
    return {**error_and_noise(local, mine, exact, rank), **per_tensor_figures(local, mine, exact, layout())}


def test_the_small_tensor_the_whole_gradient_hides_is_named():
    G = per_rank_gradients()
    mean = G.astype(np.float64).mean(0)
    aggregated = np.repeat(mean[None], N, 0)
    bias = slice(SIZES[0], SIZES[0] + SIZES[1])  # t1, the norm's gains at 1e-3
    aggregated[2, bias] += 0.02 * np.sign(mean[bias])  # an error 20x the gains themselves, on one rank
    aggregated = aggregated.astype(np.float32)
    results = run_workers(_figures_worker, N, args=(aggregated,))
    ratios = reference_ratios(G, aggregated)
    for record in results:  # every rank logs the worst rank's figures
        assert record["agg/worst_tensor"] == "t1"
        assert record["agg/tensor_error_to_noise_max"] == pytest.approx(ratios.max(), rel=1e-4)
        for t in range(len(SIZES)):
            assert record[f"tensor/t{t}"] == pytest.approx(ratios[:, t].max(), rel=1e-4, abs=1e-6)
    # the whole gradient's figure: error below 1 % of its noise, while the gains' error is over 10x theirs
    whole = results[0]["agg/rel_error_max"] / results[0]["noise/rel_std_mean"]
    assert whole < 0.01 and ratios.max() > 10


# ------------------------------------------------------------------ the autos' sample


def true_worst(G: np.ndarray, code) -> float:
    """The worst rank's worst tensor's rho under `code`, every column, by the spec's protocol (float64)."""
    c = code.c
    d = G.shape[1]
    m = -(-d // c)
    padded = np.pad(G.astype(np.float64), ((0, 0), (0, c * m - d)))
    decoded = np.stack(spec_all_reduce(padded, *spec_code_matrices(code)))[:, :d] / N
    return reference_ratios(G, decoded).max()


def draws(G: np.ndarray, code, seeds: int, uniform: bool = False) -> list[tuple[float, float]]:
    """(rho, standard error) of the worst rank's worst tensor, from `seeds` samples (a TensorSample, or a
    uniform sample of as many columns, estimated without standard error)."""
    import cerar
    from train.aggregation.auto_c import sample_indices
    from train.aggregation.tensor_errors import TensorSample, _grid, stacked_noise, worst_rank_tensor_error

    Gt = torch.from_numpy(G)
    d, c = Gt.shape[1], code.c
    z = _grid(Gt.square().sum(0), d, 1, c, 1).sum((0, 1, 3)).double()
    sigma = stacked_noise(Gt, layout())
    out = []
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(seed)
        sample = TensorSample.draw(z, layout(), 1, c, 1, generator)
        if not uniform:
            values = Gt[:, sample.indices.clamp(max=d - 1)].masked_fill(sample.indices >= d, 0)
            rho, se, _ = worst_rank_tensor_error(values, code, sample, sigma)
            out.append((rho, se))
            continue
        indices, count, total = sample_indices(d, 1, c, 1, sample.count * c, generator)
        values = Gt[:, indices.clamp(max=d - 1)].masked_fill(indices >= d, 0)
        errors = ((cerar.simulate(values, code).double() - values.double().sum(0)) / N).square()
        tensor = layout().tensor_of(indices)
        worst = 0.0
        for e in errors:
            estimate = torch.zeros(len(SIZES) + 1, dtype=torch.float64).index_add_(0, tensor, e)[:-1] * total / count
            worst = max(worst, float((estimate.sqrt() / sigma).max()))
        out.append((worst, 0.0))
    return out


@pytest.mark.parametrize("heavy", [0.0, 300.0])
def test_the_sample_covers_the_worst_tensor(heavy):
    import cerar

    G = per_rank_gradients(seed=1, heavy=heavy)
    code = cerar.make_code(N, 8, construction="perturbation", kappa_max=50)  # errs ~1e-2..1e-1, far above rounding
    truth = true_worst(G, code)
    assert truth > 1e3 * 50 * 2.0**-24  # the case is meaningful: the code's error, not float32's rounding
    estimates = draws(G, code, seeds=60)
    rho = np.array([r for r, _ in estimates])
    bounds = np.array([r + 2 * se for r, se in estimates])
    assert truth / 1.25 < np.median(rho) < truth * 1.25, (truth, np.median(rho))  # the estimate, not its margin
    assert np.median(bounds - rho) < rho.mean(), estimates[:5]  # standard errors of a usable size
    coverage = np.mean(truth <= bounds * (1 + 1e-9))
    assert coverage >= 0.9, (coverage, truth, estimates[:5])
    assert bounds.min() > truth / 1.5, (truth, bounds.min())  # never far below: no tensor or heavy column lost
    if heavy:  # a uniform sample of as many columns misses the heavy ones: its estimate falls short
        uniform = [r for r, _ in draws(G, code, seeds=60, uniform=True)]
        assert np.mean([truth <= u for u in uniform]) < 0.5


@pytest.mark.quick
def test_every_unit_drawn_gives_each_tensor_exactly():
    """per_tensor = 0 draws every unit: each tensor's estimate is its error summed, with no variance."""
    import cerar
    from train.aggregation.tensor_errors import TensorSample, _grid, stacked_noise, worst_rank_tensor_error

    G = per_rank_gradients(seed=2)
    code = cerar.make_code(N, 5, construction="perturbation", kappa_max=50)
    Gt = torch.from_numpy(G)
    d = Gt.shape[1]
    z = _grid(Gt.square().sum(0), d, 1, 5, 1).sum((0, 1, 3)).double()
    sample = TensorSample.draw(z, layout(), 1, 5, 1, torch.Generator(), per_tensor=0)
    values = Gt[:, sample.indices.clamp(max=d - 1)].masked_fill(sample.indices >= d, 0)
    rho, se, _ = worst_rank_tensor_error(values, code, sample, stacked_noise(Gt, layout()))
    assert se == 0.0 and rho == pytest.approx(true_worst(G, code), rel=1e-5)


@pytest.mark.quick
def test_nan_evidence_is_not_a_ratio():
    from train.aggregation.tensor_errors import ratio_to_noise, worst_tensor

    assert ratio_to_noise(torch.tensor([0.0, 4.0, 4.0]), torch.tensor([0.0, 0.0, 1.0])).tolist() == [0, math.inf, 2]
    rho, _, _ = worst_tensor(torch.tensor([1.0, math.nan]), torch.zeros(2), torch.ones(2))
    assert math.isnan(rho)


@pytest.mark.quick
def test_a_draw_given_its_probabilities_is_the_same_draw_and_the_grid_copies_nothing_it_need_not():
    """The first check of aggregator=auto draws one sample per candidate; candidates of one layout (fp16 and bf16,
    CERAR's c over 32- and 16-bit messages) share the units' inclusion probabilities, computed once (issue 53):
    given them, a draw is the draw that computes them, unit for unit, from the same generator state. Where a
    layout needs no padding the grid is a view of the values (a pad of width 0 would copy the gradient)."""
    from train.aggregation.tensor_errors import TensorSample, _grid

    G = torch.from_numpy(per_rank_gradients(seed=3))
    d = G.shape[1]
    for parts, pieces, unit in ((1, 1, 1), (1, 5, 1), (2, 4, 16)):
        z = _grid(G.square().sum(0), d, parts, pieces, unit).sum((0, 1, 3)).double()
        pi = TensorSample.inclusion(z, layout(), parts, pieces, unit, 40)
        first = TensorSample.draw(z, layout(), parts, pieces, unit, torch.Generator().manual_seed(7), 40)
        again = TensorSample.draw(z, layout(), parts, pieces, unit, torch.Generator().manual_seed(7), 40, pi)
        assert 0 < first.count < z.numel()  # a sample, not every unit
        assert torch.equal(first.indices, again.indices) and torch.equal(first.pi, again.pi)
        assert torch.equal(first.tensor, again.tensor) and first.count == again.count
    x = torch.arange(12.0)
    assert _grid(x, 12, 1, 3, 4).data_ptr() == x.data_ptr()  # 12 = 1 x 3 x 4: nothing to pad
    assert _grid(x, 12, 1, 5, 1).flatten()[:12].tolist() == x.tolist()  # 12 into 5 pieces of 3: padded with 3 zeros
    assert _grid(x, 12, 1, 5, 1).sum() == x.sum() and _grid(x, 12, 1, 5, 1).numel() == 15


@pytest.mark.quick
@pytest.mark.parametrize("units", [17, 40, 64])
def test_a_tensor_with_one_heavy_unit_still_expects_k_units_of_its_own(units):
    """k = 32 units per tensor (a tensor of at most 32 units: all of them), counted in 400 draws: a tensor of 17-64
    units whose one heavy unit is drawn with certainty beside ordinary ones. The first rule, pi = min(1, k share),
    gave the heavy unit's surplus to nobody: such a tensor expected 16-17 units (issue 51 drew 7-18)."""
    from train.aggregation.tensor_errors import PER_TENSOR_UNITS, TensorLayout, TensorSample

    sizes = (500, units, 300)  # the middle tensor between two large ones, units of one value (CERAR's columns)
    layout = TensorLayout(("before", "small", "after"), sizes)
    z = torch.from_numpy(np.random.default_rng(0).uniform(0.5, 1.5, sum(sizes)))
    z[sizes[0] + units // 2] = 1e6  # the heavy unit: values large on some ranks
    counts = []
    generator = torch.Generator().manual_seed(1)
    for _ in range(400):
        sample = TensorSample.draw(z, layout, 1, 1, 1, generator, PER_TENSOR_UNITS)
        counts.append(int((sample.tensor == 1).sum()))
    expected = min(PER_TENSOR_UNITS, units)
    # Poisson sampling: the count's standard deviation is at most sqrt(expected) / 2 ... sqrt(expected), so the
    # mean of 400 draws lies within 0.3 of its expectation at 1 sigma; 1.0 is over 3 sigma
    assert abs(np.mean(counts) - expected) < 1.0, (np.mean(counts), expected)
    if units <= PER_TENSOR_UNITS:
        assert min(counts) == units  # a small tensor: every unit, every time
