"""Per-phase step times of the training loop for several aggregators side by side, in one launch.

    .venv/bin/python scripts/bench/bench_phases.py            # pythia-14m, 4 CPU processes: nccl, ring, cerar c=16

Runs train/sweep.py under torchrun (one process group, the runs interleaved over `--rounds`), then
reads each run's metrics.jsonl and writes the median seconds of forward, backward, aggregate and
optimizer per step (the first `--warmup` steps of each run dropped), the bytes sent per step and the
aggregation's relative error to reports/data/phases_cpu.csv and reports/phases_cpu.md.
A benchmark, not a test: the figures depend on the machine and its load.

    .venv/bin/python scripts/bench/bench_phases.py --before /tmp/cerar-before   # before and after, back to back

``--before DIR`` first runs the same launch from another checkout (its own train/ and cerar/, e.g. a
worktree of the commit before the persistent flat gradient buffer and the new arithmetic), then this
one, and reports both: what those changes did to each phase and to the step.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
AGGREGATORS = {"nccl": "aggregator=nccl", "ring": "aggregator=ring", "cerar_c16": "aggregator=cerar c=16"}
PHASES = ("forward", "backward", "aggregate", "optimizer")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pythia-14m")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps of each run left out of the medians")
    p.add_argument("--rounds", type=int, default=2, help="each aggregator runs this many times, interleaved")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--work-dir", default=str(ROOT / "outputs" / "bench_phases"))
    p.add_argument("--csv", default=str(ROOT / "reports" / "data" / "phases_cpu.csv"))
    p.add_argument("--md", default=str(ROOT / "reports" / "phases_cpu.md"))
    p.add_argument("--no-run", action="store_true", help="rebuild the report from an earlier --work-dir")
    p.add_argument("--before", default=None, help="another checkout to run first, for a before/after table")
    return p.parse_args()


def commit_of(checkout: Path) -> str:
    from scripts.reporting.provenance import checkout_state  # the repository root is on sys.path

    state = checkout_state(checkout)
    return "?" if state is None else state[0]


def versions(args: argparse.Namespace) -> list[tuple[str, Path, Path]]:
    """(label, checkout, work dir) in the order they run: before (if any), then this checkout."""
    work = Path(args.work_dir)
    if args.before is None:
        return [("this", ROOT, work)]
    before = Path(args.before).resolve()
    return [
        (f"before {commit_of(before)}", before, work / "before"),
        (f"after {commit_of(ROOT)}", ROOT, work / "after"),
    ]


def launch(args: argparse.Namespace, checkout: Path, work_dir: Path) -> list[tuple[str, str]]:
    runs = [(f"{name}_r{r}", o) for r in range(args.rounds) for name, o in AGGREGATORS.items()]
    common = [
        f"model={args.model}",
        f"trainer.max_steps={args.steps}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"data.seq_len={args.seq_len}",
        "trainer.eval_every=0",
        "trainer.eval_batches=1",
        "trainer.drift_every=0",
        f"trainer.measure_error_every={args.steps}",
        "checkpoint.every=0",
        "checkpoint.at_end=false",
        "wandb.mode=disabled",
        "trainer.progress_bar=false",
        "resume=false",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        str(checkout / "train" / "sweep.py"),
        str(work_dir),
        *(f"{label}: {o}" for label, o in runs),
        "--",
        *common,
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    print(" ".join(cmd[2:]), flush=True)
    before = os.getloadavg()[0]
    subprocess.run(cmd, check=True, cwd=checkout, env=env)
    load = {"load_before": before, "load_after": os.getloadavg()[0]}
    (work_dir / "load.json").write_text(json.dumps(load))
    return runs


def collect(args: argparse.Namespace, code: str, work_dir: Path) -> list[dict]:
    rows = []
    load = json.loads((work_dir / "load.json").read_text()) if (work_dir / "load.json").exists() else {}
    for name in AGGREGATORS:
        records, finals = [], []
        for r in range(args.rounds):
            lines = (work_dir / f"{name}_r{r}" / "metrics.jsonl").read_text().splitlines()
            run = [json.loads(line) for line in lines]
            records += [rec for rec in run if rec["step"] > args.warmup]
            finals.append(run[-1])
        row = {"code": code, "aggregator": name, "model": args.model, "N": args.nproc, "steps_measured": len(records)}
        for phase in PHASES:
            row[f"{phase}_s"] = statistics.median(rec[f"time/{phase}"] for rec in records)
        row["step_s"] = statistics.median(rec["time/step"] for rec in records)
        row["bytes_sent"] = statistics.median(rec["bytes_sent"] for rec in records)
        row["rel_error_max"] = max(f.get("agg/rel_error_max", 0.0) for f in finals)
        row["final_train_loss"] = statistics.mean(f["train_loss"] for f in finals)
        row["load_before"], row["load_after"] = load.get("load_before", ""), load.get("load_after", "")
        rows.append(row)
    return rows


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    loads = "; ".join(
        f"{r['code']}: {r['load_before']:.1f} before, {r['load_after']:.1f} after"
        for r in rows
        if r["aggregator"] == next(iter(AGGREGATORS)) and r["load_before"] != ""
    )
    if loads:
        machine += f"; 1-minute load average {loads}"
    lines = [
        "# Per-phase step times on CPU: nccl (gloo) vs ring vs CERAR c=16",
        "",
        f"Produced by `python scripts/bench/bench_phases.py` (data: `{os.path.relpath(args.csv, ROOT)}`). "
        f"Model `{args.model}`, {args.nproc} processes on one machine ({machine}), gloo backend, "
        f"micro-batch {args.micro_batch} x {args.seq_len} tokens per rank, overlap=false (backward without "
        "DDP reduction, then one aggregation of all gradients). Median seconds per optimizer step over "
        f"{rows[0]['steps_measured']} steps per aggregator ({args.rounds} interleaved runs of {args.steps} steps, "
        f"first {args.warmup} of each dropped). `nccl` is `torch.distributed.all_reduce` on gloo here.",
        "",
        "| code | aggregator | forward s | backward s | aggregate s | optimizer s | step s | bytes sent / rank / step "
        "| worst rel. error | final train loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['code']} | {r['aggregator']} | {r['forward_s']:.3f} | {r['backward_s']:.3f} | "
            f"{r['aggregate_s']:.3f} | "
            f"{r['optimizer_s']:.3f} | {r['step_s']:.3f} | {r['bytes_sent'] / 1e6:.1f} MB | "
            f"{r['rel_error_max']:.2e} | {r['final_train_loss']:.3f} |"
        )
    lines += [
        "",
        "Reading it: the processes share the machine's cores, so compute phases are slow and noisy and the "
        "aggregate phase is loopback memory traffic plus, for ring/CERAR, Python-level point-to-point rounds; "
        "it says nothing about link-bound clusters (see `reports/costmodel.md` for those). CERAR c=16 with "
        "N=4 sends (1 + (N-2)/c) d = 1.125 d values per rank against the ring's 2(N-1)/N d = 1.5 d, in "
        "c + N - 2 = 18 rounds against 6, and pays encoding/decoding; the worst relative error is the "
        "aggregate of rank 0 against the exact average, measured once per run at its last step. "
        "`step s` is wall time per step: besides the four phases it holds the batch loading, the gradient "
        "flattening (before the persistent flat gradient buffer: a concatenation and a copy back per step) and "
        "the all-reduce of the non-finite flag, which is where ranks wait for the slowest one. With a `before` "
        "row the two launches ran back to back, the older checkout first.",
        "",
    ]
    Path(args.md).write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    args = parse_args()
    rows = []
    for code, checkout, work_dir in versions(args):
        if not args.no_run:
            launch(args, checkout, work_dir)
        rows += collect(args, code, work_dir)
    write(args, rows)


if __name__ == "__main__":
    main()
