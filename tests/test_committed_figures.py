"""The README's promise: `scripts/reporting/make_figures.py` rebuilds the committed figures in reports/figures from the
committed data (reports/runs, reports/data), with the two commands reports/README.md gives. Each rebuilt PNG
must equal the committed one byte for byte (same data, same code, same matplotlib)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.reporting import make_figures  # noqa: E402

FIGURES = ROOT / "reports" / "figures"
LAB100 = ["--only", "training", "--runs-dir", str(ROOT / "reports" / "runs" / "training_100mbit")]
LAB100 += ["--prefix", "lab100_", "--title", "(lab 100 Mbit/s)"]


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("figures")
    assert make_figures.main(["--out", str(out), "--strict"]) == 0
    assert make_figures.main([*LAB100, "--out", str(out), "--strict"]) == 0
    return out


def test_every_committed_figure_is_rebuilt(rebuilt):
    assert sorted(p.name for p in FIGURES.glob("*.png")) == sorted(p.name for p in rebuilt.glob("*.png"))


@pytest.mark.parametrize("name", [p.name for p in sorted(FIGURES.glob("*.png"))])
def test_committed_figure_equals_its_rebuild(rebuilt, name):
    assert (rebuilt / name).read_bytes() == (FIGURES / name).read_bytes()
