"""The aggregators' error-against-bytes plane (reports/data/aggregator_plane.csv, scripts/bench/aggregator_plane.py):
read, and which aggregators no other beats on both axes."""

from __future__ import annotations

import csv
from pathlib import Path

from scripts.reporting.fidelity.runs import EXACT_FLOOR


def read_plane(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [
            {**row, "ratio": float(row["bytes_ratio_to_fp32_ring"]), "error": float(row["error_median"])}
            for row in csv.DictReader(f)
        ]


def dominance(plane: list[dict]) -> list[str]:
    """Which CERAR points of the plane fp16 compression beats on both bytes and error, and where the aggregators
    below 16 bits (8-bit, CERAR over 16-bit messages) fall against it."""
    by_name = {r["aggregator"]: r for r in plane}
    fp16 = by_name.get("fp16")
    cerar = [r for r in plane if r["aggregator"].startswith("cerar") and r["error"] > EXACT_FLOOR * 10]
    if fp16 is None or not cerar:
        return []
    beaten = [r["aggregator"] for r in cerar if r["ratio"] >= fp16["ratio"] and r["error"] >= fp16["error"]]
    lines = [
        f"fp16 compression sends {fp16['ratio']:.2f} of the fp32 ring at an error of {fp16['error']:.2g}"
        + (f" (bf16: {by_name['bf16']['ratio']:.2f} at {by_name['bf16']['error']:.2g})" if "bf16" in by_name else "")
        + ". "
    ]
    if beaten:
        lines[0] += (
            f"It dominates {len(beaten)} of the {len(cerar)} approximate CERAR settings measured here "
            f"({', '.join(beaten)}): fewer bytes and less error. "
        )
    closest = min(cerar, key=lambda r: r["error"])
    lines[0] += (
        f"CERAR's most accurate approximate setting here, {closest['aggregator']}, sends {closest['ratio']:.2f} at "
        f"{closest['error']:.2g}."
    )
    below = [r for r in plane if r["ratio"] < fp16["ratio"] and r["error"] > EXACT_FLOOR * 10]
    if below:
        lines += [
            "",
            "Below 16-bit bytes: "
            + "; ".join(
                f"{r['aggregator']} sends {r['ratio']:.3f} at {r['error']:.2g} "
                f"({r['error'] / fp16['error']:.3g}x fp16's error)"
                for r in sorted(below, key=lambda r: r["ratio"])
            )
            + ". Each saves bytes over fp16 only by adding error: which to take is the run's noise's to say "
            "(a budget against the noise, as c=auto does), not the plane's.",
        ]
    return lines
