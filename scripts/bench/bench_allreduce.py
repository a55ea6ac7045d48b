#!/usr/bin/env python3
"""Benchmark all-reduce aggregation time: backend all_reduce vs exact ring vs CERAR.

What
----
For every N in ``--n``, every tensor size in ``--sizes-mb`` and every aggregator

* ``nccl``  -- the process group's own ``dist.all_reduce`` (named as in the paper; on CPU the
  group is gloo, so this is gloo's all-reduce, recorded in the ``backend`` column);
* ``ring``  -- ``cerar.ring_all_reduce``, the exact ring on the same transport as CERAR;
* ``cerar`` -- ``cerar.all_reduce`` for each construction in ``--constructions``, each c in
  ``--c-mult`` x N (combinations the construction rejects are skipped and logged) and each
  storage choice in ``--storages`` (``cerar.ring.rounds.STORAGE_CHOICES``),

it times one float32 all-reduce across N real processes: ``--warmup`` untimed runs, then
``--repeats`` repeats in which the aggregators run *interleaved* (order rotated every repeat) so
they are measured side by side under the same conditions. Each run starts after a barrier; its
time is the slowest rank's. Rows (median, min, max, quartiles, per-phase medians, bytes sent,
rounds, worst relative error vs the exact sum) are appended to ``--csv``
(default ``reports/data/allreduce.csv``) with the columns ``CSV_COLUMNS`` first, extras after.

Two tiers (issue 20): ``--ranks-per-host G`` runs N = hosts x G ranks, G per host (torchrun's
LOCAL_WORLD_SIZE, node-major ranks), and adds the hierarchical aggregators of ``cerar.hierarchical``:

* ``hier_ring``   -- ``hierarchical_ring_all_reduce``: exact reduce-scatter inside each host, the
  exact ring on each rail (the ranks with one local rank), exact all-gather: the baseline;
* ``hier_cerar``  -- ``hierarchical_all_reduce``, CERAR on the rails with a code for the n = N/G
  hosts, for each construction and each c in ``--hier-c`` (default ``--c-mult`` x n);
* ``hier_ring16`` -- ``hier_ring`` with ``--half-dtype`` messages on both tiers: the library's 16-bit
  exact hierarchy (``transport=``, ``cerar.formats.wire``: each block cast with its power-of-two scale, one
  2-byte scale per message, sums in float32; the trainer's ``aggregator=hier_fp16`` / ``hier_bf16``):
  the peer to beat on bytes.

The 8-bit all-reduce (issue 25, ``cerar.int8.all_reduce``; ``--int8-block`` values per float32 scale, default
128, recorded in ``int8_block``): ``int8`` flat (any ``--ranks-per-host``), and ``hier_int8``, exact
inside each host and int8 on the rails. Their quantize/dequantize passes are in the time.

In the lab the ranks of one host talk over its loopback (unshaped) and the hosts over one shared
NIC per host (``--rails``: one NIC per local rank); every row then records the bytes the busiest
NIC carried per call (``nic_tx_bytes_link_max``, read from the NICs' counters around the first
warm-up call; headers included, as ``tbf`` counts them), and ``byte_bound_seconds`` is that count
over the rate: what the shaper alone allows, for every aggregator alike (gloo's own included).
Rows go to the CSV with ``where`` = ``lab-<hosts>x<G>[-rails][-mtu<mtu>]``.

Where: ``--where loopback`` spawns N local processes on 127.0.0.1 (memory speed, CPU bound);
``--lab --rate-mbit R[,R2..]`` runs each rank in a host of ``scripts/lab/netlab.py`` whose links are
shaped to R Mbit/s each way (needs root), so the time reflects the bytes moved. ``--mtu 9000`` gives
the lab jumbo frames (rows: ``where`` = ``lab-mtu9000``): fewer packets for the kernel to emulate,
where many ranks share few cores.

Why: to measure whether CERAR's smaller byte count (L*m values instead of 2(N-1)ceil(d/N)) beats
its extra rounds and encode/decode arithmetic, and to feed ``cerar/planning/costmodel.py``.

Before and after: ``--code-dir DIR`` imports ``cerar`` from another checkout (e.g. a git worktree
of an older commit) instead of this one; the rows record that checkout's commit in ``code_commit``,
so two invocations back to back, each with its own all_reduce baseline, compare two versions of
the library on the same machine and load. Storage is left to that version's default there.

Figures (``--figures``; ``--figures-only`` redraws from the CSV): time vs size, saving vs c, and
measured time vs the byte bound L*m*itemsize*8 / link rate, into ``reports/figures/``.

Quick example (a few minutes)::

    python scripts/bench/bench_allreduce.py --n 2 --sizes-mb 1 --repeats 3
    sudo python scripts/bench/bench_allreduce.py --lab --rate-mbit 200 --n 4 --sizes-mb 8 --repeats 3
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench.allreduce.figures import make_figures  # noqa: E402  (the repository root is on sys.path)
from scripts.bench.allreduce.launch import append_rows, finish_rows, print_summary, run_lab, run_loopback  # noqa: E402
from scripts.bench.allreduce.options import AGGREGATORS, build_parser  # noqa: E402
from scripts.bench.allreduce.worker import worker  # noqa: E402

# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    bad = [a for a in args.aggregators if a not in AGGREGATORS]
    if bad:
        ap.error(f"unknown aggregator(s) {bad}: choose from {', '.join(AGGREGATORS)}")
    if any(N < 2 for N in args.n):
        ap.error("--n values must be >= 2 (an all-reduce needs at least two workers)")
    if args.ranks_per_host < 1 or any(N % args.ranks_per_host for N in args.n):
        ap.error(f"--ranks-per-host {args.ranks_per_host} must be >= 1 and divide every --n value {args.n}")
    if args.rails and not args.lab:
        ap.error("--rails is a lab option (one NIC per local rank): add --lab")
    if args.worker:
        try:
            rc = worker(args)
        except Exception:
            traceback.print_exc()
            rc = 1
        # Measured, written and the groups destroyed: leave without the interpreter's finalisation, where
        # gloo's threads can still hold tensors and abort the process (once in about ten 2x2 runs here).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    if args.figures_only:
        for p in make_figures(args.csv, args.figures_dir):
            print(f"bench: wrote {p}")
        return 0
    if args.lab:
        from scripts.lab import netlab

        problem = netlab.requirements_problem()
        if problem:
            print(f"bench: --lab: {problem}", file=sys.stderr)
            return 2
    run_id = f"{datetime.datetime.now():%Y%m%dT%H%M%S}-{os.getpid()}"
    all_rows, failures = [], 0
    with tempfile.TemporaryDirectory(prefix="bench_allreduce_") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        settings = [(N, r) for N in args.n for r in (args.rate_mbit if args.lab else [None])]
        for N, rate in settings:
            rows_out = Path(tmp) / f"rows-N{N}-{rate}.jsonl"
            t0 = time.monotonic()
            load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
            ok = (run_lab(args, N, rate, rows_out, run_id, log_dir) if args.lab
                  else run_loopback(args, N, rows_out, run_id, log_dir))  # fmt: skip
            if not ok:
                failures += 1
            if not rows_out.exists():
                continue
            if not ok:  # rank 0 wrote every row before the failure (at exit): the measurements stand
                print(f"bench: N={N} rate={rate}: a rank failed after the rows were written; keeping them",
                      file=sys.stderr)  # fmt: skip
            load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
            rows = [json.loads(x) for x in rows_out.read_text().splitlines() if x.strip()]
            rows = finish_rows(rows, "lab" if args.lab else "loopback", rate, run_id, load_before, args.mtu,
                               args.ranks_per_host, args.rails, load_after)  # fmt: skip
            append_rows(args.csv, rows)
            all_rows += rows
            if not args.quiet:
                dt = time.monotonic() - t0
                print(f"bench: N={N} rate={rate} took {dt:.1f}s, {len(rows)} rows -> {args.csv}")
    if all_rows:
        print_summary(all_rows)
    if args.figures and args.csv.exists():
        for p in make_figures(args.csv, args.figures_dir):
            print(f"bench: wrote {p}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
