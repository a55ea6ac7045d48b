"""scripts/reporting/fidelity_report.py turns run folders into the fidelity report: gaps to nccl with seed spread,
when curves separate, error against noise, and the figures. Run folders are written here by hand with
known curves, so every number the report prints is known in advance."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.reporting import fidelity_report  # noqa: E402


def write_run(folder: Path, val: dict[int, float], error: float, noise: float, drift: float) -> None:
    """A run of 1000 steps: val_loss at the given steps, train loss 5, error/noise/drift every 50."""
    folder.mkdir(parents=True)
    records = []
    for step in range(10, 1001, 10):
        record = {"step": step, "train_loss": 5.0, "time/step": 0.5, "tokens_per_s": 2048.0}
        if step in val:
            record.update(val_loss=val[step], val_loss_worst_replica=val[step] + drift)
        if step % 50 == 0:
            record.update({"agg/rel_error_max": error, "noise/rel_std_mean": noise, "noise/sequences_per_step": 16})
            record.update({"drift/max_abs": drift, "drift/rel_l2": drift / 10})
        records.append(record)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps({"final_step": 1000, "final_val_loss": val[max(val)]}))


PLANE = """aggregator,bytes_per_call,bytes_ratio_to_fp32_ring,error_median,error_max,calls
ring,600,1.0000,0,0,3
fp16,300,0.5000,0.0002,0.0003,3
cerar_optimized_c16,450,0.7500,0.05,0.06,3
"""


@pytest.fixture
def runs(tmp_path) -> Path:
    steps = [200, 400, 600, 800, 1000]
    write_run(tmp_path / "nccl_s1", dict(zip(steps, [6.0, 5.0, 4.5, 4.2, 4.0], strict=True)), 0.0, 0.8, 0.0)
    write_run(tmp_path / "nccl_s2", dict(zip(steps, [6.02, 5.02, 4.52, 4.22, 4.02], strict=True)), 0.0, 0.8, 0.0)
    # Inside nccl's band until step 400, above it from step 600 on, ending 2.5 % above nccl's mean of 4.01.
    write_run(tmp_path / "cerar_c16_s1", dict(zip(steps, [6.01, 5.01, 4.6, 4.3, 4.1103], strict=True)), 0.2, 0.8, 0.05)
    return tmp_path


def test_report_states_gap_spread_separation_and_where_error_meets_noise(runs, tmp_path):
    report, table = tmp_path / "fidelity.md", tmp_path / "fidelity.csv"
    plane = tmp_path / "plane.csv"
    plane.write_text(PLANE)
    argv = ["--runs-dir", str(runs), "--report", str(report), "--csv", str(table), "--plane-csv", str(plane)]
    argv += ["--log", str(tmp_path / "no-run-log"), "--grown-corpus-runs-dir", str(tmp_path / "none")]
    assert fidelity_report.main(argv) == 0
    rows = {r["setting"]: r for r in csv.DictReader(table.open())}
    assert float(rows["nccl"]["val_loss"]) == pytest.approx(4.01)
    assert rows["nccl"]["val_spread"] == "4.0000..4.0200"
    assert float(rows["cerar_c16"]["gap_to_nccl_pct"]) == pytest.approx(2.5, abs=0.01)
    assert rows["cerar_c16"]["separates_at"] == "600"
    assert float(rows["cerar_c16"]["train_loss_last200"]) == pytest.approx(5.0)  # the records between evaluations
    text = report.read_text()
    assert float(rows["cerar_c16"]["paired_gap_pct"]) == pytest.approx(100 * (4.1103 / 4.0 - 1))  # seed 1's nccl
    assert "| cerar_c16 | 1 | 1000 | 4.1103 | one seed | +2.50 % | +2.76 % |" in text
    # Noise 0.8 at 1024 tokens a step (2048 tokens/s x 0.5 s) shrinks as 1/sqrt(batch): it meets the error 0.2 at 16x.
    assert "| 16,384 |" in text
    assert "never (exact)" in text  # nccl
    assert "| fp16 | 0.500 | 0.0002 | 0.0003 |" in text  # the plane's rows, by bytes
    # A run shorter than the study's horizon only measures along the way: out of the loss table, in the drift one.
    short = runs / "cerar_c16_resync50_drift_s1"
    write_run(short, {200: 6.0, 400: 5.0}, 0.2, 0.8, 0.3)
    lines = (short / "metrics.jsonl").read_text().splitlines()
    (short / "metrics.jsonl").write_text("\n".join(lines[:50]) + "\n")  # steps 10..500
    assert fidelity_report.main(argv) == 0
    assert "cerar_c16_resync50_drift" not in {r["setting"] for r in csv.DictReader(table.open())}
    assert "| cerar_c16_resync50_drift | 0.03 | 0.03 | 0.03 | 0.03 | - | - | - | - | - |" in report.read_text()
    short.rename(tmp_path / "elsewhere")
    assert fidelity_report.main(argv) == 0
    # Findings written by hand above the marker survive a rebuild; the generated part is replaced.
    findings = "# Findings\nCERAR c=16 parts from nccl at step 600.\n"
    report.write_text(f"{findings}{fidelity_report.GENERATED_MARKER}\nstale\n")
    assert fidelity_report.main(argv) == 0
    rebuilt = report.read_text()
    assert rebuilt.startswith(findings) and "stale" not in rebuilt
    assert rebuilt.endswith(text.split("\n", 2)[2])  # all but the title, which the hand-written part carries


def test_the_runs_on_the_grown_corpus_get_their_own_table(runs, tmp_path):
    """The study rerun on another corpus: its gaps are stated beside the first study's, never mixed into them."""
    grown = tmp_path / "grown"
    steps = [200, 400, 600, 800, 1000]
    write_run(grown / "nccl_s1", dict(zip(steps, [7.0, 6.0, 5.5, 5.2, 5.0], strict=True)), 0.0, 0.8, 0.0)
    write_run(grown / "cerar_c16_s1", dict(zip(steps, [7.0, 6.0, 5.5, 5.2, 5.05], strict=True)), 0.2, 0.8, 0.05)
    report, table, grown_table = tmp_path / "fidelity.md", tmp_path / "fidelity.csv", tmp_path / "grown.csv"
    argv = ["--runs-dir", str(runs), "--report", str(report), "--csv", str(table), "--log", str(tmp_path / "no-log")]
    argv += ["--plane-csv", str(tmp_path / "no-plane"), "--grown-corpus-runs-dir", str(grown)]
    assert fidelity_report.main([*argv, "--grown-corpus-csv", str(grown_table)]) == 0
    first = {r["setting"]: r for r in csv.DictReader(table.open())}
    assert float(first["cerar_c16"]["gap_to_nccl_pct"]) == pytest.approx(2.5, abs=0.01)  # unchanged by the rerun
    rows = {r["setting"]: r for r in csv.DictReader(grown_table.open())}
    assert float(rows["cerar_c16"]["gap_to_nccl_pct"]) == pytest.approx(1.0)
    section = report.read_text().split("### The same runs on the grown corpus")[1].split("## Drift")[0]
    assert "| cerar_c16 | 1 | 1000 | 5.0500 | one seed | +1.00 % | +1.00 % |" in section
    paths = fidelity_report.figures(fidelity_report.load_runs(runs), tmp_path, grown=fidelity_report.load_runs(grown))
    assert "fidelity_corpus_v2_val_loss_vs_step.png" in [p.name for p in paths]


