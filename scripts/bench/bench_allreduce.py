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
  storage choice in ``--storages`` (``cerar.rounds.STORAGE_CHOICES``),

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
  exact hierarchy (``transport=``, ``cerar.wire``: each block cast with its power-of-two scale, one
  2-byte scale per message, sums in float32; the trainer's ``aggregator=hier_fp16`` / ``hier_bf16``):
  the peer to beat on bytes.

The 8-bit all-reduce (issue 25, ``cerar.quantized``; ``--int8-block`` values per float32 scale, default
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
its extra rounds and encode/decode arithmetic, and to feed ``cerar/costmodel.py``.

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

import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CSV_COLUMNS = [
    "where", "rate_mbit", "aggregator", "construction", "N", "c", "bytes",
    "seconds_median", "seconds_min", "seconds_max", "repeats",
]  # fmt: skip
EXTRA_COLUMNS = [
    "seconds_p25", "seconds_p75", "warmup", "backend", "itemsize", "bytes_sent", "bytes_received",
    "rounds", "byte_bound_seconds", "achieved_mbit", "seconds_encode", "seconds_comm", "seconds_decode",
    "peak_extra_bytes", "rel_error", "eps", "kappa", "run_id", "timestamp", "host", "torch",
    "storage", "code_commit", "load_before", "pipeline_chunks", "cpu_seconds", "cpu_system_seconds", "mtu", "cpus",
    "hosts", "ranks_per_host", "rails", "inter_node_method", "bytes_sent_intra", "bytes_sent_inter", "rounds_intra",
    "rounds_inter", "seconds_intra", "seconds_inter", "nic_tx_bytes", "nic_tx_bytes_link_max", "half_dtype",
    "load_after",
]  # fmt: skip
AGGREGATORS = ("nccl", "ring", "cerar", "hier_ring", "hier_cerar", "hier_ring16")
HIERARCHICAL = ("hier_ring", "hier_cerar", "hier_ring16")
# issue 25: the 8-bit all-reduce (cerar.quantized): int8 flat, hier_int8 on the two tiers (int8 on the rails)
AGGREGATORS = (*AGGREGATORS, "int8", "hier_int8")
HIERARCHICAL = (*HIERARCHICAL, "hier_int8")
EXTRA_COLUMNS = [*EXTRA_COLUMNS, "int8_block", "transport"]
DEFAULT_CSV = ROOT / "reports" / "data" / "allreduce.csv"
DEFAULT_FIGURES = ROOT / "reports" / "figures"
ITEMSIZE = 4  # float32


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _floats(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from e
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {s!r}")
    return vals


def _strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--n", type=_ints, default=[2, 4, 8], help="world sizes, e.g. 2,4,8")
    ap.add_argument("--sizes-mb", type=_floats, default=[1, 4, 16, 64, 256],
                    help="tensor sizes in MiB (float32), e.g. 1,16,256")  # fmt: skip
    ap.add_argument("--aggregators", type=_strs, default=["nccl", "ring", "cerar"],
                    help=f"subset of {','.join(AGGREGATORS)}")  # fmt: skip
    ap.add_argument("--constructions", type=_strs, default=None,
                    help="CERAR constructions (default: all of cerar.CONSTRUCTIONS)")  # fmt: skip
    ap.add_argument("--c-mult", type=_ints, default=[1, 2, 4], help="c = k*N for k in this list")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks per host G (LOCAL_WORLD_SIZE; N must be a multiple): two tiers when > 1")  # fmt: skip
    ap.add_argument("--rails", action="store_true", help="lab: one NIC per local rank instead of one per host")
    ap.add_argument("--hier-c", type=_ints, default=None,
                    help="hier_cerar: c values, e.g. 8,16 (default: --c-mult times the number of hosts)")  # fmt: skip
    ap.add_argument("--half-dtype", choices=["float16", "bfloat16"], default="float16",
                    help="hier_ring16: the 16-bit message type (default float16, as torch's fp16 hook)")  # fmt: skip
    ap.add_argument("--int8-block", type=int, default=128, help="int8/hier_int8: values per float32 scale")
    ap.add_argument("--cerar-transport", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="cerar/hier_cerar: the dtype their messages travel in (cerar.wire; 16 bits: kappa_max "
                         "defaults to cerar.default_kappa_max of it), recorded in the transport column")  # fmt: skip
    ap.add_argument("--storages", type=_strs, default=None,
                    help="CERAR storage choices, e.g. spec,messages (default: the library's default)")  # fmt: skip
    ap.add_argument("--pipeline-chunks", type=_ints, default=None,
                    help="CERAR: most messages a round's block is cut into (cerar.rounds.PIPELINE_MAX_CHUNKS), "
                         "e.g. 2,4 (default: the library's)")  # fmt: skip
    ap.add_argument("--code-dir", type=Path, default=None,
                    help="import cerar from this checkout (before/after comparisons); default: this one")  # fmt: skip
    ap.add_argument("--eps", type=float, default=None, help="code eps (default: the construction's)")
    ap.add_argument("--kappa-max", type=float, default=None, help="code kappa_max (default: the library's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lab", action="store_true", help="run in a netlab lab (root) instead of loopback")
    ap.add_argument("--rate-mbit", type=_floats, default=[200.0], help="lab link rates, e.g. 100,400,2000")
    ap.add_argument("--mtu", type=int, default=1500, help="lab link MTU (9000: jumbo frames)")
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--figures", action="store_true", help="draw figures from the CSV after the run")
    ap.add_argument("--figures-only", action="store_true", help="only (re)draw figures from --csv")
    ap.add_argument("--figures-dir", type=Path, default=DEFAULT_FIGURES)
    ap.add_argument("--timeout", type=float, default=1800.0, help="wall-clock limit per (N, rate) run")
    ap.add_argument("--collective-timeout", type=float, default=300.0, help="limit per collective (s)")
    ap.add_argument("--log-dir", type=Path, default=None, help="keep rank logs here")
    ap.add_argument("--quiet", action="store_true")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--where", default="loopback", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    return ap


# --------------------------------------------------------------------------- worker


def _stat(stats, name):
    v = getattr(stats, name, None)
    if v is None and isinstance(stats, dict):
        v = stats.get(name)
    return v


def worker(args) -> int:
    """One rank: build the aggregators, time them interleaved, rank 0 writes JSON rows."""
    import torch
    import torch.distributed as dist

    if args.code_dir is not None:
        sys.path.insert(0, str(args.code_dir.resolve()))
    import cerar

    if args.code_dir is not None and not Path(cerar.__file__).resolve().is_relative_to(args.code_dir.resolve()):
        raise RuntimeError(f"--code-dir {args.code_dir}: imported cerar from {cerar.__file__} instead")
    if not hasattr(cerar, "all_reduce"):  # before cerar/__init__ exports the protocol
        import cerar.protocol as proto

        cerar.all_reduce, cerar.ring_all_reduce = proto.all_reduce, proto.ring_all_reduce
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.collective_timeout)
    dist.init_process_group("gloo", timeout=timeout)
    torch.set_num_threads(1)
    N = world

    import cerar.rounds

    default_chunks = cerar.rounds.PIPELINE_MAX_CHUNKS
    G = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    hosts = N // G
    tiers = None
    if any(a in HIERARCHICAL for a in args.aggregators):
        from cerar import hierarchical

        # the node and rail groups, made once (a collective call) before anything is timed
        tiers = hierarchical.tier_groups(hierarchical.NodeLayout.from_env(), args.collective_timeout)
    configs = []  # (aggregator, construction, c, code, storage, pipeline chunks)
    skipped = []
    if "nccl" in args.aggregators:
        configs.append(("nccl", "", None, None, None, None))
    if "ring" in args.aggregators:
        configs.append(("ring", "", None, None, None, None))
    if "hier_ring" in args.aggregators:
        configs.append(("hier_ring", "", None, None, None, None))
    if "hier_ring16" in args.aggregators:
        configs.append(("hier_ring16", "", None, None, None, None))
    for agg in ("int8", "hier_int8"):  # issue 25
        if agg in args.aggregators:
            configs.append((agg, "", None, None, None, None))
    coded = [("cerar", N, [k * N for k in args.c_mult])] if "cerar" in args.aggregators else []
    if "hier_cerar" in args.aggregators:  # the code runs between the hosts: built for n = hosts
        coded.append(("hier_cerar", hosts, args.hier_c or [k * hosts for k in args.c_mult]))
    for agg, workers, cs in coded:
        for cons in args.constructions or list(cerar.CONSTRUCTIONS):
            for c in cs:
                try:
                    kappa_max = args.kappa_max
                    if kappa_max is None and args.cerar_transport != "float32":
                        kappa_max = cerar.default_kappa_max(args.cerar_transport)
                    code = cerar.make_code(workers, c, construction=cons, eps=args.eps, kappa_max=kappa_max)
                except ValueError as e:
                    skipped.append(f"{agg} {cons} c={c}: {e}")
                    continue
                for storage in args.storages or [None]:
                    for chunks in args.pipeline_chunks or [default_chunks]:
                        configs.append((agg, cons, c, code, storage, chunks))
    if rank == 0:
        for s in skipped:
            print(f"bench: skipped {s}", flush=True)

    def run_one(cfg, buf):
        agg, _, _, code, storage, chunks = cfg
        ct = args.collective_timeout
        if agg == "nccl":
            work = dist.all_reduce(buf, async_op=True)
            work.wait(timeout=timeout)
            return None
        if agg == "ring":
            return cerar.ring_all_reduce(buf, timeout=ct)
        if agg == "hier_ring":
            return hierarchical.hierarchical_ring_all_reduce(buf, tiers, timeout=ct)
        if agg == "hier_ring16":  # the library's 16-bit exact hierarchy (docs/cerar-16bit.md)
            return hierarchical.hierarchical_ring_all_reduce(buf, tiers, timeout=ct, transport=args.half_dtype)
        if agg in ("int8", "hier_int8"):  # issue 25: the sum, like the others (rel_error is against the sum)
            from cerar.hierarchical.quantized import hierarchical_quantized_all_reduce
            from cerar.quantized import quantized_all_reduce

            if agg == "int8":
                return quantized_all_reduce(buf, op="sum", timeout=ct, block=args.int8_block)
            return hierarchical_quantized_all_reduce(buf, tiers, op="sum", timeout=ct, block=args.int8_block)
        cerar.rounds.PIPELINE_MAX_CHUNKS = chunks
        kw = {} if storage is None else {"storage": storage}  # None: the library's default (older versions: no knob)
        if args.cerar_transport != "float32":
            kw["transport"] = args.cerar_transport
        if agg == "hier_cerar":
            return hierarchical.hierarchical_all_reduce(buf, code, tiers, timeout=ct, **kw)
        return cerar.all_reduce(buf, code, timeout=ct, **kw)

    nics = [n for n in os.environ.get("LAB_NICS", "").split(",") if n]
    reads_nics = bool(nics) and int(os.environ.get("LOCAL_RANK", "0")) == 0  # one reader per host

    def nic_tx() -> list[int]:
        """Bytes this host's NICs have sent so far (one entry per NIC)."""
        return [int(Path(f"/sys/class/net/{n}/statistics/tx_bytes").read_text()) for n in nics]

    rows = []
    gen = torch.Generator().manual_seed(1234 + rank)
    for size_mb in args.sizes_mb:
        nbytes = int(round(size_mb * 2**20)) // ITEMSIZE * ITEMSIZE
        d = nbytes // ITEMSIZE
        src = torch.randn(d, generator=gen, dtype=torch.float32)
        exact = src.to(torch.float64)
        dist.all_reduce(exact)
        buf = torch.empty_like(src)
        errors, stats_of = {}, {}
        # per config: the bytes the host's busiest NIC and all its NICs together sent in one call
        nic_bytes = torch.zeros(len(configs), 2, dtype=torch.float64)
        for k, cfg in enumerate(configs):
            for w in range(max(args.warmup, 1)):
                counting = bool(nics) and w == 0  # the same on every rank
                buf.copy_(src)
                dist.barrier()
                before = nic_tx() if counting and reads_nics else None
                st = run_one(cfg, buf)
                if w == 0:
                    e = float((buf.to(torch.float64) - exact).norm() / exact.norm())
                    errors[k], stats_of[k] = e, st
                if counting:
                    dist.barrier()  # every rank of the host is done sending
                if before is not None:
                    sent = [b - a for a, b in zip(before, nic_tx(), strict=True)]
                    nic_bytes[k] = torch.tensor([max(sent), sum(sent)], dtype=torch.float64)
        dist.all_reduce(nic_bytes, op=dist.ReduceOp.MAX)  # the busiest host's
        times = torch.zeros(len(configs), args.repeats, dtype=torch.float64)
        cpu = torch.zeros(len(configs), args.repeats, 2, dtype=torch.float64)  # this rank's CPU (all, system)
        phases = torch.zeros(len(configs), args.repeats, 5, dtype=torch.float64)  # encode comm decode intra inter
        for rep in range(args.repeats):
            order = [(rep + j) % len(configs) for j in range(len(configs))]
            for k in order:
                buf.copy_(src)
                dist.barrier()
                t0, c0 = time.perf_counter(), torch.tensor(_cpu_seconds(), dtype=torch.float64)
                st = run_one(configs[k], buf)
                times[k, rep] = time.perf_counter() - t0
                cpu[k, rep] = torch.tensor(_cpu_seconds(), dtype=torch.float64) - c0
                if st is not None:
                    phases[k, rep] = torch.tensor(_phases(st), dtype=torch.float64)
        # The time of a run is its slowest rank's; errors: the worst rank's.
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(phases, op=dist.ReduceOp.MAX)
        cpu = cpu.median(dim=1).values
        dist.all_reduce(cpu)  # the ranks' mean CPU seconds per call, below
        err = torch.tensor([errors[k] for k in range(len(configs))], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if rank == 0:
            for k, (agg, cons, c, code, storage, chunks) in enumerate(configs):
                ts = sorted(times[k].tolist())
                st = stats_of[k]
                q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
                row = {
                    "aggregator": agg, "construction": cons, "N": N, "c": "" if c is None else c,
                    "bytes": nbytes, "seconds_median": statistics.median(ts), "seconds_min": ts[0],
                    "seconds_max": ts[-1], "repeats": len(ts), "seconds_p25": q[0], "seconds_p75": q[2],
                    "warmup": args.warmup, "backend": dist.get_backend() if agg == "nccl" else "gloo",
                    "itemsize": ITEMSIZE, "rel_error": float(err[k]),
                    "eps": "" if code is None or code.eps is None else code.eps,
                    "kappa": "" if code is None else code.kappa,
                    "storage": "" if agg != "cerar" else (storage or _default_storage()),
                    "code_commit": _commit_of(Path(cerar.__file__).resolve().parents[1]),
                    "pipeline_chunks": "" if chunks is None else chunks, "cpu_seconds": float(cpu[k, 0]) / N,
                    "cpu_system_seconds": float(cpu[k, 1]) / N, "hosts": hosts, "ranks_per_host": G,
                    "half_dtype": args.half_dtype if agg == "hier_ring16" else "",
                }  # fmt: skip
                if agg in ("cerar", "hier_cerar"):
                    row["storage"] = storage or _default_storage()
                    row["transport"] = args.cerar_transport
                if agg in ("int8", "hier_int8"):
                    row["int8_block"] = args.int8_block
                if nics:
                    row["nic_tx_bytes_link_max"], row["nic_tx_bytes"] = (int(x) for x in nic_bytes[k].tolist())
                for name in ("bytes_sent", "bytes_received", "rounds", "peak_extra_bytes"):
                    v = _stat(st, name) if st is not None else None
                    row[name] = "" if v is None else int(v)
                if agg in HIERARCHICAL:
                    row["peak_extra_bytes"] = st.intra_node.peak_extra_bytes + st.inter_node.peak_extra_bytes
                    row["inter_node_method"] = st.inter_node_method
                    for tier, part in (("intra", st.intra_node), ("inter", st.inter_node)):
                        row[f"bytes_sent_{tier}"], row[f"rounds_{tier}"] = part.bytes_sent, part.rounds
                for p, name in enumerate(PHASE_COLUMNS):
                    v = phases[k, :, p]
                    row[name] = "" if st is None or torch.isnan(v).all() else float(v.median())
                rows.append(row)
            print(f"bench: N={N} {size_mb:g} MiB done", flush=True)
    if rank == 0 and args.rows_out:
        args.rows_out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


PHASE_COLUMNS = ("seconds_encode", "seconds_comm", "seconds_decode", "seconds_intra", "seconds_inter")


def _phases(st) -> list[float]:
    """A call's seconds per phase (``PHASE_COLUMNS``; NaN where the stats do not say): for a hierarchical
    call, encode is the rail's, comm and decode add both tiers', intra and inter are each tier's total."""
    nan = float("nan")
    if hasattr(st, "intra_node"):
        a, b = st.intra_node, st.inter_node
        return [b.seconds_encode, a.seconds_comm + b.seconds_comm, a.seconds_decode + b.seconds_decode,
                a.seconds_total, b.seconds_total]  # fmt: skip
    flat = [_stat(st, name) for name in PHASE_COLUMNS[:3]]
    return [nan if v is None else float(v) for v in flat] + [nan, nan]


def _cpu_seconds() -> tuple[float, float]:
    """This process's CPU time (user + system, system), all threads: gloo's transport threads, and
    the kernel's network stack (in the lab: veth, bridge and tbf) run on the sender's time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_stime


def _default_storage() -> str:
    """The library's default storage choice; ``"-"`` for versions from before the knob."""
    try:
        from cerar.rounds import DEFAULT_STORAGE
    except ImportError:
        return "-"
    return DEFAULT_STORAGE


def _commit_of(checkout: Path) -> str:
    """The checkout's commit, with ``+dirty`` when its cerar/ differs from it."""
    from scripts.reporting.provenance import checkout_state  # the repository root is on sys.path

    state = checkout_state(checkout, short=12)
    if state is None:
        return ""
    commit, changed = state
    return commit + ("+dirty" if changed else "")


# --------------------------------------------------------------------------- launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_argv(args, rows_out: Path, where: str, run_id: str) -> list[str]:
    a = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rows-out", str(rows_out),
         "--where", where, "--run-id", run_id,
         "--sizes-mb", ",".join(f"{s:g}" for s in args.sizes_mb),
         "--aggregators", ",".join(args.aggregators), "--c-mult", ",".join(map(str, args.c_mult)),
         "--repeats", str(args.repeats), "--warmup", str(args.warmup),
         "--collective-timeout", str(args.collective_timeout)]  # fmt: skip
    if args.constructions:
        a += ["--constructions", ",".join(args.constructions)]
    if args.storages:
        a += ["--storages", ",".join(args.storages)]
    if args.pipeline_chunks:
        a += ["--pipeline-chunks", ",".join(map(str, args.pipeline_chunks))]
    if args.code_dir is not None:
        a += ["--code-dir", str(args.code_dir.resolve())]
    if args.hier_c:
        a += ["--hier-c", ",".join(map(str, args.hier_c))]
    if "hier_ring16" in args.aggregators:
        a += ["--half-dtype", args.half_dtype]
    if "int8" in args.aggregators or "hier_int8" in args.aggregators:
        a += ["--int8-block", str(args.int8_block)]
    if args.eps is not None:
        a += ["--eps", str(args.eps)]
    if args.kappa_max is not None:
        a += ["--kappa-max", str(args.kappa_max)]
    if args.cerar_transport != "float32":
        a += ["--cerar-transport", args.cerar_transport]
    return a


def run_loopback(args, N: int, rows_out: Path, run_id: str, log_dir: Path) -> bool:
    """Spawn N local ranks (torchrun-like: env rendezvous on 127.0.0.1); kill all on failure/timeout."""
    port = _free_port()
    procs = []
    G = args.ranks_per_host if args.ranks_per_host > 1 else N  # loopback: one host, or G-rank "hosts"
    for r in range(N):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r % G), WORLD_SIZE=str(N), LOCAL_WORLD_SIZE=str(G),
                   GROUP_RANK=str(r // G), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                   PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # fmt: skip
        out = open(log_dir / f"N{N}-rank{r}.log", "wb")  # noqa: SIM115
        procs.append((subprocess.Popen(worker_argv(args, rows_out, "loopback", run_id), env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True), out))  # fmt: skip
    deadline = time.monotonic() + args.timeout
    failed_at = None
    try:
        while True:
            codes = [p.poll() for p, _ in procs]
            if all(c is not None for c in codes):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if time.monotonic() > deadline or (failed_at and time.monotonic() - failed_at > 10):
                break
            time.sleep(0.05)
    finally:
        for p, out in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
            p.wait()
            out.close()
    ok = all(p.returncode == 0 for p, _ in procs)
    if not ok:
        print(f"bench: loopback N={N} failed: return codes {[p.returncode for p, _ in procs]}; "
              f"logs in {log_dir}", file=sys.stderr)  # fmt: skip
        print((log_dir / f"N{N}-rank0.log").read_text()[-3000:], file=sys.stderr)
    return ok


def run_lab(args, N: int, rate: float, rows_out: Path, run_id: str, log_dir: Path) -> bool:
    from scripts.lab import netlab

    G = args.ranks_per_host
    with netlab.NetLab(hosts=N // G, rate_mbit=rate, mtu=args.mtu, ranks_per_host=G, rails=args.rails) as lab:
        res = lab.run(worker_argv(args, rows_out, "lab", run_id), timeout=args.timeout,
                      out_dir=log_dir / f"lab-N{N}-r{rate:g}", echo=not args.quiet,
                      env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    if not res.ok:
        print(f"bench: lab N={N} rate={rate:g} failed: {res.describe()}", file=sys.stderr)
        for r in res.ranks:
            if r.returncode != 0:
                print(f"--- rank {r.rank} stderr ---\n{r.stderr[-3000:]}", file=sys.stderr)
    return res.ok


def append_rows(csv_path: Path, rows: list[dict]) -> None:
    """Append rows; write the header if the file is new. Existing files must have our columns first."""
    from scripts.bench.csv_rows import append_rows as append

    append(csv_path, rows, CSV_COLUMNS + EXTRA_COLUMNS, required_prefix=CSV_COLUMNS)


def setting_name(where: str, mtu: int, ranks_per_host: int = 1, hosts: int = 0, rails: bool = False) -> str:
    """The ``where`` of a row: ``loopback``, ``lab``, or the lab's shape: ``lab-<hosts>x<G>[-rails]``, with
    ``-mtu<mtu>`` for jumbo frames. Settings are never mixed by figures, fits and tables."""
    if where != "lab":
        return where if ranks_per_host == 1 else f"{where}-{hosts}x{ranks_per_host}"
    name = "lab" if ranks_per_host == 1 else f"lab-{hosts}x{ranks_per_host}" + ("-rails" if rails else "")
    return name if mtu == 1500 else f"{name}-mtu{mtu}"


def finish_rows(
    rows: list[dict], where: str, rate: float | None, run_id: str, load_before: str, mtu: int,
    ranks_per_host: int = 1, rails: bool = False, load_after: str = "",
) -> list[dict]:  # fmt: skip
    import torch

    for r in rows:
        r["load_before"], r["load_after"] = load_before, load_after
        G = ranks_per_host  # as launched (a flat loopback run is one host of N ranks to the library)
        r["where"] = setting_name(where, mtu, G, int(r["N"]) // G, rails)
        r["mtu"] = mtu if where == "lab" else ""
        r["rails"] = int(rails) if where == "lab" and G > 1 else ""
        r["cpus"] = os.cpu_count()
        r["rate_mbit"] = "" if rate is None else f"{rate:g}"
        sent = r.get("bytes_sent")
        link = r.get("nic_tx_bytes_link_max")
        if G > 1 and link not in ("", None) and rate is not None:
            # two tiers: what the busiest shaped link carried (measured), not what one rank sent
            r["byte_bound_seconds"] = link * 8 / (rate * 1e6)
            if r["seconds_median"] > 0:
                r["achieved_mbit"] = link * 8 / r["seconds_median"] / 1e6
        elif sent not in ("", None) and r["seconds_median"] > 0:
            r["achieved_mbit"] = sent * 8 / r["seconds_median"] / 1e6
            if rate is not None:
                r["byte_bound_seconds"] = sent * 8 / (rate * 1e6)
        r.update(run_id=run_id, timestamp=datetime.datetime.now().isoformat(timespec="seconds"),
                 host=platform.node(), torch=torch.__version__)  # fmt: skip
    return rows


def print_summary(rows: list[dict]) -> None:
    print(f"{'where':8} {'rate':>6} {'N':>3} {'MiB':>7} {'aggregator':31} {'median s':>10} "
          f"{'min':>9} {'max':>9} {'sent MB':>8} {'Mbit/s':>7} {'bound s':>8} {'rel err':>8} {'cpu s':>7}")  # fmt: skip
    for r in rows:
        name = _label(r).replace(" ", "/")
        sent = r.get("bytes_sent")
        print(f"{r['where']:8} {r['rate_mbit'] or '-':>6} {r['N']:>3} {r['bytes'] / 2**20:>7.2f} {name:31} "
              f"{r['seconds_median']:>10.4f} {r['seconds_min']:>9.4f} {r['seconds_max']:>9.4f} "
              f"{(sent / 1e6 if sent not in ('', None) else float('nan')):>8.2f} "
              f"{r.get('achieved_mbit') or math.nan:>7.1f} {r.get('byte_bound_seconds') or math.nan:>8.4f} "
              f"{r['rel_error']:>8.1e} {r.get('cpu_seconds', math.nan):>7.3f}")  # fmt: skip


# --------------------------------------------------------------------------- figures


def _label(r: dict) -> str:
    if r["aggregator"] == "hier_ring16":
        return f"hier_ring16 {r.get('half_dtype') or ''}".strip()
    if r["aggregator"] not in ("cerar", "hier_cerar"):
        return r["aggregator"]
    storage, chunks = r.get("storage") or "", str(r.get("pipeline_chunks") or "")
    transport = r.get("transport") or ""
    return (f"{r['aggregator']} {r['construction']} c={r['c']}"
            + (f" {transport}" if transport not in ("", "float32") else "")
            + (f" {storage}" if storage not in ("", "-", "spec") else "")
            + (f" chunks={chunks}" if chunks not in ("", "2") else ""))  # fmt: skip


def make_figures(csv_path: Path, out_dir: Path) -> list[Path]:
    """Draw time-vs-size, saving-vs-c and measured-vs-byte-bound figures from the CSV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{csv_path} has no rows to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["_t"] = float(r["seconds_median"])
        r["_mb"] = int(r["bytes"]) / 2**20
        r["_N"] = int(r["N"])
    paths = []
    settings = sorted({(r["where"], r["rate_mbit"]) for r in rows})
    # 1. time vs size, one panel per N, per setting
    for where, rate in settings:
        sub = [r for r in rows if (r["where"], r["rate_mbit"]) == (where, rate)]
        Ns = sorted({r["_N"] for r in sub})
        fig, axes = plt.subplots(1, len(Ns), figsize=(5 * len(Ns), 4), squeeze=False)
        for ax, N in zip(axes[0], Ns, strict=True):
            series: dict[str, dict[float, list[float]]] = {}
            for r in sub:
                if r["_N"] != N:
                    continue
                key = _label(r)
                series.setdefault(key, {}).setdefault(r["_mb"], []).append(r["_t"])
            for key, pts in sorted(series.items()):
                xs = sorted(pts)
                ax.plot(xs, [statistics.median(pts[x]) for x in xs], marker="o", label=key,
                        linestyle="-" if not key.startswith("cerar") else "--")  # fmt: skip
            ax.set(xscale="log", yscale="log", xlabel="tensor size (MiB)", ylabel="all-reduce time (s)",
                   title=f"{where} {rate + ' Mbit/s' if rate else ''} N={N}")  # fmt: skip
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        fig.tight_layout()
        p = out_dir / f"time_vs_size_{where}{'_' + rate if rate else ''}.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    # 2. saving vs c/N at the largest size, relative to the ring
    fig, ax = plt.subplots(figsize=(6, 4))
    for where, rate in settings:
        sub = [r for r in rows if (r["where"], r["rate_mbit"]) == (where, rate)]
        for N in sorted({r["_N"] for r in sub}):
            subn = [r for r in sub if r["_N"] == N]
            big = max(r["_mb"] for r in subn)
            ring = [r["_t"] for r in subn if r["aggregator"] == "ring" and r["_mb"] == big]
            if not ring:
                continue
            t_ring = statistics.median(ring)
            for cons in sorted({r["construction"] for r in subn if r["aggregator"] == "cerar"}):
                pts = {}
                for r in subn:
                    if r["aggregator"] == "cerar" and r["construction"] == cons and r["_mb"] == big:
                        pts.setdefault(int(r["c"]) / N, []).append(r["_t"])
                xs = sorted(pts)
                ax.plot(xs, [1 - statistics.median(pts[x]) / t_ring for x in xs], marker="o",
                        label=f"{where} {rate + ' Mbit/s ' if rate else ''}N={N} {cons} ({big:g} MiB)")  # fmt: skip
                from_model = [1 - (1 + (N - 2) / (x * N)) / (2 * (N - 1) / N) for x in xs]
                ax.plot(xs, from_model, color="gray", linestyle=":", linewidth=0.8)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(xlabel="c / N", ylabel="saving vs ring (1 - t_cerar / t_ring)",
           title="CERAR saving vs c (dotted: byte-count bound)")  # fmt: skip
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    else:
        ax.text(0.5, 0.5, "no ring + cerar rows yet", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    p = out_dir / "saving_vs_c.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    # 3. measured time vs byte bound (lab rows)
    lab = [r for r in rows if r.get("byte_bound_seconds") not in ("", None)]
    if lab:
        fig, ax = plt.subplots(figsize=(5, 5))
        for agg in sorted({r["aggregator"] for r in lab}):
            pts = [(float(r["byte_bound_seconds"]), r["_t"]) for r in lab if r["aggregator"] == agg]
            ax.scatter([x for x, _ in pts], [y for _, y in pts], label=agg, s=14)
        lo = min(float(r["byte_bound_seconds"]) for r in lab)
        hi = max(max(float(r["byte_bound_seconds"]), r["_t"]) for r in lab)
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="time = bytes sent / link rate")
        ax.set(xscale="log", yscale="log", xlabel="byte bound: bytes sent per worker * 8 / rate (s)",
               ylabel="measured median time (s)", title="lab: measured vs byte bound")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / "achieved_vs_byte_bound.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


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
