"""Launching the ranks of a benchmark setting, on loopback or in the network lab, and turning their rows into the
CSV's (the setting's name, the load, the machine)."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench.allreduce.options import CSV_COLUMNS, EXTRA_COLUMNS, ROOT, _label

SCRIPT = ROOT / "scripts" / "bench" / "bench_allreduce.py"  # the command the ranks run (--worker)

# --------------------------------------------------------------------------- launcher


def _held_store(timeout_s: float):
    """The ranks' meeting point: a TCPStore server on a port the kernel picks, held by this launcher until its ranks
    have ended, which every rank joins as a client (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent). A
    port found free, closed and handed to rank 0 to bind could be taken in between by any other process's
    connection (EADDRINUSE: a loaded machine's parallel tests met it)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip


def worker_argv(args, rows_out: Path, where: str, run_id: str) -> list[str]:
    a = [sys.executable, str(SCRIPT), "--worker", "--rows-out", str(rows_out),
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
    if args.fused:
        a += ["--fused"]
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
    store = _held_store(args.timeout)
    procs = []
    G = args.ranks_per_host if args.ranks_per_host > 1 else N  # loopback: one host, or G-rank "hosts"
    for r in range(N):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r % G), WORLD_SIZE=str(N), LOCAL_WORLD_SIZE=str(G),
                   GROUP_RANK=str(r // G), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   TORCHELASTIC_USE_AGENT_STORE="True", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1")  # fmt: skip
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
        del store  # the ranks have ended: the port is free again
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
