"""Measure the links a job runs on, in the cost model's terms: a tier's alpha (seconds per round) and bandwidth
(bytes per second per direction of one link), and the memory bandwidth the arithmetic streams at.

    timings = time_ring(group, sizes=(4096, 65536, 1 << 20), reps=5, timeout=60)  # every member calls
    tier, rel_rmse = fit_tier(timings, n=group.size(), memory_bandwidth=probe_memory_bandwidth(device))

How: cerar's exact ``ring_all_reduce`` of d float32 values, timed on the group's own members at a few sizes
(the fastest of ``reps`` calls after one untimed call that makes the connections; growing x4 until the bytes
dominate the time), is 2 (n-1) rounds and
2 (n-1) ceil(d/n) x 4 bytes per rank plus the additions' memory traffic (``costmodel.two_tier_features``,
the features the model predicts with). With the memory term taken from ``probe_memory_bandwidth`` (a timed
in-place add), ``fit_tier`` fits alpha, beta = 1 / bandwidth >= 0 to the rest by least squares on relative
residuals, as ``costmodel.fit`` fits the lab's rows. So a tier measured this way is priced by the same
features it was measured with, and a prediction for another aggregator on it extrapolates only in the
bytes and rounds it sends.

Under load (issue 34: the probe gave up at 50 % RMS beside other jobs on a shared 2-core machine, leaving
aggregator=auto exact): contention only ever adds time, so a size whose calls all met a loaded moment sits
above the link's line. ``misfits`` names the sizes above the line by more than ``MISS``, which the caller
times again and keeps the faster of (``train.aggregation.auto_aggregator.measure_links`` does, collectively), and
``robust_fit`` leaves out at most one such slow size when at least ``MIN_SIZES_KEPT`` remain. Timings with no
bytes term, or that miss any line, are still refused.

What it does not see: a link's contention by other jobs, and (for a tier's bandwidth) the sharing of a NIC
by several rails unless the caller times the rails alone and together (``NicSharing``); the timings are of
this process's calls, so a caller that wants every rank to decide alike agrees them first (e.g. an
all-reduce of the maxima).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from cerar.planning import costmodel

DEFAULT_SIZES = (1 << 12, 1 << 15, 1 << 18)
"""Values (float32) per probe call to start with: 16 KiB .. 1 MiB (``time_ring`` adds larger ones until the
bytes dominate)."""
MAX_VALUES = 1 << 24
"""The largest probe call: 64 MiB of float32."""
BYTES_DOMINATE = (8.0, 0.05)
"""``time_ring`` grows its calls (x4) until the largest takes 8 x the smallest's time and at least 50 ms, so
that the bandwidth term stands above the rounds' (and the scheduler's) noise: on loopback 1 MiB is latency."""
MAX_FIT_RMSE = 0.5
"""A fit whose relative residuals exceed this is not a measurement of a link (``fit_tier`` refuses it)."""
MISS = 0.25
"""A size whose time is above the fitted line by more than this met contention: ``measure_links`` times it again
(keeping the faster), and ``robust_fit`` may leave one such size out when the fit misses by more than this."""
MIN_SIZES_KEPT = 3
"""A fit that leaves a size out keeps at least this many (two would fit any alpha and beta exactly)."""


class LinkProbeError(RuntimeError):
    """A probe whose timings no alpha + bytes / bandwidth describes (or that could not run)."""


def sync_device(device: torch.device) -> None:
    """Wait for this rank's queued device work (CUDA; nothing on a CPU), so that a host clock times it."""
    if device.type == "cuda":  # after a bounded cerar call: the stream holds only this rank's own work
        torch.cuda.synchronize(device)


