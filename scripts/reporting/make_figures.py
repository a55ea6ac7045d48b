#!/usr/bin/env python3
# ruff: noqa: E501
"""Rebuild every figure in reports/ from run data.

Sources
-------
* training runs: the local run folders (default ``reports/runs/training/<setting>_s<seed>/`` with
  ``metrics.jsonl`` + ``summary.json``, as written by ``scripts/bench/compare_training.py``), or W&B runs
  with ``--wandb ENTITY/PROJECT`` (public API, needs network and, for private projects, a login);
* ``reports/data/allreduce.csv`` (``scripts/bench/bench_allreduce.py``);
* ``reports/data/code_design.csv`` (``python -m cerar.planning.design``).

Figures (into ``reports/figures/``)
-----------------------------------
* ``val_loss_vs_step.png``, ``val_loss_vs_wall.png``: validation loss per aggregator (one line per
  seed); wall time = cumulative ``time/step`` (evaluations excluded);
* ``phase_bars.png``: mean forward/backward/aggregate/optimizer seconds per step per aggregator;
* ``time_vs_size_<where>[_<rate>].png``, ``saving_vs_c.png``, ``achieved_vs_byte_bound.png``: from
  the all-reduce CSV (``scripts/bench/allreduce/figures.py``);
* ``error_vs_kappa.png``: worst-worker error against kappa (``cerar.planning.design.plot_error_vs_kappa``);
* ``fidelity_{val_loss,drift,error}_vs_step.png``, ``fidelity_noise_vs_error.png``: the long-horizon
  runs under ``reports/runs/fidelity/`` (``scripts/reporting/fidelity/figures.py``), and
  ``fidelity_corpus_v2_val_loss_vs_step.png`` from those on the grown corpus (``reports/runs/fidelity-corpus-v2/``),
  and ``batch_scaling_gap.png`` from the batch-scaling runs (``reports/runs/batch-scaling-150/``) once they exist;
* ``saving_vs_N.png``: 1 - t_cerar / t_ref against N at c = 4N: measured (lab rows of the CSV, against
  the ring and against the backend all_reduce) and modelled (``cerar.planning.costmodel`` fitted to the same
  setting's rows), with the byte-count bound;
* ``two_tier_choice.png``: which aggregator on clusters of 8-GPU nodes, from the two-tier cost model alone
  (``scripts/reporting/costmodel/two_tier.py``);
* ``aggregators_gap_vs_bytes.png``: the 1,500-step aggregators study under ``reports/runs/aggregators-1500/``
  (``scripts/reporting/aggregators_report.figure``);
* ``tensors_error_to_noise.png``: each aggregator's error against each parameter tensor's noise, before and after
  the per-tensor fixes (``reports/runs/tensors-1500/``; ``scripts/reporting/tensors_report.figure``), and
  ``tensors_error_to_noise_pythia14m.png`` the same at pythia-14m after them (``reports/runs/tensors-pythia-14m/``);
* ``time_to_loss_<setting>.png``: validation loss against wall clock per setting of the time-to-loss study
  (``reports/data/time_to_loss.csv``, ``reports/runs/time_to_loss/``; ``scripts/studies/ttl/report.figures``);
* ``two_tier_lab_<where>_<rate>.png`` from ``reports/data/hierarchical_lab.csv``
  (``scripts/hierarchical_report.figures``) and ``two_tier_*`` training figures from
  ``reports/runs/training_hierarchical/``, once ``scripts/bench/run_hierarchical_lab.sh`` has measured them (until
  then they are skipped with a message, also under ``--strict``, unless ``--only hierarchical`` asks for them).

A missing source skips its figures with a message; ``--strict`` makes that an error.

    .venv/bin/python scripts/reporting/make_figures.py
    .venv/bin/python scripts/reporting/make_figures.py --wandb my-entity/cerar-pythia
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench.compare_training import read_metrics  # noqa: E402  (the repository root is on sys.path)

PHASES = ("forward", "backward", "aggregate", "optimizer")
_RUN_RE = re.compile(r"^(.*)_s(\d+)$")


# --------------------------------------------------------------------------- loading runs


def _run(setting: str, seed: int | None, metrics: list[dict], summary: dict) -> dict:
    return {"setting": setting, "seed": seed, "metrics": sorted(metrics, key=lambda r: r.get("step", 0)),
            "summary": summary}  # fmt: skip


def setting_name(aggregator: str, c) -> str:
    """The compare_training name of a run: cerar settings carry c."""
    return f"{aggregator}_c{c}" if aggregator.startswith("cerar") and c not in (None, "") else aggregator


def load_local_runs(runs_dir: Path) -> list[dict]:
    """Every folder under runs_dir holding a metrics.jsonl (setting and seed from '<setting>_s<seed>')."""
    runs = []
    for mp in sorted(Path(runs_dir).rglob("metrics.jsonl")):
        d = mp.parent
        metrics = read_metrics(d)
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
        m = _RUN_RE.match(d.name)
        if m:
            setting, seed = m.group(1), int(m.group(2))
        else:
            setting, seed = setting_name(summary.get("aggregator", d.name), summary.get("c")), None
        runs.append(_run(setting, seed, metrics, summary))
    return runs


def runs_from_wandb(api_runs: Iterable) -> list[dict]:
    """Shape W&B runs (objects with .config, .summary, .scan_history()) like local run folders."""
    runs = []
    for r in api_runs:
        cfg = dict(r.config)
        agg = cfg.get("aggregator", {})
        agg_name = agg.get("name") if isinstance(agg, dict) else cfg.get("aggregator/name", agg)
        summary = {k: v for k, v in dict(r.summary).items() if not str(k).startswith("_")}
        metrics = []
        for row in r.scan_history():
            row = {k: v for k, v in dict(row).items() if v is not None}
            if "_step" in row and "step" not in row:
                row["step"] = row["_step"]
            metrics.append({k: v for k, v in row.items() if not str(k).startswith("_")})
        runs.append(_run(setting_name(str(agg_name), cfg.get("c")), cfg.get("seed"), metrics, summary))
    return runs


def load_wandb_runs(path: str) -> list[dict]:  # pragma: no cover - needs network
    import wandb

    return runs_from_wandb(wandb.Api().runs(path))


# --------------------------------------------------------------------------- training figures


def _colors(settings: list[str]) -> dict[str, str]:
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {s: cycle[i % len(cycle)] for i, s in enumerate(settings)}


def _settings(runs: list[dict]) -> list[str]:
    order = ["nccl", "ring", "cerar_c4", "cerar_c8", "cerar_c16", "powersgd", "fp16", "bf16", "hier_ring",
             "hier_cerar_c8", "hier_cerar_c16"]  # fmt: skip
    found = sorted({r["setting"] for r in runs}, key=lambda s: (order.index(s) if s in order else 99, s))
    return found


def training_figures(runs: list[dict], out: Path, prefix: str = "", title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = _settings(runs)
    color = _colors(settings)
    paths = []
    for xkey, fname, xlabel in (("step", "val_loss_vs_step.png", "step"),
                                ("wall", "val_loss_vs_wall.png", "training wall time (s, sum of time/step)")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in settings:
            for i, r in enumerate(x for x in runs if x["setting"] == s):
                wall, xs, ys = 0.0, [], []
                for m in r["metrics"]:
                    wall += float(m.get("time/step", 0.0))
                    if m.get("val_loss") is not None:
                        xs.append(m["step"] if xkey == "step" else wall)
                        ys.append(float(m["val_loss"]))
                if xs:
                    ax.plot(xs, ys, color=color[s], marker=".", linewidth=1, alpha=0.8,
                            label=s if i == 0 else None)  # fmt: skip
        ax.set(xlabel=xlabel, ylabel="validation loss", title=f"validation loss vs {xkey} {title}".strip())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / (prefix + fname)
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    # per-phase bars: mean seconds per step (steps > 1), averaged over seeds
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bottoms = [0.0] * len(settings)
    for ph in PHASES:
        vals = []
        for s in settings:
            per_run = []
            for r in (x for x in runs if x["setting"] == s):
                steady = [float(m.get(f"time/{ph}", 0.0)) for m in r["metrics"] if m.get("step", 0) > 1]
                if steady:
                    per_run.append(statistics.mean(steady))
            vals.append(statistics.mean(per_run) if per_run else 0.0)
        ax.bar(settings, vals, bottom=bottoms, label=ph)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set(ylabel="seconds per step (mean, steps 2..)", title=f"per-phase time per step {title}".strip())
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / (prefix + "phase_bars.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths


# --------------------------------------------------------------------------- other figures


def error_vs_kappa(design_csv: Path, out: Path) -> list[Path]:
    import dataclasses

    from cerar.planning import design

    fields = {f.name: f.type for f in dataclasses.fields(design.DesignRow)}
    rows = []
    with open(design_csv, newline="") as f:
        for raw in csv.DictReader(f):
            if raw.get("sweep") not in ("kappa_max", "eps", "exact", "cli"):
                continue  # as cerar.planning.design: the bar and reference rows are not in the sweep figure
            kw = {}
            for k in fields:
                v = raw.get(k, "")
                if k in ("N", "c", "worst_worker", "best_worker", "d", "seed"):
                    kw[k] = int(v) if v not in ("", None) else -1
                elif k in ("construction", "sweep", "dtype", "status"):
                    kw[k] = v
                elif k in ("kappa_max", "requested_eps", "eps"):
                    kw[k] = float(v) if v not in ("", None) else None
                else:
                    kw[k] = float(v) if v not in ("", None) else math.nan
            rows.append(design.DesignRow(**kw))
    if not rows:
        raise ValueError(f"{design_csv}: no sweep rows")
    p = out / "error_vs_kappa.png"
    from scripts.reporting.design_report import plot_error_vs_kappa  # the repository root is on sys.path

    plot_error_vs_kappa(rows, p)
    return [p]


def saving_vs_n(allreduce_csv: Path, out: Path, size_mb: float = 64.0, c_mult: int = 4) -> list[Path]:
    """Measured and modelled 1 - t_cerar/t_ref against N at c = c_mult*N, one line per lab rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cerar.planning import costmodel

    with open(allreduce_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    nbytes = int(round(size_mb * 2**20))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    Ns_all = list(range(2, 17))
    ax.plot(Ns_all, [1 - costmodel.byte_ratio_limit(N, c_mult * N) for N in Ns_all], color="black",
            linestyle=":", label=f"byte-count bound (c={c_mult}N)")  # fmt: skip
    fits = costmodel.fit_groups(rows)
    settings = sorted({(r["where"], r["rate_mbit"]) for r in rows}, key=lambda k: (k[0], float(k[1] or 0)))
    for where, rate in settings:
        sub = [r for r in rows if (r["where"], r["rate_mbit"]) == (where, rate) and int(r["bytes"]) == nbytes]
        tag = f"{where} {rate + ' Mbit/s' if rate else ''}".strip()
        meas, points = {}, {}
        for N in sorted({int(r["N"]) for r in sub}):
            per_run = {}  # ratios within one run only: aggregators measured side by side
            for r in sub:
                if int(r["N"]) != N:
                    continue
                t = per_run.setdefault(r.get("run_id", ""), {})
                if r["aggregator"] in ("ring", "nccl"):
                    t[r["aggregator"]] = float(r["seconds_median"])
                elif (r["aggregator"] == "cerar" and r["c"] and int(r["c"]) == c_mult * N
                      and r["construction"] == "perturbation"):  # fmt: skip
                    t["cerar"] = float(r["seconds_median"])
            for ref in ("nccl", "ring"):
                sav = [1 - t["cerar"] / t[ref] for t in per_run.values() if "cerar" in t and ref in t]
                if sav:
                    meas.setdefault(ref, []).append((N, statistics.median(sav)))
                    points.setdefault(ref, []).extend((N, v) for v in sav)
        line = None
        for ref, marker in (("nccl", "o"), ("ring", "s")):
            if ref in meas:
                xs, ys = zip(*meas[ref], strict=True)
                (line,) = ax.plot(xs, ys, marker=marker, linestyle="-" if ref == "nccl" else "--",
                                  color=None if line is None else line.get_color(),
                                  label=f"measured vs {ref}: {tag} (median of runs)")  # fmt: skip
                if len(points[ref]) > len(xs):
                    ax.scatter(*zip(*points[ref], strict=True), marker=marker, s=12, alpha=0.5,
                               color=line.get_color())  # fmt: skip
        f_ = fits.get((where, rate))
        if meas and isinstance(f_, costmodel.Fit):
            d = nbytes // 4
            model = [1 - f_.predict("cerar", d, N, c_mult * N) / f_.predict("ring", d, N, None) for N in Ns_all]
            ax.plot(Ns_all, model, linestyle="-.", linewidth=1, color=None if line is None else line.get_color(),
                    label=f"model (fit to {tag}) vs ring")  # fmt: skip
    ax.axhline(0, color="gray", linewidth=0.8)
    lo = ax.get_ylim()[0]
    if lo < -1:
        ax.set_ylim(-1, 0.6)
        ax.text(0.01, 0.01, f"y clipped at -1 (lowest value {lo:.1f}: CPU-bound settings)", transform=ax.transAxes,
                fontsize=7)  # fmt: skip
    ax.set(xlabel="N (workers)", ylabel="saving 1 - t_cerar / t_ref (perturbation)",
           title=f"CERAR saving vs N ({size_mb:g} MiB, c = {c_mult}N)")  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    p = out / "saving_vs_N.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return [p]


# --------------------------------------------------------------------------- main


GROUPS = ["training", "allreduce", "design", "fidelity", "costmodel", "hierarchical", "aggregators", "tensors",
          "time_to_loss"]  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "reports" / "runs" / "training")
    ap.add_argument("--wandb", metavar="ENTITY/PROJECT", default=None, help="read training runs from W&B")
    ap.add_argument("--fidelity-dir", type=Path, default=ROOT / "reports" / "runs" / "fidelity")
    ap.add_argument("--fidelity-grown-corpus-dir", type=Path, default=ROOT / "reports" / "runs" / "fidelity-corpus-v2")
    ap.add_argument("--batch-scaling-dir", type=Path, default=ROOT / "reports" / "runs" / "batch-scaling-150")
    ap.add_argument("--allreduce-csv", type=Path, default=ROOT / "reports" / "data" / "allreduce.csv")
    ap.add_argument("--design-csv", type=Path, default=ROOT / "reports" / "data" / "code_design.csv")
    ap.add_argument("--hierarchical-csv", type=Path, default=ROOT / "reports" / "data" / "hierarchical_lab.csv")
    ap.add_argument("--hierarchical-runs-dir", type=Path, default=ROOT / "reports" / "runs" / "training_hierarchical")
    ap.add_argument("--aggregators-dir", type=Path, default=ROOT / "reports" / "runs" / "aggregators-1500")
    ap.add_argument("--tensors-dir", type=Path, default=ROOT / "reports" / "runs" / "tensors-1500")
    ap.add_argument("--time-to-loss-csv", type=Path, default=ROOT / "reports" / "data" / "time_to_loss.csv")
    ap.add_argument("--time-to-loss-dir", type=Path, default=ROOT / "reports" / "runs" / "time_to_loss")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "figures")
    ap.add_argument("--strict", action="store_true", help="fail when a source is missing")
    ap.add_argument(
        "--only",
        choices=GROUPS,
        action="append",
        default=None,
        help="draw only these groups (repeatable); default all",
    )
    ap.add_argument("--prefix", default="", help="file-name prefix of the training figures")
    ap.add_argument("--title", default="", help="appended to the training figures' titles")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written, missing = [], []

    groups = set(args.only or GROUPS)
    runs = []
    if "training" in groups:
        runs = load_wandb_runs(args.wandb) if args.wandb else load_local_runs(args.runs_dir)
    if runs:
        written += training_figures(runs, args.out, args.prefix, args.title)
    elif "training" in groups:
        missing.append(f"training runs ({args.wandb or args.runs_dir})")
    if "allreduce" not in groups:
        pass
    elif args.allreduce_csv.exists():
        from scripts.bench.allreduce.figures import make_figures as allreduce_figures

        written += allreduce_figures(args.allreduce_csv, args.out)
        written += saving_vs_n(args.allreduce_csv, args.out)
    else:
        missing.append(str(args.allreduce_csv))
    if "design" not in groups:
        pass
    elif args.design_csv.exists():
        written += error_vs_kappa(args.design_csv, args.out)
    else:
        missing.append(str(args.design_csv))
    if "fidelity" in groups:
        from scripts.reporting.fidelity import batch_scaling, figures, runs

        fidelity_runs = runs.load_runs(args.fidelity_dir)
        batch_rows = batch_scaling.batch_scaling_rows(batch_scaling.load_batch_scaling(args.batch_scaling_dir))
        if fidelity_runs:
            grown_runs = runs.load_runs(args.fidelity_grown_corpus_dir)
            written += figures.figures(fidelity_runs, args.out, grown=grown_runs, batch_rows=batch_rows)
        else:
            missing.append(f"fidelity runs ({args.fidelity_dir})")
        if batch_rows:  # issue 19's study, once its runs exist
            written.append(figures.batch_scaling_figure(batch_rows, args.out / "batch_scaling_gap.png"))
    if "costmodel" in groups:
        from scripts.reporting.costmodel.two_tier import two_tier_figure

        written.append(two_tier_figure(args.out / "two_tier_choice.png"))
    if "hierarchical" in groups:
        from scripts.reporting import hierarchical_report

        # measured by scripts/bench/run_hierarchical_lab.sh: absent until then, which only an explicit request calls missing
        if args.hierarchical_csv.exists():
            written += hierarchical_report.figures(args.hierarchical_csv, args.out)
        elif args.only:
            missing.append(str(args.hierarchical_csv))
        else:
            print(f"make_figures: not measured yet, skipped: {args.hierarchical_csv}", file=sys.stderr)
        two_tier_runs = load_local_runs(args.hierarchical_runs_dir) if args.hierarchical_runs_dir.is_dir() else []
        if two_tier_runs:
            written += training_figures(two_tier_runs, args.out, "two_tier_", "(two-tier lab, 4 x 2 ranks, 100 Mbit/s)")
        elif args.only:
            missing.append(f"two-tier training runs ({args.hierarchical_runs_dir})")
    if "aggregators" in groups:
        from scripts.reporting import aggregators_report

        rows, _ = aggregators_report.study_rows(aggregators_report.load_runs(args.aggregators_dir))
        drawn = aggregators_report.figure(rows, args.out / "aggregators_gap_vs_bytes.png")
        if drawn:
            written.append(drawn)
        else:
            missing.append(f"aggregators study runs ({args.aggregators_dir})")
    if "tensors" in groups:  # issue 33's per-tensor study (scripts/studies/run_fidelity.sh T to W)
        from scripts.reporting import tensors_report

        summary = tensors_report.summarise(args.tensors_dir)
        if summary:
            written.append(tensors_report.figure(summary, args.out / "tensors_error_to_noise.png"))
        else:
            missing.append(f"per-tensor study runs ({args.tensors_dir})")
        pythia = tensors_report.summarise(tensors_report.PYTHIA_RUNS)  # run_fidelity.sh X, once it has runs
        if pythia:
            written.append(tensors_report.figure(pythia, args.out / tensors_report.PYTHIA_FIGURE, "pythia-14m"))
    if "time_to_loss" in groups:  # issue 34's study (scripts/studies/time_to_loss.py), once it has rows
        from scripts.studies.ttl import report as time_to_loss

        if args.time_to_loss_csv.exists():
            written += time_to_loss.figures(args.time_to_loss_csv, args.time_to_loss_dir, args.out)
        elif args.only:
            missing.append(str(args.time_to_loss_csv))
    for p in written:
        print(f"make_figures: wrote {p}")
    for m in missing:
        print(f"make_figures: no data, skipped: {m}", file=sys.stderr)
    return 1 if (missing and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
