"""Aggregation error against SGD noise per parameter tensor, as Adam sees it.

Adam divides each parameter's step by that parameter's own running gradient scale, so an aggregation error is
harmless only if it is small against what that tensor's gradient already carries, tensor by tensor: a layer
norm's gains or a bias whose gradient is small but mostly aggregation error take full-size steps in a wrong
direction, and the whole gradient's norm, dominated by the embeddings and the large matrices, cannot see it.

The criterion (docs/auto.md, "per tensor"): for each parameter tensor t, with g_r,t rank r's gradient, g_bar_t
their exact mean and g_hat_t what an aggregator gave a rank,

    rho_t = ||g_hat_t - g_bar_t|| / sigma_t,   sigma_t = sqrt(sum_r ||g_r,t - g_bar_t||^2 / (N (N - 1))),

sigma_t being the standard deviation of g_bar_t around its expectation, estimated from the N per-rank
gradients (the whole-gradient `noise/rel_std_mean` is sqrt(sum_t sigma_t^2) / ||g_bar||). An aggregation fits
when max_t rho_t (its worst rank's) is at most the error budget: each tensor then receives, on top of the noise
its optimizer already averages over, an error `budget` times smaller than that noise. Why against the noise
and not against Adam's sqrt(v_t): v_t tracks E[g_bar_t^2] = (signal)^2 + sigma_t^2 >= sigma_t^2, so an error
within budget x sigma_t is within budget x sqrt(v_t) as well (the noise is the stricter yardstick, and the
trainer logs both: `agg/tensor_error_to_adam_max`); and the noise needs no optimizer state, so both autos can
measure it at their first check. sum_t rho_t^2 sigma_t^2 / sum_t sigma_t^2 is the whole-gradient ratio
squared, so max_t rho_t is never below it: the per-tensor criterion only ever asks for more accuracy.

The autos measure rho_t on a sample (`TensorSample`): a candidate's arithmetic mixes or scales values in units
(CERAR's columns, int8's blocks; `train/aggregation/auto_choice.py` `Candidate`), and a sample of whole units keeps its
error. The units are drawn with Poisson sampling, each with probability pi_s = max_{t in s} min(1, lambda_t
(z_s / Z_t + 1 / U_t) / 2): z_s the unit's squared norm summed over the ranks, Z_t the sum of z over the U_t units
tensor t has values in, and lambda_t such that tensor t expects exactly min(k, U_t) units of its own (water-filling,
`inclusion`: what a unit drawn with certainty cannot take goes to the others; lambda_t = k where none reaches 1).
So every tensor expects k units of its own (a tensor of at most k units all of them), half drawn in proportion to
their size and half uniformly: the heavy units that a uniform draw would miss (values large on some ranks that
cancel in the sum among them) are drawn with probability near 1, and the ordinary units that heavy ones would crowd
out of a draw by size alone are still drawn (measured: tests/test_tensor_errors.py). The Horvitz-Thompson estimate
of each tensor's squared error, sum_s a_s,t / pi_s, is unbiased whatever z is, and its variance, sum_s (1 - pi_s)
a_s,t^2 / pi_s^2, is estimated from the same sample; units drawn with certainty contribute no variance.

A tensor that is zero on every rank (an unused parameter) has no noise and, since every aggregator returns it as
zeros (`TensorLayout.zero`), no error: rho 0. A tensor with no noise and an error (identical on every rank, yet
mixed with its column-mates) has rho = inf: no inexact candidate fits it, a decision and not evidence to refuse;
only nan (a non-finite gradient) is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.functional import pad

from train.aggregation.auto_c import SIGMAS, unit_indices
from train.distributed import bounded

PER_TENSOR_UNITS = 32
"""k: the units each tensor expects in a sample (a tensor with at most k units gets all of them)."""


def per_tensor_units(sample_values: int, tensors: int, values_per_unit: int) -> int:
    """k, the units each tensor is expected to get in a check's sample, from aggregator.auto_sample_values (about
    how many values a check samples per rank) over T tensors of units of `values_per_unit` values (every part's
    and piece's): 0 means every unit; otherwise at least PER_TENSOR_UNITS."""
    if sample_values <= 0:
        return 0
    return max(PER_TENSOR_UNITS, sample_values // max(1, tensors * values_per_unit))


@dataclass(frozen=True)
class TensorLayout:
    """The parameter tensors of a flat gradient: their names and sizes, in the flat order (FlatGradients')."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes) or not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"TensorLayout: {len(self.names)} names for sizes {self.sizes[:8]}...: need one "
                             "name per tensor and every size >= 1")  # fmt: skip

    @classmethod
    def of(cls, named_params) -> TensorLayout:
        """The layout of (name, parameter) pairs that require a gradient, in the order given."""
        pairs = [(name, p.numel()) for name, p in named_params if p.requires_grad]
        return cls(tuple(n for n, _ in pairs), tuple(s for _, s in pairs))

    @classmethod
    def single(cls, d: int) -> TensorLayout:
        """One tensor of d values: the whole-gradient view."""
        return cls(("all",), (d,))

    @property
    def d(self) -> int:
        return sum(self.sizes)

    def ends(self, device=None) -> torch.Tensor:
        """Each tensor's end offset in the flat gradient (int64)."""
        return torch.tensor(self.sizes, dtype=torch.int64, device=device).cumsum(0)

    def tensor_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The tensor index of each flat position (positions >= d: T, out of range)."""
        return torch.searchsorted(self.ends(positions.device), positions, right=True)

    def squared_norms(self, x: torch.Tensor) -> torch.Tensor:
        """||x_t||^2 per tensor (float64 [T]): one fused norm over the split views, no copy of x."""
        if x.numel() != self.d:
            raise ValueError(f"TensorLayout: a flat tensor of {x.numel()} values for a layout of {self.d}")
        norms = torch._foreach_norm(list(x.split(self.sizes)), 2, dtype=torch.float64)  # accumulated in float64
        return torch.stack(norms).square()

    def zero(self, exact: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Which tensors are zero on every rank (bool [T]): no spread (sigma_t = 0, `tensor_noise`: every rank's
        g_r,t equals g_bar_t bit for bit, since the float64 sum of the float32 differences' squares is 0 only then)
        and an exact mean g_bar_t of zero. Every aggregator returns such a tensor as zeros, its exact mean: the
        exact ones, the casts and int8 round 0 to 0, and the coded ones restore it
        (train/aggregation/aggregators.py `keeping_zero_tensors`, `cerar.ring.equilibrate.equilibrated`), so the
        autos set a sample's values there to 0 after a candidate's call, as its call on the whole gradient does."""
        return (noise.cpu() == 0) & (self.squared_norms(exact).cpu() == 0)


def tensor_noise(local: torch.Tensor, exact: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """sigma_t per tensor (float64 [T], the same on every rank): the standard deviation of g_bar_t estimated from
    the spread of the N per-rank gradients (module docstring). Every rank calls (one all-reduce of T values)."""
    N = dist.get_world_size()
    spread = layout.squared_norms(local - exact)
    bounded("per-tensor noise all_reduce", lambda: dist.all_reduce(spread, async_op=True))
    return (spread.cpu() / (N * (N - 1))).sqrt()


def stacked_noise(G: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """sigma_t per tensor (float64 [T]) from every rank's gradient stacked [N, d] (as `tensor_noise` measures it
    across a process group)."""
    G = G.double()
    N = G.shape[0]
    spread = sum(layout.squared_norms(g) for g in G - G.mean(0))
    return (spread / (N * (N - 1))).sqrt()


def ratio_to_noise(error_squared: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """rho_t = sqrt(error_squared_t) / sigma_t; 0 where both are 0 (nothing to err), inf where only the noise
    is 0 (an error on a tensor that carries none); nan stays nan (evidence to refuse, not to read)."""
    error = error_squared.sqrt()
    ratio = error / noise
    ratio = torch.where((noise == 0) & (error == 0), torch.zeros_like(ratio), ratio)
    return torch.where((noise == 0) & (error > 0), torch.full_like(ratio, math.inf), ratio)


def per_tensor_figures(
    local: torch.Tensor, aggregated: torch.Tensor, exact: torch.Tensor, layout: TensorLayout, optimizer=None,
    params=None,
) -> dict:  # fmt: skip
    """The trainer's per-tensor figures at a measured step (every rank calls): each tensor's error against its
    noise, the worst rank's (`tensor/<name>`), the worst tensor's ratio and name, the worst tensor's relative
    error ||g_hat_t - g_bar_t|| / ||g_bar_t||, and, given an Adam optimizer whose state holds exp_avg_sq for
    `params`, the worst ||g_hat_t - g_bar_t|| / ||sqrt(v_t)|| (the yardstick Adam divides by)."""
    noise = tensor_noise(local, exact, layout)
    diff = aggregated - exact
    error_squared = layout.squared_norms(diff)
    relative = (error_squared / layout.squared_norms(exact).clamp_min(1e-300)).sqrt()
    adam = torch.zeros(len(layout.sizes), dtype=torch.float64)
    if optimizer is not None and params is not None:
        second = [optimizer.state.get(p, {}).get("exp_avg_sq") for p in params]
        if all(v is not None for v in second):
            scale = torch.stack(torch._foreach_norm(torch._foreach_sqrt(second), 2, dtype=torch.float64)).cpu()
            adam = error_squared.cpu().sqrt() / scale.clamp_min(1e-300)
    ratio = ratio_to_noise(error_squared.cpu(), noise)
    both = torch.stack([ratio, relative.cpu(), adam]).to(exact.device)
    bounded("per-tensor error all_reduce", lambda: dist.all_reduce(both, dist.ReduceOp.MAX, async_op=True))
    ratio, relative, adam = both.cpu()
    worst = int(ratio.nan_to_num(math.inf).argmax())
    record = {
        "agg/tensor_error_to_noise_max": float(ratio[worst]),
        "agg/worst_tensor": layout.names[worst],
        "agg/tensor_rel_error_max": float(relative.max()),
    }
    if optimizer is not None and float(adam.max()) > 0:
        record["agg/tensor_error_to_adam_max"] = float(adam.max())
    record.update({f"tensor/{name}": float(r) for name, r in zip(layout.names, ratio.tolist(), strict=True)})
    return record


# --------------------------------------------------------------------------------------------- the sample


def _grid(x: torch.Tensor, d: int, parts: int, pieces: int, unit: int) -> torch.Tensor:
    """x (d values) laid out as a call with `parts` shards of `pieces` pieces of units sees it: [parts, pieces,
    slots, unit], zero-padded where a shard, a piece or a unit runs past the values (train/aggregation/auto_c.py
    `sample_indices`' layout)."""
    P = -(-d // parts)
    M = -(-P // pieces)
    slots = -(-M // unit)
    grid = _pad_end(x, parts * P - d).view(parts, P)
    grid = _pad_end(grid, pieces * M - P).view(parts, pieces, M)
    return _pad_end(grid, slots * unit - M).view(parts, pieces, slots, unit)


def _pad_end(x: torch.Tensor, extra: int) -> torch.Tensor:
    """x with `extra` zeros after its last dimension's values; x itself where there are none (a pad of width 0
    still copies: three copies of the gradient per layout at a check, issue 53)."""
    return pad(x, (0, extra)) if extra else x


def unit_sizes(local: torch.Tensor, parts: int, pieces: int, unit: int) -> torch.Tensor:
    """z_s, each unit's squared norm summed over the ranks (float64 [units], the same on every rank): the sizes
    a `TensorSample` is drawn in proportion to. Every rank calls (one all-reduce of d / (parts pieces unit)
    values)."""
    grid = _grid(local.float(), local.numel(), parts, pieces, unit)
    z = torch.linalg.vector_norm(grid, 2, dim=(0, 1, 3), dtype=torch.float64).square()  # no float32 square
    bounded("per-tensor sample sizes all_reduce", lambda: dist.all_reduce(z, async_op=True))
    return z.cpu()


def _tensor_slot_ranges(layout: TensorLayout, parts: int, pieces: int, unit: int):
    """(tensor, first slot, end slot) for each stretch of a tensor inside one (shard, piece) cell: the units
    (slots) the tensor has values in."""
    d = layout.d
    P = -(-d // parts)
    M = -(-P // pieces)
    start = 0
    for t, size in enumerate(layout.sizes):
        end = start + size
        position = start
        while position < end:
            q, within = divmod(position, P)
            k, offset = divmod(within, M)
            cell_end = min(q * P + min((k + 1) * M, P), d)
            stop = min(end, cell_end)
            yield t, offset // unit, -(-(offset + stop - position) // unit)
            position = stop
        start = end


def _tensor_units(layout: TensorLayout, parts: int, pieces: int, unit: int):
    """For each tensor, the units it has values in, as sorted disjoint (first slot, end slot) ranges: the union of
    its stretches over the (shard, piece) cells (a tensor longer than a piece meets the same slots in two cells)."""
    ranges: list[list[tuple[int, int]]] = [[] for _ in layout.sizes]
    for t, lo, hi in _tensor_slot_ranges(layout, parts, pieces, unit):
        ranges[t].append((lo, hi))
    for stretches in ranges:
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(stretches):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        yield merged


def inclusion(share: torch.Tensor, K: int) -> torch.Tensor:
    """Inclusion probabilities pi_s = min(1, lambda share_s) over one tensor's units whose expected count,
    sum_s pi_s, is exactly K (<= the number of units): lambda found by water-filling, since the units whose
    probability reaches 1 give up the rest of their share. The first rule, pi_s = min(1, k share_s), lost that
    mass: a tensor of 17-64 units with one heavy unit (share ~1/2, pi = 1) expected 16-17 units, not 32 (issue 51).
    Only the K largest shares can reach 1, so only they are sorted."""
    U = share.numel()
    if K >= U:
        return torch.ones_like(share)
    top = torch.topk(share, K).values  # descending
    rest = float(share.sum()) - torch.cat([top.new_zeros(1), top.cumsum(0)[:-1]])  # mass below the j largest
    lam = (K - torch.arange(K, dtype=torch.float64)) / rest  # lambda with the j largest at 1
    j = int(torch.nonzero(lam * top <= 1)[0])  # the fewest at 1 that leave the (j+1)-th below it (j = K-1 always)
    return (lam[j] * share).clamp(max=1.0)


@dataclass
class TensorSample:
    """A Poisson sample of a call's units (module docstring) drawn for every tensor: `indices` the sampled
    values' flat positions in the call's layout (`sample_indices`' format: d where padding), `count` the units
    drawn, `pi` each drawn unit's inclusion probability, `tensor` each sampled value's tensor (T: padding)."""

    indices: torch.Tensor
    count: int
    pi: torch.Tensor
    tensor: torch.Tensor
    slot_of_value: torch.Tensor
    layout: TensorLayout

    @classmethod
    def draw(
        cls, z: torch.Tensor, layout: TensorLayout, parts: int, pieces: int, unit: int, generator: torch.Generator,
        per_tensor: int = PER_TENSOR_UNITS, pi: torch.Tensor | None = None,
    ) -> TensorSample:  # fmt: skip
        """Draw the sample from the units' sizes z (`unit_sizes`: the same on every rank, so with the same
        generator state every rank draws the same units); per_tensor = 0 draws every unit. `pi`, the units'
        inclusion probabilities (`inclusion`) where the caller has them from a draw of the same z, layout and
        per_tensor: the same draw without computing them again."""
        pi = cls.inclusion(z, layout, parts, pieces, unit, per_tensor) if pi is None else pi
        draw = torch.rand(pi.numel(), generator=generator, dtype=torch.float64)
        picked = torch.nonzero(draw < pi).reshape(-1)
        count = picked.numel()
        indices = unit_indices(layout.d, parts, pieces, unit, picked)
        slot_of_value = torch.arange(count).view(1, 1, count, 1).expand(parts, pieces, count, unit).reshape(-1)
        return cls(indices, count, pi[picked], layout.tensor_of(indices), slot_of_value, layout)

    @staticmethod
    def inclusion(z: torch.Tensor, layout: TensorLayout, parts: int, pieces: int, unit: int,
                  per_tensor: int = PER_TENSOR_UNITS) -> torch.Tensor:  # fmt: skip
        """pi_s, each unit's inclusion probability (float64 [units], module docstring) from the units' sizes z:
        each tensor t expects min(k, U_t) units of its own (the module's `inclusion`), a unit holding values of
        several tensors the largest of their probabilities for it; per_tensor = 0: every unit."""
        z = z.double().cpu()
        slots = z.numel()
        pi = torch.ones(slots, dtype=torch.float64) if per_tensor <= 0 else torch.zeros(slots, dtype=torch.float64)
        for units in _tensor_units(layout, parts, pieces, unit) if per_tensor > 0 else ():
            w = torch.cat([z[lo:hi] for lo, hi in units])  # z_s over the tensor's U_t units
            Z, U = float(w.sum()), w.numel()
            share = ((w / Z if Z > 0 else torch.zeros_like(w)) + 1 / U) / 2
            mine = inclusion(share, min(per_tensor, U))
            offset = 0
            for lo, hi in units:
                pi[lo:hi] = torch.maximum(pi[lo:hi], mine[offset : offset + hi - lo])
                offset += hi - lo
        return pi

    def scales(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """Each sampled value's scale from per-tensor scales (an aggregator's `tensor_scales`; padding: 1)."""
        return torch.cat([per_tensor, per_tensor.new_ones(1)])[self.tensor.to(per_tensor.device)]

    def in_tensors(self, which: torch.Tensor) -> torch.Tensor:
        """Whether each sampled value lies in one of the tensors `which` marks (bool per tensor; padding: False)."""
        return torch.cat([which.cpu().bool(), torch.zeros(1, dtype=torch.bool)])[self.tensor]

    def values(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's values at the sample's positions (zero at padding), in the call's layout."""
        indices = self.indices.to(flat.device)
        return flat[indices.clamp(max=flat.numel() - 1)].masked_fill_(indices >= flat.numel(), 0)

    def estimate(self, squared_errors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(estimate, variance) of each tensor's squared error from the sampled values' squared errors (float64
        [T] each; Horvitz-Thompson, module docstring)."""
        T = len(self.layout.sizes)
        kept = self.tensor < T
        e = squared_errors.double().cpu()[kept]
        tensor, slot = self.tensor[kept], self.slot_of_value[kept]
        key = slot * T + tensor
        keys, inverse = torch.unique(key, return_inverse=True)
        a = torch.zeros(keys.numel(), dtype=torch.float64).index_add_(0, inverse, e)  # a_s,t
        pi = self.pi[keys // T]
        estimate = torch.zeros(T, dtype=torch.float64).index_add_(0, keys % T, a / pi)
        variance = torch.zeros(T, dtype=torch.float64).index_add_(0, keys % T, (1 - pi) * a.square() / pi.square())
        return estimate, variance


def worst_tensor(estimate: torch.Tensor, variance: torch.Tensor, noise: torch.Tensor) -> tuple[float, float, int]:
    """(rho, standard error, tensor) of the tensor whose bound rho_t + SIGMAS se_t is the largest, from a squared
    error estimate and its variance per tensor and the tensors' noise (delta method: se of sqrt(E) is
    sqrt(V) / (2 sqrt(E))). A tensor with no noise and an error is (inf, 0): certain, since an estimate above 0
    comes from some unit that erred, and it fits no budget (docs/auto.md: only the candidates that leave it
    exact fit). Input that is not finite (a nan gradient) is returned as nan: evidence to refuse, never a pass or
    a fail."""
    if not (torch.isfinite(estimate).all() and torch.isfinite(variance).all() and torch.isfinite(noise).all()):
        return math.nan, 0.0, 0
    rho = ratio_to_noise(estimate.clamp_min(0), noise)
    root = estimate.clamp_min(0).sqrt()
    se = torch.where(root > 0, variance.clamp_min(0).sqrt() / (2 * root), torch.zeros_like(root))
    se = torch.where(noise > 0, se / noise, torch.zeros_like(se))  # no noise: rho is 0 or inf, with certainty
    bound = rho + SIGMAS * se
    t = int(bound.argmax())
    return float(rho[t]), float(se[t]), t


def worst_rank_tensor_error(
    G: torch.Tensor, code, sample: TensorSample, noise: torch.Tensor, scales: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
) -> tuple[float, float, int]:  # fmt: skip
    """(rho, standard error, tensor) of `code`'s worst rank and worst tensor (by rho + SIGMAS se) on per-rank
    values G [N, c x count] at a `TensorSample` of columns (1 part, c pieces, unit 1): S_hat_i from
    `cerar.simulate` in G's dtype, S the exact sum in float64, each rank's error of the mean (S_hat_i - S) / N
    estimated per tensor against `noise` (sigma_t). `scales` (one per sampled value), where the aggregator
    equilibrates, multiply G before the simulated call and divide its result after, as the call does. `zero`
    (per tensor, `TensorLayout.zero`): the tensors zero on every rank, which the call returns as zeros."""
    import cerar

    N = G.shape[0]
    S_hat = cerar.simulate(G if scales is None else G * scales, code).double()
    if scales is not None:
        S_hat /= scales.double()
    S = G.double().sum(0)
    if zero is not None:
        S_hat[:, sample.in_tensors(zero)] = 0.0
    worst = (-math.inf, 0.0, 0)
    for i in range(N):
        estimate, variance = sample.estimate(((S_hat[i] - S) / N).square())
        rho, se, t = worst_tensor(estimate, variance, noise)
        if math.isnan(rho + se):
            return math.nan, 0.0, t
        if rho + SIGMAS * se > worst[0] + SIGMAS * worst[1]:
            worst = (rho, se, t)
    return worst