def test_figures_are_drawn_from_the_run_folders(runs, tmp_path):
    out = tmp_path / "figures"
    out.mkdir()
    plane = tmp_path / "plane.csv"
    plane.write_text(PLANE)
    paths = fidelity_report.figures(fidelity_report.load_runs(runs), out, plane)
    assert sorted(p.name for p in paths) == [
        "aggregator_plane.png",
        "fidelity_drift_vs_step.png",
        "fidelity_error_vs_step.png",
        "fidelity_noise_vs_error.png",
        "fidelity_val_loss_vs_step.png",
    ]
    assert all(p.stat().st_size > 10_000 for p in paths)


def write_shape(root: Path, sequences: int, seq_len: int, noise: float, finals: dict[str, float]) -> None:
    """One batch shape of the batch-scaling study: a run per setting (seed from the name), its final validation
    loss given, the noise given, CERAR's error 0.04 (c=16) or 0.005 (c=auto, which says it chose c=12)."""
    for label, value in finals.items():
        folder = root / f"batch{sequences}x{seq_len}" / label
        error = 0.0 if label.startswith("nccl") else 0.005 if "auto" in label else 0.04
        write_run(folder, {500: value + 0.5, 1000: value}, error, noise, 0.0)
        summary = json.loads((folder / "summary.json").read_text())
        summary.update(global_batch_size=sequences, seq_len=seq_len, c_chosen=12 if "auto" in label else None)
        (folder / "summary.json").write_text(json.dumps(summary))


