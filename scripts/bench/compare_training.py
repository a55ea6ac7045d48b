#!/usr/bin/env python3
# ruff: noqa: E501
"""Training comparison in the network lab: the same job under each gradient aggregator.

What
----
For every seed and every aggregator setting (default: nccl, ring, cerar c=4/8/16, powersgd, fp16)
it runs ``train/main.py`` with N ranks, one per host of a ``scripts/lab/netlab.py`` lab whose links are
shaped to ``--rate-mbit`` each way (needs root), into ``<out>/<setting>_s<seed>/`` (Hydra run dir:
``metrics.jsonl``, ``summary.json``, ``.hydra/``; W&B offline files under ``wandb/``, not committed).
Settings run interleaved (seed-major, the setting order rotated per seed) so slow drifts of the
machine's load hit every setting alike. One row per run goes to ``--csv``
(default ``reports/data/training.csv``), with the load average before and after the run and the
exact command; ``--report`` writes the summary table (mean and spread over seeds) to
``reports/training.md``.

Why: issue 5's training target -- cerar c=16 wall time >= 15 % below nccl with the final validation
loss within 1 % (mean of 3 seeds) -- measured under a low-bandwidth link, as in the paper.

Two tiers (issue 20): ``--ranks-per-host G`` runs N/G hosts of G ranks (unshaped between the ranks of a
host, ``--rate-mbit`` between hosts on one shared NIC per host, or one per rank with ``--rails``;
``--mtu 9000`` for jumbo frames), for the hierarchical settings ``hier_ring`` (the exact hierarchy)
and ``hier_cerar_c8``/``hier_cerar_c16`` (CERAR between the hosts) beside ``nccl``. Every row and the
report carry the per-phase seconds per step (forward, backward, aggregate, optimizer).

Example (about 2 minutes per run at the defaults)::

    sudo .venv/bin/python scripts/bench/compare_training.py --seeds 1,2,3 --rate-mbit 200
    .venv/bin/python scripts/bench/compare_training.py --report-only
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> overrides of train/main.py
SETTINGS = {
    "nccl": ["aggregator=nccl"],
    "ring": ["aggregator=ring"],
    "cerar_c4": ["aggregator=cerar", "c=4"],
    "cerar_c8": ["aggregator=cerar", "c=8"],
    "cerar_c16": ["aggregator=cerar", "c=16"],
    "powersgd": ["aggregator=powersgd"],
    "fp16": ["aggregator=fp16"],
    "hier_ring": ["aggregator=hier_ring"],
    "hier_cerar_c8": ["aggregator=hier_cerar", "c=8"],
    "hier_cerar_c16": ["aggregator=hier_cerar", "c=16"],
}
PHASES = ("forward", "backward", "aggregate", "optimizer")
CSV_COLUMNS = [
    "setting", "seed", "ok", "N", "rate_mbit", "model", "max_steps", "micro_batch_size", "seq_len",
    "wall_seconds", "launch_seconds", "final_val_loss", "final_step", "aggregate_seconds_mean",
    "step_seconds_mean", "bytes_sent_per_step", "overlap", "load_before", "load_after", "run_dir",
    "timestamp", "command", "forward_seconds_mean", "backward_seconds_mean", "optimizer_seconds_mean",
    "hosts", "ranks_per_host", "rails", "mtu",
]  # fmt: skip
DEFAULT_CSV = ROOT / "reports" / "data" / "training.csv"
DEFAULT_OUT = ROOT / "reports" / "runs" / "training"


def _list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


def read_metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def run_row(run_dir: Path) -> dict:
    """Numbers of one finished run folder (summary.json + metrics.jsonl)."""
    row: dict = {}
    sp = run_dir / "summary.json"
    if sp.exists():
        s = json.loads(sp.read_text())
        row.update(wall_seconds=s.get("wall_seconds"), final_val_loss=s.get("final_val_loss"),
                   final_step=s.get("final_step"), overlap=s.get("overlap"))  # fmt: skip
    m = read_metrics(run_dir)
    # step 1 includes one-time costs (allocations, the first collective of each kind): left out
    steady = [r for r in m if r.get("step", 0) > 1]
    if steady:
        for phase in PHASES:
            row[f"{phase}_seconds_mean"] = statistics.mean(r.get(f"time/{phase}", 0.0) for r in steady)
        row["step_seconds_mean"] = statistics.mean(r["time/step"] for r in steady)
        row["bytes_sent_per_step"] = statistics.median(r.get("bytes_sent", 0) for r in steady)
    return row


def _common_overrides(args) -> list[str]:
    return [
        f"model={args.model}", f"trainer.max_steps={args.steps}", f"trainer.micro_batch_size={args.micro_batch}",
        f"data.seq_len={args.seq_len}", f"trainer.eval_every={args.eval_every}", "trainer.drift_every=0",
        "trainer.progress_bar=false", "checkpoint.every=0", "checkpoint.at_end=false", "resume=false",
        f"wandb.mode={args.wandb}", f"wandb.group={args.model}-{_shape(args)}-{args.rate_mbit:g}mbit", *args.extra,
    ]  # fmt: skip


def _shape(args) -> str:
    """n<N> for one rank per host, <hosts>x<G>[-rails] for two tiers."""
    G = args.ranks_per_host
    return f"n{args.n}" if G == 1 else f"{args.n // G}x{G}" + ("-rails" if args.rails else "")


def _lab_description(args) -> str:
    G = args.ranks_per_host
    hosts = f"{args.n} hosts" if G == 1 else f"{args.n // G} hosts x {G} ranks" + (", rails" if args.rails else "")
    return f"netlab({hosts}, {args.rate_mbit:g} Mbit/s" + (f", mtu {args.mtu}" if args.mtu != 1500 else "") + ")"


def train_command(args, setting: str, seed: int, run_dir: Path) -> list[str]:
    """One run, one launch: train/main.py."""
    return [sys.executable, str(ROOT / "train" / "main.py"), *SETTINGS[setting], f"seed={seed}",
            *_common_overrides(args), f"hydra.run.dir={run_dir}"]  # fmt: skip


def sweep_command(args, settings: list[str], seed: int) -> list[str]:
    """Several runs, one launch (train/sweep.py: one process group, imports paid once)."""
    runs = [f"{s}_s{seed}: {' '.join(SETTINGS[s])} seed={seed}" for s in settings]
    return [sys.executable, str(ROOT / "train" / "sweep.py"), str(args.out), *runs, "--", *_common_overrides(args)]


def _show(cmd: list[str]) -> str:
    return shlex.join([Path(cmd[0]).name, *[c.replace(str(ROOT) + "/", "") for c in cmd[1:]]])


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def run_all(args) -> int:
    from scripts.lab import netlab

    problem = netlab.requirements_problem()
    if problem:
        print(f"compare_training: {problem}", file=sys.stderr)
        return 2
    failures = 0
    k = 0
    for si, seed in enumerate(args.seeds):
        order = args.settings[si % len(args.settings) :] + args.settings[: si % len(args.settings)]
        if args.skip_done:
            order = [s for s in order if not (args.out / f"{s}_s{seed}" / "summary.json").exists()]
        # one launch per seed (all settings, train/sweep.py) or one launch per run (train/main.py)
        launches = [(order, sweep_command(args, order, seed))] if args.one_launch and order else [
            ([s], train_command(args, s, seed, args.out / f"{s}_s{seed}")) for s in order]  # fmt: skip
        for settings, cmd in launches:
            before = loadavg()
            t0 = time.monotonic()
            k += 1
            log_dir = args.out / "logs" / f"launch{k}_s{seed}"
            G = args.ranks_per_host
            with netlab.NetLab(hosts=args.n // G, rate_mbit=args.rate_mbit, master_port=29600 + k % 300,
                               mtu=args.mtu, ranks_per_host=G, rails=args.rails) as lab:  # fmt: skip
                res = lab.run(cmd, timeout=args.timeout * len(settings), out_dir=log_dir,
                              env={"OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"})  # fmt: skip
            dt = time.monotonic() - t0
            after = loadavg()
            for setting in settings:
                run_dir = args.out / f"{setting}_s{seed}"
                done = (run_dir / "summary.json").exists()
                row = {
                    "setting": setting, "seed": seed, "ok": done and (res.ok or len(settings) > 1),
                    "N": args.n, "rate_mbit": f"{args.rate_mbit:g}", "model": args.model, "max_steps": args.steps,
                    "micro_batch_size": args.micro_batch, "seq_len": args.seq_len, "launch_seconds": round(dt, 2),
                    "load_before": before, "load_after": after, "run_dir": _rel(run_dir),
                    "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
                    "command": f"{_lab_description(args)}: {_show(cmd)}", "hosts": args.n // G,
                    "ranks_per_host": G, "rails": int(args.rails), "mtu": args.mtu,
                }  # fmt: skip
                row.update(run_row(run_dir))
                append_row(args.csv, row)
                print(f"compare_training: {setting} seed={seed}: {'ok' if row['ok'] else 'FAILED'}, wall "
                      f"{row.get('wall_seconds')}, val {row.get('final_val_loss')}", flush=True)  # fmt: skip
            print(f"compare_training: launch {k} ({len(settings)} runs) {res.describe()} in {dt:.1f}s, "
                  f"load {before} -> {after}", flush=True)  # fmt: skip
            if not res.ok:
                failures += 1
                for r in res.ranks:
                    if r.returncode != 0:
                        print(f"--- rank {r.rank} stderr ---\n{r.stderr[-2000:]}", file=sys.stderr)
    return 1 if failures else 0


def append_row(csv_path: Path, row: dict) -> None:
    """Append one row; a file written before columns were added gains them (its rows keep theirs)."""
    from scripts.bench.csv_rows import append_rows

    append_rows(csv_path, [row], CSV_COLUMNS)


def _f(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def summarize(rows: list[dict]) -> list[dict]:
    """Mean and spread (min..max) per setting over its successful runs; ratios against nccl."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if str(r.get("ok")) in ("True", "true", "1") and _f(r.get("wall_seconds")) is not None:
            by.setdefault(r["setting"], []).append(r)
    out = []
    for setting, rs in by.items():
        walls = [_f(r["wall_seconds"]) for r in rs]
        steps = []  # training steps only: sum of time/step (evaluations and logging excluded)
        for r in rs:
            m = read_metrics(ROOT / r["run_dir"]) if r.get("run_dir") else []
            if m:
                steps.append(sum(float(x.get("time/step", 0.0)) for x in m))
        vals = [_f(r["final_val_loss"]) for r in rs if _f(r.get("final_val_loss")) is not None]
        aggs = [_f(r["aggregate_seconds_mean"]) for r in rs if _f(r.get("aggregate_seconds_mean")) is not None]
        phases = {}
        for phase in PHASES:
            vals_ = [_f(r.get(f"{phase}_seconds_mean")) for r in rs]
            phases[phase] = statistics.mean(vals_) if vals_ and all(v is not None for v in vals_) else None
        out.append({
            "setting": setting, "runs": len(rs), "seeds": ",".join(sorted({str(r["seed"]) for r in rs})),
            "wall_mean": statistics.mean(walls), "wall_min": min(walls), "wall_max": max(walls),
            "val_mean": statistics.mean(vals) if vals else None, "val_min": min(vals) if vals else None,
            "val_max": max(vals) if vals else None, "agg_mean": statistics.mean(aggs) if aggs else None,
            "overlap": rs[0].get("overlap"), "phases": phases,
            "steps_mean": statistics.mean(steps) if len(steps) == len(rs) else None,
            "steps_min": min(steps) if len(steps) == len(rs) else None,
            "steps_max": max(steps) if len(steps) == len(rs) else None,
        })  # fmt: skip
    base = next((s for s in out if s["setting"] == "nccl"), None)
    for s in out:
        s["wall_ratio"] = s["wall_mean"] / base["wall_mean"] if base else None
        s["steps_ratio"] = (s["steps_mean"] / base["steps_mean"]
                            if base and s["steps_mean"] and base["steps_mean"] else None)  # fmt: skip
        s["val_rel"] = (s["val_mean"] / base["val_mean"] - 1) if base and s["val_mean"] and base["val_mean"] else None
    order = list(SETTINGS)
    out.sort(key=lambda s: order.index(s["setting"]) if s["setting"] in order else len(order))
    return out


