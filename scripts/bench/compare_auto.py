#!/usr/bin/env python3
"""aggregator=auto beside every fixed candidate it chooses among, side by side, on loopback or in the lab.

What
----
One launch (``train/sweep.py``: one process group, the runs one after another) trains the same short job under
``aggregator=auto`` and under each of auto's candidates fixed (the names ``train.aggregation.auto_choice.candidates``
gives
for the layout, so the two lists cannot drift apart), seed-major with the order rotated per seed. Where:

- ``--where loopback``: ``torchrun --standalone --nproc_per_node=N`` on this machine (fast links, one node);
- ``--where lab``: ``scripts/lab/netlab.py`` hosts of ``--ranks-per-host`` ranks each, ``--rate-mbit`` between
  hosts (needs root).

Each run's aggregation seconds are the median of ``time/aggregate`` over the steps after auto's check step (the
same window for every run, so auto's exact warm-up is not counted against it). Whether a fixed candidate's
error fits the budget is auto's own measurement at its check (error + 2 standard errors <= budget x noise, in
the auto run's ``summary.json``). One row per run goes to ``--csv`` (with the load average before and after the
launch and the command); ``--report`` rebuilds ``reports/auto_compare.md``: per place, auto's choice, its
aggregation seconds against the fastest fixed candidate that fits (target: within 10 %), and every candidate's
bound, prediction, trial time and fixed-run time.

Example (loopback, about 4 minutes; the lab as root)::

    .venv/bin/python scripts/bench/compare_auto.py --where loopback --n 4
    sudo .venv/bin/python scripts/bench/compare_auto.py --where lab --n 8 --ranks-per-host 2 --rate-mbit 200
    .venv/bin/python scripts/bench/compare_auto.py --report-only
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.compare_training import loadavg, read_metrics  # noqa: E402

DEFAULT_CSV = ROOT / "reports" / "data" / "auto_compare.csv"
DEFAULT_OUT = ROOT / "reports" / "runs" / "auto_compare"
DEFAULT_REPORT = ROOT / "reports" / "auto_compare.md"
TARGET = 1.10  # issue 28: auto's aggregation time within 10 % of the fastest fixed candidate that fits
COLUMNS = [
    "where", "shape", "rate_mbit", "seed", "setting", "overrides", "ok", "window", "aggregate_s_median",
    "aggregate_s_mean", "final_val_loss", "load_before", "load_after", "run_dir", "command", "timestamp",
]  # fmt: skip


def candidate_overrides(cand) -> list[str]:
    """The fixed run of one auto candidate (train.aggregation.auto_choice.Candidate): its aggregator, c and
    transport."""
    kind = {"nccl": "nccl", "fp16": "fp16", "bf16": "bf16", "int8": "int8", "cerar": "cerar",
            "hier_ring": "hier_ring", "hier_cerar": "hier_cerar", "hier_int8": "hier_int8", "int4": "int4",
            "hier_int4": "hier_int4"}[cand.kind]  # fmt: skip
    out = [f"aggregator={kind}"]
    if cand.c is not None:
        out.append(f"c={cand.c}")
    if cand.transport != "float32":
        out.append(f"aggregator.transport={cand.transport}")
    return out


def settings_for(args) -> dict[str, list[str]]:
    """name -> overrides: auto, then each of its candidates on this layout (composed as the runs will be)."""
    from hydra import compose, initialize_config_dir

    from train.aggregation.auto_choice import candidates
    from train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["aggregator=auto", *common_overrides(args)])
    G = args.ranks_per_host
    pool = candidates(args.n, args.n // G, G, cfg.aggregator)
    return {"auto": ["aggregator=auto"], **{name: candidate_overrides(cand) for name, cand in pool.items()}}


def common_overrides(args) -> list[str]:
    return [
        f"model={args.model}", f"trainer.max_steps={args.steps}", f"trainer.micro_batch_size={args.micro_batch}",
        f"data.seq_len={args.seq_len}", f"trainer.eval_every={args.steps}", "trainer.drift_every=0",
        "trainer.progress_bar=false", "trainer.log_every=1", "checkpoint.every=0", "checkpoint.at_end=false",
        "resume=false", "wandb.mode=disabled", f"aggregator.auto_warmup_steps={args.warmup}",
        "aggregator.auto_check_every=0", *args.extra,
    ]  # fmt: skip


def shape_of(args) -> str:
    G = args.ranks_per_host
    return f"n{args.n}" if G == 1 else f"{args.n // G}x{G}"


def launch(args, settings: dict[str, list[str]], order: list[str], seed: int, out: Path, k: int):
    """One sweep launch of `order`; returns (ok, seconds, command shown)."""
    runs = [f"{name}_s{seed}: {' '.join(settings[name])} seed={seed}" for name in order]
    sweep = [str(ROOT / "train" / "sweep.py"), str(out), *runs, "--", *common_overrides(args)]
    env = {"OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    t0 = time.monotonic()
    if args.where == "loopback":
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--standalone", f"--nproc_per_node={args.n}", *sweep]
        log_dir = out / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"launch{k}_s{seed}.log", "w") as log:
            proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout * len(order))  # fmt: skip
        ok = proc.returncode == 0
        shown = shlex.join(["torchrun", *cmd[1:]]).replace(str(ROOT) + "/", "")
    else:
        from scripts.lab import netlab

        G = args.ranks_per_host
        with netlab.NetLab(hosts=args.n // G, rate_mbit=args.rate_mbit, master_port=29700 + k % 200, mtu=args.mtu,
                           ranks_per_host=G) as lab:  # fmt: skip
            res = lab.run([sys.executable, *sweep], timeout=args.timeout * len(order),
                          out_dir=out / "logs" / f"launch{k}", env=env)  # fmt: skip
        ok = res.ok
        where = f"netlab({args.n // G} hosts x {G} ranks, {args.rate_mbit:g} Mbit/s, mtu {args.mtu})"
        shown = where + ": " + shlex.join(["python", *sweep]).replace(str(ROOT) + "/", "")
    return ok, time.monotonic() - t0, shown


def aggregate_seconds(run_dir: Path, first_step: int) -> tuple[float | None, float | None, int]:
    """(median, mean, count) of time/aggregate over the run's steps >= first_step."""
    times = [float(r["time/aggregate"]) for r in read_metrics(run_dir) if r.get("step", 0) >= first_step
             and "time/aggregate" in r]  # fmt: skip
    if not times:
        return None, None, 0
    return statistics.median(times), statistics.mean(times), len(times)


