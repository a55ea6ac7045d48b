"""The fidelity study's figures (scripts/reporting/make_figures.py draws them): validation loss per setting, the
gaps, the drift, and the aggregators' error-against-bytes plane."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from scripts.reporting.fidelity.batch_scaling import noise_from_ratio, noise_unit, ratio_at
from scripts.reporting.fidelity.plane import read_plane
from scripts.reporting.fidelity.runs import (
    EXACT_FLOOR,
    PLANE_CSV,
    PYTHIA_SEQ_LEN,
    PYTHIA_SEQUENCES,
    batch_size,
    complete_settings,
    series,
    summarize,
)

# ------------------------------------------------------------- figures (scripts/reporting/make_figures.py draws them)


def _style(settings: dict[str, list[dict]]):
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = sorted(settings, key=lambda s: (s != "nccl", s))
    return names, {s: cycle[i % len(cycle)] for i, s in enumerate(names)}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def mean_before(points: list[tuple[int, float]], step: int, window: int = 100) -> float | None:
    """Mean of the values logged in the `window` steps up to `step` (one step's train loss is too noisy)."""
    values = [v for s, v in points if step - window < s <= step]
    return statistics.mean(values) if values else None


def val_loss_figure(settings: dict[str, list[dict]], path: Path, corpus: str = "") -> Path:
    """Validation loss against step for every setting that ran the whole horizon, with the val - train gap
    below it (memorisation shows there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, color = _style(settings)
    complete = complete_settings(settings)
    whole = [name for name in names if name in complete]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name in whole:
        for i, run in enumerate(settings[name]):
            label = name if i == 0 else None
            steps, values = zip(*series(run, "val_loss"), strict=True)
            top.plot(steps, values, color=color[name], linewidth=1, label=label)
            worst = series(run, "val_loss_worst_replica")
            if worst and name.startswith("cerar"):
                top.plot(*zip(*worst, strict=True), color=color[name], linewidth=0.8, linestyle=":")
            train = series(run, "train_loss")
            val_train = [(s, v, mean_before(train, s)) for s, v in series(run, "val_loss")]
            gap = [(s, v - t) for s, v, t in val_train if t is not None]
            bottom.plot(*zip(*gap, strict=True), color=color[name], linewidth=0.8, alpha=0.7, label=label)
    title = f"{corpus}validation loss (solid: reference replica, dotted: worst replica)"
    top.set(ylabel="validation loss", title=title)
    top.set_ylim(top=min(top.get_ylim()[1], 6.5))
    gap_title = "val - train loss, train averaged over the 100 steps before (memorisation shows here)"
    bottom.set(xlabel="step", ylabel="val - train loss", title=gap_title)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    top.legend(fontsize=7)
    return _save(fig, path)


def figures(
    settings: dict[str, list[dict]],
    out: Path,
    plane_csv: Path = PLANE_CSV,
    grown: dict[str, list[dict]] | None = None,
    batch_rows: list[dict] | None = None,
) -> list[Path]:
    """fidelity_{val_loss,drift,error}_vs_step.png, fidelity_noise_vs_error.png (the noise projected to Pythia's
    batch in the unit `batch_rows`, the batch-scaling study's, measured; not projected without them), with the runs
    on the grown corpus fidelity_corpus_v2_val_loss_vs_step.png, and, when plane_csv exists, aggregator_plane.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, color = _style(settings)
    complete = complete_settings(settings)
    whole = [name for name in names if name in complete]
    paths = [val_loss_figure(settings, out / "fidelity_val_loss_vs_step.png")]
    if grown:
        paths.append(val_loss_figure(grown, out / "fidelity_corpus_v2_val_loss_vs_step.png", "embedded corpus v2: "))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax in zip(("drift/rel_l2", "drift/max_abs"), axes, strict=True):
        for name in names:
            for i, run in enumerate(settings[name]):
                points = [(s, v) for s, v in series(run, key) if v > 0]
                if points:
                    ax.plot(*zip(*points, strict=True), color=color[name], linewidth=1, label=name if i == 0 else None)
        ax.set(xlabel="step", ylabel=key, yscale="log", title=f"{key} against the reference replica")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    paths.append(_save(fig, out / "fidelity_drift_vs_step.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in whole:
        for i, run in enumerate(settings[name]):
            error = [(s, v) for s, v in series(run, "agg/rel_error_max") if v > 0]
            if error:
                ax.plot(*zip(*error, strict=True), color=color[name], linewidth=1, label=name if i == 0 else None)
    nccl_noise = [p for run in settings.get("nccl", []) for p in series(run, "noise/rel_std_mean")]
    if nccl_noise:
        ax.plot(*zip(*sorted(nccl_noise), strict=True), color="black", linestyle="--", linewidth=1,
                label="SGD noise of the mean gradient (nccl runs)")  # fmt: skip
    ax.set(xlabel="step", ylabel="relative to ||g_bar||", yscale="log",
           title="worst rank's aggregation error and the gradient noise at the same steps")  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "fidelity_error_vs_step.png"))

    rows = summarize(settings)
    sequences, batch_tokens = batch_size(settings)
    seq_len = batch_tokens // sequences
    noise = statistics.median([r["noise_median"] for r in rows if r["noise_median"]] or [math.nan])
    unit = noise_unit(batch_rows or [])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.scatter(
        [sequences], [noise], color="black", marker="x", label=f"SGD noise, this study ({sequences} x {seq_len})"
    )
    measured = [r for r in batch_rows or [] if r["setting"] == "nccl" and r["noise_median"]]
    for i, r in enumerate(measured):
        label = "SGD noise, batch-scaling study (label: tokens per sequence)" if i == 0 else None
        ax.scatter(r["sequences"], r["noise_median"], marker="o", facecolors="none", edgecolors="black", label=label)
        ax.annotate(str(r["seq_len"]), (r["sequences"], r["noise_median"]), fontsize=7, xytext=(4, -9),
                    textcoords="offset points")  # fmt: skip
    title = "noise against CERAR's error as the batch grows"
    if unit and unit["r_pythia"] is not None:
        counts = [sequences * 2**k for k in range(-2, 13)]
        a, b = unit["sequences_exponent"], unit["seq_len_exponent"]
        projected = [noise_from_ratio(ratio_at(unit, n, PYTHIA_SEQ_LEN)) for n in counts]
        label = f"projected at {PYTHIA_SEQ_LEN} tokens per sequence: r ~ sequences^-{a:.2f} x seq_len^-{b:.2f}"
        ax.plot(counts, projected, color="black", label=label)
    else:
        title += " (not projected: the batch-scaling runs have not measured its unit)"
    for r in rows:
        if r["setting"].startswith("cerar") and r["rel_error_median"]:
            ax.axhline(r["rel_error_median"], color=color[r["setting"]], linestyle="--", linewidth=1,
                       label=f"{r['setting']}: aggregation error")  # fmt: skip
    ax.axvline(sequences, color="grey", linewidth=0.8)
    ax.axvline(PYTHIA_SEQUENCES, color="red", linewidth=0.8)
    at_bottom = ax.get_xaxis_transform()  # x in data, y in axes fractions
    ax.text(sequences, 0.02, " this study", fontsize=7, transform=at_bottom)
    ax.text(PYTHIA_SEQUENCES, 0.02, f" Pythia ({PYTHIA_SEQUENCES} x {PYTHIA_SEQ_LEN})", fontsize=7, color="red",
            transform=at_bottom)  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="sequences per optimizer step", ylabel="relative to ||g_bar||",
           title=title)  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2)  # below: the axes are full
    paths.append(_save(fig, out / "fidelity_noise_vs_error.png"))
    return paths + plane_figure(plane_csv, out)