def test_batch_scaling_section_states_gap_against_band_and_the_noise_unit(runs, tmp_path):
    """Three shapes with known noise: r = nu / sqrt(1 - nu^2) is 4 at 16 x 64, 1 at 256 x 64 (16x the sequences:
    r ~ sequences^-0.5) and 4 at 16 x 1024 (16x the length: no change), so a = 0.5, b = 0 and Pythia's 1024 x 2048
    has r = 4 / 8 = 0.5, logged noise 0.5 / sqrt(1.25) = 0.447, at which c=16's error 0.04 is 0.0894 of it."""
    root = tmp_path / "batch-scaling"
    nu4, nu1 = 4 / math.sqrt(17), 1 / math.sqrt(2)
    base = {"nccl_s1": 4.0, "nccl_s2": 4.02, "cerar_c16_s1": 4.01, "cerar_auto_s1": 4.0}
    write_shape(root, 16, 64, nu4, base)
    write_shape(root, 256, 64, nu1, {**base, "cerar_c16_s1": 4.06})  # +1.5 %: out of nccl's 0.5 % band
    write_shape(root, 16, 1024, nu4, base)
    report, table, batch_csv = tmp_path / "fidelity.md", tmp_path / "fidelity.csv", tmp_path / "batch.csv"
    argv = ["--runs-dir", str(runs), "--report", str(report), "--csv", str(table), "--log", str(tmp_path / "no-log")]
    argv += ["--plane-csv", str(tmp_path / "no-plane"), "--grown-corpus-runs-dir", str(tmp_path / "none")]
    argv += ["--batch-scaling-dir", str(root), "--batch-scaling-csv", str(batch_csv)]
    assert fidelity_report.main(argv) == 0
    rows = {(r["shape"], r["setting"]): r for r in csv.DictReader(batch_csv.open())}
    big = rows[("batch256x64", "cerar_c16")]
    assert float(big["paired_gap_pct"]) == pytest.approx(1.5) and big["inside_band"] == "False"
    assert float(big["nccl_band_pct"]) == pytest.approx(0.5)
    assert float(big["error_over_noise"]) == pytest.approx(0.04 / nu1)
    assert rows[("batch16x1024", "cerar_c16")]["inside_band"] == "True"
    section = report.read_text().split("## Does the gap grow with the batch?")[1]
    row = "| 256 x 64 | 16,384 | 1000 | 0.50 % | 0.707 | 1 | +0.00 % in (0.00707) c=12 | +1.50 % **out** (0.0566) |"
    assert row in section
    assert "a = 0.50 (sequences varied at 64 tokens), b = 0.00 (sequence length varied at 16 sequences)" in section
    # projected from the shape where r is smallest, 256 x 64: r = 1 x (1024/256)^-0.5 = 0.5
    projection = "from 256 x 64 (r = 1) to Pythia's 1024 x 2048: r = 0.5, logged noise 0.447; "
    projection += "cerar_auto: error 0.005, error/noise 0.0112; cerar_c16: error 0.04, error/noise 0.0894."
    assert projection in section
    rows = fidelity_report.batch_scaling_rows(fidelity_report.load_batch_scaling(root))
    assert fidelity_report.batch_scaling_figure(rows, tmp_path / "gap.png").stat().st_size > 10_000
    # A run whose summary says another shape than its folder stops the report, naming it.
    liar = root / "batch16x64" / "cerar_c16_s1" / "summary.json"
    liar.write_text(json.dumps({**json.loads(liar.read_text()), "global_batch_size": 32}))
    with pytest.raises(ValueError, match="cerar_c16_s1: its summary says 32 sequences x 64 tokens, its folder 16 x 64"):
        fidelity_report.load_batch_scaling(root)
