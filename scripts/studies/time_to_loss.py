#!/usr/bin/env python3
"""Time to nccl's loss (issues 34, 53): every aggregator trained to the same horizon on slow and fast links, side
by side.

What
----
For each setting (links x model: the flat network lab, 4 hosts x 1 rank at the model's calibrated rate or
``--rate-mbit``; the two-tier lab, 4 hosts x 2 ranks; unshaped loopback, 4 ranks; models tiny, pythia-14m,
pythia-31m) and each seed, it trains the setting's aggregators (``scripts/studies/ttl/settings.py``: issue 34's
lists) one launch of ``train/main.py`` per run, seed by seed, the aggregators interleaved in an order rotated or
shuffled by seed (``scripts/studies/ttl/plan.py``), recording the load average before and after each run and the
CPU seconds its processes used. The code that trains is a snapshot of one commit (``git archive``; the ``commit``
column). One row per run goes to ``reports/data/time_to_loss.csv`` (issue 34's columns), the run's metrics stay in
``reports/runs/time_to_loss/<setting>/<aggregator>_s<seed>/``. Resumable: a run already in the CSV (or finished
and waiting for nccl's run of its seed) is skipped; with ``--retire-stale`` a row of other code is retired
(disclosed in ``reports/data/time_to_loss_retired.csv``) and run again, so that a setting's rows are one code's.
``--dry-run`` prints the plan (every run in order, what it will do, the hours it would take) and launches nothing.

``--report`` rebuilds ``reports/time_to_loss.md`` and ``reports/figures/time_to_loss_*.png`` from the CSV and the
run folders alone (``scripts/studies/ttl/report.py``; the metric: ``scripts/studies/ttl/metric.py``).
``--calibrate RATES`` measures nccl's share of a step in the flat lab at each rate
(``reports/data/time_to_loss_rates.csv``), the evidence the lab's rate is chosen from.

Issue 53's two plans, one command each (root for the lab; ``--dry-run`` first to see them):

    sudo nohup .venv/bin/python scripts/studies/time_to_loss.py --plan headline > /tmp/ttl-headline.log 2>&1 &
    sudo nohup .venv/bin/python scripts/studies/time_to_loss.py --plan long > /tmp/ttl-long.log 2>&1 &
    .venv/bin/python scripts/studies/time_to_loss.py --report

``--plan headline``: the flat lab at tiny and pythia-14m and the two tiers at both, seeds 1-3 of every aggregator,
shuffled, stale rows retired and rerun. ``--plan long``: the flat lab at pythia-14m to 1,500 steps (evaluated every
75), nccl, bf16, CERAR c=16 and CERAR c=8 over fp16 messages, seeds 1-3, shuffled. Others:

    sudo .venv/bin/python scripts/studies/time_to_loss.py --calibrate 100,200 --calibrate-steps 40
    sudo .venv/bin/python scripts/studies/time_to_loss.py --calibrate 400,1000 --calibrate-model pythia-14m
    sudo nohup .venv/bin/python scripts/studies/time_to_loss.py --settings lab:tiny --seeds 4 > /tmp/ttl.log 2>&1 &
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.studies.ttl import plan as PL  # noqa: E402, N812
from scripts.studies.ttl import settings as S  # noqa: E402, N812


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


PLANS = {
    "headline": {"settings": S.HEADLINE_SETTINGS, "seeds": S.HEADLINE_SEEDS, "order": "shuffled",
                 "retire_stale": True},
    "long": {"settings": S.LONG_SETTING, "seeds": S.HEADLINE_SEEDS, "steps": S.LONG_STEPS,
             "eval_every": S.LONG_EVAL_EVERY, "aggregators": ",".join(S.LONG_AGGREGATORS), "order": "shuffled"},
}  # fmt: skip
"""Issue 53's plans (the module docstring): what ``--plan`` sets; a flag given beside it must agree."""
DEFAULTS = {"settings": "all", "seeds": [1, 2], "order": "rotated", "retire_stale": False, "steps": None,
            "eval_every": None, "aggregators": None}  # fmt: skip


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", choices=sorted(PLANS), default=None, help="issue 53's plans (module docstring)")
    ap.add_argument("--settings", default=None, help="LINKS:MODEL,... (links: lab, lab-4x2, loopback) or all")
    ap.add_argument(
        "--aggregators",
        default=None,
        help="a subset of each setting's list (comma-separated); nccl is always added: every ratio is against its "
        "run of the same seed (skipped where its row exists)",
    )
    ap.add_argument("--seeds", type=_ints, default=None, help="comma-separated (default 1,2)")
    ap.add_argument("--order", choices=PL.ORDERS, default=None, help="rotated by seed (default) or shuffled")
    ap.add_argument("--order-seed", type=int, default=0, help="the shuffled order's generator seed")
    ap.add_argument("--retire-stale", action="store_true", default=None,
                    help="retire (and rerun) rows whose commit trained other code than --commit's")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="print the plan and launch nothing")
    ap.add_argument("--rate-mbit", type=float, default=None,
                    help="the lab's rate between hosts, each direction (default: the model's, settings.RATE_MBIT)")
    ap.add_argument("--steps", type=int, default=None, help="the horizon (default per model: settings.STEPS)")
    ap.add_argument("--eval-every", type=int, default=None, help="default per model: settings.EVAL_EVERY")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per step (default per model: "
                    "settings.MICRO_BATCH)")  # fmt: skip
    ap.add_argument("--mtu", type=int, default=9000, help="the lab's MTU (jumbo frames: less emulation CPU)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (default 3600 per 300 steps)")
    ap.add_argument("--csv", type=Path, default=S.DEFAULT_CSV)
    ap.add_argument("--runs", type=Path, default=S.DEFAULT_RUNS)
    ap.add_argument("--retired-csv", type=Path, default=S.RETIRED_CSV)
    ap.add_argument("--retired-runs", type=Path, default=S.RETIRED_RUNS)
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
    chosen = PLANS.get(args.plan, {})
    for name, default in DEFAULTS.items():
        given = getattr(args, name)
        if given is not None and name in chosen and given != chosen[name]:
            ap.error(f"--{name.replace('_', '-')} {given} disagrees with --plan {args.plan} ({chosen[name]})")
        setattr(args, name, given if given is not None else chosen.get(name, default))
    if args.seeds is not None and not args.seeds:
        ap.error("--seeds: give at least one")
    for name in ("steps", "eval_every", "micro_batch", "calibrate_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.rate_mbit is not None and not args.rate_mbit > 0:
        ap.error(f"--rate-mbit must be > 0, got {args.rate_mbit}")
    args.setting_list = []
    if not (args.report or args.retarget or args.calibrate):  # those read the CSV's settings, or one of their own
        try:
            args.setting_list = S.parse_settings(args.settings, args.rate_mbit, args.steps)
        except ValueError as err:
            ap.error(f"--settings: {err}")
    if isinstance(args.aggregators, str):
        args.aggregators = [a.strip() for a in args.aggregators.split(",") if a.strip()]
        bad = [a for a in args.aggregators if a not in S.AGGREGATORS]
        if bad:
            ap.error(f"--aggregators: unknown {bad}; choose from {list(S.AGGREGATORS)}")
    if args.code_dir is not None and not (args.code_dir / "train" / "main.py").is_file():
        ap.error(f"--code-dir {args.code_dir}: no train/main.py there")
    if args.code_dir is not None and args.commit is None:
        ap.error("--code-dir needs --commit (the commit column names what ran)")
    args.runs = args.runs.resolve()
    steps = args.steps or max(S.STEPS.values())
    args.timeout = args.timeout or 3600.0 * steps / 300
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

        print(write_report(args.csv, args.runs, args.report_path, args.figures, args.retired_csv))
    if args.retarget or args.report:
        return 0
    if args.calibrate:
        from scripts.studies.ttl import launch

        return 0 if launch.calibrate(args, args.calibrate, args.calibrate_model, args.calibrate_steps) else 1
    if args.dry_run:
        from scripts.studies.ttl.rows import read_rows

        print(PL.describe(PL.plan(args, args.setting_list), read_rows(args.csv)))
        return 0
    return PL.run_study(args, args.setting_list)


if __name__ == "__main__":
    sys.exit(main())
