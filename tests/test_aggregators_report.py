"""The aggregators study's report (scripts/reporting/aggregators_report.py) on a synthetic study of known answer:
gaps, band, bytes and verdicts computed by hand from the runs written here."""

import json

import pytest

from scripts.reporting.aggregators_report import render, study_rows
from scripts.reporting.fidelity.runs import load_runs

pytestmark = pytest.mark.quick


def _run(root, name, val_losses, bytes_sent, error=0.0, noise=0.5, summary=None):
    folder = root / name
    folder.mkdir(parents=True)
    with (folder / "metrics.jsonl").open("w") as f:
        for step, v in val_losses:
            f.write(json.dumps({"step": step, "val_loss": v, "bytes_sent": bytes_sent,
                                "agg/rel_error_max": error, "noise/rel_std_mean": noise}) + "\n")  # fmt: skip
    (folder / "summary.json").write_text(json.dumps(summary or {}))


def test_gaps_band_bytes_and_verdicts_are_the_hand_computed_ones(tmp_path):
    _run(tmp_path, "nccl_s1", [(100, 6.0), (200, 5.000)], 1000)
    _run(tmp_path, "nccl_s2", [(100, 6.0), (200, 5.010)], 1000)  # band: 5.010/5.000 - 1 = 0.2 %
    _run(tmp_path, "int8_s1", [(100, 6.0), (200, 5.005)], 250, error=0.01)  # gap +0.1 %: inside
    _run(tmp_path, "cerar_c8_s1", [(100, 6.0), (200, 5.050)], 460, error=0.2, noise=0.4,
         summary={"aggregator_kind": "cerar", "c": 8})  # gap +1 %: outside  # fmt: skip
    _run(tmp_path, "short_s1", [(100, 6.0)], 100)  # never reached the horizon
    rows, unfinished = study_rows(load_runs(tmp_path), horizon=200)
    by = {r["setting"]: r for r in rows}
    assert unfinished == ["short"]
    assert list(by) == ["nccl", "cerar_c8", "int8"]
    assert by["int8"]["nccl_band_pct"] == pytest.approx(0.2, rel=1e-9)
    assert by["int8"]["paired_gap_pct"] == pytest.approx(0.1, rel=1e-9)
    assert by["int8"]["inside_band"] is True
    assert by["int8"]["bytes_ratio_to_nccl"] == pytest.approx(0.25)
    assert by["cerar_c8"]["paired_gap_pct"] == pytest.approx(1.0, rel=1e-9)
    assert by["cerar_c8"]["inside_band"] is False
    assert by["cerar_c8"]["c_used"] == "8"
    assert by["cerar_c8"]["error_over_noise"] == pytest.approx(0.5)
    text = render(rows, unfinished, tmp_path, [])
    assert "1 of 2 settings end inside nccl's seed band; the fewest bytes among them: `int8` at 0.250" in text
    assert "Outside: `cerar_c8` (+1.00 %)" in text
    assert "`short`" in text
