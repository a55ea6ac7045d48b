#!/usr/bin/env python3
"""reports/fidelity.md and reports/data/fidelity.csv from the long-horizon runs (scripts/studies/run_fidelity.sh), and
its batch-scaling section with reports/data/batch_scaling.csv (scripts/studies/run_batch_scaling.sh).

Does CERAR train like exact all-reduce over thousands of steps? For every setting (folders
``<setting>_s<seed>`` under ``--runs-dir``) the report gives the reference replica's final validation
loss with its seed spread and gap to nccl, the worst replica's, train against validation loss (to tell
memorisation from aggregation effects), when the curves separate, replica drift, CERAR's aggregation
error beside the SGD noise of the same steps and its projection to Pythia's batch, and a
time-to-target-loss estimate from the per-step times measured in the 100 Mbit/s lab.

    .venv/bin/python scripts/reporting/fidelity_report.py            # the report and the CSV
    .venv/bin/python scripts/reporting/make_figures.py --only fidelity   # its figures
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.reporting.fidelity.batch_scaling import (  # noqa: E402  (the repository root is on sys.path)
    BATCH_SCALING_DIR,
    BATCH_SCALING_HORIZON_DIR,
    batch_scaling_rows,
    load_batch_scaling,
    render_batch_scaling,
)
from scripts.reporting.fidelity.plane import read_plane  # noqa: E402
from scripts.reporting.fidelity.report import render, write_csv  # noqa: E402
from scripts.reporting.fidelity.runs import (  # noqa: E402
    GENERATED_MARKER,
    GROWN_CORPUS_RUNS_DIR,
    LAB_CSV,
    PLANE_CSV,
    RUNS_DIR,
    lab_step_seconds,
    load_runs,
    summarize,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    ap.add_argument("--lab-csv", type=Path, default=LAB_CSV)
    ap.add_argument("--plane-csv", type=Path, default=PLANE_CSV)
    ap.add_argument("--grown-corpus-runs-dir", type=Path, default=GROWN_CORPUS_RUNS_DIR)
    ap.add_argument("--csv", type=Path, default=ROOT / "reports" / "data" / "fidelity.csv")
    ap.add_argument("--grown-corpus-csv", type=Path, default=ROOT / "reports" / "data" / "fidelity_corpus_v2.csv")
    ap.add_argument("--report", type=Path, default=ROOT / "reports" / "fidelity.md")
    ap.add_argument("--log", type=Path, default=ROOT / "reports" / "logs" / "fidelity_runs.log")
    ap.add_argument("--batch-scaling-dir", type=Path, default=BATCH_SCALING_DIR)
    ap.add_argument("--batch-scaling-horizon-dir", type=Path, default=BATCH_SCALING_HORIZON_DIR)
    ap.add_argument("--batch-scaling-csv", type=Path, default=ROOT / "reports" / "data" / "batch_scaling.csv")
    ap.add_argument("--batch-scaling-log", type=Path, default=ROOT / "reports" / "logs" / "batch_scaling_runs.log")
    args = ap.parse_args(argv)
    settings = load_runs(args.runs_dir)
    if not settings:
        print(f"no runs under {args.runs_dir}", file=sys.stderr)
        return 1
    rows = summarize(settings)
    write_csv(rows, args.csv)
    grown = load_runs(args.grown_corpus_runs_dir)
    grown_rows = summarize(grown) if grown else None
    if grown_rows:
        write_csv(grown_rows, args.grown_corpus_csv)
    log_lines = args.log.read_text().splitlines() if args.log.exists() else []
    plane = read_plane(args.plane_csv)
    kept = ""  # the findings written by hand above the marker survive a rebuild
    if args.report.exists() and GENERATED_MARKER in (old := args.report.read_text()):
        kept = old.split(GENERATED_MARKER)[0]
    shapes = load_batch_scaling(args.batch_scaling_dir)
    batch_rows = batch_scaling_rows(shapes)
    generated = render(rows, settings, lab_step_seconds(args.lab_csv), log_lines, plane, grown_rows, batch_rows)
    if batch_rows:  # the section goes before the run logs
        write_csv(batch_rows, args.batch_scaling_csv)
        horizon_rows = batch_scaling_rows(load_batch_scaling(args.batch_scaling_horizon_dir))
        section = render_batch_scaling(
            batch_rows, shapes, horizon_rows, args.batch_scaling_dir, args.batch_scaling_horizon_dir
        )
        batch_log = args.batch_scaling_log.read_text().splitlines() if args.batch_scaling_log.exists() else []
        if batch_log:
            section += ["", "Batch-scaling runs and load:", "", "```", *batch_log, "```"]
        head, logs, tail = generated.partition("\n## Runs and load")
        generated = head.rstrip("\n") + "\n" + "\n".join(section) + "\n" + (f"{logs}{tail}" if logs else "")
    if kept:  # the hand-written part carries the title
        generated = generated.split("\n", 2)[2]
    args.report.write_text(f"{kept}{GENERATED_MARKER}\n\n{generated}" if kept else generated)
    print(f"wrote {args.report} and {args.csv} ({len(rows)} settings)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