def write_report(csv_path: Path, path: Path) -> str:
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    summ = summarize(rows)
    first = rows[0] if rows else {}
    fmt = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    G = int(first.get("ranks_per_host") or 1)
    if G > 1:
        placement = (f"on {first.get('hosts')} lab hosts of {G} ranks (unshaped between the ranks of a host; "
                     + ("one NIC per rank" if str(first.get("rails")) == "1" else "one shared NIC per host")
                     + f", mtu {first.get('mtu')}) at")  # fmt: skip
    else:
        placement = "one per lab host at"
    lines = [
        "# Training comparison in the network lab",
        "",
        f"Generated by `scripts/bench/compare_training.py --report-only` from `{csv_path.relative_to(ROOT) if csv_path.is_relative_to(ROOT) else csv_path}`"
        f" ({len(rows)} runs). Setting: {first.get('model')}, N={first.get('N')} ranks, {placement} "
        f"{first.get('rate_mbit')} Mbit/s per direction, {first.get('max_steps')} steps of "
        f"{first.get('micro_batch_size')} x {first.get('seq_len')} tokens per rank, data=embedded.",
        "Wall time: `summary.json` `wall_seconds` (the training loop, evaluations included; start-up excluded). "
        "time/aggregate: mean over steps 2.. of the aggregation phase (0 when the aggregator runs as a DDP hook "
        "overlapping backward). Steps s: sum of `time/step` over the run's steps (the training steps alone: "
        "evaluations, logging and start-up excluded). Spread: min..max over seeds.",
        "",
        "| aggregator | runs | wall s (mean) | wall min..max | wall / nccl | steps s (mean) | steps min..max | steps / nccl "
        "| time/aggregate s | final val loss (mean) | val min..max | val vs nccl |",
        "|" + " --- |" * 12,
    ]
    for s in summ:
        lines.append(
            f"| {s['setting']}{' (hook, overlap)' if str(s['overlap']) == 'True' else ''} | {s['runs']} | "
            f"{fmt(s['wall_mean'], 1)} | {fmt(s['wall_min'], 1)}..{fmt(s['wall_max'], 1)} | {fmt(s['wall_ratio'], 3)} | "
            f"{fmt(s['steps_mean'], 1)} | {fmt(s['steps_min'], 1)}..{fmt(s['steps_max'], 1)} | {fmt(s['steps_ratio'], 3)} | "
            f"{fmt(s['agg_mean'], 2)} | {fmt(s['val_mean'], 4)} | {fmt(s['val_min'], 4)}..{fmt(s['val_max'], 4)} | "
            f"{'-' if s['val_rel'] is None else format(100 * s['val_rel'], '+.3f') + ' %'} |"
        )
    if any(all(v is not None for v in s["phases"].values()) for s in summ):  # rows written since phases were kept
        lines += ["", "Per-phase seconds per step (mean over steps 2.. of each run, then over its seeds; each phase "
                  "timed between synchronisations):", "",
                  "| aggregator | " + " | ".join(PHASES) + " | sum |", "|" + " --- |" * (len(PHASES) + 2)]  # fmt: skip
        for s in summ:
            ph = s["phases"]
            total = sum(v for v in ph.values() if v is not None)
            lines.append(f"| {s['setting']} | " + " | ".join(fmt(ph[p]) for p in PHASES) + f" | {fmt(total)} |")
    failed = [r for r in rows if str(r.get("ok")) not in ("True", "true", "1")]
    if failed:
        lines += ["", "Failed runs: " + ", ".join(f"{r['setting']} s{r['seed']}" for r in failed)]
    loads = dict.fromkeys(f"seed {r['seed']}: {r['load_before']} -> {r.get('load_after', '')}" for r in rows)
    lines += ["", "Load average (1/5/15 min) before -> after each launch (all settings of a seed run in one launch): "
              + "; ".join(loads), "",
              "Launch commands (each run in a lab built by `scripts/bench/compare_training.py`; netlab sets RANK, "
              "WORLD_SIZE, MASTER_ADDR, MASTER_PORT per host):", ""]  # fmt: skip
    for cmd in dict.fromkeys(r.get("command", "") for r in rows):
        lines += [f"    {cmd}", ""]
    text = "\n".join(lines)
    path.write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", type=_list, default=list(SETTINGS), help=f"subset of {','.join(SETTINGS)}")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in _list(s)], default=[1, 2, 3])
    ap.add_argument("--n", type=int, default=4, help="ranks in all (hosts x --ranks-per-host)")
    ap.add_argument("--ranks-per-host", type=int, default=1, help="ranks per lab host (two tiers when > 1)")
    ap.add_argument("--rails", action="store_true", help="one NIC per rank instead of one shared NIC per host")
    ap.add_argument("--mtu", type=int, default=1500, help="lab link MTU (9000: jumbo frames)")
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument("--model", default="pythia-14m")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--wandb", default="offline", choices=["offline", "disabled"])
    ap.add_argument("--timeout", type=float, default=900.0, help="per run")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--report", type=Path, default=ROOT / "reports" / "training.md")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument(
        "--one-launch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="all settings of a seed in one launch (train/sweep.py; default) or one launch per run",
    )
    ap.add_argument("--skip-done", action="store_true", help="skip runs whose folder has a summary.json")
    ap.add_argument("extra", nargs="*", help="more train/main.py overrides")
    args = ap.parse_args(argv)
    bad = [s for s in args.settings if s not in SETTINGS]
    if bad:
        ap.error(f"unknown settings {bad}; choose from {list(SETTINGS)}")
    if args.ranks_per_host < 1 or args.n % args.ranks_per_host:
        ap.error(f"--ranks-per-host {args.ranks_per_host} must be >= 1 and divide --n {args.n}")
    args.out = args.out.resolve()
    rc = 0
    if not args.report_only:
        rc = run_all(args)
    if args.csv.exists():
        print(write_report(args.csv, args.report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
