"""One rank of a benchmark run (``bench_allreduce.py --worker``): the aggregators timed interleaved, side by side,
and rank 0's rows. ``cerar`` is imported inside ``worker`` (after ``--code-dir``), never at import."""

from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from scripts.bench.allreduce.options import HIERARCHICAL, ITEMSIZE
from scripts.code_dir import library_module

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
        proto = library_module("cerar.ring.protocol", "cerar.protocol")

        cerar.all_reduce, cerar.ring_all_reduce = proto.all_reduce, proto.ring_all_reduce
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.collective_timeout)
    dist.init_process_group("gloo", timeout=timeout)
    torch.set_num_threads(1)
    N = world
    fused_on = _enable_fused(args, rank)

    rounds = library_module("cerar.ring.rounds", "cerar.rounds")
    default_chunks = rounds.PIPELINE_MAX_CHUNKS
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
    for agg in ("int8", "hier_int8", "int4", "hier_int4", "hier_int4_exact"):  # issues 25 and 54
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
            quantized_all_reduce = library_module("cerar.int8.all_reduce", "cerar.quantized").quantized_all_reduce
            two_tier = library_module("cerar.int8.two_tier", "cerar.hierarchical.quantized")
            hierarchical_quantized_all_reduce = two_tier.hierarchical_quantized_all_reduce

            if agg == "int8":
                return quantized_all_reduce(buf, op="sum", timeout=ct, block=args.int8_block)
            return hierarchical_quantized_all_reduce(buf, tiers, op="sum", timeout=ct, block=args.int8_block)
        if agg in ("int4", "hier_int4", "hier_int4_exact"):  # issue 54: the sum, rotated, stochastic
            int4 = library_module("cerar.int4.all_reduce")
            if agg == "int4":
                return int4.int4_all_reduce(buf, op="sum", timeout=ct, block=args.int8_block)
            two_tier = library_module("cerar.int4.two_tier")
            intra = "exact" if agg == "hier_int4_exact" else "int8"
            return two_tier.hierarchical_int4_all_reduce(buf, tiers, op="sum", timeout=ct, block=args.int8_block,
                                                         intra=intra)  # fmt: skip
        rounds.PIPELINE_MAX_CHUNKS = chunks
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

    def tcp_retransmitted() -> int:
        """TCP segments this host's network namespace has retransmitted so far (/proc/net/snmp's Tcp RetransSegs):
        the NICs' counters count each of them again."""
        snmp = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line.startswith("Tcp:")]
        return int(snmp[1][snmp[0].index("RetransSegs")])

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
        # per config: the bytes the host's busiest NIC and all its NICs together sent in one call, and the TCP
        # segments the host retransmitted in it
        nic_bytes = torch.zeros(len(configs), 3, dtype=torch.float64)
        for k, cfg in enumerate(configs):
            for w in range(max(args.warmup, 1)):
                counting = bool(nics) and w == 0  # the same on every rank
                buf.copy_(src)
                dist.barrier()
                before = (nic_tx(), tcp_retransmitted()) if counting and reads_nics else None
                st = run_one(cfg, buf)
                if w == 0:
                    e = float((buf.to(torch.float64) - exact).norm() / exact.norm())
                    errors[k], stats_of[k] = e, st
                if counting:
                    dist.barrier()  # every rank of the host is done sending
                if before is not None:
                    sent = [b - a for a, b in zip(before[0], nic_tx(), strict=True)]
                    retransmitted = tcp_retransmitted() - before[1]
                    nic_bytes[k] = torch.tensor([max(sent), sum(sent), retransmitted], dtype=torch.float64)
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
                if agg in ("int8", "hier_int8", "int4", "hier_int4", "hier_int4_exact"):
                    row["int8_block"] = args.int8_block
                row["fused"] = fused_on
                if nics:
                    link, host, retransmitted = (int(x) for x in nic_bytes[k].tolist())
                    row["nic_tx_bytes_link_max"], row["nic_tx_bytes"] = link, host
                    row["nic_tcp_retransmitted_segments"] = retransmitted
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


def _enable_fused(args, rank: int) -> str:
    """``--fused``: the compiled kernels on in this rank before anything is timed (the trainer's warm-up does the
    same); the CSV's ``fused`` column names those that are on ("" without ``--fused``: the eager arithmetic)."""
    if not args.fused:
        return ""
    try:
        from cerar.formats import fused
    except ImportError as error:
        raise RuntimeError(f"--fused: the code under test has no cerar.formats.fused ({error})") from error
    say = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    fused.enable("cpu", args.int8_block, say=say)
    return "+".join(sorted({name for name, _, _ in fused.enabled()})) or "none"


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
        rounds = library_module("cerar.ring.rounds", "cerar.rounds")
    except ImportError:
        return "-"
    return getattr(rounds, "DEFAULT_STORAGE", "-")


def _commit_of(checkout: Path) -> str:
    """The checkout's commit, with ``+dirty`` when its cerar/ differs from it."""
    from scripts.reporting.provenance import checkout_state  # the repository root is on sys.path

    state = checkout_state(checkout, short=12)
    if state is None:
        return ""
    commit, changed = state
    return commit + ("+dirty" if changed else "")
