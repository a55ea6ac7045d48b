#!/usr/bin/env python3
"""reports/fidelity.md and reports/data/fidelity.csv from the long-horizon runs (scripts/run_fidelity.sh).

Does CERAR train like exact all-reduce over thousands of steps? For every setting (folders
``<setting>_s<seed>`` under ``--runs-dir``) the report gives the reference replica's final validation
loss with its seed spread and gap to nccl, the worst replica's, train against validation loss (to tell
memorisation from aggregation effects), when the curves separate, replica drift, CERAR's aggregation
error beside the SGD noise of the same steps and its projection to Pythia's batch, and a
time-to-target-loss estimate from the per-step times measured in the 100 Mbit/s lab.

    .venv/bin/python scripts/fidelity_report.py            # the report and the CSV
    .venv/bin/python scripts/make_figures.py --only fidelity   # its figures
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from compare_training import read_metrics  # noqa: E402  (scripts/ is on sys.path)

RUNS_DIR = ROOT / "reports" / "runs" / "fidelity"
LAB_CSV = ROOT / "reports" / "data" / "training_100mbit.csv"
PLANE_CSV = ROOT / "reports" / "data" / "aggregator_plane.csv"  # scripts/aggregator_plane.py
EXACT_FLOOR = 1e-8  # where exact aggregators sit on the log-scale error axis
PYTHIA_BATCH_TOKENS = 1024 * 2048  # EleutherAI's released configs: 1024 sequences of 2048 tokens per step
HORIZON = 3000
_RUN = re.compile(r"^(?P<setting>.*)_s(?P<seed>\d+)$")


def load_runs(runs_dir: Path) -> dict[str, list[dict]]:
    """setting -> its runs (seed, metrics, summary), from folders named <setting>_s<seed>."""
    settings: dict[str, list[dict]] = {}
    for folder in sorted(p for p in Path(runs_dir).iterdir() if p.is_dir()):
        match = _RUN.match(folder.name)
        metrics = read_metrics(folder)
        if not match or not any("val_loss" in r for r in metrics):
            continue
        summary_path = folder / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        run = {"seed": int(match["seed"]), "metrics": metrics, "summary": summary, "folder": folder}
        settings.setdefault(match["setting"], []).append(run)
    return settings


def series(run: dict, key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric, in step order."""
    return [(r["step"], r[key]) for r in run["metrics"] if r.get(key) is not None]


def last_step(run: dict) -> int:
    return max(r["step"] for r in run["metrics"])


def final(run: dict, key: str) -> float | None:
    points = series(run, key)
    return points[-1][1] if points else None


def tail_mean(run: dict, key: str, steps: int = 200) -> float | None:
    """Mean of a metric over the run's last `steps` steps (train loss is noisy step to step)."""
    points = series(run, key)
    if not points:
        return None
    end = points[-1][0]
    return statistics.mean(v for s, v in points if s > end - steps)


def median_of(run: dict, key: str, after: int = 0) -> float | None:
    values = [v for s, v in series(run, key) if s > after]
    return statistics.median(values) if values else None


def spread(values: list[float]) -> str:
    return f"{min(values):.4f}..{max(values):.4f}" if len(values) > 1 else "one seed"


def separation_step(runs: list[dict], reference: list[dict]) -> int | None:
    """The first evaluation step from which the setting's mean validation loss stays outside the reference's
    seed band (min..max over its seeds, widened to +-0.2 % when it has one seed); None when it never leaves."""

    def by_step(group):
        table: dict[int, list[float]] = {}
        for run in group:
            for step, value in series(run, "val_loss"):
                table.setdefault(step, []).append(value)
        return table

    mine, ref = by_step(runs), by_step(reference)
    steps = sorted(set(mine) & set(ref))
    outside = []
    for step in steps:
        low, high = min(ref[step]), max(ref[step])
        if len(ref[step]) == 1:
            low, high = low * 0.998, high * 1.002
        value = statistics.mean(mine[step])
        outside.append(value < low or value > high)
    for k, step in enumerate(steps):
        if outside[k] and all(outside[k:]):
            return step
    return None


