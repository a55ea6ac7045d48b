#!/usr/bin/env python3
"""Time to nccl's loss (issue 34): every aggregator trained to the same horizon on slow and fast links, side by side.

What
----
For each setting (links x model: the flat network lab, 4 hosts x 1 rank at ``--rate-mbit``; the two-tier lab,
4 hosts x 2 ranks; unshaped loopback, 4 ranks; models tiny, pythia-14m, pythia-31m) and each seed, it trains the
setting's aggregators (``scripts/studies/ttl/settings.py``: issue 34's lists) one after another, the order rotated
by seed, one ``train/main.py`` launch per run, recording the load average before and after each. The code that
trains is a snapshot of one commit (``git archive``; the ``commit`` column). One row per run goes to
``reports/data/time_to_loss.csv`` (issue 34's columns), the run's metrics (validation loss against ``time/wall``)
stay in ``reports/runs/time_to_loss/<setting>/<aggregator>_s<seed>/``. Resumable: a run already in the CSV (or
finished and waiting for nccl's run of its seed, whose final validation loss is its target) is skipped, so the
command can run in the background for hours and be committed as rows arrive.

``--report`` rebuilds ``reports/time_to_loss.md`` and ``reports/figures/time_to_loss_*.png`` from the CSV and the
run folders alone (``scripts/studies/ttl/report.py``). ``--calibrate RATES`` measures nccl's share of a step in the
flat lab at each rate (``reports/data/time_to_loss_rates.csv``), the evidence the lab's rate is chosen from.

    sudo .venv/bin/python scripts/studies/time_to_loss.py --calibrate 100,200 --calibrate-steps 40
    sudo .venv/bin/python scripts/studies/time_to_loss.py --calibrate 400,1000 --calibrate-model pythia-14m
    sudo nohup .venv/bin/python scripts/studies/time_to_loss.py --settings all --seeds 1,2 > /tmp/ttl.log 2>&1 &
    .venv/bin/python scripts/studies/time_to_loss.py --report
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.studies.ttl import settings as S  # noqa: E402, N812


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="all", help="LINKS:MODEL,... (links: lab, lab-4x2, loopback) or all")
    ap.add_argument(
        "--aggregators",
        default=None,
        help="a subset of each setting's list (comma-separated); nccl is always added: every ratio is against its "
        "run of the same seed (skipped where its row exists)",
    )
    ap.add_argument("--seeds", type=_ints, default=[1, 2])
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="the lab's rate between hosts, each direction")
    ap.add_argument("--steps", type=int, default=None, help="the horizon (default per model: settings.STEPS)")
    ap.add_argument("--eval-every", type=int, default=None, help="default per model: settings.EVAL_EVERY")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per step (default per model: "
                    "settings.MICRO_BATCH)")  # fmt: skip
    ap.add_argument("--mtu", type=int, default=9000, help="the lab's MTU (jumbo frames: less emulation CPU)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    ap.add_argument("--csv", type=Path, default=S.DEFAULT_CSV)
    ap.add_argument("--runs", type=Path, default=S.DEFAULT_RUNS)
    ap.add_argument("--report", action="store_true", help="rebuild the report and figures from the CSV and runs")
    ap.add_argument("--retarget", action="store_true", help="recompute time_to_target_s from the run folders")
    ap.add_argument("--report-path", type=Path, default=S.DEFAULT_REPORT)
    ap.add_argument("--figures", type=Path, default=S.DEFAULT_FIGURES)
    ap.add_argument("--calibrate", type=_floats, default=None, help="rates (Mbit/s): nccl's share of a step at each")
    ap.add_argument("--calibrate-steps", type=int, default=40)
    ap.add_argument("--calibrate-model", choices=S.MODELS, default="tiny", help="the model --calibrate trains")
    ap.add_argument("--commit", default=None, help="the commit whose code trains (default: HEAD)")
    ap.add_argument("--code-dir", type=Path, default=None, help="train this code (with --commit)")
    ap.add_argument("--code-cache", type=Path, default=Path("/tmp/time_to_loss-code"))
    ap.add_argument("extra", nargs="*", help="more train/main.py overrides for every run")
    args = ap.parse_args(argv)
    try:
        args.setting_list = S.parse_settings(args.settings, args.rate_mbit)
    except ValueError as err:
        ap.error(f"--settings: {err}")
    if args.aggregators is not None:
        args.aggregators = [a.strip() for a in args.aggregators.split(",") if a.strip()]
        bad = [a for a in args.aggregators if a not in S.AGGREGATORS]
        if bad:
            ap.error(f"--aggregators: unknown {bad}; choose from {list(S.AGGREGATORS)}")
    if not args.seeds:
        ap.error("--seeds: give at least one")
    for name in ("steps", "eval_every", "micro_batch", "calibrate_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.rate_mbit > 0:
        ap.error(f"--rate-mbit must be > 0, got {args.rate_mbit}")
    if args.code_dir is not None and not (args.code_dir / "train" / "main.py").is_file():
        ap.error(f"--code-dir {args.code_dir}: no train/main.py there")
    if args.code_dir is not None and args.commit is None:
        ap.error("--code-dir needs --commit (the commit column names what ran)")
    args.runs = args.runs.resolve()
    args.steps_for = lambda s: args.steps or S.STEPS[s.model]
    args.eval_for = lambda s: args.eval_every or S.EVAL_EVERY[s.model]
    args.micro_batch_for = lambda s: args.micro_batch or S.MICRO_BATCH[s.model]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.retarget:
        from scripts.studies.ttl.launch import retarget

        print(f"time_to_loss: {retarget(args.csv, args.runs)} time_to_target_s cells recomputed")
    if args.report:
        from scripts.studies.ttl.report import write_report

        print(write_report(args.csv, args.runs, args.report_path, args.figures))
    if args.retarget or args.report:
        return 0
    from scripts.studies.ttl import launch

    if args.calibrate:
        return 0 if launch.calibrate(args, args.calibrate, args.calibrate_model, args.calibrate_steps) else 1
    return launch.run_study(args, args.setting_list)


if __name__ == "__main__":
    sys.exit(main())
