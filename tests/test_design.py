"""Tests of ``python -m cerar.planning.design`` (the per-construction table, flag validation) and of the
reduced sweep that ``scripts/reporting/design_report.py`` renders.

The CLI runs as a subprocess, as a user would run it. Codes are kept small (N=4, c<=8) so the
optimiser's search takes well under a second; its cache goes to a temporary directory.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cerar.planning.design import DesignRow, evaluate, format_table, main

ROOT = Path(__file__).resolve().parents[1]


def run_design(*args: str, cache_dir: Path, script: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CERAR_CACHE_DIR": str(cache_dir)}
    return subprocess.run(
        [sys.executable, *(["-m", "cerar.planning.design"] if script is None else [script]), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def table_rows(stdout: str) -> dict[str, list[str]]:
    """Construction name -> the whitespace-split cells of its table line."""
    rows = {}
    for line in stdout.splitlines():
        cells = line.split()
        if cells and cells[0] in ("exact", "vandermonde", "perturbation", "optimized"):
            rows[cells[0]] = cells
    return rows


def test_table_has_a_sane_row_per_construction(tmp_path):
    done = run_design("--N", "4", "--c", "8", "--d", "8192", cache_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = table_rows(done.stdout)
    # exact needs c <= N, so it is not applicable here; the others each get a row.
    assert set(rows) == {"vandermonde", "perturbation", "optimized"}, done.stdout
    assert rows["vandermonde"][1] == "unreachable:", "Vandermonde cannot meet kappa 1e4 at c=8"
    for name in ("perturbation", "optimized"):
        eps, kappa, predicted, measured = (float(v) for v in rows[name][1:5])
        assert 0 < eps < 1e-2
        assert 1e3 < kappa <= 1e4 * (1 + 1e-6)
        assert 0 < predicted < measured < 2e-3, rows[name]
    # rates: L/c = 10/8 against the ring's 2*3/4, storage 1 + 4/8
    assert "1.250 vs 1.500" in " ".join(rows["perturbation"])
    assert rows["perturbation"][-1] == "1.500"
    # the optimiser's decoders beat the polynomial ones at the same kappa
    assert float(rows["optimized"][3]) < 0.6 * float(rows["perturbation"][3])


@pytest.mark.quick
def test_measured_error_tracks_prediction_where_truncation_dominates():
    row = evaluate(4, 8, "perturbation", kappa_max=100.0, d=8192, seed=1)
    assert row.ok and row.kappa <= 100 * (1 + 1e-9)
    assert row.predicted_error > 1e-2  # truncation-dominated: float32 rounding is ~kappa*6e-8
    assert 0.8 < row.measured_error / row.predicted_error < 1.25
    assert row.best_worker == 3, "worker N-1 has no truncation error"
    assert row.best_measured_error < 1e-4


@pytest.mark.quick
def test_sixteen_bit_refused_for_ill_conditioned_but_run_for_exact():
    refused = evaluate(4, 8, "perturbation", dtype="bfloat16", d=1024)
    assert refused.status.startswith("refused:") and "16-bit" in refused.status
    assert math.isnan(refused.measured_error) and refused.kappa > 1
    exact = evaluate(4, 4, "exact", dtype="bfloat16", d=1024)
    assert exact.ok and 1e-4 < exact.measured_error < 3e-2  # bfloat16 rounding, no truncation
    assert "refused:" in format_table([refused, exact])


@pytest.mark.quick
def test_unreachable_budget_becomes_a_row_not_a_crash():
    row = evaluate(4, 32, "perturbation", kappa_max=1e4, d=1024)
    assert row.status.startswith("unreachable:") and "kappa_max" in row.status
    assert isinstance(row, DesignRow) and math.isnan(row.kappa)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--N", "0"], "--N"),
        (["--c", "-3"], "--c"),
        (["--eps", "1.5"], "--eps"),
        (["--kappa-max", "0.5"], "--kappa-max"),
        (["--construction", "bogus"], "--construction"),
        (["--dtype", "int8"], "--dtype"),
    ],
)
@pytest.mark.quick
def test_bad_flags_are_rejected_naming_the_flag(args, flag, capsys):
    # In-process (argparse exits before any code is built): a subprocess per case costs a torch import.
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.quick
def test_bad_sweep_flags_are_rejected_naming_the_flag(capsys):
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.reporting import design_report
    finally:
        sys.path.remove(str(ROOT))
    for args, flag in [(["--grid-c", "8,x"], "--grid-c"), (["--bar", "4,16"], "--bar")]:
        with pytest.raises(SystemExit) as exited:
            design_report.main(args)
        assert exited.value.code == 2
        assert f"argument {flag}" in capsys.readouterr().err


def test_bad_flag_exits_with_usage_from_the_command_line(tmp_path):
    done = run_design("--N", "0", cache_dir=tmp_path)
    assert done.returncode == 2 and "argument --N: must be an integer >= 1, got 0" in done.stderr


def test_reduced_sweep_writes_csv_png_and_report(tmp_path):
    out = tmp_path / "reports"
    args = [
        "--out", str(out), "--grid-N", "4", "--grid-c", "4,8", "--grid-kappa-max", "1e2,1e4",
        "--grid-optimized-kappa-max", "1e3", "--grid-eps", "0.1", "--bar", "4,8,1e2", "--d", "4096",
    ]  # fmt: skip
    done = run_design(
        *args, cache_dir=tmp_path / "cache", script=str(ROOT / "scripts" / "reporting" / "design_report.py")
    )
    assert done.returncode == 0, done.stderr

    with (out / "data" / "code_design.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    kinds = {(r["c"], r["construction"], r["sweep"]) for r in rows}
    assert ("4", "exact", "exact") in kinds and ("8", "optimized", "kappa_max") in kinds
    assert ("8", "optimized", "bar") in kinds and ("16", "perturbation", "reference") in kinds
    vandermonde = [r for r in rows if r["construction"] == "vandermonde" and r["sweep"] == "kappa_max"]
    assert vandermonde and all(r["status"].startswith("unreachable:") for r in vandermonde)
    perturbation = next(
        r for r in rows if (r["c"], r["construction"], r["kappa_max"]) == ("8", "perturbation", "100.0")
    )
    assert 0.8 < float(perturbation["measured_error"]) / float(perturbation["predicted_error"]) < 1.25

    png = (out / "figures" / "error_vs_kappa.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

    report = (out / "code_design.md").read_text()
    assert "python scripts/reporting/design_report.py --out" in report  # the command that made it
    assert "## The optimiser's bar: N=4, c=8, float32, kappa_max=100" in report
    assert "optimized / perturbation = " in report and "**met**" in report
    assert "| 8 | 16 | 0.01 |" in report  # the spec's reference rows, re-measured
    assert "figures/error_vs_kappa.png" in report
