"""The time-to-loss study's data, read: the CSV's rows, a run folder's metrics and evaluations, a row's setting,
whether two rows' commits trained the same code.

What the launcher and its plan (which write rows) and the report (which reads them) all need, so that neither side
imports the other (issue 53: launch and report imported each other)."""

from __future__ import annotations

import csv
import json
import math
import subprocess
from pathlib import Path

from scripts.studies.ttl.settings import COLUMNS, ROOT, Setting


def read_rows(csv_path: Path, columns: list[str] = COLUMNS) -> list[dict]:
    """The CSV's rows; a file whose header is not ``columns`` is refused, naming the difference."""
    if not csv_path.exists() or csv_path.stat().st_size == 0:
        return []
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != columns:
            raise ValueError(f"{csv_path}: columns {reader.fieldnames} are not the study's {columns}")
        return list(reader)


def read_metrics(run_dir: Path) -> list[dict]:
    """A run folder's metrics.jsonl, one record per logged step ([] without one; a torn last line is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a killed run
    return out


def evaluations(metrics: list[dict]) -> list[tuple[int, float, float]]:
    """(step, wall seconds, validation loss) of every evaluation, in order (``time/wall``: the loop's clock,
    evaluations included, read after the step's evaluation)."""
    return [(int(r["step"]), float(r["time/wall"]), float(r["val_loss"]))
            for r in metrics if "val_loss" in r and "time/wall" in r]  # fmt: skip


def curve(metrics: list[dict]) -> list[tuple[float, float]]:
    """(wall seconds, validation loss) of every evaluation, in order: the figures' curve."""
    return [(t, loss) for _, t, loss in evaluations(metrics)]


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def number(x) -> float | None:
    """A CSV cell as a finite float, else None (empty, text, nan)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def row_key(r: dict) -> tuple:
    """A row's setting as the CSV names it: (links, rate, hosts, ranks per host, model)."""
    return (r["links"], r["rate_mbit"], r["hosts"], r["ranks_per_host"], r["model"])


def run_key(r: dict) -> tuple:
    """A row's run: its setting, horizon, aggregator and seed (what the study skips when it is there)."""
    return (*row_key(r), r["steps"], r["aggregator"], r["seed"])


def setting_of_row(r: dict) -> Setting:
    return Setting(r["links"], number(r["rate_mbit"]), int(r["hosts"]), int(r["ranks_per_host"]), r["model"],
                   int(r["steps"]))  # fmt: skip


def group(rows: list[dict]) -> dict[Setting, list[dict]]:
    """The rows by setting (its horizon included), in the order the settings first appear."""
    out: dict[Setting, list[dict]] = {}
    for r in rows:
        out.setdefault(setting_of_row(r), []).append(r)
    return out


def run_folder(runs: Path, r: dict) -> Path:
    return runs / setting_of_row(r).key / f"{r['aggregator']}_s{r['seed']}"


REPO = ROOT
"""The git repository whose commits the rows name (the checkout's)."""


def code_differs(a: str, b: str) -> bool | None:
    """Whether commits a and b of ``REPO`` differ in cerar/, train/ or configs/ (what a run trains:
    ``launch.code_snapshot``); None where git cannot compare them (a commit this clone lacks)."""
    if a == b:
        return False
    rc = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", a, b, "--", "cerar", "train", "configs"],
                        capture_output=True).returncode  # fmt: skip
    return {0: False, 1: True}.get(rc)
