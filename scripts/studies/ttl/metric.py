"""The time-to-loss study's arithmetic (issue 53): the target every run crosses, the time and step it crosses at,
the end state's confidence interval, the steady state's phases, aggregator=auto's costs spread over its run.

The target. A setting's target is nccl's mean validation loss, over its seeds in that setting, at its evaluation
``target_step``: the first evaluation at or after ``FRACTION`` of the horizon (step 150 of 300). Every run of the
study's rows crosses it mid-run (all 74 runs by step 165), where the loss still falls about 0.2 in the second half:
no run's time to it is its wall time, unlike a target at nccl's final loss (issue 34's), which every run's loss
reaches at its last evaluation if at all, so that that time was the wall time and "never reached" a gap of a
fraction of one step.

The crossing. With a run's evaluations (s_i, t_i, L_i) in order (step, ``time/wall`` after the evaluation,
validation loss), k the first with L_k <= target:

    f = (L_{k-1} - target) / (L_{k-1} - L_k),   step = s_{k-1} + f (s_k - s_{k-1}),   time = t_{k-1} + f (t_k - t_{k-1})

linear in step and in wall time between the two evaluations around the crossing. k = 0 (the first evaluation
already at or below): its own step and time. No such k: the run never crosses (None).

The end state, judged apart: each seed's gap to nccl's final loss at the same seed, L / L_nccl - 1 (paired: the
same seed gives both runs the same initial weights and batches), their mean with a two-sided ``LEVEL`` Student t
interval on n - 1 degrees of freedom (n seeds; none for one seed), beside nccl's own seed band (``report``).

The steady state. Every aggregator of a setting is timed over the same steps, ``steady_window``: after auto's
exact warm-up (``settings.WARMUP_STEPS``), before the last step, leaving out any step that carries a check
(``time/auto``, ``time/auto_c``). Over them: the step, the aggregation phase, and forward + backward, which is the
same work for every aggregator of a setting: its ratio to nccl's is the contention the run met, not its
aggregator's cost.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scripts.studies.ttl.settings import WARMUP_STEPS

FRACTION = 0.5
"""Where the target is taken: nccl's loss at the first evaluation at or after this fraction of the horizon."""
LEVEL = 0.95
"""The confidence level of the end state's interval (two-sided)."""
CHECKS = ("time/auto", "time/auto_c")
"""The phases of a step that holds an auto's check: such a step is not steady state."""


def target_step(evaluated: list[int], horizon: int, fraction: float = FRACTION) -> int | None:
    """The first of the ``evaluated`` steps at or after ``fraction`` x ``horizon`` (None: none there)."""
    return next((s for s in sorted(evaluated) if s >= fraction * horizon), None)


def target(nccl_runs: list[list[tuple[int, float, float]]], horizon: int) -> tuple[int, float, int] | None:
    """(step, loss, runs): nccl's mean validation loss at ``target_step`` of its first run's evaluations, over
    those of its runs (their evaluations: ``rows.evaluations``) that evaluated at that step; None without one."""
    runs = [run for run in nccl_runs if run]
    if not runs:
        return None
    step = target_step([s for s, _, _ in runs[0]], horizon)
    losses = [loss for run in runs for s, _, loss in run if s == step]
    if step is None or not losses:
        return None
    return step, statistics.fmean(losses), len(losses)


@dataclass(frozen=True)
class Crossing:
    """Where a run's validation loss first reached the target (module docstring): the interpolated step and wall
    seconds, and the evaluation at or below it (``at``)."""

    step: float
    seconds: float
    at: int


def crossing(points: list[tuple[int, float, float]], goal: float) -> Crossing | None:
    """The run's crossing of ``goal`` from its evaluations (step, wall seconds, loss), interpolated between the
    evaluations around it (module docstring); None: it never reaches it."""
    for k, (step, seconds, loss) in enumerate(points):
        if loss > goal:
            continue
        if k == 0:
            return Crossing(float(step), float(seconds), step)
        s0, t0, l0 = points[k - 1]
        f = (l0 - goal) / (l0 - loss)
        return Crossing(s0 + f * (step - s0), t0 + f * (seconds - t0), step)
    return None


def paired_gaps(points: list[tuple[int, float, float]], nccl: list[tuple[int, float, float]]
                ) -> list[tuple[int, float]]:  # fmt: skip
    """(step, L / L_nccl - 1) at every step both runs evaluated, in the run's order: the gap paired by seed (the
    same initial weights and batches) and by step, the course of the end state's gap (``report``'s quarters, the
    figures' right panel)."""
    theirs = {step: loss for step, _, loss in nccl}
    return [(step, loss / theirs[step] - 1) for step, _, loss in points if theirs.get(step)]


def t_interval(values: list[float], level: float = LEVEL) -> tuple[float, float | None]:
    """(mean, half-width) of the two-sided Student t interval at ``level`` on n - 1 degrees of freedom; the
    half-width is None for fewer than two values (no spread to estimate)."""
    if not values:
        raise ValueError("t_interval needs at least one value")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    from scipy.special import stdtrit  # Student t's quantile (scipy.stats's t.ppf, without importing scipy.stats)

    quantile = float(stdtrit(len(values) - 1, (1 + level) / 2))
    return mean, quantile * statistics.stdev(values) / math.sqrt(len(values))


def steady_window(horizon: int, warmup: int = WARMUP_STEPS) -> range:
    """The steps every aggregator of a setting is timed over: after the warm-up, before the last step (a run too
    short for that: from step 2, step 1 paying one-time costs)."""
    first = warmup + 1 if warmup + 1 < horizon else 2
    return range(first, horizon)


def phases(metrics: list[dict], window: range) -> dict | None:
    """Mean seconds per step over the window's steps that hold no check: ``step`` (time/step), ``aggregate``
    (time/aggregate), ``compute`` (time/forward + time/backward), and how many ``steps``; None: no such step."""
    steady = [r for r in metrics if r.get("step") in window and "time/step" in r and not any(c in r for c in CHECKS)]
    if not steady:
        return None
    return {
        "step": statistics.fmean(float(r["time/step"]) for r in steady),
        "aggregate": statistics.fmean(float(r.get("time/aggregate", 0.0)) for r in steady),
        "compute": statistics.fmean(float(r.get("time/forward", 0.0)) + float(r.get("time/backward", 0.0))
                                    for r in steady),  # fmt: skip
        "steps": len(steady),
    }


def amortized(metrics: list[dict], steady_step: float, warmup: int = WARMUP_STEPS) -> dict:
    """An auto run's seconds per step over its whole run, split (each over the run's steps H): ``steady`` its
    steady-state step; ``warmup`` what its steps 1..warmup took above it (the exact warm-up: nccl's price, and
    one-time costs); ``checks`` its checks (time/auto, time/auto_c, wherever they fall); ``rest`` the remainder
    (the steady window's spread, the last step); ``total`` the mean of time/step, the four summed."""
    steps = [r for r in metrics if "time/step" in r]
    H = len(steps)
    checks = sum(float(r.get(c, 0.0)) for r in steps for c in CHECKS)
    warm = sum(float(r["time/step"]) - sum(float(r.get(c, 0.0)) for c in CHECKS) - steady_step
               for r in steps if r["step"] <= warmup)  # fmt: skip
    total = sum(float(r["time/step"]) for r in steps)
    return {"steady": steady_step, "warmup": warm / H, "checks": checks / H,
            "rest": (total - checks - warm) / H - steady_step, "total": total / H}  # fmt: skip
