#!/usr/bin/env python3
"""aggregator=auto's link probe beside a CPU load: does its fit succeed, and how close is it (issue 34)?

What
----
Runs ``train.aggregation.auto_aggregator.measure_links`` and ``cluster_from_timings`` (the probe and the fit auto runs
at
start) ``--repeats`` times on 4 ranks, on loopback (one node: the tier inside it) or in the flat network lab
(4 hosts x 1 rank: the tier between them), while a second training run (``--load-ranks`` ranks of model=tiny on
loopback, bounded by a timeout) keeps the 2 cores busy, as the study's own runs and the machine's other jobs do.
``--code-dir`` imports ``cerar`` and ``train`` from another checkout (e.g. the commit before the robust probe,
``git archive <commit> cerar train configs | tar -x -C DIR``), so the same command measures before and after.
One row per probe goes to ``--csv``: the code's commit, where, the 1-minute load before, the fit's relative RMS
(or the refusal that leaves auto exact), the sizes timed again, the fitted bandwidth and the probe's seconds.

Why: the probe's fit gave up at 50 % RMS under contention, leaving aggregator=auto exact with one warning line;
the time-to-loss study judges auto as users get it, so its probe must succeed under the study's own load.

    sudo .venv/bin/python scripts/studies/probe_under_load.py --where lab --repeats 8
    .venv/bin/python scripts/studies/probe_under_load.py --where loopback --repeats 8 --code-dir /tmp/before
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_CSV = ROOT / "reports" / "data" / "probe_under_load.csv"
COLUMNS = ["code_commit", "where", "rate_mbit", "ranks", "repeat", "load_before", "load_ranks", "fit", "rel_rmse",
           "gbit_s", "retried", "probe_s", "timestamp"]  # fmt: skip


def worker(code_dir: str, repeats: int) -> None:
    """One rank (launched by torchrun or the lab): the probe and the fit, ``repeats`` times; rank 0 prints one
    JSON line per probe."""
    sys.path.insert(0, code_dir)
    import torch
    import torch.distributed as dist

    from cerar.hierarchical import NodeLayout, tier_groups
    from scripts.code_dir import library_module

    LinkProbeError = library_module("cerar.planning.link_probe", "cerar.link_probe").LinkProbeError  # noqa: N806
    auto = library_module("train.aggregation.auto_aggregator", "train.auto_aggregator")
    cluster_from_timings, measure_links = auto.cluster_from_timings, auto.measure_links

    dist.init_process_group("gloo")
    world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    layout = NodeLayout(world // local, local)
    groups = tier_groups(layout, 60.0)
    for k in range(repeats):
        load = os.getloadavg()[0]
        start = time.perf_counter()
        timings = measure_links(groups, 1 << 20, torch.device("cpu"), 60.0)
        row = {"repeat": k, "load_before": round(load, 2), "probe_s": round(time.perf_counter() - start, 2),
               "retried": json.dumps(timings.get("retried", "-"))}  # fmt: skip
        try:
            _, record = cluster_from_timings(layout, timings)
            (tier,) = record["tiers"].values()
            gbit_s = 8 * tier["bandwidth_bytes_s"] / 1e9
            row.update(fit="ok", rel_rmse=round(tier["rel_rmse"], 4), gbit_s=round(gbit_s, 4))
        except LinkProbeError as err:
            row.update(fit=f"refused: {str(err)[:160]}", rel_rmse="", gbit_s="")
        if dist.get_rank() == 0:
            print("PROBE " + json.dumps(row), flush=True)
    dist.destroy_process_group()


def commit_of(code_dir: Path) -> str:
    """The checkout's commit (a git work tree), or the name of an exported copy's folder."""
    out = subprocess.run(["git", "-C", str(code_dir), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if out.returncode == 0 and Path(code_dir, ".git").exists():
        dirty = subprocess.run(["git", "-C", str(code_dir), "diff", "--quiet", "HEAD", "--", "cerar", "train"])
        return out.stdout.strip() + ("+dirty" if dirty.returncode else "")
    return code_dir.name


def start_load(ranks: int, seconds: float, port: int) -> subprocess.Popen | None:
    """A second training run on loopback (model=tiny, ``ranks`` ranks), ended by ``timeout`` at ``seconds``."""
    if ranks < 1:
        return None
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = ["timeout", str(int(seconds)), torchrun, "--standalone", f"--nproc_per_node={ranks}", f"--master_port={port}",
           str(ROOT / "train" / "main.py"), "model=tiny", "trainer.max_steps=1000000", "trainer.eval_every=1000000",
           "wandb.mode=disabled", "trainer.progress_bar=false", "checkpoint.every=0", "checkpoint.at_end=false",
           "resume=false", f"hydra.run.dir=/tmp/probe_under_load_{os.getpid()}"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--where", choices=["loopback", "lab"], default="loopback")
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="lab: per direction")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--load-ranks", type=int, default=4, help="ranks of the training run beside it (0: none)")
    ap.add_argument("--code-dir", type=Path, default=ROOT, help="the checkout whose cerar and train are probed")
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(str(args.code_dir), args.repeats)
        return 0
    if not any((args.code_dir / "cerar" / f).is_file() for f in ("planning/link_probe.py", "link_probe.py")):
        ap.error(f"--code-dir {args.code_dir}: no cerar/planning/link_probe.py (or cerar/link_probe.py) there")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--code-dir", str(args.code_dir.resolve()),
          "--repeats", str(args.repeats)]  # fmt: skip
    load = start_load(args.load_ranks, args.timeout + 60, 29900 + os.getpid() % 90)
    try:
        time.sleep(20 if load else 0)  # the load's ranks past their start-up
        if args.where == "loopback":
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            cmd = [torchrun, "--standalone", "--nproc_per_node=4", f"--master_port={29990 - os.getpid() % 90}", *me[1:]]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
            ok, output = proc.returncode == 0, proc.stdout + proc.stderr
        else:
            from scripts.lab import netlab

            problem = netlab.requirements_problem()
            if problem:
                print(f"probe_under_load: {problem}", file=sys.stderr)
                return 2
            with netlab.NetLab(hosts=4, rate_mbit=args.rate_mbit, master_port=29650) as lab:
                res = lab.run(me, timeout=args.timeout, env={"OMP_NUM_THREADS": "1"})
            ok, output = res.ok, "\n".join(r.stdout + r.stderr for r in res.ranks)
    finally:
        if load is not None:
            os.killpg(load.pid, 15)
            load.wait(timeout=30)
    from scripts.bench.csv_rows import append_rows

    rows = []
    for line in output.splitlines():
        if "PROBE " in line:
            row = json.loads(line.split("PROBE ", 1)[1])
            row.update(code_commit=commit_of(args.code_dir), where=args.where, ranks=4, load_ranks=args.load_ranks,
                       rate_mbit=f"{args.rate_mbit:g}" if args.where == "lab" else "",
                       timestamp=datetime.datetime.now().isoformat(timespec="seconds"))  # fmt: skip
            rows.append(row)
            print(f"{row['code_commit']} {args.where} load {row['load_before']}: {row['fit'][:60]} "
                  f"rms {row['rel_rmse']} retried {row['retried']} ({row['probe_s']} s)")  # fmt: skip
    if rows:
        append_rows(args.csv, rows, COLUMNS)
    if not ok:
        print(output[-3000:], file=sys.stderr)
    return 0 if ok and rows else 1


if __name__ == "__main__":
    sys.exit(main())
