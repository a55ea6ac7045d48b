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
from scripts.reporting.fidelity import batch_scaling as fidelity_batch  # noqa: E402
from scripts.reporting.fidelity import figures as fidelity_figures  # noqa: E402
from scripts.reporting.fidelity import report as fidelity_text  # noqa: E402
from scripts.reporting.fidelity import runs as fidelity_runs  # noqa: E402


def write_run(folder: Path, val: dict[int, float], error: float, noise: float, drift: float, steps: int = 1000) -> None:
    """A run of `steps` steps: val_loss at the given steps, train loss 5, error/noise/drift every 50."""
    folder.mkdir(parents=True)
    records = []
    for step in range(10, steps + 1, 10):
        record = {"step": step, "train_loss": 5.0, "time/step": 0.5, "tokens_per_s": 2048.0}
        if step in val:
            record.update(val_loss=val[step], val_loss_worst_replica=val[step] + drift)
        if step % 50 == 0:
            record.update({"agg/rel_error_max": error, "noise/rel_std_mean": noise, "noise/sequences_per_step": 16})
            record.update({"drift/max_abs": drift, "drift/rel_l2": drift / 10})
        records.append(record)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps({"final_step": steps, "final_val_loss": val[max(val)]}))


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
    argv += ["--batch-scaling-dir", str(tmp_path / "no-batch-scaling")]
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
    # Without the batch-scaling runs the noise's unit is unknown: nothing is projected to Pythia's batch, and the
    # earlier per-token figure (noise 0.8 at 1024 tokens a step, 2048 tokens/s x 0.5 s: 0.8 / sqrt(2048) = 0.0177)
    # is named as what it was.
    assert "from 0.8 at 16 x 64 (1,024 tokens) to 0.0177 at Pythia's 1024 x 2048 (2,097,152 tokens). " in text
    assert "The batch-scaling runs are absent, so the noise is not projected to Pythia's batch here" in text
    assert "| cerar_c16 | 0.05 | 0.005 | 0.2 | 0.8 | 0.25 | - | - |" in text
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
    report.write_text(f"{findings}{fidelity_runs.GENERATED_MARKER}\nstale\n")
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
    argv += ["--batch-scaling-dir", str(tmp_path / "no-batch-scaling")]
    assert fidelity_report.main([*argv, "--grown-corpus-csv", str(grown_table)]) == 0
    first = {r["setting"]: r for r in csv.DictReader(table.open())}
    assert float(first["cerar_c16"]["gap_to_nccl_pct"]) == pytest.approx(2.5, abs=0.01)  # unchanged by the rerun
    rows = {r["setting"]: r for r in csv.DictReader(grown_table.open())}
    assert float(rows["cerar_c16"]["gap_to_nccl_pct"]) == pytest.approx(1.0)
    section = report.read_text().split("### The same runs on the grown corpus")[1].split("## Drift")[0]
    assert "| cerar_c16 | 1 | 1000 | 5.0500 | one seed | +1.00 % | +1.00 % |" in section
    paths = fidelity_figures.figures(fidelity_runs.load_runs(runs), tmp_path, grown=fidelity_runs.load_runs(grown))
    assert "fidelity_corpus_v2_val_loss_vs_step.png" in [p.name for p in paths]


def test_figures_are_drawn_from_the_run_folders(runs, tmp_path):
    out = tmp_path / "figures"
    out.mkdir()
    plane = tmp_path / "plane.csv"
    plane.write_text(PLANE)
    paths = fidelity_figures.figures(fidelity_runs.load_runs(runs), out, plane)
    assert sorted(p.name for p in paths) == [
        "aggregator_plane.png",
        "fidelity_drift_vs_step.png",
        "fidelity_error_vs_step.png",
        "fidelity_noise_vs_error.png",
        "fidelity_val_loss_vs_step.png",
    ]
    assert all(p.stat().st_size > 10_000 for p in paths)


