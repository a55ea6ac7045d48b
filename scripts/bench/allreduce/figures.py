"""bench_allreduce's figures from the CSV: time against size, saving against c, and measured time against the
byte bound."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from scripts.bench.allreduce.options import _label

# --------------------------------------------------------------------------- figures


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