def time_ring(
    group,
    sizes=DEFAULT_SIZES,
    reps: int = 5,
    timeout=60.0,
    device=None,
    grow: bool = True,
    statistic=min,
) -> list[tuple[int, float]]:
    """(d, seconds) of cerar's exact ring all-reduce of d float32 values on ``group`` for each size, and (with
    ``grow``) for sizes 4x larger until ``BYTES_DOMINATE`` holds or ``MAX_VALUES`` is reached. A collective:
    every member calls it with the same arguments. Each size's seconds are the members' mean of their fastest of
    ``reps`` calls (averaged by the same ring, so every member takes the same sizes and returns the same rows):
    a busy CPU or a neighbour's traffic only ever adds time, so the fastest call is the link's (on the lab's 8
    ranks over 2 cores the medians missed any alpha + bytes / bandwidth by 44-55 % RMS). Where the contention is
    what is measured (several groups sharing a link at once, each timing its own calls), pass
    ``statistic=statistics.median``: the fastest call may be one the other groups happened to leave alone.
    One untimed call first makes the connections. The calls keep cerar's per-round deadlines (``timeout``), so a
    stalled member ends the probe with cerar's error, never a hang."""
    from cerar.ring.protocol import ring_all_reduce

    if reps < 1:
        raise ValueError(f"time_ring: reps must be >= 1, got {reps!r}")
    device = torch.device("cpu") if device is None else torch.device(device)
    ring_all_reduce(torch.ones(max(sizes), device=device), group, timeout=timeout, timed=False)

    def timed(d: int) -> float:
        x = torch.ones(d, device=device)
        seconds = []
        for _ in range(reps):
            sync_device(device)
            start = time.perf_counter()
            ring_all_reduce(x, group, timeout=timeout, timed=False)
            sync_device(device)
            seconds.append(time.perf_counter() - start)
        agreed = torch.tensor([float(statistic(seconds))], dtype=torch.float64, device=device)
        ring_all_reduce(agreed, group, op="avg", timeout=timeout, timed=False)
        return float(agreed)

    rows = [(int(d), timed(int(d))) for d in sizes]
    ratio, floor = BYTES_DOMINATE
    while grow and rows[-1][0] < MAX_VALUES and rows[-1][1] < max(ratio * rows[0][1], floor):
        d = min(4 * rows[-1][0], MAX_VALUES)
        rows.append((d, timed(d)))
    return rows


def probe_memory_bandwidth(device=None, values: int = 1 << 22, reps: int = 3) -> float:
    """Bytes per second of an in-place float32 add of ``values`` values (read 4 + 4, write 4 bytes a value):
    the rate ``costmodel``'s gamma term streams the arithmetic at. The fastest of ``reps`` timed adds."""
    device = torch.device("cpu") if device is None else torch.device(device)
    x, y = torch.ones(values, device=device), torch.ones(values, device=device)
    x.add_(y)  # untimed: pages and kernels in place
    best = math.inf
    for _ in range(reps):
        sync_device(device)
        start = time.perf_counter()
        x.add_(y)
        sync_device(device)
        best = min(best, time.perf_counter() - start)
    return 12 * values / max(best, 1e-9)


def ring_features(d, n: int) -> np.ndarray:
    """(rounds, bytes sent, bytes the additions move) of one rank's exact ring all-reduce of d float32 values
    over n ranks: ``costmodel.two_tier_features`` of the flat ring on one node of n ranks."""
    x = costmodel.two_tier_features("ring", d, 1, n)
    return np.array([x[0], x[1], x[4]], dtype=float)


def _solve(timings: list[tuple[int, float]], n: int, memory_bandwidth: float) -> tuple[float, float, np.ndarray]:
    """(alpha, beta, predicted seconds) of the least-squares fit on relative residuals (alpha, beta >= 0)."""
    X = np.array([ring_features(d, n) for d, _ in timings])
    measured = np.array([t for _, t in timings])
    y = measured - X[:, 2] / memory_bandwidth
    A = X[:, :2] / measured[:, None]  # relative residuals: small and large calls weigh alike
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    alpha, beta = costmodel._nonneg_lstsq(A / scale, y / measured) / scale
    return float(alpha), float(beta), X[:, 0] * alpha + X[:, 1] * beta + X[:, 2] / memory_bandwidth


def _rms(predicted: np.ndarray, timings: list[tuple[int, float]]) -> float:
    measured = np.array([t for _, t in timings])
    return float(np.sqrt(np.mean(((predicted - measured) / measured) ** 2)))