def write_shape(
    root: Path, sequences: int, seq_len: int, noise: float, finals: dict[str, float], steps: int = 1000
) -> None:
    """One batch shape of the batch-scaling study: a run per setting (seed from the name), its final validation
    loss given, the noise given, CERAR's error 0.04 (c=16) or 0.005 (c=auto, which says it chose c=12)."""
    for label, value in finals.items():
        folder = root / f"batch{sequences}x{seq_len}" / label
        error = 0.0 if label.startswith("nccl") else 0.005 if "auto" in label else 0.04
        write_run(folder, {steps // 2: value + 0.5, steps: value}, error, noise, 0.0, steps=steps)
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
    argv += ["--batch-scaling-horizon-dir", str(tmp_path / "no-horizon")]
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
    projection += "cerar_auto: error 0.005, error/noise 0.0112; cerar_c16: error 0.04, error/noise 0.0894 (one small"
    assert projection in section
    rows = fidelity_batch.batch_scaling_rows(fidelity_batch.load_batch_scaling(root))
    assert fidelity_figures.batch_scaling_figure(rows, tmp_path / "gap.png").stat().st_size > 10_000
    # A run whose summary says another shape than its folder stops the report, naming it.
    liar = root / "batch16x64" / "cerar_c16_s1" / "summary.json"
    liar.write_text(json.dumps({**json.loads(liar.read_text()), "global_batch_size": 32}))
    with pytest.raises(ValueError, match="cerar_c16_s1: its summary says 32 sequences x 64 tokens, its folder 16 x 64"):
        fidelity_batch.load_batch_scaling(root)


def ratio_noise(r: float) -> float:
    """The noise nu the trainer logs at noise-to-signal ratio r (nu = r / sqrt(1 + r^2)), written from the
    definition E||g_bar||^2 = ||mu||^2 + sigma^2, independently of the report's own conversion."""
    return math.sqrt(r * r / (1 + r * r))


def auto_evidence(folder: Path, decisions: list[dict]) -> None:
    """c=auto's decisions in a run's summary.json, in the trainer's layout (errors and bytes keyed by c as strings)."""
    summary = json.loads((folder / "summary.json").read_text())
    summary["auto_c"] = {
        "error_budget": 0.01,
        "bytes_per_step": {"5": 500, "8": 400, "12": 300, "16": 250},
        "decisions": [{**d, "errors": {str(c): e for c, e in d["errors"].items()}} for d in decisions],
    }
    (folder / "summary.json").write_text(json.dumps(summary))


# Five shapes whose noise falls as sequences^-0.5 and not with the length: r = 4 at 16 sequences, 2 at 64, 1 at 256.
# c=16's gap leaves nccl's 0.5 % band at 64 and 256 sequences and stays inside at 16 sequences of every length up to
# 16 x 1024 (as many tokens as 256 x 64): the unit of its threshold is sequences, from 64 sequences per step.
SHAPES = {(16, 64): 4.0, (64, 64): 2.0, (256, 64): 1.0, (16, 256): 4.0, (16, 1024): 4.0}
C16_FINALS = {(16, 64): 4.01, (64, 64): 4.04, (256, 64): 4.06, (16, 256): 4.01, (16, 1024): 4.0}


@pytest.fixture
def study(tmp_path) -> Path:
    root = tmp_path / "batch-scaling-1000"
    for (sequences, seq_len), r in SHAPES.items():
        finals = {"nccl_s1": 4.0, "nccl_s2": 4.02, "cerar_c16_optimized_s1": C16_FINALS[sequences, seq_len]}
        finals.update({"cerar_c16_optimized_resync50_s1": 4.01, "cerar_auto_s1": 4.0})
        write_shape(root, sequences, seq_len, ratio_noise(r), finals)
        folder = root / f"batch{sequences}x{seq_len}" / "cerar_auto_s1"
        auto_evidence(folder, [{"step": 100, "c": 12, "errors": {5: 2e-4, 8: 3e-3, 12: 5e-3, 16: 7e-3}}])
    # At 256 x 64 c=auto first took c=16 (noise 0.8 then: budget 0.008), then moved to 12 when c=16 erred 0.04.
    auto_evidence(
        root / "batch256x64" / "cerar_auto_s1",
        [
            {"step": 100, "c": 16, "errors": {5: 2e-4, 8: 3e-3, 12: 5e-3, 16: 7e-3}},
            {"step": 200, "c": 12, "errors": {5: 2e-4, 8: 3e-3, 12: 6e-3, 16: 0.04}},
        ],
    )
    # A c=8 run stopped at step 500 (no summary.json): it must not count, and must be named.
    stopped = root / "batch64x64" / "cerar_c8_optimized_s1"
    write_run(stopped, {250: 4.5, 500: 4.3}, 0.0005, ratio_noise(2.0), 0.0, steps=500)
    (stopped / "summary.json").unlink()
    return root


def test_batch_scaling_answers_where_c16_leaves_the_band_in_which_unit_and_at_pythias_batch(runs, study, tmp_path):
    """The generated answer to issue 19 on a study whose answer is known by construction (SHAPES, C16_FINALS), the
    older projection corrected to the measured unit, and the horizon check against a longer run of one shape."""
    longer = tmp_path / "batch-scaling-2000"
    finals = {"nccl_s1": 4.0, "nccl_s2": 4.02, "cerar_c16_optimized_s1": 4.05, "cerar_c16_optimized_resync50_s1": 4.01}
    write_shape(longer, 16, 64, ratio_noise(4.0), finals, steps=2000)
    report, batch_csv = tmp_path / "fidelity.md", tmp_path / "batch.csv"
    argv = ["--runs-dir", str(runs), "--report", str(report), "--csv", str(tmp_path / "f.csv")]
    argv += ["--log", str(tmp_path / "no-log"), "--plane-csv", str(tmp_path / "no-plane")]
    argv += ["--grown-corpus-runs-dir", str(tmp_path / "none"), "--batch-scaling-csv", str(batch_csv)]
    argv += ["--batch-scaling-dir", str(study), "--batch-scaling-horizon-dir", str(longer)]
    assert fidelity_report.main(argv) == 0
    text = report.read_text()
    section = text.split("## Does the gap grow with the batch?")[1]
    assert "cerar_c8_optimized" not in {r["setting"] for r in csv.DictReader(batch_csv.open())}
    assert "Not counted yet (no summary.json at the horizon: still running, or stopped): " in section
    assert "64 x 64: cerar_c8_optimized_s1 (step 500 of 1000)" in section
    # c=16: out from 64 sequences whatever their length (16 x 1024 has 4x the tokens of 64 x 64 and is inside).
    # Pythia's logged noise is 0.5 / sqrt(1.25) = 0.447: c=16's 0.04 is 0.0894 of it, above the 0.04 / (2 /
    # sqrt(5)) = 0.0447 at which its gap was already outside (64 x 64).
    c16 = (
        "- `cerar_c16_optimized`'s same-seed gap leaves nccl's seed band from 64 sequences per step, whatever their "
        "length (outside: 64 x 64 +1.00 % vs band 0.50 %, 256 x 64 +1.50 % vs band 0.50 %; inside: 16 x 64 +0.25 % "
        "vs band 0.50 %, 16 x 256 +0.25 % vs band 0.50 %, 16 x 1024 +0.00 % vs band 0.50 %): its unit is sequences, "
        "not tokens (Pythia: 1024 sequences per step, past that). At Pythia's 1024 x 2048 its error/noise projects "
        "to 0.0894, at or above the 0.0447 at which its gap was outside the band here: expect it outside."
    )
    assert c16 in section
    # With resync: inside everywhere; its largest measured ratio, 0.04 / (1 / sqrt(2)) = 0.0566, is below Pythia's.
    resync = (
        "- `cerar_c16_optimized_resync50`'s same-seed gap stays inside nccl's seed band at every shape judged, up "
        "to 16,384 tokens per step and 256 sequences"
    )
    assert resync in section
    assert "0.0894, above every ratio measured here (all inside, up to 0.0566): these runs do not tell." in section
    # c=auto: inside everywhere; at Pythia's noise 0.447 its 0.01 budget is 0.00447, which c=5 (2e-4) and c=8 (3e-3)
    # meet and c=12 (6e-3, its latest measurement at 256 x 64) does not: c=8, the fewer bytes of the two.
    auto = "- c=auto (`cerar_auto`) ends inside nccl's seed band at every shape judged (16 x 64 +0.00 % vs band 0.50 %"
    assert auto in section
    assert "16 x 64 c=12, 16 x 256 c=12, 64 x 64 c=12, 16 x 1024 c=12, 256 x 64 c=16>12." in section
    pythia_auto = (
        "At Pythia's projected noise 0.447 its budget (0.01 x noise = 0.00447) against the errors it measured at "
        "256 x 64 (c=5 0.0002, c=8 0.003, c=12 0.006, c=16 0.04): it would choose c=8."
    )
    assert pythia_auto in section
    # The horizon check: at 2000 steps c=16 is +1.25 % (out), at 1000 +0.25 % (in); resync in at both.
    assert (
        "- `cerar_c16_optimized` at 16 x 64: +1.25 % against a band of 0.50 % at 2000 steps, +0.25 % against 0.50 % "
        "at 1000 steps: a different verdict (outside at 2000)." in section
    )
    assert "- `cerar_c16_optimized_resync50` at 16 x 64: +0.25 % against a band of 0.50 % at 2000 steps, " in section
    # The older projection, corrected: per token the noise 4/sqrt(17) = 0.970 at 16 x 64 would be 0.243 at 16 x 1024;
    # it measured 0.970 there, so b = 0 and tokens are not the unit. In the measured unit Pythia's noise is 0.447,
    # 25.3x the per-token 0.8 / sqrt(2048) = 0.0177; the study's c=16 (error 0.2) meets it at 256 x 24 = 6,144
    # sequences of 2048 tokens (r = 0.2 / sqrt(0.96), (1 / r)^2 = 24).
    drift = text.split("## Drift, aggregation error and SGD noise")[1].split("## Does the gap")[0]
    assert "falls as sequences^-0.50 x seq_len^-0.00." in drift
    assert "16 x 1024: 0.243 per token, 0.97 measured; 256 x 64: 0.243 per token, 0.707 measured." in drift
    assert "b = 0.00 is nearer 0 than 0.5" in drift and "the per-token projection did not hold" in drift
    assert "Pythia's noise is nu = 0.447 (r = 0.5), 25.3x the per-token figure" in drift
    assert "| cerar_c16 | 0.05 | 0.005 | 0.2 | 0.8 | 0.25 | 0.447 | 6,144 |" in drift
    paths = fidelity_figures.figures(
        fidelity_runs.load_runs(runs),
        tmp_path,
        grown={},
        batch_rows=fidelity_batch.batch_scaling_rows(fidelity_batch.load_batch_scaling(study)),
    )
    assert (tmp_path / "fidelity_noise_vs_error.png") in paths


def test_noise_that_falls_with_tokens_keeps_the_per_token_projection(tmp_path):
    """r ~ tokens^-0.5 (r = 4 at 16 x 64, 2 at 64 x 64 and at 16 x 256): a = b = 0.5, and the report says the
    per-token projection held; Pythia's r = 2 x (1024/64)^-0.5 x (2048/64)^-0.5 = 2 / sqrt(512)."""
    root = tmp_path / "bs"
    for (sequences, seq_len), r in {(16, 64): 4.0, (64, 64): 2.0, (16, 256): 2.0}.items():
        write_shape(root, sequences, seq_len, ratio_noise(r), {"nccl_s1": 4.0, "nccl_s2": 4.02})
    rows = fidelity_batch.batch_scaling_rows(fidelity_batch.load_batch_scaling(root))
    unit = fidelity_batch.noise_unit(rows)
    assert unit["sequences_exponent"] == pytest.approx(0.5) and unit["seq_len_exponent"] == pytest.approx(0.5)
    assert unit["r_pythia"] == pytest.approx(2 / math.sqrt(512))
    study = [{"setting": "nccl", "noise_median": ratio_noise(4.0)}]
    (text,) = fidelity_text.pythia_projection(study, 16, 64, rows)
    assert "b = 0.50 is nearer 0.5 than 0: tokens are the unit, and the per-token projection held" in text
    assert "16 x 256: 0.485 per token, 0.894 measured; 64 x 64: 0.485 per token, 0.894 measured." in text


def shape_row(setting: str, sequences: int, seq_len: int, inside: bool) -> dict:
    return {"setting": setting, "sequences": sequences, "seq_len": seq_len, "tokens_per_step": sequences * seq_len,
            "inside_band": inside}  # fmt: skip


@pytest.mark.parametrize(
    ("outside", "inside", "units"),
    [
        ([(16, 1024), (256, 64)], [(16, 64), (64, 64), (16, 256)], ["tokens"]),  # length counts as much as sequences
        ([(256, 64)], [(16, 64), (64, 64)], ["sequences", "tokens"]),  # these shapes cannot tell the two apart
        ([(64, 64)], [(16, 64), (256, 64)], []),  # out at the middle batch only: no threshold in either unit
    ],
)
def test_the_unit_of_the_threshold_is_the_one_that_separates_shapes_out_from_shapes_in(outside, inside, units):
    rows = [shape_row("c16", s, t, False) for s, t in outside] + [shape_row("c16", s, t, True) for s, t in inside]
    assert fidelity_batch.band_exit(rows, "c16")["units"] == units
    assert fidelity_batch.band_exit(rows, "c8") is None
