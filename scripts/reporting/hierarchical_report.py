#!/usr/bin/env python3
"""The two-tier lab's all-reduce table, its targets stated as met or missed, and its figures (issue 20).

Reads the rows ``scripts/bench/bench_allreduce.py --lab --ranks-per-host G`` wrote (default
``reports/data/hierarchical_lab.csv``; ``scripts/bench/run_hierarchical_lab.sh`` runs it) and writes
``reports/hierarchical_lab.md``:

* per setting (lab shape, rate) and size: every aggregator measured side by side in one run (median, spread,
  each against the exact hierarchy and against gloo's flat all_reduce), the bytes the busiest NIC carried per
  call (the kernel's count, headers included) and the time that alone allows at the shaped rate, the error
  against the float64 sum, the seconds of each tier, the CPU per rank and the load before and after the run;
* the issue's targets at 64 MiB for hierarchical CERAR c = 16, per construction: at most ``TARGET_VS_HIER``
  of the exact hierarchy's time and at most ``TARGET_VS_FLAT`` of gloo's flat all_reduce, beside the byte
  bounds (1.125 d against 1.5 d and 1.75 d per NIC: 0.75 and 0.64), each stated as met or missed;
* the training comparison of the same lab (``reports/training_hierarchical.md``), when it exists.

Figures (``figures``; ``scripts/reporting/make_figures.py`` calls it): ``two_tier_lab_<where>_<rate>.png``, each
aggregator's time at the largest size with its spread, the byte bound and the targets.

    .venv/bin/python scripts/reporting/hierarchical_report.py
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CSV = ROOT / "reports" / "data" / "hierarchical_lab.csv"
DEFAULT_OUT = ROOT / "reports" / "hierarchical_lab.md"
TRAINING_REPORT = ROOT / "reports" / "training_hierarchical.md"
TARGET_SIZE = 64 * 2**20
TARGET_C = 16
TARGET_VS_HIER = 0.80
TARGET_VS_FLAT = 0.72
ORDER = ("nccl", "cerar", "hier_ring", "hier_ring16", "hier_cerar")
ORDER = (*ORDER, "int8", "hier_int8")  # issue 25: the 8-bit all-reduce
INT8_TARGET_VS_FLAT = 0.30
BOUND_TARGET = 1.2  # issue 35: every 16- and 8-bit path within 1.2x of its byte bound in the two-tier lab
CERAR16_TARGET_VS_HIER16 = 0.90  # issue 25: hierarchical CERAR over fp16 messages at c = 2n against the fp16 hierarchy
"""Issue 25's target: the 8-bit hierarchy at most 0.30x gloo's flat all_reduce (4x2 lab, 200 Mbit/s, 64 MiB)."""


def _arithmetic(row: dict) -> str:
    """How the run's per-call arithmetic ran: the compiled kernels it switched on (bench ``--fused``), or eager."""
    fused = row.get("fused") or ""
    if fused in ("", "none"):
        return "eager arithmetic" + (" (--fused: no kernel compiled)" if fused == "none" else "")
    return f"fused kernels on ({fused.replace('+', ', ')})"