def run_all(args) -> int:
    from scripts.bench.csv_rows import append_rows

    if args.where == "lab":
        from scripts.lab import netlab

        problem = netlab.requirements_problem()
        if problem:
            print(f"compare_auto: {problem}", file=sys.stderr)
            return 2
    settings = settings_for(args)
    names = list(settings)
    out = args.out / f"{args.where}-{shape_of(args)}"
    failures = 0
    for si, seed in enumerate(args.seeds):
        order = names[si % len(names) :] + names[: si % len(names)]
        before = loadavg()
        ok, seconds, shown = launch(args, settings, order, seed, out, si + 1)
        after = loadavg()
        failures += not ok
        rows = []
        for name in order:
            run_dir = out / f"{name}_s{seed}"
            summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
            median, mean, count = aggregate_seconds(run_dir, args.warmup + 1)
            rows.append({
                "where": args.where, "shape": shape_of(args),
                "rate_mbit": f"{args.rate_mbit:g}" if args.where == "lab" else "", "seed": seed, "setting": name,
                "overrides": " ".join(settings[name]), "ok": bool(summary),
                "window": f"steps {args.warmup + 1}..{args.steps} ({count})", "aggregate_s_median": median,
                "aggregate_s_mean": mean, "final_val_loss": summary.get("final_val_loss"), "load_before": before,
                "load_after": after, "run_dir": str(run_dir.relative_to(ROOT)), "command": shown,
                "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
            })  # fmt: skip
        append_rows(args.csv, rows, COLUMNS)
        print(f"compare_auto: {args.where} seed {seed}: {len(order)} runs in {seconds:.0f} s, ok={ok}, load {before} "
              f"-> {after}", flush=True)  # fmt: skip
    return 1 if failures else 0


# --------------------------------------------------------------------------------------------- the report


def place_summary(rows: list[dict]) -> dict:
    """One place's comparison (rows of one where/shape/rate): auto's choice and seconds against the fastest
    fixed candidate whose error fits by auto's own measurement, per seed and over the seeds."""
    from train.aggregation.auto_choice import fastest_within

    by_seed: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], {})[r["setting"]] = r
    seeds = []
    for seed, runs in sorted(by_seed.items()):
        auto_row = runs.get("auto")
        if not auto_row or str(auto_row["ok"]) != "True":
            continue
        summary = json.loads((ROOT / auto_row["run_dir"] / "summary.json").read_text())["auto"]
        decision = summary["decisions"][0]  # the only one: the runs check once (auto_check_every=0)
        bounds = summary["bounds"]  # what the decision compared with its allowance, the exact ones at 0
        fixed = {n: float(r["aggregate_s_median"]) for n, r in runs.items()
                 if n != "auto" and str(r["ok"]) == "True" and r["aggregate_s_median"] not in ("", None)}  # fmt: skip
        fitting = {n: s for n, s in fixed.items() if bounds.get(n, math.inf) <= decision["allowed"]}
        best = min(fitting, key=fitting.get)
        model_pick = fastest_within(summary["predicted_s"], bounds, decision["allowed"])  # auto_trials=0's choice
        auto_s = float(auto_row["aggregate_s_median"])
        seeds.append({
            "seed": seed, "choice": summary["choice"], "auto_s": auto_s, "best": best, "best_s": fitting[best],
            "ratio": auto_s / fitting[best], "model_pick": model_pick,
            "model_ratio": fixed[model_pick] / fitting[best] if model_pick in fixed else None, "decision": decision,
            "bounds": bounds, "fixed": fixed,
            "predicted": summary["predicted_s"], "links": summary.get("links", {}), "row": auto_row,
        })  # fmt: skip
    return {"seeds": seeds, "rows": rows}


