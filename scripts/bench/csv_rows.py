"""Appending benchmark rows to a CSV that outlives its columns.

A results CSV in reports/data/ is appended to over many sessions while the benchmarks gain columns; rewriting
old rows with empty new columns keeps every row readable by name instead of misaligned.
"""

from __future__ import annotations

import csv
from pathlib import Path


def append_rows(csv_path: Path, rows: list[dict], fields: list[str], required_prefix: list[str] = ()) -> None:
    """Append ``rows`` under ``fields``; a new file gets the header. An existing file must start with
    ``required_prefix`` (ValueError otherwise) and gains the fields it lacks, its old rows with them empty."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    new = not csv_path.exists() or csv_path.stat().st_size == 0
    if not new:
        with open(csv_path, newline="") as f:
            header = next(csv.reader(f), [])
        prefix = list(required_prefix)
        if header[: len(prefix)] != prefix:
            raise ValueError(f"{csv_path}: header {header[: len(prefix)]} does not start with {prefix}")
        fields = header + [c for c in fields if c not in header]
        if fields != header:
            with open(csv_path, newline="") as f:
                old = list(csv.DictReader(f))
            with open(csv_path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields, restval="")
                w.writeheader()
                w.writerows(old)
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