def _f(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def label(r: dict) -> str:
    """The row's aggregator as the tables name it."""
    agg = r["aggregator"]
    if agg == "nccl":
        return "gloo all_reduce (flat)"
    if agg == "ring":
        return "flat ring (cerar.ring_all_reduce)"
    if agg == "hier_ring":
        return "exact hierarchy (hier_ring)"
    if agg == "hier_ring16":
        return f"exact hierarchy, {r.get('half_dtype') or '16-bit'} messages (hier_ring16)"
    if agg in ("int8", "hier_int8"):  # issue 25
        name = "8-bit hierarchy (hier_int8" if agg == "hier_int8" else "flat 8-bit all-reduce (int8"
        return f"{name}, B={r.get('int8_block') or 128})"
    method = r.get("inter_node_method") or ""
    transport = r.get("transport") or ""
    wire = f", {transport} messages" if transport not in ("", "float32") else ""
    prefix = "flat CERAR" if agg == "cerar" else "hier CERAR"
    rail = " (ran the exact rail)" if method == "exact ring" else ""
    return f"{prefix} {r['construction']} c={r['c']}{wire}{rail}"


def _sort_key(r: dict):
    agg = r["aggregator"]
    return (ORDER.index(agg) if agg in ORDER else len(ORDER), r.get("construction", ""), _f(r.get("c")) or 0)


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def runs(rows: list[dict]) -> dict[tuple[str, str, str, int], list[dict]]:
    """Rows grouped by (where, rate, run_id, bytes): the aggregators of one run, measured side by side."""
    out: dict[tuple[str, str, str, int], list[dict]] = {}
    for r in rows:
        out.setdefault((r["where"], r["rate_mbit"], r.get("run_id", ""), int(r["bytes"])), []).append(r)
    return out


def _ratio(r: dict, ref: dict | None) -> float | None:
    if ref is None:
        return None
    return float(r["seconds_median"]) / float(ref["seconds_median"])


def _fmt(x, p: int = 3, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f} %" if pct else f"{x:.{p}f}"


def targets(group: list[dict]) -> list[dict]:
    """Each hier_cerar c=16 row of one run against the targets; ratios of medians measured side by side."""
    hier = next((r for r in group if r["aggregator"] == "hier_ring"), None)
    flat = next((r for r in group if r["aggregator"] == "nccl"), None)
    out = []
    for r in group:
        if r["aggregator"] != "hier_cerar" or _f(r.get("c")) != TARGET_C or _is_16bit(r):
            continue
        vs_hier, vs_flat = _ratio(r, hier), _ratio(r, flat)
        nic = lambda x: _f(x.get("nic_tx_bytes_link_max")) if x else None  # noqa: E731
        bytes_hier = nic(r) / nic(hier) if nic(r) and nic(hier) else None
        bytes_flat = nic(r) / nic(flat) if nic(r) and nic(flat) else None
        out.append({
            "row": r, "vs_hier": vs_hier, "vs_flat": vs_flat, "bytes_vs_hier": bytes_hier, "bytes_vs_flat": bytes_flat,
            "met_hier": vs_hier is not None and vs_hier <= TARGET_VS_HIER,
            "met_flat": vs_flat is not None and vs_flat <= TARGET_VS_FLAT,
        })  # fmt: skip
    return out


def _is_16bit(r: dict) -> bool:
    return (r.get("transport") or "float32") != "float32"


def cerar16_targets_section(by_run: dict) -> list[str]:
    """Issue 25's target for hierarchical CERAR over fp16 messages at c = 2n (n hosts): at most
    ``CERAR16_TARGET_VS_HIER16`` of the fp16 exact hierarchy measured beside it."""
    L = [f"Hierarchical CERAR over float16 messages at c = 2n (n hosts), {TARGET_SIZE // 2**20} MiB: at most "
         f"{CERAR16_TARGET_VS_HIER16:.2f}x the float16 exact hierarchy (`hier_ring16`). Per host the bytes between "
         "hosts are (1 + (n-2)/c) d against 2(n-1)/n d, both in 16 bits: 1.25 d against 1.5 d at n = 4, c = 8 "
         "(byte bound 0.83).", ""]  # fmt: skip
    found = []
    for (where, rate, run_id, nbytes), group in sorted(by_run.items()):
        hier16 = next((r for r in group if r["aggregator"] == "hier_ring16"
                       and (r.get("half_dtype") or "float16") == "float16"), None)  # fmt: skip
        for r in group:
            hosts = _f(r.get("hosts"))
            if (nbytes == TARGET_SIZE and r["aggregator"] == "hier_cerar" and r.get("transport") == "float16"
                    and hosts and _f(r.get("c")) == 2 * hosts):  # fmt: skip
                found.append((where, rate, run_id, r, _ratio(r, hier16)))
    if not found:
        return [
            *L,
            "Not measured yet: `bench_allreduce.py --lab ... --aggregators hier_ring16,hier_cerar "
            "--cerar-transport float16 --hier-c 8` measures it.",
            "",
        ]
    L += ["| lab | rate (Mbit/s) | run | construction | / fp16 exact hierarchy | target | error | load before -> after "
          "|",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for where, rate, run_id, r, vs in found:
        met = vs is not None and vs <= CERAR16_TARGET_VS_HIER16
        L.append(f"| {where} | {rate} | {run_id} | {r['construction']} | {_fmt(vs)} | {_verdict(met, vs)} (<= "
                 f"{CERAR16_TARGET_VS_HIER16}) | {float(r['rel_error']):.1e} | "
                 f"{r.get('load_before', '')} -> {r.get('load_after', '')} |")  # fmt: skip
    return [*L, ""]


def _verdict(ok: bool, value: float | None) -> str:
    return "not measured" if value is None else ("**met**" if ok else "**missed**")


def report(rows: list[dict], csv_path: Path, training_report: Path = TRAINING_REPORT) -> str:
    rel = csv_path.relative_to(ROOT) if csv_path.is_relative_to(ROOT) else csv_path
    L = ["# Two-tier lab: hierarchical CERAR against the exact hierarchy, 16-bit messages and flat all-reduces", "",
         f"Generated by `scripts/reporting/hierarchical_report.py` from `{rel}` ({len(rows)} rows), which "
         "`scripts/bench/run_hierarchical_lab.sh` measures with `scripts/bench/bench_allreduce.py`. "
         "Every aggregator of a run "
         "was timed side by side (interleaved, the order rotated every repeat; a run's time is its slowest rank's), "
         "so the ratios compare calls made seconds apart under the same load. Lab: `scripts/lab/netlab.py` hosts of "
         "several ranks, unshaped between the ranks of a host (its loopback), shaped between hosts (`tbf`, each "
         "direction). Byte bound: the bytes the busiest NIC carried in one call (the kernel's counters, TCP/IP "
         "headers included, as the shaper counts them) over the rate. gloo's all_reduce is torch's "
         "`dist.all_reduce` on gloo (named `nccl` in the CSV: the trainer's name for the backend's own).",
         ""]  # fmt: skip
    # ---- targets
    by_run = runs(rows)
    target_rows = []
    for (where, rate, run_id, nbytes), group in sorted(by_run.items()):
        if nbytes == TARGET_SIZE:
            target_rows += [(where, rate, run_id, t) for t in targets(group)]
    L += ["## Targets (issue 20)", "",
          f"Hierarchical CERAR at c = {TARGET_C} (a code for the hosts), {TARGET_SIZE // 2**20} MiB: at most "
          f"{TARGET_VS_HIER:.2f}x the exact hierarchy and at most {TARGET_VS_FLAT:.2f}x gloo's flat all_reduce. The "
          "byte bounds with one NIC per host are 1.125 d against 1.5 d and 1.75 d per NIC: 0.75 and 0.64; the "
          "measured NIC bytes give the ratios the shaper alone would allow.", ""]  # fmt: skip
    if not target_rows:
        L += ["Not measured yet: `scripts/bench/run_hierarchical_lab.sh` (as root) measures them.", ""]
    else:
        L += ["| lab | rate (Mbit/s) | run | construction | / exact hierarchy | target | / gloo flat | target "
              "| NIC bytes / exact hierarchy's | NIC bytes / gloo's | load before -> after |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for where, rate, run_id, t in target_rows:
            r = t["row"]
            L.append(f"| {where} | {rate} | {run_id} | {r['construction']} | {_fmt(t['vs_hier'])} | "
                     f"{_verdict(t['met_hier'], t['vs_hier'])} (<= {TARGET_VS_HIER}) | {_fmt(t['vs_flat'])} | "
                     f"{_verdict(t['met_flat'], t['vs_flat'])} (<= {TARGET_VS_FLAT}) | {_fmt(t['bytes_vs_hier'])} | "
                     f"{_fmt(t['bytes_vs_flat'])} | {r.get('load_before', '')} -> "
                     f"{r.get('load_after', '')} |")  # fmt: skip
        L.append("")
    L += int8_targets_section(by_run)
    L += arithmetic_section(by_run)
    # ---- every run
    L += ["## Every run", "",
          "Ratios are of medians within the run. Error: worst rank's relative error against the float64 sum "
          "(Gaussian gradients). Tiers: median seconds inside the hosts / between them (the hierarchical calls' "
          "own timers, slowest rank). CPU: mean CPU seconds per rank and call (gloo's threads and the kernel's "
          "network stack included).", ""]  # fmt: skip
    for (where, rate, run_id, nbytes), group in sorted(by_run.items()):
        group = sorted(group, key=_sort_key)
        first = group[0]
        hier = next((r for r in group if r["aggregator"] == "hier_ring"), None)
        flat = next((r for r in group if r["aggregator"] == "nccl"), None)
        L += [f"### {where}, {rate or '-'} Mbit/s, {nbytes / 2**20:g} MiB (run {run_id})", "",
              f"{first.get('hosts')} hosts x {first.get('ranks_per_host')} ranks, "
              f"{'one NIC per rank' if str(first.get('rails')) == '1' else 'one NIC per host'}, mtu "
              f"{first.get('mtu')}; {first.get('repeats')} repeats after {first.get('warmup')} warm-up; load "
              f"{first.get('load_before', '')} -> {first.get('load_after', '')}; {first.get('cpus')} CPUs; torch "
              f"{first.get('torch')}; code {first.get('code_commit')}; "
              f"{_arithmetic(first)}.", "",
              "| aggregator | median s | min..max | / exact hierarchy | / gloo flat | busiest NIC MB | byte bound s "
              "| median / bound | error | tiers s (inside / between) | CPU s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in group:
            med, bound = float(r["seconds_median"]), _f(r.get("byte_bound_seconds"))
            nic = _f(r.get("nic_tx_bytes_link_max"))
            tiers = "-"
            if _f(r.get("seconds_intra")) is not None:
                tiers = f"{float(r['seconds_intra']):.3f} / {float(r['seconds_inter']):.3f}"
            L.append(f"| {label(r)} | {med:.3f} | {float(r['seconds_min']):.3f}..{float(r['seconds_max']):.3f} | "
                     f"{_fmt(_ratio(r, hier))} | {_fmt(_ratio(r, flat))} | {_fmt(nic / 1e6 if nic else None, 2)} | "
                     f"{_fmt(bound)} | {_fmt(med / bound if bound else None, 2)} | {float(r['rel_error']):.1e} | "
                     f"{tiers} | {_fmt(_f(r.get('cpu_seconds')), 2)} |")  # fmt: skip
        L.append("")
    if training_report.exists():
        shown = training_report.relative_to(ROOT) if training_report.is_relative_to(ROOT) else training_report
        L += ["## Training", "", f"The training comparison in the same lab: `{shown}` "
              "(per-phase seconds per step and validation loss, nccl against the exact hierarchy and "
              "hierarchical CERAR).", ""]  # fmt: skip
    return "\n".join(L) + "\n"


def int8_targets_section(by_run: dict) -> list[str]:
    """Issue 25's target for the 8-bit hierarchy at 64 MiB, against gloo's flat all_reduce measured beside it."""
    L = ["## Target (issue 25)", "",
         f"The 8-bit hierarchy (`hier_int8`), {TARGET_SIZE // 2**20} MiB: at most {INT8_TARGET_VS_FLAT:.2f}x gloo's "
         "flat all_reduce. Its bytes on a host's NIC are about (1 + 4/B)/4 of the exact hierarchy's.", ""]  # fmt: skip
    found = []
    for (where, rate, run_id, nbytes), group in sorted(by_run.items()):
        flat = next((r for r in group if r["aggregator"] == "nccl"), None)
        hier = next((r for r in group if r["aggregator"] == "hier_ring"), None)
        for r in group:
            if nbytes == TARGET_SIZE and r["aggregator"] == "hier_int8":
                found.append((where, rate, run_id, r, _ratio(r, flat), _ratio(r, hier)))
    if not found:
        return [*L, "Not measured yet: `scripts/bench/run_hierarchical_lab.sh` (as root) measures it.", ""]
    L += ["| lab | rate (Mbit/s) | run | / gloo flat | target | / exact hierarchy | error | load before -> after |",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for where, rate, run_id, r, vs_flat, vs_hier in found:
        met = vs_flat is not None and vs_flat <= INT8_TARGET_VS_FLAT
        L.append(f"| {where} | {rate} | {run_id} | {_fmt(vs_flat)} | {_verdict(met, vs_flat)} (<= "
                 f"{INT8_TARGET_VS_FLAT}) | {_fmt(vs_hier)} | {float(r['rel_error']):.1e} | "
                 f"{r.get('load_before', '')} -> {r.get('load_after', '')} |")  # fmt: skip
    return [*L, "", *cerar16_targets_section(by_run)]


def _low_precision(r: dict) -> bool:
    """A path whose per-call arithmetic issue 35 rewrote: the 8-bit all-reduce, or any 16-bit messages."""
    return r["aggregator"] in ("int8", "hier_int8", "hier_ring16") or _is_16bit(r)


def arithmetic_section(by_run: dict) -> list[str]:
    """Issue 35: the paths whose per-call arithmetic was rewritten (fewer passes, then the fused kernels), before
    and after, at 64 MiB. Per place, one column per code and arithmetic (its latest run of each aggregator); each
    cell the call's time against gloo's all_reduce timed beside it in the same run, and (where the NICs were
    counted) against its byte bound."""
    places: dict[str, dict[tuple[str, str], dict[str, tuple[dict, dict | None]]]] = {}
    for (where, _rate, _run_id, nbytes), group in sorted(by_run.items(), key=lambda kv: kv[0][2]):  # oldest first
        if nbytes != TARGET_SIZE or not any(_low_precision(r) for r in group):
            continue
        flat = next((r for r in group if r["aggregator"] == "nccl"), None)
        variant = (group[0].get("code_commit", ""), _arithmetic(group[0]))
        cells = places.setdefault(where, {}).setdefault(variant, {})
        for r in group:
            if r["aggregator"] != "nccl":
                cells[label(r)] = (r, flat)  # a later run of the same code and arithmetic replaces it
    places = {w: v for w, v in places.items() if any(a.startswith("fused") for _, a in v)}
    if not places:
        return []
    L = ["## Per-call arithmetic before and after (issue 35)", "",
         "The paths whose arithmetic issue 35 rewrote (the 8-bit quantizer in fewer passes and then fused, the 16-bit "
         "wire's encode likewise), and CERAR over float32 messages beside them, at 64 MiB: each cell is the call's "
         "median against gloo's all_reduce timed beside it in the same run, and in brackets its median against its "
         "byte bound (the busiest NIC's bytes over the rate; the lab only). One column per code and arithmetic "
         "(`scripts/bench/run_arithmetic_lab.sh`: the code before the rewrite, this code eager, and with `--fused`, "
         "the compiled kernels on in every rank before timing, as the trainer switches them on). Targets: the "
         f"8-bit hierarchy at most {INT8_TARGET_VS_FLAT:.2f}x gloo's flat all_reduce, every 16- and 8-bit path "
         f"within {BOUND_TARGET}x of its byte bound (the two-tier lab).", ""]  # fmt: skip
    for where, variants in places.items():
        order = list(variants)
        rows_of = {name: r for cells in variants.values() for name, (r, _) in cells.items()}
        names = sorted(rows_of, key=lambda name: _sort_key(rows_of[name]))
        L += [f"### {where}", "",
              "| aggregator | " + " | ".join(f"code {code[:7]}, {arith}" for code, arith in order) + " |",
              "| --- |" + " --- |" * len(order)]  # fmt: skip
        for name in names:
            cells = []
            for variant in order:
                r, flat = variants[variant].get(name, (None, None))
                if r is None:
                    cells.append("-")
                    continue
                bound = _f(r.get("byte_bound_seconds"))
                over = f" ({float(r['seconds_median']) / bound:.2f})" if bound else ""
                cells.append(f"{_fmt(_ratio(r, flat))}{over}")
            L.append(f"| {name} | " + " | ".join(cells) + " |")
        loads = []
        for (code, arith), cells in variants.items():
            r = next(iter(cells.values()))[0]
            loads.append(f"{code[:7]}, {arith}: {r.get('load_before', '')} -> {r.get('load_after', '')}")
        L += ["", "Load (1, 5, 15 min) before -> after each column's run: " + "; ".join(loads) + ".", ""]
    return L


def figures(csv_path: Path, out_dir: Path) -> list[Path]:
    """Per lab setting: each aggregator's time at the largest size (median, min..max), its byte bound, and the
    targets' lines (0.80x the exact hierarchy, 0.72x gloo's flat all_reduce)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(csv_path)
    if not rows:
        raise ValueError(f"{csv_path} has no rows to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for where, rate in sorted({(r["where"], r["rate_mbit"]) for r in rows}):
        sub = [r for r in rows if (r["where"], r["rate_mbit"]) == (where, rate)]
        size = max(int(r["bytes"]) for r in sub)
        latest = max(r.get("run_id", "") for r in sub if int(r["bytes"]) == size)
        group = sorted([r for r in sub if int(r["bytes"]) == size and r.get("run_id", "") == latest], key=_sort_key)
        names = [label(r).replace(" (", "\n(") for r in group]
        med = [float(r["seconds_median"]) for r in group]
        err = [[m - float(r["seconds_min"]) for m, r in zip(med, group, strict=True)],
               [float(r["seconds_max"]) - m for m, r in zip(med, group, strict=True)]]  # fmt: skip
        colors = ["tab:blue" if r["aggregator"] == "hier_cerar" else "tab:orange" if r["aggregator"] == "hier_ring16"
                  else "tab:gray" for r in group]  # fmt: skip
        fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(group)), 4.8))
        xs = list(range(len(group)))
        ax.bar(xs, med, yerr=err, color=colors, capsize=3)
        bounds = [(x, _f(r.get("byte_bound_seconds"))) for x, r in zip(xs, group, strict=True)]
        bx = [x for x, b in bounds if b]
        ax.scatter(bx, [b for _, b in bounds if b], marker="_", s=400, color="black", zorder=3,
                   label="byte bound: busiest NIC's bytes / rate")  # fmt: skip
        hier = next((r for r in group if r["aggregator"] == "hier_ring"), None)
        flat = next((r for r in group if r["aggregator"] == "nccl"), None)
        if hier:
            ax.axhline(TARGET_VS_HIER * float(hier["seconds_median"]), color="tab:green", linestyle="--",
                       label=f"target: {TARGET_VS_HIER}x the exact hierarchy")  # fmt: skip
        if flat:
            ax.axhline(TARGET_VS_FLAT * float(flat["seconds_median"]), color="tab:red", linestyle=":",
                       label=f"target: {TARGET_VS_FLAT}x gloo's flat all_reduce")  # fmt: skip
        ax.set_xticks(xs, names, fontsize=6, rotation=30, ha="right")
        ax.set(ylabel="all-reduce time (s), median and min..max",
               title=f"{where}, {rate} Mbit/s between hosts, {size / 2**20:g} MiB (run {latest})")  # fmt: skip
        ax.title.set_fontsize(9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"two_tier_lab_{where}_{rate or 'unshaped'}.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--figures-dir", type=Path, default=None, help="also draw the figures here")
    ap.add_argument("--training-report", type=Path, default=TRAINING_REPORT, help="the lab's training report")
    args = ap.parse_args(argv)
    if not args.csv.is_file():
        print(f"hierarchical_report: no rows: {args.csv} does not exist "
              "(scripts/bench/run_hierarchical_lab.sh writes it)",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = read_rows(args.csv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(rows, args.csv.resolve(), args.training_report.resolve()))
    print(f"hierarchical_report: wrote {args.out}")
    if args.figures_dir:
        for p in figures(args.csv, args.figures_dir):
            print(f"hierarchical_report: wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
