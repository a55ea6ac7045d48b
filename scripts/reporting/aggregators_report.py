#!/usr/bin/env python3
"""The aggregators study (issue 25): does each aggregator a user would weigh train like the exact all-reduce,
and for how many bytes?

Reads the 1,500-step runs of ``scripts/studies/run_fidelity.sh K`` and ``L`` (N=4, model=tiny, corpus v2, the
fidelity study's shape; folders ``<setting>_s<seed>`` under ``reports/runs/aggregators-1500``) and writes, per
setting: the final validation loss; its same-seed gap to ``nccl`` beside ``nccl``'s seed band (the spread of
its two seeds' final losses: a gap inside the band is a difference the seed alone makes); the bytes one rank sent
per step over ``nccl``'s (the fp32 ring's 2 (N-1)/N d); the worst rank's aggregation error against the exact
mean (``agg/rel_error_max``, median after the first tenth of the run) beside the SGD noise it adds to
(``noise/rel_std_mean``); and, for ``c=auto``, the c it used.

    .venv/bin/python scripts/reporting/aggregators_report.py

Writes ``reports/aggregators.md`` (generated: rerun this script rather than edit it),
``reports/data/aggregators_1500.csv`` and ``reports/figures/aggregators_gap_vs_bytes.png``. A setting whose
runs have not reached the study's horizon is named as unfinished, not judged.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.reporting.fidelity.runs import final, last_step, load_runs, median_of, paired_gap  # noqa: E402

RUNS_DIR = ROOT / "reports" / "runs" / "aggregators-1500"
HORIZON = 1500
HALVES = ("K", "L")
COLUMNS = [
    "setting", "aggregator", "transport", "c_used", "seeds", "steps", "val_loss", "paired_gap_pct", "nccl_band_pct",
    "inside_band", "bytes_ratio_to_nccl", "rel_error_median", "noise_median", "error_over_noise",
]  # fmt: skip


def _bytes_per_step(run: dict) -> float | None:
    values = [r["bytes_sent"] for r in run["metrics"] if r.get("bytes_sent") is not None]
    return statistics.median(values) if values else None


def _c_used(run: dict) -> str:
    summary = run["summary"]
    if summary.get("aggregator_kind") not in ("cerar", "hier_cerar"):
        return ""
    chosen = summary.get("c_chosen")
    return str(chosen if chosen is not None else summary.get("c", ""))


def study_rows(settings: dict[str, list[dict]], horizon: int = HORIZON) -> tuple[list[dict], list[str]]:
    """One row per setting whose runs all reached `horizon` (nccl first), and the names of those that did not."""
    done = {k: v for k, v in settings.items() if all(last_step(r) >= horizon for r in v)}
    unfinished = sorted(set(settings) - set(done))
    nccl = done.get("nccl", [])
    finals = [final(r, "val_loss") for r in nccl]
    band = 100 * (max(finals) / min(finals) - 1) if len(finals) > 1 else None
    nccl_bytes = statistics.mean(b for b in map(_bytes_per_step, nccl) if b) if nccl else None
    rows = []
    for name, runs in sorted(done.items(), key=lambda kv: (kv[0] != "nccl", kv[0])):
        gap = paired_gap(runs, nccl) if name != "nccl" and nccl else None
        error = statistics.mean([median_of(r, "agg/rel_error_max", after=horizon // 10) or 0.0 for r in runs])
        noises = [median_of(r, "noise/rel_std_mean", after=horizon // 10) for r in runs]
        noise = statistics.mean(n for n in noises if n is not None) if any(n is not None for n in noises) else None
        sent = [b for b in map(_bytes_per_step, runs) if b]
        summary = runs[0]["summary"]
        rows.append({
            "setting": name, "aggregator": summary.get("aggregator", ""),
            "transport": summary.get("transport", "") or "", "c_used": _c_used(runs[0]),
            "seeds": ",".join(str(r["seed"]) for r in runs), "steps": min(last_step(r) for r in runs),
            "val_loss": statistics.mean(final(r, "val_loss") for r in runs),
            "paired_gap_pct": gap, "nccl_band_pct": band,
            "inside_band": None if gap is None or band is None else abs(gap) <= band,
            "bytes_ratio_to_nccl": statistics.mean(sent) / nccl_bytes if sent and nccl_bytes else None,
            "rel_error_median": error, "noise_median": noise,
            "error_over_noise": error / noise if noise else None,
        })  # fmt: skip
    return rows, unfinished


def _f(value, spec: str) -> str:
    return "-" if value is None or value == "" else format(value, spec)


def _pct(value, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}} %"


def _verdict(row: dict) -> str:
    if row["inside_band"] is None:
        return "-"
    return "inside" if row["inside_band"] else "**outside**"


def load_lines(log: Path) -> list[str]:
    """The study's start and end lines from the runs' log (their load averages)."""
    if not log.exists():
        return []
    pattern = re.compile(rf"half ({'|'.join(HALVES)})\b")
    return [line.strip() for line in log.read_text().splitlines() if pattern.search(line)]


def render(rows: list[dict], unfinished: list[str], runs_dir: Path, loads: list[str]) -> str:
    out = [
        "# Every aggregator a user would weigh: 1,500 steps against nccl",
        "",
        "<!-- generated by scripts/reporting/aggregators_report.py: rerun it rather than edit -->",
        "",
        f"Runs: `{runs_dir.relative_to(ROOT) if runs_dir.is_relative_to(ROOT) else runs_dir}` "
        "(`scripts/studies/run_fidelity.sh K` and `L`): N=4 ranks of model=tiny on the embedded corpus v2, "
        "16 sequences of 64 tokens per step, Pythia's recipe, 1,500 steps (the schedule of 1,500), the same "
        "model initialisation and data order per seed. Gap: the final validation loss over `nccl`'s at the same "
        "seed; band: the spread of `nccl`'s two seeds. Bytes: one rank's per step over `nccl`'s (the fp32 ring). "
        "Error: the worst rank's ||g_hat - g_bar|| / ||g_bar|| against the exact mean (median after step "
        f"{HORIZON // 10}); noise: the SGD noise of the averaged gradient at the same steps.",
        "",
        "| setting | c used | bytes / nccl | worst-rank error | noise | error / noise | val loss | same-seed gap "
        "| nccl's band | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['setting']} | {r['c_used'] or '-'} | {_f(r['bytes_ratio_to_nccl'], '.3f')} "
            f"| {_f(r['rel_error_median'], '.2g')} | {_f(r['noise_median'], '.3f')} "
            f"| {_f(r['error_over_noise'], '.2g')} | {r['val_loss']:.4f} | {_pct(r['paired_gap_pct'], '+.2f')} "
            f"| {_pct(r['nccl_band_pct'], '.2f')} | {_verdict(r)} |"
        )
    if unfinished:
        out += ["", f"Not judged (runs short of step {HORIZON}): {', '.join(f'`{u}`' for u in unfinished)}."]
    judged = [r for r in rows if r["inside_band"] is not None]
    if judged:
        inside = [r for r in judged if r["inside_band"]]
        cheapest = min(inside, key=lambda r: r["bytes_ratio_to_nccl"] or 1.0) if inside else None
        out += ["", "## Answer", ""]
        out.append(
            f"{len(inside)} of {len(judged)} settings end inside nccl's seed band"
            + (
                f"; the fewest bytes among them: `{cheapest['setting']}` at {cheapest['bytes_ratio_to_nccl']:.3f} of "
                f"nccl's bytes (gap {cheapest['paired_gap_pct']:+.2f} % in a {cheapest['nccl_band_pct']:.2f} % band)."
                if cheapest
                else "."
            )
        )
        outside = [r for r in judged if not r["inside_band"]]
        if outside:
            out.append(
                "Outside: "
                + ", ".join(f"`{r['setting']}` ({r['paired_gap_pct']:+.2f} %)" for r in outside)
                + ". A gap outside the band is one the seed alone does not explain; one pair of seeds at one "
                "batch, so read it as a warning, not a verdict for every run."
            )
    if loads:
        out += ["", "## Load", "", "The study's start and end lines (the machine's load averages):", "", "```"]
        out += loads + ["```"]
    return "\n".join(out) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS})


def figure(rows: list[dict], path: Path) -> Path | None:
    """Same-seed gap against bytes, with nccl's band shaded: the settings to weigh at a glance."""
    shown = [r for r in rows if r["paired_gap_pct"] is not None and r["bytes_ratio_to_nccl"] is not None]
    if not shown:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    band = shown[0]["nccl_band_pct"]
    if band is not None:
        ax.axhspan(-band, band, color="0.85", label=f"nccl's seed band (+-{band:.2f} %)")
    for r in shown:
        ax.scatter(r["bytes_ratio_to_nccl"], r["paired_gap_pct"], s=36)
        ax.annotate(r["setting"], (r["bytes_ratio_to_nccl"], r["paired_gap_pct"]), fontsize=8,
                    xytext=(4, 3), textcoords="offset points")  # fmt: skip
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xlabel("bytes per step / nccl's (fp32 ring)")
    ax.set_ylabel("final val loss over nccl's, same seed (%)")
    ax.set_title(f"Aggregators at N=4, {HORIZON} steps: gap against bytes")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    ap.add_argument("--horizon", type=int, default=HORIZON)
    ap.add_argument("--report", type=Path, default=ROOT / "reports" / "aggregators.md")
    ap.add_argument("--csv", type=Path, default=ROOT / "reports" / "data" / "aggregators_1500.csv")
    ap.add_argument("--figure", type=Path, default=ROOT / "reports" / "figures" / "aggregators_gap_vs_bytes.png")
    ap.add_argument("--log", type=Path, default=ROOT / "reports" / "logs" / "fidelity_runs.log")
    args = ap.parse_args(argv)
    rows, unfinished = study_rows(load_runs(args.runs_dir), args.horizon)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(render(rows, unfinished, args.runs_dir, load_lines(args.log)))
    write_csv(rows, args.csv)
    drawn = figure(rows, args.figure)
    print(f"aggregators_report: {len(rows)} settings judged, {len(unfinished)} unfinished -> {args.report}"
          + (f", {drawn}" if drawn else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
