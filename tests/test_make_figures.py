# ruff: noqa: E501
"""scripts/reporting/make_figures.py and compare_training's report on small synthetic data (no processes, no network).

Checks that every figure file is produced from local run folders and CSVs, that W&B runs are shaped
like local run folders (on a stand-in object, no network), and that the training summary computes
means, spreads and ratios against nccl. Numbers here are synthetic test inputs, not results.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench import compare_training  # noqa: E402
from scripts.bench.allreduce.options import CSV_COLUMNS, EXTRA_COLUMNS  # noqa: E402
from scripts.reporting import make_figures  # noqa: E402

# The figure groups these tests feed through arguments; the others (fidelity, cost model, hierarchical) read the
# committed runs and data whatever the arguments, and test_committed_figures.py rebuilds them once per session.
GROUPS_FROM_ARGUMENTS = ["--only", "training", "--only", "allreduce", "--only", "design"]


def _write_runs(root: Path) -> None:
    for setting, agg_t in (("nccl", 1.0), ("cerar_c16", 0.7), ("powersgd", 0.0)):
        for seed in (1, 2):
            d = root / f"{setting}_s{seed}"
            d.mkdir(parents=True)
            lines = []
            for step in range(1, 7):
                rec = {"step": step, "train_loss": 10 - step * 0.1, "time/forward": 0.1, "time/backward": 0.2,
                       "time/aggregate": agg_t, "time/optimizer": 0.05, "time/step": 0.35 + agg_t,
                       "bytes_sent": 1000}  # fmt: skip
                if step % 3 == 0:
                    rec["val_loss"] = 10 - step * 0.1 + seed * 0.01
                lines.append(json.dumps(rec))
            (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
            (d / "summary.json").write_text(json.dumps({"final_val_loss": 9.4, "wall_seconds": 6 * (0.35 + agg_t),
                                                        "final_step": 6, "aggregator": setting, "overlap": False}))  # fmt: skip


def _write_allreduce(path: Path) -> None:
    rows = []
    for where, rate in (("loopback", ""), ("lab", "200")):
        for N in (2, 4):
            for nbytes in (2**20, 64 * 2**20):
                base = nbytes * 8 / 200e6 * 2 * (N - 1) / N
                for agg, cons, c, t in (("nccl", "", "", base), ("ring", "", "", base * 1.02),
                                        ("cerar", "perturbation", 4 * N, base * 0.8),
                                        ("cerar", "perturbation", 2 * N, base * 0.9)):  # fmt: skip
                    rows.append({"where": where, "rate_mbit": rate, "aggregator": agg, "construction": cons, "N": N,
                                 "c": c, "bytes": nbytes, "seconds_median": t, "seconds_min": t * 0.9,
                                 "seconds_max": t * 1.1, "repeats": 3,
                                 "byte_bound_seconds": t * 0.9 if rate else "", "bytes_sent": nbytes})  # fmt: skip
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS + EXTRA_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def test_make_figures_local(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "fig"
    _write_runs(runs)
    ar = tmp_path / "allreduce.csv"
    _write_allreduce(ar)
    design = ROOT / "reports" / "data" / "code_design.csv"
    rc = make_figures.main(["--runs-dir", str(runs), "--allreduce-csv", str(ar), "--design-csv", str(design),
                            "--out", str(out), "--strict", *GROUPS_FROM_ARGUMENTS])  # fmt: skip
    assert rc == 0
    expected = ["val_loss_vs_step.png", "val_loss_vs_wall.png", "phase_bars.png", "time_vs_size_loopback.png",
                "time_vs_size_lab_200.png", "saving_vs_c.png", "achieved_vs_byte_bound.png", "saving_vs_N.png",
                "error_vs_kappa.png"]  # fmt: skip
    for name in expected:
        p = out / name
        assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.quick
def test_make_figures_missing_sources(tmp_path):
    args = ["--runs-dir", str(tmp_path / "none"), "--allreduce-csv", str(tmp_path / "no.csv"),
            "--design-csv", str(tmp_path / "no2.csv"), "--out", str(tmp_path / "fig"), *GROUPS_FROM_ARGUMENTS]  # fmt: skip
    assert make_figures.main(args) == 0
    assert make_figures.main([*args, "--strict"]) == 1


class _FakeWandbRun:
    def __init__(self, agg, c, seed):
        self.config = {"aggregator": {"name": agg}, "c": c, "seed": seed}
        self.summary = {"final_val_loss": 9.0, "_runtime": 3}
        self._hist = [{"_step": s, "train_loss": 10 - s, "val_loss": None if s % 2 else 9.5, "_timestamp": 1}
                      for s in range(1, 5)]  # fmt: skip

    def scan_history(self):
        return iter(self._hist)


@pytest.mark.quick
def test_runs_from_wandb_shapes_like_local(tmp_path):
    runs = make_figures.runs_from_wandb([_FakeWandbRun("cerar", 16, 1), _FakeWandbRun("nccl", 16, 2)])
    assert [r["setting"] for r in runs] == ["cerar_c16", "nccl"]
    assert runs[0]["seed"] == 1 and runs[0]["summary"] == {"final_val_loss": 9.0}
    assert [m["step"] for m in runs[0]["metrics"]] == [1, 2, 3, 4]
    assert "val_loss" not in runs[0]["metrics"][0] and runs[0]["metrics"][1]["val_loss"] == 9.5
    assert not any(k.startswith("_") for m in runs[0]["metrics"] for k in m)
    paths = make_figures.training_figures(runs, tmp_path)
    assert all(p.exists() for p in paths)


@pytest.mark.quick
def test_training_summary_and_report(tmp_path):
    runs = tmp_path / "runs"
    _write_runs(runs)
    csv_path = tmp_path / "training.csv"
    for d in sorted(runs.iterdir()):
        setting, seed = d.name.rsplit("_s", 1)
        row = {"setting": setting, "seed": seed, "ok": True, "N": 4, "rate_mbit": "200", "model": "m",
               "max_steps": 6, "micro_batch_size": 4, "seq_len": 128, "load_before": "1 1 1", "command": "x"}  # fmt: skip
        row.update(compare_training.run_row(d))
        compare_training.append_row(csv_path, row)
    text = compare_training.write_report(csv_path, tmp_path / "training.md")
    with open(csv_path, newline="") as f:
        summ = {s["setting"]: s for s in compare_training.summarize(list(csv.DictReader(f)))}
    assert abs(summ["nccl"]["wall_ratio"] - 1) < 1e-12
    assert abs(summ["cerar_c16"]["wall_ratio"] - (0.35 + 0.7) / (0.35 + 1.0)) < 1e-9
    assert abs(summ["cerar_c16"]["agg_mean"] - 0.7) < 1e-12 and summ["nccl"]["runs"] == 2
    assert "| cerar_c16 |" in text and (tmp_path / "training.md").exists()


@pytest.mark.quick
def test_report_tables_targets(tmp_path):
    from scripts.reporting import report_tables

    ar = tmp_path / "allreduce.csv"
    _write_allreduce(ar)
    with open(ar, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r.update(run_id="20261130T051902-1", seconds_encode=0.1, seconds_comm=0.2, seconds_decode=0.3,
                 rel_error=0.01, bytes_sent=r["bytes"], achieved_mbit=1)  # fmt: skip
        if r["aggregator"] == "cerar" and r["rate_mbit"]:
            r["byte_bound_seconds"] = float(r["seconds_median"]) / 2
    with open(ar, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS + EXTRA_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    log = tmp_path / "runs.log"
    log.write_text(
        "=== 2026-11-30T05:19:02+00:00 load before: 1.00 2.00 3.00\n$ x\n=== rc=0 in 5 s; load after: 4.00 5.00 6.00\n"
    )
    out = tmp_path / "tables.md"
    assert report_tables.main(["--csv", str(ar), "--log", str(log), "--out", str(out)]) == 0
    text = out.read_text()
    # N=4, c=16, 64 MiB, lab 200: synthetic cerar = 0.8 x nccl (see _write_allreduce)
    line = next(x for x in text.splitlines() if "| 4 | 16 | 200 |" in x)
    assert "**0.800**" in line and "missed by +0.010" in line and "1.00 2.00 3.00 -> 4.00 5.00 6.00" in line
    assert "## Every setting" in text
