"""Smoke test of scripts/bench/bench_allreduce.py: tiny sizes, N=2, loopback, real gloo processes.

Checks that every aggregator produces a row with the required CSV columns first, sane values,
and that the CERAR rows report the closed-form rounds and bytes. No speed is asserted.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

import cerar

try:  # cerar.all_reduce, or the protocol module before cerar/__init__ exports it
    import cerar.ring.protocol as _proto

    HAVE_PROTOCOL = hasattr(_proto, "all_reduce") and hasattr(_proto, "ring_all_reduce")
except ImportError:
    HAVE_PROTOCOL = hasattr(cerar, "all_reduce") and hasattr(cerar, "ring_all_reduce")
needs_protocol = pytest.mark.skipif(not HAVE_PROTOCOL, reason="cerar.all_reduce / ring_all_reduce not available")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench" / "bench_allreduce.py"
REQUIRED = ["where", "rate_mbit", "aggregator", "construction", "N", "c", "bytes",
            "seconds_median", "seconds_min", "seconds_max", "repeats"]  # fmt: skip


def _run(tmp_path, *extra, timeout=240, sizes="0.0625,0.25", figures=False):
    """The benchmark on loopback (or the lab, with --lab in extra); --figures only where the test reads them."""
    csv_path = tmp_path / "allreduce.csv"
    drawn = ["--figures", "--figures-dir", str(tmp_path / "fig")] if figures else []
    cmd = [sys.executable, str(SCRIPT), "--n", "2", "--sizes-mb", sizes, "--repeats", "2",
           "--warmup", "1", "--csv", str(csv_path), "--timeout", "200", "--collective-timeout", "60",
           "--log-dir", str(tmp_path / "logs"), *drawn, *extra]  # fmt: skip
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.log")))
    assert cp.returncode == 0, cp.stdout + cp.stderr + logs
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        rows = list(reader)
    return header, rows


@needs_protocol
def test_bench_loopback_rows(tmp_path):
    header, rows = _run(tmp_path, "--constructions", "exact,perturbation", "--c-mult", "1,2", figures=True)
    assert header[: len(REQUIRED)] == REQUIRED
    keys = {(r["aggregator"], r["construction"], r["c"], int(r["bytes"])) for r in rows}
    for nbytes in (65536, 262144):
        assert ("nccl", "", "", nbytes) in keys and ("ring", "", "", nbytes) in keys
        assert ("cerar", "exact", "2", nbytes) in keys
        assert ("cerar", "perturbation", "4", nbytes) in keys
    for r in rows:
        assert r["where"] == "loopback" and r["rate_mbit"] == "" and r["N"] == "2" and r["repeats"] == "2"
        lo, med, hi = float(r["seconds_min"]), float(r["seconds_median"]), float(r["seconds_max"])
        assert 0 < lo <= med <= hi
        if r["aggregator"] == "cerar":
            N, c, d = 2, int(r["c"]), int(r["bytes"]) // 4
            assert int(r["rounds"]) == c + N - 2
            assert int(r["bytes_sent"]) == (c + N - 2) * -(-d // c) * 4
        if r["aggregator"] != "cerar" or r["construction"] == "exact":
            assert float(r["rel_error"]) < 1e-5
    assert (tmp_path / "fig" / "saving_vs_c.png").stat().st_size > 0


def test_bench_rejects_bad_flags(tmp_path):
    for args, word in [
        (["--n", "1"], "--n"),
        (["--aggregators", "tree"], "tree"),
        (["--sizes-mb", "x"], "sizes"),
    ]:
        cp = subprocess.run([sys.executable, str(SCRIPT), *args, "--csv", str(tmp_path / "x.csv")],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
        assert cp.returncode == 2 and word in cp.stderr, cp.stderr
        assert not (tmp_path / "x.csv").exists()


@needs_protocol
@pytest.mark.netlab
def test_bench_in_lab_rows(tmp_path):
    """The --lab path: a 2-host lab at 400 Mbit/s; rows carry the rate and the byte bound."""
    sys.path.insert(0, str(ROOT))
    from scripts.lab import netlab

    problem = netlab.requirements_problem()
    if problem:
        pytest.skip(problem)
    header, rows = _run(tmp_path, "--lab", "--rate-mbit", "400", "--quiet", "--constructions", "exact",
                        "--c-mult", "1", sizes="0.0625,1")  # fmt: skip
    assert header[: len(REQUIRED)] == REQUIRED
    assert {r["aggregator"] for r in rows} == {"nccl", "ring", "cerar"}
    for r in rows:
        assert r["where"] == "lab" and r["rate_mbit"] == "400"
        if r["aggregator"] != "nccl":
            bound = int(r["bytes_sent"]) * 8 / 400e6
            assert float(r["byte_bound_seconds"]) == pytest.approx(bound)
            if int(r["bytes"]) == 2**20:
                # a shaped link cannot beat its rate (a lower bound only; slack for the tbf burst)
                assert float(r["seconds_min"]) >= bound / 1.3, r


@needs_protocol
def test_bench_measures_storages_and_another_checkout_side_by_side(tmp_path):
    """--storages gives one row per storage choice; --code-dir runs another checkout's cerar (here a copy
    whose default storage is "messages", so its rows say so); an older CSV gains the new columns and keeps
    its rows; every row records the CPU each rank spent, the load it ran under and the kernels ``--fused``
    switched on."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(ROOT / "cerar", other / "cerar", ignore=shutil.ignore_patterns("__pycache__"))
    rounds = other / "cerar" / "ring" / "rounds.py"
    rounds.write_text(rounds.read_text().replace('DEFAULT_STORAGE = "spec"', 'DEFAULT_STORAGE = "messages"'))
    old = tmp_path / "allreduce.csv"
    old.write_text(",".join(REQUIRED) + "\nloopback,,nccl,,2,,64,0.1,0.1,0.1,1\n")
    common = ("--aggregators", "nccl,cerar", "--constructions", "perturbation", "--c-mult", "2")
    _run(tmp_path, *common, "--storages", "spec,messages", "--fused", sizes="0.25")  # the suite: CERAR_FUSED=0
    header, rows = _run(tmp_path, *common, "--code-dir", str(other), sizes="0.25")
    assert header[: len(REQUIRED)] == REQUIRED and {"storage", "cpu_seconds", "load_before"} <= set(header)
    assert rows[0]["seconds_median"] == "0.1" and rows[0]["storage"] == ""  # the older row, kept
    cerar_rows = [r for r in rows if r["aggregator"] == "cerar"]
    assert [r["storage"] for r in cerar_rows] == ["spec", "messages", "messages"]
    assert all(float(r["cpu_seconds"]) > 0 and len(r["load_before"].split()) == 3 for r in rows[1:])
    assert all(float(r["rel_error"]) < 1e-3 for r in cerar_rows)
    # --fused asked every rank to switch the kernels on; CERAR_FUSED=0 kept them eager, and the rows say so
    assert [r["fused"] for r in rows[1:]] == ["none"] * 3 + [""] * 2