def write_report(csv_path: Path, path: Path) -> str:
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    places: dict[tuple, list[dict]] = {}
    for r in rows:
        places.setdefault((r["where"], r["shape"], r["rate_mbit"]), []).append(r)
    lines = [
        "# aggregator=auto beside every fixed candidate",
        "",
        f"Generated by `scripts/bench/compare_auto.py --report-only` from `{csv_path.relative_to(ROOT)}` "
        f"({len(rows)} runs). Each launch trains the same short job under aggregator=auto and under each of its "
        "candidates fixed, one after another in one process group (`train/sweep.py`). Aggregation seconds: the "
        "median of `time/aggregate` over the steps after auto's check step (the same window for every run). A "
        "candidate fits when auto's own measurement at its check says so (error + 2 standard errors <= budget x "
        f"noise). Target (issue 28): auto's seconds <= {TARGET:.2f} x the fastest fixed candidate that fits.",
    ]
    for (where, shape, rate), place in places.items():
        summary = place_summary(place)
        title = f"{where}, {shape}" + (f", {rate} Mbit/s between hosts" if rate else " (one node, loopback)")
        lines += ["", f"## {title}", ""]
        if not summary["seeds"]:
            lines.append("No finished auto run.")
            continue
        lines += ["| seed | auto chose | auto s | fastest fitting fixed | its s | auto / it | target "
                  "| the model's pick (auto_trials=0) / it |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for s in summary["seeds"]:
            pick = "-" if s["model_ratio"] is None else f"{s['model_pick']}: {s['model_ratio']:.3f}"
            lines.append(f"| {s['seed']} | {s['choice']} | {s['auto_s']:.4f} | {s['best']} | {s['best_s']:.4f} | "
                         f"{s['ratio']:.3f} | {'met' if s['ratio'] <= TARGET else 'MISSED'} | {pick} |")  # fmt: skip
        last = summary["seeds"][-1]
        d = last["decision"]
        lines += ["", f"Seed {last['seed']}'s evidence: noise {d['noise']:.3g}, allowed error {d['allowed']:.3g}; "
                  f"links {describe_links(last['links'])}.", "",
                  "| candidate | error bound | fits | predicted ms | auto's trial ms | fixed run ms "
                  "| fixed / fastest fitting |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        timed = d.get("timed_s") or {}
        for name in sorted(last["fixed"], key=last["fixed"].get):
            bound = last["bounds"].get(name, math.inf)
            fits = "yes" if bound <= d["allowed"] else "no"
            trial = f"{1e3 * timed[name]:.1f}" if name in timed else "-"
            lines.append(f"| {name} | {bound:.3g} | {fits} | {1e3 * last['predicted'][name]:.1f} | {trial} | "
                         f"{1e3 * last['fixed'][name]:.1f} | {last['fixed'][name] / last['best_s']:.2f} |")  # fmt: skip
        loads = dict.fromkeys(f"seed {r['seed']}: {r['load_before']} -> {r['load_after']}" for r in place)
        lines += ["", "Load average (1/5/15 min) before -> after each launch: " + "; ".join(loads), "", "Launch:", ""]
        lines += [f"    {cmd}" for cmd in dict.fromkeys(r["command"] for r in place)]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def describe_links(links: dict) -> str:
    tiers = links.get("tiers") or {}
    parts = [f"{tier} alpha {1e6 * f['alpha_s']:.3g} us, {8 * f['bandwidth_bytes_s'] / 1e9:.3g} Gbit/s "
             f"(fit {f['rel_rmse']:.0%} RMS)" for tier, f in tiers.items()]  # fmt: skip
    return "; ".join(parts) or "declared"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--where", choices=["loopback", "lab"], default="loopback")
    ap.add_argument("--n", type=int, default=4, help="ranks in all")
    ap.add_argument("--ranks-per-host", type=int, default=1, help="lab: ranks per host (two tiers when > 1)")
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="lab: per direction between hosts")
    ap.add_argument("--mtu", type=int, default=9000, help="lab link MTU")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="auto's check step (exact until then)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",") if x.strip()], default=[1])
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--report", type=Path, default=DEFAULT_REPORT)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("extra", nargs="*", help="more train/main.py overrides for every run")
    args = ap.parse_args(argv)
    if args.ranks_per_host < 1 or args.n % args.ranks_per_host:
        ap.error(f"--ranks-per-host {args.ranks_per_host} must be >= 1 and divide --n {args.n}")
    if args.where == "loopback" and args.ranks_per_host != 1:
        ap.error("--ranks-per-host is the lab's: loopback runs one node")
    if not 1 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup} must be >= 1 and below --steps {args.steps}")
    args.out = args.out.resolve()
    rc = 0 if args.report_only else run_all(args)
    if args.csv.exists():
        print(write_report(args.csv, args.report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
