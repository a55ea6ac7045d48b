"""The GPU benchmark (scripts/bench/gpu/) runs end to end on the CPU at toy sizes (its dry run), writes each row
with its provenance to the report and the jsonl as it goes, keeps to its budget (a row that does not fit is NOT
RUN, saying why), and reads the trainer's metrics with the warm-up steps dropped."""

import json
import os
import subprocess
import sys

import pytest
import torch

from scripts.bench.gpu.measure import ROOT


def bench(tmp_path, *extra, timeout=1500):
    out = tmp_path / "gpu_bench.md"
    run = subprocess.run(
        [sys.executable, "-m", "scripts.checks.gpu", "--bench", "--device", "cpu", "--small", "--out", out, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "CERAR_FUSED"},  # the bench switches the kernels itself
    )
    rows = [json.loads(line) for line in (tmp_path / "data" / "gpu_bench.jsonl").read_text().splitlines()]
    return run, out.read_text() if out.exists() else "", rows


def test_the_benchmark_dry_run_measures_every_section_and_says_where_each_row_comes_from(tmp_path):
    run, report, rows = bench(tmp_path, "--budget-s", "1200")  # the machinery, on cores that may be busy
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert {r["section"] for r in rows} == {"arithmetic", "formats", "trainer", "model_step"}
    assert all(r["status"] == "measured" for r in rows), [r for r in rows if r["status"] != "measured"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for r in rows:  # every row says where it was measured
        assert r["commit"].split("+")[0] == head and r["seed"] == 1234 and r["torch"] == torch.__version__, r
        assert r["device"].startswith("cpu") and "cuda" in r and "nccl" in r and "triton" in r
    for heading in ("The trainer's MFU", "The model step alone", "CERAR's arithmetic", "The formats against a copy"):
        assert f"## {heading}" in report
    (trainer,) = [r for r in rows if r["section"] == "trainer"]  # the tiny model, 6 steps, the first 2 dropped
    assert (trainer["steps_logged"], trainer["warmup_steps_dropped"], trainer["steps_measured"]) == (6, 2, 4)
    assert trainer["exit"] == 0 and trainer["tokens_per_s"] > 0 and trainer["mfu"] is None  # a CPU has no peak
    arithmetic = [r for r in rows if r["section"] == "arithmetic"]
    assert [(r["N"], r["c"]) for r in arithmetic] == [(4, 16), (8, 32)] and all(r["aten_ops"] > 0 for r in arithmetic)
    fused = [r for r in rows if r["section"] == "formats" and r["variant"] == "fused" and r["runs"] == "fused"]
    assert len(fused) == 4 and all(r["bytes_equal_to_eager"] is True for r in fused)  # 2 quantizes, 2 encodes
    assert {r["mode"] for r in rows if r["section"] == "model_step"} == {"eager", "compiled"}
    assert "progress" not in report and "[" in run.stdout and "done:" in run.stdout  # progress lines as it went


def test_a_row_that_does_not_fit_the_budget_is_not_run_and_says_so(tmp_path, monkeypatch, capsys):
    """With no time left every row is NOT RUN with the budget as its reason, in the jsonl and the report; nothing
    is launched or measured, and the run ends cleanly. In this process (the entry point's ``main``, as
    ``python -m scripts.checks.gpu`` calls it): the dry run above starts the command itself; an interpreter and its
    torch import here would be seconds of a core for a run that measures nothing."""
    from scripts.checks.gpu.runner import main

    monkeypatch.delenv("CERAR_FUSED", raising=False)  # as bench() runs it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # main sets a default in os.environ
    out = tmp_path / "gpu_bench.md"
    code = main(["--bench", "--device", "cpu", "--small", "--out", str(out), "--budget-s", "0.001"])
    assert code == 0, capsys.readouterr()
    report, rows = out.read_text(), [json.loads(line) for line in (tmp_path / "data" / "gpu_bench.jsonl").open()]
    assert rows and {r["section"] for r in rows} == {"arithmetic", "formats", "trainer", "model_step"}
    assert all(r["status"] == "NOT RUN" and r["reason"].startswith("the budget:") for r in rows), rows
    assert "## Not measured" in report and report.count("NOT RUN (the budget:") == len(rows)


@pytest.mark.quick
def test_the_trainers_rows_are_medians_after_the_dropped_warm_up_steps():
    """Medians over the steps after the first ``warmup`` (the first steps compile and allocate: step 1 took 2 s
    on the H200 against 0.12 s after), the first step's seconds kept apart, the largest peak memory."""
    from scripts.bench.gpu.trainer_mfu import summarize

    records = [{"step": 1, "time/step": 2.0, "mfu": 0.01, "tokens_per_s": 100.0, "memory/peak_gib": 31.0}]
    records += [
        {"step": s, "time/step": t, "mfu": m, "tokens_per_s": 1000.0 * s, "memory/peak_gib": 32.5}
        for s, t, m in ((2, 0.5, 0.2), (3, 0.12, 0.26), (4, 0.13, 0.27), (5, 0.11, 0.25))
    ]
    records.append({"step": 5, "val_loss": 7.0})  # an evaluation's record: no time/step
    got = summarize(records, warmup=2)
    assert (got["steps_logged"], got["steps_measured"], got["warmup_steps_dropped"]) == (5, 3, 2)
    assert got["mfu"] == 0.26 and got["time/step"] == 0.12 and got["tokens_per_s"] == 4000.0
    assert got["first_step_s"] == 2.0 and got["peak_gib"] == 32.5 and got["time/forward"] is None
    assert summarize(records[:2], warmup=5)["steps_measured"] == 0


@pytest.mark.quick
def test_a_commit_named_in_the_command_is_the_rows_commit(monkeypatch):
    """On the H200 of 2026-12-04 the device's copy of tree 084fa14 carried a .git at e259866, so git said
    e259866+dirty: the hash the lease's command names (CERAR_BENCH_COMMIT) is what a row records; without it, git's."""
    from scripts.bench.gpu.measure import commit

    monkeypatch.setenv("CERAR_BENCH_COMMIT", "084fa14")
    assert commit() == "084fa14"
    monkeypatch.delenv("CERAR_BENCH_COMMIT")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert commit().split("+")[0] == head