def lab_step_seconds(lab_csv: Path) -> dict[str, float]:
    """Mean seconds per training step in the 100 Mbit/s lab (pythia-14m, N=4), per setting measured there."""
    if not lab_csv.exists():
        return {}
    table: dict[str, list[float]] = {}
    with open(lab_csv) as f:
        for row in csv.DictReader(f):
            if row.get("ok") == "True" and row.get("step_seconds_mean"):
                table.setdefault(row["setting"], []).append(float(row["step_seconds_mean"]))
    return {k: statistics.mean(v) for k, v in table.items()}


def steps_to_reach(run: dict, target: float) -> int | None:
    for step, value in series(run, "val_loss"):
        if value <= target:
            return step
    return None


def summarize(settings: dict[str, list[dict]]) -> list[dict]:
    """One row per setting: losses, gaps, drift, error, noise."""
    nccl = settings.get("nccl", [])
    nccl_final = statistics.mean(final(r, "val_loss") for r in nccl) if nccl else None
    rows = []
    for name, runs in sorted(settings.items(), key=lambda kv: (kv[0] != "nccl", kv[0])):
        finals = [final(r, "val_loss") for r in runs]
        worst = [final(r, "val_loss_worst_replica") for r in runs]
        trains = [tail_mean(r, "train_loss") for r in runs]
        row = {
            "setting": name,
            "seeds": ",".join(str(r["seed"]) for r in runs),
            "steps": min(last_step(r) for r in runs),
            "val_loss": statistics.mean(finals),
            "val_spread": spread(finals),
            "gap_to_nccl_pct": 100 * (statistics.mean(finals) / nccl_final - 1) if nccl_final else None,
            "val_loss_worst_replica": statistics.mean(w for w in worst if w is not None) if any(worst) else None,
            "train_loss_last200": statistics.mean(trains),
            "drift_max_abs": statistics.mean(final(r, "drift/max_abs") or 0.0 for r in runs),
            "drift_rel_l2": statistics.mean(final(r, "drift/rel_l2") or 0.0 for r in runs),
            "rel_error_median": _mean_or_none([median_of(r, "agg/rel_error_max") for r in runs]),
            "noise_median": _mean_or_none([median_of(r, "noise/rel_std_mean", after=HORIZON // 10) for r in runs]),
            "separates_at": separation_step(runs, nccl) if nccl and name != "nccl" else None,
            "steps_to_nccl_final": _mean_or_none([steps_to_reach(r, nccl_final) for r in runs]) if nccl_final else None,
        }
        rows.append(row)
    return rows


def _mean_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def batch_where_error_equals_noise(error: float, noise: float, batch_tokens: int) -> float:
    """Noise shrinks as 1/sqrt(batch), CERAR's relative error does not: they meet at batch * (noise/error)^2."""
    return batch_tokens * (noise / error) ** 2


def batch_size(settings: dict[str, list[dict]]) -> tuple[int, int]:
    """(sequences, tokens) per optimizer step of the study, read from the first run's records."""
    record = next(r for r in next(iter(settings.values()))[0]["metrics"] if "noise/sequences_per_step" in r)
    return record["noise/sequences_per_step"], round(record["tokens_per_s"] * record["time/step"])


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _f(value, spec=".4f") -> str:
    return "-" if value is None else format(value, spec)


def render(
    rows: list[dict], settings: dict[str, list[dict]], lab: dict[str, float], log_lines: list[str], plane: list[dict]
) -> str:
    batch, batch_tokens = batch_size(settings)
    seq_len = batch_tokens // batch
    out = [
        "# Does CERAR train like exact all-reduce over a long run?",
        "",
        "Generated by `scripts/fidelity_report.py` from the run folders under `reports/runs/fidelity/` "
        "(written by `scripts/run_fidelity.sh A` and `B`); figures by `scripts/make_figures.py --only fidelity`.",
        "",
        f"Setup: model=tiny (GPTNeoX, 2 layers, hidden 64, Pythia init and recipe), data=embedded, N=4 ranks on gloo "
        f"(this 2-core machine, loopback), {batch} sequences x {seq_len} tokens = {batch_tokens} tokens per optimizer "
        f"step, {HORIZON} steps, the same seed (model init and data order) for every setting of a seed. "
        "Validation loss every 100 steps on a fixed set of 256 windows; drift, aggregation error and gradient "
        "noise every 50 steps. `val_loss` is the reference replica's (rank N-1: exact under CERAR, the one "
        "checkpoints keep and resync broadcasts) on the whole validation set; the worst replica's is beside it.",
        "",
        "## Final validation loss per setting",
        "",
        "| setting | seeds | steps | val loss (ref. replica) | seed spread | gap to nccl | worst replica | "
        "train loss (last 200 steps) | val - train | separates from nccl at step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        gap = "-" if r["gap_to_nccl_pct"] is None else f"{r['gap_to_nccl_pct']:+.2f} %"
        sep = "never" if r["separates_at"] is None and r["setting"] != "nccl" else _f(r["separates_at"], "d")
        out.append(
            f"| {r['setting']} | {r['seeds']} | {r['steps']} | {r['val_loss']:.4f} | {r['val_spread']} | {gap} | "
            f"{_f(r['val_loss_worst_replica'])} | {r['train_loss_last200']:.4f} | "
            f"{r['val_loss'] - r['train_loss_last200']:+.4f} | {sep} |"
        )
    out += [
        "",
        "Separation: the first evaluation from which the setting's mean validation loss stays outside nccl's seed "
        "band (min..max of its seeds) until the end.",
        "",
        "## Drift, aggregation error and SGD noise",
        "",
        "Drift is measured against the reference replica: `max_abs` = max |theta_r - theta_ref|, `rel_l2` = "
        "||theta_r - theta_ref|| / ||theta_ref||, worst rank, at the last measurement. Error: the worst rank's "
        "||g_hat - g_bar|| / ||g_bar|| (median over the run). Noise: the estimated relative standard deviation of "
        "the averaged gradient g_bar itself, from the spread of the 4 per-rank gradients (median after the first "
        f"{HORIZON // 10} steps). Pythia's batch is {PYTHIA_BATCH_TOKENS:,} tokens; noise shrinks as "
        "1/sqrt(batch) while CERAR's relative error does not, so the two meet at batch x (noise/error)^2.",
        "",
        "| setting | drift max_abs | drift rel_l2 | error (median) | noise (median) | error / noise | "
        "noise at Pythia's batch | batch (tokens) where error = noise |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        error, noise = r["rel_error_median"], r["noise_median"]
        ratio = "-" if not (error and noise) else f"{error / noise:.3g}"
        pythia_noise = noise * math.sqrt(batch_tokens / PYTHIA_BATCH_TOKENS) if noise and batch_tokens else None
        if error is not None and error <= 1e-6:
            meet = "never (exact)"
        elif error and noise:
            meet = f"{batch_where_error_equals_noise(error, noise, batch_tokens):,.0f}"
        else:
            meet = "-"
        out.append(
            f"| {r['setting']} | {r['drift_max_abs']:.3g} | {r['drift_rel_l2']:.3g} | {_f(error, '.3g')} | "
            f"{_f(noise, '.3g')} | {ratio} | {_f(pythia_noise, '.3g')} | {meet} |"
        )
    resynced = [name for name in settings if re.search(r"resync(\d+)", name)]
    for name in resynced:
        k = int(re.search(r"resync(\d+)", name)[1])
        run = settings[name][0]
        bytes_per_step = statistics.median(r["bytes_sent"] for r in run["metrics"] if r.get("bytes_sent"))
        d = run["summary"].get("parameters")
        if d:
            out += [
                "",
                f"Resync cost ({name}): a broadcast of the d = {d:,} parameters every {k} steps, in which each rank "
                f"sends at most d values: {4 * d / k:,.0f} bytes per step amortised, "
                f"{100 * 4 * d / k / bytes_per_step:.1f} % on top of the {bytes_per_step:,.0f} bytes CERAR sends "
                "per step.",
            ]
    if plane:
        out += [
            "",
            "## Bytes against error: where CERAR stands",
            "",
            "`scripts/aggregator_plane.py` (N=4, real gradients of the same model, every aggregator from the same "
            "gradients; figure `aggregator_plane.png`). Bytes are per call for the whole gradient, relative to the "
            "fp32 ring all-reduce's 2(N-1)/N d values; error is the worst rank's, median over the calls.",
            "",
            "| aggregator | bytes / fp32 ring | worst-rank error (median) | max |",
            "| --- | --- | --- | --- |",
            *(
                f"| {r['aggregator']} | {r['ratio']:.3f} | {r['error']:.3g} | {float(r['error_max']):.3g} |"
                for r in sorted(plane, key=lambda r: r["ratio"])
            ),
            "",
            "CERAR's bytes are (1 + (N-2)/c) d against the ring's 2(N-1)/N d: the ratio N(c+N-2)/(2c(N-1)) falls "
            "towards N/(2(N-1)) as c grows but never reaches it (2/3 at N=4, 4/7 at N=8, always above 1/2), and the "
            "error grows with c (more perturbation levels per kappa budget).",
            "",
            *dominance(plane),
        ]
    out += ["", "## Time to nccl's final validation loss", ""]
    out += [
        "Steps to reach nccl's mean final validation loss in this study, times the seconds per step measured in the "
        "100 Mbit/s lab (`reports/training_100mbit.md`: pythia-14m, N=4, one rank per lab host). Settings without a "
        "lab measurement are marked; they are not estimated.",
        "",
        "| setting | steps to nccl's final loss | lab s/step | estimated time s |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lab_key = "nccl" if r["setting"] == "nccl" else "cerar_c16" if r["setting"].startswith("cerar_c16_") else None
        seconds = lab.get(lab_key) if lab_key else None
        steps = r["steps_to_nccl_final"]
        estimate = "-" if seconds is None or steps is None else f"{steps * seconds:,.0f}"
        reached = "not reached" if steps is None else f"{steps:.0f}"
        out.append(f"| {r['setting']} | {reached} | {_f(seconds, '.2f')} | {estimate} |")
    if log_lines:
        out += ["", "## Runs and load", "", "```", *log_lines, "```"]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------- figures (scripts/make_figures.py draws them)


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


def figures(settings: dict[str, list[dict]], out: Path, plane_csv: Path = PLANE_CSV) -> list[Path]:
    """fidelity_{val_loss,drift,error}_vs_step.png, fidelity_noise_vs_error.png and, when plane_csv exists,
    aggregator_plane.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, color = _style(settings)
    paths = []

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name in names:
        for i, run in enumerate(settings[name]):
            label = name if i == 0 else None
            steps, values = zip(*series(run, "val_loss"), strict=True)
            top.plot(steps, values, color=color[name], linewidth=1, label=label)
            worst = series(run, "val_loss_worst_replica")
            if worst and name.startswith("cerar"):
                top.plot(*zip(*worst, strict=True), color=color[name], linewidth=0.8, linestyle=":")
            train = dict(series(run, "train_loss"))
            gap = [(s, v - train[s]) for s, v in series(run, "val_loss") if s in train]
            bottom.plot(*zip(*gap, strict=True), color=color[name], linewidth=0.8, alpha=0.7, label=label)
    top.set(ylabel="validation loss", title="validation loss (solid: reference replica, dotted: worst replica)")
    top.set_ylim(top=min(top.get_ylim()[1], 6.5))
    bottom.set(xlabel="step", ylabel="val - train loss", title="generalisation gap (memorisation shows here)")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    top.legend(fontsize=7)
    paths.append(_save(fig, out / "fidelity_val_loss_vs_step.png"))

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
    for name in names:
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
    _, batch_tokens = batch_size(settings)
    noise = statistics.median([r["noise_median"] for r in rows if r["noise_median"]] or [math.nan])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    sizes = [batch_tokens * 2**k for k in range(-2, 16)]
    ax.plot(sizes, [noise * math.sqrt(batch_tokens / b) for b in sizes], color="black",
            label="SGD noise of the mean gradient, measured here, ~ 1/sqrt(batch)")  # fmt: skip
    for r in rows:
        if r["setting"].startswith("cerar") and r["rel_error_median"]:
            ax.axhline(r["rel_error_median"], color=color[r["setting"]], linestyle="--", linewidth=1,
                       label=f"{r['setting']}: aggregation error")  # fmt: skip
    ax.axvline(batch_tokens, color="grey", linewidth=0.8)
    ax.axvline(PYTHIA_BATCH_TOKENS, color="red", linewidth=0.8)
    ax.text(batch_tokens, ax.get_ylim()[0], " this study", fontsize=7, va="bottom")
    ax.text(PYTHIA_BATCH_TOKENS, ax.get_ylim()[0], " Pythia (1024 x 2048)", fontsize=7, va="bottom", color="red")
    ax.set(xscale="log", yscale="log", xlabel="tokens per optimizer step", ylabel="relative to ||g_bar||",
           title="noise against CERAR's error as the batch grows")  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "fidelity_noise_vs_error.png"))
    return paths + plane_figure(plane_csv, out)


def read_plane(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [
            {**row, "ratio": float(row["bytes_ratio_to_fp32_ring"]), "error": float(row["error_median"])}
            for row in csv.DictReader(f)
        ]


def dominance(plane: list[dict]) -> list[str]:
    """Which CERAR points of the plane fp16 compression beats on both bytes and error."""
    by_name = {r["aggregator"]: r for r in plane}
    fp16 = by_name.get("fp16")
    cerar = [r for r in plane if r["aggregator"].startswith("cerar") and r["error"] > EXACT_FLOOR * 10]
    if fp16 is None or not cerar:
        return []
    beaten = [r["aggregator"] for r in cerar if r["ratio"] >= fp16["ratio"] and r["error"] >= fp16["error"]]
    lines = [
        f"fp16 compression sends {fp16['ratio']:.2f} of the fp32 ring at an error of {fp16['error']:.2g}"
        + (f" (bf16: {by_name['bf16']['ratio']:.2f} at {by_name['bf16']['error']:.2g})" if "bf16" in by_name else "")
        + ". "
    ]
    if beaten:
        lines[0] += (
            f"It dominates {len(beaten)} of the {len(cerar)} approximate CERAR settings measured here "
            f"({', '.join(beaten)}): fewer bytes and less error. "
        )
    closest = min(cerar, key=lambda r: r["error"])
    lines[0] += (
        f"CERAR's most accurate approximate setting here, {closest['aggregator']}, sends {closest['ratio']:.2f} at "
        f"{closest['error']:.2g}. CERAR is worth its error only where 16-bit transport is ruled out, or on top of "
        "it: CERAR in 16-bit transport needs kappa = 1 (c <= N), where it saves nothing over the ring."
    )
    return lines


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    ap.add_argument("--lab-csv", type=Path, default=LAB_CSV)
    ap.add_argument("--plane-csv", type=Path, default=PLANE_CSV)
    ap.add_argument("--csv", type=Path, default=ROOT / "reports" / "data" / "fidelity.csv")
    ap.add_argument("--report", type=Path, default=ROOT / "reports" / "fidelity.md")
    ap.add_argument("--log", type=Path, default=ROOT / "reports" / "logs" / "fidelity_runs.log")
    args = ap.parse_args(argv)
    settings = load_runs(args.runs_dir)
    if not settings:
        print(f"no runs under {args.runs_dir}", file=sys.stderr)
        return 1
    rows = summarize(settings)
    write_csv(rows, args.csv)
    log_lines = args.log.read_text().splitlines() if args.log.exists() else []
    plane = read_plane(args.plane_csv)
    args.report.write_text(render(rows, settings, lab_step_seconds(args.lab_csv), log_lines, plane))
    print(f"wrote {args.report} and {args.csv} ({len(rows)} settings)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