def plane_figure(plane_csv: Path, out: Path) -> list[Path]:
    """aggregator_plane.png: bytes per call (relative to the fp32 ring all-reduce) against worst-rank error."""
    rows = read_plane(plane_csv)
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        error = max(row["error"], EXACT_FLOOR)
        marker = "o" if row["aggregator"].startswith("cerar") else "s"
        ax.scatter(row["ratio"], error, marker=marker)
        ax.annotate(row["aggregator"], (row["ratio"], error), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.axhline(EXACT_FLOOR, color="grey", linewidth=0.5)
    ax.text(ax.get_xlim()[0], EXACT_FLOOR, " exact", fontsize=7, va="bottom", color="grey")
    ax.set(xlabel="bytes a rank sends per call / fp32 ring all-reduce's 2(N-1)/N d", xscale="log",
           ylabel="worst rank's relative error (median over calls)", yscale="log",
           title="every aggregator, N=4, real gradients of model=tiny")  # fmt: skip
    ax.grid(True, alpha=0.3)
    return [_save(fig, out / "aggregator_plane.png")]


def batch_scaling_figure(rows: list[dict], path: Path) -> Path:
    """batch_scaling_gap.png: same-seed gap against tokens per step with nccl's band (left), error/noise and
    c=auto's choice against tokens per step (right); circles vary sequences, squares sequence length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = min(rows, key=lambda r: (r["tokens_per_step"], r["sequences"]))
    marker = lambda r: "o" if r["seq_len"] == base["seq_len"] else "s"  # noqa: E731
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    bands = sorted({(r["tokens_per_step"], r["nccl_band_pct"]) for r in rows if r["nccl_band_pct"] is not None})
    if bands:
        xs, widths = zip(*bands, strict=True)
        left.fill_between(xs, [-w for w in widths], widths, color="grey", alpha=0.25, label="nccl's seed band")
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    settings = sorted({r["setting"] for r in rows} - {"nccl"})
    for i, name in enumerate(settings):
        mine = sorted((r for r in rows if r["setting"] == name), key=lambda r: r["tokens_per_step"])
        for r in mine:
            if r["paired_gap_pct"] is not None:
                left.scatter(r["tokens_per_step"], r["paired_gap_pct"], color=cycle[i % len(cycle)], marker=marker(r))
            if r["error_over_noise"]:
                right.scatter(r["tokens_per_step"], r["error_over_noise"], color=cycle[i % len(cycle)],
                              marker=marker(r))  # fmt: skip
                if name.endswith("auto") and r["c_chosen"]:
                    right.annotate(f"c={r['c_chosen']}", (r["tokens_per_step"], r["error_over_noise"]), fontsize=7,
                                   xytext=(4, 3), textcoords="offset points")  # fmt: skip
        left.plot([], [], color=cycle[i % len(cycle)], label=name)
    left.axhline(0, color="black", linewidth=0.5)
    left.set(xscale="log", xlabel="tokens per optimizer step", ylabel="val loss gap to nccl, same seed (%)",
             title="gap against batch (circles: more sequences, squares: longer sequences)")  # fmt: skip
    right.set(xscale="log", yscale="log", xlabel="tokens per optimizer step", ylabel="worst-rank error / noise",
              title="aggregation error over gradient noise; c=auto's choice")  # fmt: skip
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    return _save(fig, path)
