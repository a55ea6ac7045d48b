#!/usr/bin/env python3
# ruff: noqa: E501
"""Markdown tables from reports/data/allreduce.csv for reports/README.md (writes reports/allreduce_tables.md).

* the issue's targets: CERAR / dist.all_reduce and CERAR / ring at 64 MiB, (N=4, c=16) and (N=8, c=32),
  with the byte-count ratio, CERAR's time against its byte bound (nominal: bytes_sent * 8 / rate;
  goodput-adjusted: divided by ``--goodput``, the TCP goodput fraction of a tbf link measured by
  scripts/lab/netlab.py's ring test, 191 of 200 Mbit/s), per-phase medians and the run's load average;
* before and after the arithmetic with fewer passes (``scripts/bench/run_allreduce_sweeps.sh passes``): per setting,
  the library before (``storage`` "-") and after ("spec", the default, and "messages"), each against the
  all_reduce measured in the same invocation, with the CPU each rank spent per call and the share of the
  machine's cores the N ranks kept busy (near 1: the CPU, not the link, sets the time);
* every setting's rows (median, min..max, ratios to all_reduce and ring, bytes, phases).

When a configuration was measured in several runs, every run is listed (newest last), so reruns under a
different machine load stay visible. The load average of a run comes from reports/logs/allreduce_runs.log
(written by scripts/bench/run_allreduce_sweeps.sh), matched by run_id order when available.

    .venv/bin/python scripts/reporting/report_tables.py
"""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _f(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def byte_ratio(N: int, c: int) -> float:
    return (1 + (N - 2) / c) / (2 * (N - 1) / N)


def load_by_start(log: Path) -> list[tuple[str, str]]:
    """(start timestamp, 'load before -> after') per bench command in the sweep log."""
    if not log.exists():
        return []
    out, cur = [], None
    for line in log.read_text().splitlines():
        m = re.match(r"=== (\S+) load before: (.*)$", line)
        if m:
            cur = [m.group(1), m.group(2)]
        m = re.match(r"=== rc=\d+ in \d+ s; load after: (.*)$", line)
        if m and cur:
            out.append((cur[0], f"{cur[1]} -> {m.group(1)}"))
            cur = None
    return out


def run_load(run_id: str, loads: list[tuple[str, str]]) -> str:
    """run_id is '<YYYYmmddTHHMMSS>-<pid>', stamped just after its sweep command started: take the
    latest command that started at most 60 s before it."""
    import datetime as dt

    try:
        t = dt.datetime.strptime(run_id.split("-")[0], "%Y%m%dT%H%M%S")
    except ValueError:
        return "-"
    best = "-"
    for start, load in loads:
        s = dt.datetime.fromisoformat(start).replace(tzinfo=None)
        if 0 <= (t - s).total_seconds() <= 60:
            best = load
    return best


def _cpu_text(total, system) -> str:
    if total is None:
        return "-"
    return f"{total:.3f}" + ("" if system is None else f" ({system:.3f})")


def before_after(rows: list[dict], loads, goodput: float) -> list[str]:
    """The 'passes' phase: rows that name the storage they ran with ("-": the library before the knob)."""
    mine = [r for r in rows if r.get("storage") and r.get("code_commit")]
    if not mine:
        return []
    L = ["## Before and after: the arithmetic with fewer passes (64 MiB, c = 4N, optimized)\n",
         "Each line is one bench invocation's CERAR against the all_reduce of the same invocation; `before` "
         "is the library at the commit named (imported from a worktree by the same bench script), run "
         "back to back with `after`. CPU: seconds per call per rank (all threads; system: the kernel's, "
         "which in the lab includes the emulated links); busy: N x CPU / (cores x time), the share of the "
         "machine the ranks used (near 1: CPU-bound).\n",
         "| where | rate | MTU | N | c | code | storage | load | t s | t_all_reduce s | **/ all_reduce** | / byte bound "
         "(nominal, goodput) | CPU s (system) | all_reduce CPU s (system) | busy | encode / comm / decode s |",
         "|" + " --- |" * 16]  # fmt: skip
    nccl = {r["run_id"]: r for r in rows if r["aggregator"] == "nccl"}
    key = lambda r: (r["where"], _f(r["rate_mbit"]) or 0, int(_f(r.get("mtu")) or 0), int(r["N"]), r["timestamp"])  # noqa: E731
    for r in sorted((r for r in mine if r["aggregator"] == "cerar"), key=key):
        base = nccl.get(r["run_id"])
        if base is None:
            continue
        t, tn, N = float(r["seconds_median"]), float(base["seconds_median"]), int(r["N"])
        bound = _f(r.get("byte_bound_seconds"))
        cores = int(_f(r.get("cpus")) or 2)
        cpu, cpu_sys = _f(r.get("cpu_seconds")), _f(r.get("cpu_system_seconds"))
        ncpu, ncpu_sys = _f(base.get("cpu_seconds")), _f(base.get("cpu_system_seconds"))
        phase_seconds = [_f(r.get(f"seconds_{p}")) for p in ("encode", "comm", "decode")]
        phases = " / ".join("-" if x is None else f"{x:.3f}" for x in phase_seconds)
        code = "before " if r["storage"] == "-" else "after "
        storage = "(default)" if r["storage"] == "-" else r["storage"]
        if r.get("pipeline_chunks") not in (None, "", "2"):
            storage += f", {r['pipeline_chunks']} chunks"
        L.append(
            f"| {r['where']} | {r['rate_mbit'] or '-'} | {r.get('mtu') or '-'} | {N} | {r['c']} | {code}{r['code_commit'][:7]} | "
            f"{storage} | {r.get('load_before') or run_load(r['run_id'], loads)} | {t:.3f} | {tn:.3f} | **{t / tn:.3f}** | "
            f"{'-' if bound is None else f'{t / bound:.3f}, {t / (bound / goodput):.3f}'} | "
            f"{_cpu_text(cpu, cpu_sys)} | {_cpu_text(ncpu, ncpu_sys)} | "
            f"{'-' if cpu is None else f'{N * cpu / (cores * t):.2f}'} | "
            f"{phases} |"
        )  # fmt: skip
    return L + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, default=ROOT / "reports" / "data" / "allreduce.csv")
    ap.add_argument("--log", type=Path, default=ROOT / "reports" / "logs" / "allreduce_runs.log")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "allreduce_tables.md")
    ap.add_argument("--goodput", type=float, default=191 / 200, help="TCP goodput / tbf rate (netlab measurement)")
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    loads = load_by_start(args.log)
    L = [f"# All-reduce tables\n\nGenerated by `.venv/bin/python scripts/reporting/report_tables.py` from "
         f"`reports/data/allreduce.csv` ({len(rows)} rows). Times: median over interleaved repeats, slowest rank. "
         f"Byte bound: bytes sent per worker * 8 / link rate; goodput-adjusted: divided by {args.goodput:.3f} "
         f"(TCP goodput on a tbf link, netlab ring test). Load: 1/5/15-min load average of the 2-core machine "
         f"before -> after the bench command (other engineers' jobs included).\n"]  # fmt: skip

    def runs_of(pred):
        by: dict[str, list[dict]] = {}
        for r in rows:
            if pred(r):
                by.setdefault((r["run_id"], r["rate_mbit"]), []).append(r)
        return by

    L.append("## Targets (lab at low rates <= 400 Mbit/s, 64 MiB; the issue's rate for them: 200 Mbit/s)\n")
    L.append("| run | load | N | c | rate | construction | t_cerar s | t_all_reduce s | t_ring s | cerar / all_reduce "
             "| target | byte ratio | cerar / ring | cerar / byte bound (nominal, goodput) | all_reduce / its bound (nominal, goodput) "
             "| encode / comm / decode s | rel. error |")  # fmt: skip
    L.append("|" + " --- |" * 17)
    for N, c, target in ((4, 16, 0.79), (8, 32, 0.71)):
        by = runs_of(
            lambda r, N=N: (
                r["where"] == "lab"
                and int(r["N"]) == N
                and int(r["bytes"]) == 64 * 2**20
                and float(r["rate_mbit"]) <= 400
            )
        )
        for (run_id, _), rs in sorted(by.items()):
            base = {r["aggregator"]: r for r in rs if r["aggregator"] in ("nccl", "ring")}
            for r in rs:
                if r["aggregator"] != "cerar" or int(r["c"]) != c or "nccl" not in base:
                    continue
                t, tn, tr = (
                    float(r["seconds_median"]),
                    float(base["nccl"]["seconds_median"]),
                    _f(base.get("ring", {}).get("seconds_median")),
                )
                rate = float(r["rate_mbit"])
                bound = float(r["byte_bound_seconds"])
                ring_bytes = 2 * (N - 1) * (int(r["bytes"]) // N)
                nb = ring_bytes * 8 / (rate * 1e6)
                ratio = t / tn
                L.append(
                    f"| {run_id} | {run_load(run_id, loads)} | {N} | {c} | {rate:g} | {r['construction']} | {t:.3f} | {tn:.3f} | "
                    f"{'-' if tr is None else f'{tr:.3f}'} | **{ratio:.3f}** | <= {target} ({'met' if ratio <= target else f'missed by {ratio - target:+.3f}'}) | "
                    f"{byte_ratio(N, c):.3f} | {'-' if tr is None else f'{t / tr:.3f}'} | {t / bound:.2f}, {t / (bound / args.goodput):.2f} | "
                    f"{tn / nb:.2f}, {tn / (nb / args.goodput):.2f} | "
                    f"{float(r['seconds_encode']):.2f} / {float(r['seconds_comm']):.2f} / {float(r['seconds_decode']):.2f} | {float(r['rel_error']):.1e} |"
                )  # fmt: skip
    L.append("")
    L += before_after(rows, loads, args.goodput)
    L.append("## Every setting\n")
    keyf = lambda r: (r["where"], float(r["rate_mbit"] or 0), int(r["N"]), int(r["bytes"]), r["run_id"])  # noqa: E731
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(keyf(r), []).append(r)
    L.append("| where | rate | N | MiB | run | aggregator | median s | min..max s | / all_reduce | / ring | sent MB | "
             "achieved Mbit/s | / byte bound | encode / comm / decode s | rel. error |")  # fmt: skip
    L.append("|" + " --- |" * 15)
    for k in sorted(groups):
        rs = groups[k]
        tn = next((float(r["seconds_median"]) for r in rs if r["aggregator"] == "nccl"), None)
        tr = next((float(r["seconds_median"]) for r in rs if r["aggregator"] == "ring"), None)
        for r in rs:
            t = float(r["seconds_median"])
            name = r["aggregator"] + (f" {r['construction']} c={r['c']}" if r["aggregator"] == "cerar" else "")
            bb = _f(r.get("byte_bound_seconds"))
            ph = [_f(r.get(f"seconds_{p}")) for p in ("encode", "comm", "decode")]
            L.append(
                f"| {k[0]} | {r['rate_mbit'] or '-'} | {k[2]} | {k[3] / 2**20:g} | {k[4]} | {name} | {t:.4f} | "
                f"{float(r['seconds_min']):.4f}..{float(r['seconds_max']):.4f} | {'-' if tn is None else f'{t / tn:.3f}'} | "
                f"{'-' if tr is None else f'{t / tr:.3f}'} | {(_f(r.get('bytes_sent')) or 0) / 1e6:.1f} | "
                f"{(_f(r.get('achieved_mbit')) or 0):.0f} | {'-' if bb is None else f'{t / bb:.2f}'} | "
                f"{' / '.join('-' if p is None else f'{p:.3f}' for p in ph)} | {float(r['rel_error']):.1e} |"
            )  # fmt: skip
    args.out.write_text("\n".join(L) + "\n")
    print(f"report_tables: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