def robust_fit(
    timings: list[tuple[int, float]], n: int, memory_bandwidth: float
) -> tuple[float, float, float, list[tuple[int, float]]]:
    """(alpha, beta, relative RMS over the sizes kept, the sizes left out) of ``fit_tier``'s rule: the fit on
    every size, or, when that misses by more than ``MISS`` (RMS) and ``MIN_SIZES_KEPT`` sizes would remain, the
    best fit with one size left out, provided that size took longer than the fit predicts for it by more than
    ``MISS``. Why: contention (a busy CPU, a neighbour's traffic) only ever adds time, so one size that all its
    calls met at a loaded moment sits above the link's line and drags the fit off it; a size that is faster
    than the line is no such accident, and is never left out. No check of the result (``fit_tier`` checks)."""
    alpha, beta, predicted = _solve(timings, n, memory_bandwidth)
    rms = _rms(predicted, timings)
    if rms <= MISS or len(timings) - 1 < MIN_SIZES_KEPT:
        return alpha, beta, rms, []
    best = None
    for i in range(len(timings)):
        kept = timings[:i] + timings[i + 1 :]
        a, b, p = _solve(kept, n, memory_bandwidth)
        own = float(ring_features(timings[i][0], n) @ [a, b, 1 / memory_bandwidth])
        if not (b > 0 and timings[i][1] > (1 + MISS) * own):  # only a slow size is contention's, on a link's line
            continue
        r = _rms(p, kept)
        if best is None or r < best[2]:
            best = (a, b, r, [timings[i]])
    return best if best is not None and best[2] < rms else (alpha, beta, rms, [])


def misfits(timings: list[tuple[int, float]], n: int, memory_bandwidth: float) -> list[int]:
    """The sizes (d) worth timing again: those above ``robust_fit``'s line by more than ``MISS``, or every size
    when the timings give no bytes term. Every member that holds the same (agreed) timings names the same sizes,
    so a caller can re-time them collectively (``train.aggregation.auto_aggregator.measure_links``)."""
    if len(timings) < 2:
        return [d for d, _ in timings]
    alpha, beta, _, _ = robust_fit(timings, n, memory_bandwidth)
    if not beta > 0:
        return [d for d, _ in timings]
    return [d for d, t in timings if t > (1 + MISS) * float(ring_features(d, n) @ [alpha, beta, 1 / memory_bandwidth])]


def fit_tier(
    timings: list[tuple[int, float]], n: int, memory_bandwidth: float, name: str = ""
) -> tuple[costmodel.Tier, float]:
    """(Tier, relative RMS residual) fitted to ``time_ring``'s timings on n ranks: seconds = alpha rounds +
    bytes / bandwidth + moved / memory_bandwidth, by ``robust_fit`` (one slow size may be left out; the Tier's
    note names it, and the RMS is over the sizes kept). Raises LinkProbeError when the timings do not describe a
    link (fewer than 2 sizes, a non-positive time, no bandwidth term, or residuals above ``MAX_FIT_RMSE``)."""
    if n < 2:
        raise LinkProbeError(f"fit_tier: a tier of {n} rank has no links to measure")
    if len(timings) < 2 or any(not (t > 0 and math.isfinite(t)) for _, t in timings):
        raise LinkProbeError(f"fit_tier: need at least 2 positive timings, got {timings!r}")
    if not memory_bandwidth > 0:
        raise LinkProbeError(f"fit_tier: memory_bandwidth must be > 0, got {memory_bandwidth!r}")
    alpha, beta, rel_rmse, left_out = robust_fit(list(timings), n, memory_bandwidth)
    if not beta > 0:
        raise LinkProbeError(f"fit_tier: the timings {timings!r} grow with no bytes term (bandwidth unmeasurable)")
    if not rel_rmse <= MAX_FIT_RMSE:
        raise LinkProbeError(
            f"fit_tier ({name or f'{n} ranks'}): alpha + bytes / bandwidth misses the timings by {rel_rmse:.0%} "
            f"(RMS; at most {MAX_FIT_RMSE:.0%}): " + ", ".join(f"{d} values {1e3 * t:.3g} ms" for d, t in timings)
        )
    note = f"measured: {len(timings)} sizes"
    if left_out:
        note += ", left out (slow): " + ", ".join(f"{d} values {1e3 * t:.3g} ms" for d, t in left_out)
    return costmodel.Tier(alpha, 1 / beta, name, note), rel_rmse


@dataclass(frozen=True)
class NicSharing:
    """How many of a node's G rails share one NIC, from one size timed on one rail alone and on all rails at
    once: G x (alone / together) NICs, rounded, within [1, G] (one shared NIC: together takes G times as
    long; a NIC per rail: as long)."""

    alone_s: float
    together_s: float
    local_size: int

    @property
    def nics_per_node(self) -> int:
        if not (self.alone_s > 0 and self.together_s > 0):
            raise LinkProbeError(f"NicSharing: timings must be > 0, got {self}")
        G = self.local_size
        return int(min(G, max(1, round(G * self.alone_s / self.together_s))))
