"""scripts/studies/time_to_loss.py (issues 34, 53): the metric, the report's arithmetic, the CSV's columns,
resuming, the order and the plan, every configuration the study will launch, and one real run through it.

The metric is held to cases worked out by hand in the comments (the target, a crossing between two evaluations,
one at an evaluation, one that never comes, a t interval from the t table); the report's arithmetic to a
hand-made study of run folders whose every expected number is worked out likewise; the plans to what issue 53
asks of them, printed by --dry-run; the real run is a 2-rank loopback launch of train/main.py (model=tiny, 4
steps), read back into a row."""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.studies import time_to_loss as cli
from scripts.studies.ttl import launch as study
from scripts.studies.ttl import metric, rows
from scripts.studies.ttl import plan as planning
from scripts.studies.ttl.appendix import model_parameters, unmeasured_cost
from scripts.studies.ttl.report import (
    HEADLINE_SEEDS,
    auto_apart,
    auto_verdict,
    headline,
    loads_vary,
    others_column,
    summarize,
    write_report,
)
from scripts.studies.ttl.settings import (
    AGGREGATORS,
    COLUMNS,
    FLAT,
    RETIRED_COLUMNS,
    ROOT,
    TWO_TIER,
    Setting,
    parse_settings,
)

ISSUE_COLUMNS = ("links, rate_mbit, hosts, ranks_per_host, model, aggregator, chosen, seed, steps, wall_s, "
                 "steps_s, aggregate_share, bytes_per_step, final_val_loss, time_to_target_s, load_before, "
                 "load_after, commit")  # fmt: skip
LAB = Setting("lab", 200.0, 4, 1, "tiny", steps=40)


def write_run(folder: Path, evals: list[tuple[int, float, float]], final: float, wall: float, *, step_s=1.0,
              aggregate_s=0.4, compute_s=0.4, steps: int = 40, load: float = 1.0, commit: str = "abc1234",
              checks: dict | None = None, warm: tuple[int, float] | None = None, summary_extra=None,
              cpu: float | None = None, others: tuple[float, ...] | None = None) -> None:  # fmt: skip
    """A finished run folder as train/main.py and the study leave it: metrics.jsonl (every step timed: time/step,
    time/aggregate, forward and backward half of ``compute_s`` each; ``checks`` {step: seconds of time/auto}, added
    to that step's time; ``warm`` (W, seconds): steps 1..W take that long instead; evaluations (step, time/wall,
    val_loss)), summary.json and launch.json (``others``: (others_cpu_s, cores, seconds[, irq_s[, others_procs_s]])
    as the launcher records them)."""
    folder.mkdir(parents=True, exist_ok=True)
    at = {s: (t, loss) for s, t, loss in evals}
    lines = []
    for step in range(1, steps + 1):
        took = warm[1] if warm and step <= warm[0] else step_s
        record = {"step": step, "time/step": took + (checks or {}).get(step, 0.0), "time/aggregate": aggregate_s,
                  "time/forward": compute_s / 2, "time/backward": compute_s / 2, "bytes_sent": 1000 * step}
        if step in (checks or {}):
            record["time/auto"] = checks[step]
        if step in at:
            record["time/wall"], record["val_loss"] = at[step]
        lines.append(json.dumps(record))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {"final_step": steps, "final_val_loss": final, "wall_seconds": wall, **(summary_extra or {})}
    (folder / "summary.json").write_text(json.dumps(summary))
    record = {"commit": commit, "load_before": f"{load:.2f} 2.00 3.00", "load_after": f"{load:.2f} 5.00 6.00"}
    if cpu is not None:
        record["cpu_s"] = cpu
    if others is not None:
        keys = ("others_cpu_s", "cores", "seconds", "irq_s", "others_procs_s")
        record.update(zip(keys[: len(others)], others, strict=True))
    (folder / "launch.json").write_text(json.dumps(record))


# ------------------------------------------------------------------ the metric, by hand


@pytest.mark.quick
def test_the_target_and_the_time_to_it_are_the_hand_computed_ones():
    """nccl's two seeds evaluated at steps 10..40 of a 40-step horizon: the target is their mean at step 20 (the
    first evaluation at or after half of 40), (6.0 + 6.4) / 2 = 6.2. A run at 7.0, 6.6, 5.8, 5.5 (walls 12, 25,
    37, 50 s) first reaches 6.2 at step 30; between steps 20 and 30 the loss falls 0.8, of which 0.4 above the
    target: half way, step 25 at 25 + 12 / 2 = 31.0 s. A run at 6.0 already at its first evaluation: there, no
    earlier one to interpolate from. A run at 7.0, 6.8, 6.5, 6.3 never reaches it."""
    nccl_1 = [(10, 10.0, 8.0), (20, 20.0, 6.0), (30, 30.0, 5.0), (40, 40.0, 4.6)]
    nccl_2 = [(10, 11.0, 8.2), (20, 22.0, 6.4), (30, 33.0, 5.2), (40, 44.0, 4.7)]
    assert metric.target_step([10, 20, 30, 40], 40) == 20 and metric.target_step([15, 30, 45], 40) == 30
    step, goal, n = metric.target([nccl_1, nccl_2], 40)
    assert (step, n) == (20, 2) and goal == pytest.approx(6.2, abs=1e-12)
    crossing = metric.crossing([(10, 12.0, 7.0), (20, 25.0, 6.6), (30, 37.0, 5.8), (40, 50.0, 5.5)], 6.2)
    assert crossing.step == pytest.approx(25.0) and crossing.seconds == pytest.approx(31.0) and crossing.at == 30
    # nccl's own seed 1: 8.0 -> 6.0 between steps 10 and 20, 1.8 of the 2.0 above 6.2: step 19, 19.0 s
    own = metric.crossing(nccl_1, 6.2)
    assert own.step == pytest.approx(19.0) and own.seconds == pytest.approx(19.0)
    first = metric.crossing([(10, 9.0, 6.0), (20, 18.0, 5.0)], 6.2)
    assert (first.step, first.seconds, first.at) == (10.0, 9.0, 10)
    assert metric.crossing([(10, 12.0, 7.0), (20, 25.0, 6.8), (30, 37.0, 6.5), (40, 50.0, 6.3)], 6.2) is None


@pytest.mark.quick
def test_the_end_states_interval_is_students_t_on_n_minus_1_degrees():
    """Gaps 0.01, 0.03, 0.02: mean 0.02, standard deviation 0.01; t(0.975, 2 dof) = 4.303 (the t table), so the
    95 % half-width is 4.303 x 0.01 / sqrt(3) = 0.02484. One value: no interval."""
    mean, half = metric.t_interval([0.01, 0.03, 0.02])
    assert mean == pytest.approx(0.02) and half == pytest.approx(4.302653 * 0.01 / 3**0.5, rel=1e-6)
    assert metric.t_interval([0.05]) == (0.05, None)
    assert metric.steady_window(300) == range(101, 300) and metric.steady_window(40, 100) == range(2, 40)


@pytest.mark.quick
def test_the_gaps_course_is_paired_by_seed_and_step():
    """A run evaluated at steps 10, 20, 30, 40 against nccl's run of its seed evaluated at 10, 20, 40 (30 missing):
    5.05 / 5.0 - 1 = +1 %, 3.96 / 4.0 - 1 = -1 %, 3.003 / 3.0 - 1 = +0.1 %, at the steps both have, in order; the
    walls, whatever they are, do not enter."""
    run = [(10, 1.0, 5.05), (20, 2.0, 3.96), (30, 3.0, 3.5), (40, 4.0, 3.003)]
    nccl = [(10, 7.0, 5.0), (20, 9.0, 4.0), (40, 11.0, 3.0)]
    got = metric.paired_gaps(run, nccl)
    assert [s for s, _ in got] == [10, 20, 40]
    assert [g for _, g in got] == pytest.approx([0.01, -0.01, 0.001], abs=1e-12)
    assert metric.paired_gaps(run, []) == []


# ------------------------------------------------------------------ the columns and the rows


@pytest.mark.quick
def test_the_csv_has_exactly_the_issues_columns_and_refuses_others(tmp_path):
    assert [c.strip() for c in ISSUE_COLUMNS.split(",")] == COLUMNS
    bad = tmp_path / "bad.csv"
    bad.write_text("links,rate_mbit,aggregator\nlab,200,nccl\n")
    with pytest.raises(ValueError, match="are not the study's"):
        rows.read_rows(bad)


@pytest.mark.quick
def test_rows_wait_for_nccl_and_carry_the_time_to_the_settings_target(tmp_path):
    folder = tmp_path / "runs" / LAB.key
    auto = {"auto": {"fallback": None, "decisions": [{"step": 2, "choice": "nccl"}, {"step": 3, "choice": "fp16"}]}}
    write_run(folder / "auto_s1", [(10, 12.0, 7.0), (20, 25.0, 6.6), (30, 37.0, 5.8), (40, 50.0, 5.5)], 5.5, 50.0,
              summary_extra=auto)  # fmt: skip
    csv_path = tmp_path / "t.csv"
    # auto finished first: no row until nccl's run of the seed (every ratio is against it)
    assert study.flush_rows(csv_path, LAB, folder, 1, ["nccl", "auto"], final=False) == 0 and not csv_path.exists()
    write_run(folder / "nccl_s1", [(10, 10.0, 8.0), (20, 20.0, 6.2), (30, 30.0, 5.0), (40, 40.0, 4.6)], 4.6, 40.0,
              aggregate_s=0.25, step_s=0.5)  # fmt: skip
    assert study.flush_rows(csv_path, LAB, folder, 1, ["nccl", "auto"], final=False) == 2
    got = {r["aggregator"]: r for r in rows.read_rows(csv_path)}
    # one nccl seed: the target is its loss at step 20, 6.2; auto crosses it at 31.0 s (the hand case above)
    assert got["nccl"]["time_to_target_s"] == "20.0" and got["auto"]["time_to_target_s"] == "31.0"
    assert got["auto"]["chosen"] == "nccl at step 2 -> fp16 at step 3"
    # steps_s: 40 steps x 0.5 s; the share: mean over steps 2.. of 0.25 / 0.5; bytes: median of 2000..40000
    assert got["nccl"]["steps_s"] == "20.0" and got["nccl"]["aggregate_share"] == "0.5"
    assert got["nccl"]["bytes_per_step"] == "21000" and got["nccl"]["steps"] == "40"
    assert got["nccl"]["load_before"] == "1.00 2.00 3.00" and got["nccl"]["commit"] == "abc1234"
    assert study.flush_rows(csv_path, LAB, folder, 1, ["nccl", "auto"], final=True) == 0  # nothing twice
    # nccl's second seed moves the target to (6.2 + 6.6) / 2 = 6.4: auto's 6.6 -> 5.8 crosses it a quarter of the
    # way from step 20: 25 + 12 / 4 = 28.0 s; every row is recomputed, none is added twice
    write_run(folder / "nccl_s2", [(10, 10.0, 8.0), (20, 20.0, 6.6), (30, 30.0, 5.0), (40, 40.0, 4.7)], 4.7, 40.0)
    assert study.flush_rows(csv_path, LAB, folder, 2, ["nccl"], final=False) == 1
    assert {r["aggregator"] + r["seed"]: r["time_to_target_s"] for r in rows.read_rows(csv_path)}["auto1"] == "28.0"
    text = csv_path.read_text()
    csv_path.write_text(text.replace(",28.0,", ",,"))
    assert study.retarget(csv_path, tmp_path / "runs") == 1 and csv_path.read_text() == text
    fallback = {"auto": {"fallback": "aggregator=auto: no link measurement (fit_tier (measured inter): misses); x"}}
    assert study.chosen("auto", fallback).startswith("fallback: nccl (fit_tier (measured inter)")


@pytest.mark.quick
def test_the_committed_rows_carry_the_metric_the_report_computes(tmp_path):
    """reports/data/time_to_loss.csv's time_to_target_s is what --retarget computes from the run folders today."""
    copy = tmp_path / "time_to_loss.csv"
    copy.write_text((ROOT / "reports" / "data" / "time_to_loss.csv").read_text())
    assert study.retarget(copy, ROOT / "reports" / "runs" / "time_to_loss") == 0


@pytest.mark.quick
def test_the_launcher_counts_what_the_whole_machine_used(tmp_path):
    """machine_cpu_s sums /proc/stat's busy columns (user, nice, system, irq, softirq, steal; not idle, iowait)
    and, apart, its interrupt columns (irq, softirq), in clock ticks: a hand-written line gives the hand-summed
    seconds; on this machine a child that spins 0.3 s of CPU adds at least that much to the busy seconds (other
    work can only add more)."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 9000 700 5 6 7 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert study.machine_cpu_s(stat) == pytest.approx(((100 + 20 + 30 + 5 + 6 + 7) / tick, (5 + 6) / tick))
    stat.write_text("intr 1 2 3\n")
    assert study.machine_cpu_s(stat) is None and study.machine_cpu_s(tmp_path / "absent") is None
    before = study.machine_cpu_s()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    after = study.machine_cpu_s()
    assert after[0] - before[0] >= 0.25 and 0 <= after[1] - before[1] <= after[0] - before[0]


@pytest.mark.quick
def test_the_launcher_counts_the_cpu_its_runs_used():
    """children_cpu reads the CPU time of the ended children: a child that spins 0.3 s of CPU adds that much."""
    before = study.children_cpu()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    assert 0.25 < study.children_cpu() - before < 5.0


# ------------------------------------------------------------------ the report's arithmetic


def hand_made(tmp_path: Path) -> tuple[Path, Path]:
    """Three seeds of nccl and fp16, one of cerar_c16 and of auto, on the flat lab, 40 steps, evaluated every 10:
    every expected number in the tests below is worked out from these by hand."""
    runs = tmp_path / "runs"
    folder = runs / LAB.key
    # nccl: the target is its mean at step 20, (6.0 + 6.4 + 6.2) / 3 = 6.2. Its crossings: seed 1 at 19.0 s (step
    # 19, 8.0 -> 6.0); seed 2 between 6.4 and 5.2 a sixth of the way: 22 + 11 / 6 s (step 20 + 10 / 6); seed 3 at
    # 6.2 itself: 20 s (step 20). Finals 4.60, 4.70, 4.65: band 0.10 / 4.65 = 2.15 %
    nccl = {1: [(10, 10.0, 8.0), (20, 20.0, 6.0), (30, 30.0, 5.0), (40, 40.0, 4.60)],
            2: [(10, 11.0, 8.2), (20, 22.0, 6.4), (30, 33.0, 5.2), (40, 44.0, 4.70)],
            3: [(10, 10.0, 8.1), (20, 20.0, 6.2), (30, 30.0, 5.1), (40, 40.0, 4.65)]}  # fmt: skip
    for seed, evals in nccl.items():
        write_run(folder / f"nccl_s{seed}", evals, evals[-1][2], evals[-1][1], load=2.0 if seed == 2 else 0.0,
                  cpu=100.0)  # fmt: skip
    # fp16: nccl's losses at 0.8 of its walls: time to the target 0.8 of nccl's at every seed, steps 1.0; steps of
    # 0.8 s (0.8), aggregation 0.2 s (0.5), forward+backward 0.4 s (1.0); 60 CPU seconds against 100 (0.6). Other
    # work beside it: not recorded at seed 1; at seed 2 the machine's busy seconds less the run's, 16 of 2 cores x
    # 40 s (at most 20 %); at seed 3 those are 40 s, of which 10 interrupts, and the other processes counted one by
    # one 24 s: 30 % (not 50 %, nor 37.5 % with the interrupts taken off).
    # Finals: gaps 0, +0.1 %, +0.2 %: mean 0.1 %, half-width 4.303 x 0.1 % / sqrt(3) = 0.248 %; inside the band
    finals = {1: 4.60, 2: 4.70 * 1.001, 3: 4.65 * 1.002}
    for seed, evals in nccl.items():
        scaled = [(s, 0.8 * t, loss) for s, t, loss in evals[:-1]] + [(40, 0.8 * evals[-1][1], finals[seed])]
        write_run(folder / f"fp16_s{seed}", scaled, finals[seed], 0.8 * evals[-1][1], step_s=0.8, aggregate_s=0.2,
                  cpu=60.0, commit="abc1234" if seed < 3 else "def5678",
                  others={1: None, 2: (16.0, 2, 40.0), 3: (40.0, 2, 40.0, 10.0, 24.0)}[seed])  # fmt: skip
    # cerar_c16, seed 1 only: never reaches 6.2; its final 6.3 is +37 %: outside the band
    write_run(folder / "cerar_c16_s1", [(10, 12.0, 8.5), (20, 24.0, 6.9), (30, 36.0, 6.5), (40, 48.0, 6.3)], 6.3,
              48.0)  # fmt: skip
    # auto, seed 1: exact (1.0 s steps) to its check at step 10 (3 s), fp16's 0.8 s steps after, a re-check at
    # step 20 (1.4 s). Its crossing: 8.0 -> 6.0 between walls 14 and 22, at 0.9 of the way: 21.2 s, 21.2 / 19.0 =
    # 1.1158x nccl's, 1.1158 / 0.8 = 1.395x fp16's. Steady state (warm-up 10: steps 11..39 but 20) 0.8 s: 1.0x
    # fp16's. Its 40 steps: 10 x 1.0 + 3 + 30 x 0.8 + 1.4 = 38.4 s, 0.96 s a step = steady 0.8 + warm-up (10 x
    # (1.0 - 0.8)) / 40 = 0.05 + checks 4.4 / 40 = 0.11 + rest 0; against fp16's 0.8: 1.2x
    decisions = {"auto": {"fallback": None, "decisions": [{"step": 10, "choice": "fp16"}]}}
    write_run(folder / "auto_s1", [(10, 14.0, 8.0), (20, 22.0, 6.0), (30, 30.0, 5.0), (40, 38.0, 4.60)], 4.60, 38.0,
              step_s=0.8, aggregate_s=0.2, checks={10: 3.0, 20: 1.4}, warm=(10, 1.0), summary_extra=decisions)
    csv_path = tmp_path / "t.csv"
    for seed in (1, 2, 3):
        study.flush_rows(csv_path, LAB, folder, seed, ["nccl", "fp16", "cerar_c16", "auto"], final=True)
    return csv_path, runs


@pytest.mark.quick
def test_the_reports_arithmetic_from_a_hand_made_study(tmp_path):
    csv_path, runs = hand_made(tmp_path)
    s = summarize(rows.read_rows(csv_path), runs / LAB.key, warmup=10)
    assert s["target"][:1] == (20,) and s["target"][1] == pytest.approx(6.2) and s["target"][2] == 3
    assert s["band"] == pytest.approx(0.10 / 4.65)
    nccl, fp16, cerar, auto = (s["aggregators"][n] for n in ("nccl", "fp16", "cerar_c16", "auto"))
    assert nccl["ttt"] == pytest.approx(1.0) and nccl["inside"] is True
    assert (fp16["ttt"], fp16["stt"], fp16["wall"]) == pytest.approx((0.8, 1.0, 0.8))
    assert (fp16["steady"], fp16["agg"], fp16["compute"], fp16["cpu"]) == pytest.approx((0.8, 0.5, 1.0, 0.6))
    assert fp16["gap"] == pytest.approx(0.001)
    assert fp16["others"] == pytest.approx(0.25) and fp16["others_span"] == pytest.approx((0.2, 0.3))
    assert fp16["others_n"] == 2 and nccl["others"] is None
    assert (others_column(fp16), others_column(nccl)) == ("at most 25 % (20..30 %) (2 seeds)", "-")
    assert others_column({"others": 0.3, "others_span": None, "others_n": 1, "others_bound": False}) == "30 % (1 seed)"
    assert fp16["gap_half"] == pytest.approx(4.302653 * 0.001 / 3**0.5, rel=1e-5)
    assert fp16["inside"] is True and fp16["n"] == 3
    assert cerar["reached"] is False and cerar["ttt"] is None and cerar["never"] == ["1"] and cerar["inside"] is False
    assert auto["ttt"] == pytest.approx(21.2 / 19.0) and auto["steady"] == pytest.approx(0.8)
    # nccl's seed 3 ran at load 0.00 (its start and end): a ratio to 0 is no ratio, the others' still are
    assert fp16["load_span"] is None and fp16["load"] == pytest.approx(1.0 / 2.0)  # seed 2's alone
    apart = auto_apart(s)
    assert "steady step 1.000x fp16's" in apart and "its mean step 0.960 s = steady 0.800 + warm-up 0.050" in apart
    assert "checks 0.110 + rest 0.000, 1.200x fp16's 0.800 s" in apart
    best, why = headline(s)
    assert best == "fp16" and "0.800x nccl's (3 seeds" in why and "cerar_c16 1 seed, auto 1 seed: not headlines" in why
    assert "separate" not in why  # fp16 0.8x at every seed, nccl 1.0x: apart
    fp16["ttt_span"] = (0.7, 1.02)  # had one seed been 1.02x nccl's: the seeds would not separate the two
    assert headline(s)[1].count("; its seeds (0.700..1.020) do not separate it from nccl 1.000x;") == 1
    verdict = auto_verdict(s)
    assert verdict.startswith("MISSED") and f"{21.2 / 19.0 / 0.8:.3f}" in verdict
    assert "1 seed: not a headline" in verdict
    # fewer than HEADLINE_SEEDS of nccl: nothing is a headline
    two = [r for r in rows.read_rows(csv_path) if r["seed"] != "3"]
    assert headline(summarize(two, runs / LAB.key)) == (None, "nccl 2 seeds: not a headline") and HEADLINE_SEEDS == 3


@pytest.mark.quick
def test_a_load_of_zero_keeps_the_load_caveat():
    """Issue 53: `min(loads) > 0` dropped the caveat where one run recorded 0.00; 0.00 to 4.8 is a span."""
    assert loads_vary([0.0, 4.78, 4.2]) and loads_vary([1.0, 1.6]) and not loads_vary([1.0, 1.4])
    assert not loads_vary([0.0, 0.0]) and not loads_vary([])


@pytest.mark.quick
def test_the_report_is_rebuilt_from_the_csv_the_retired_rows_and_the_folders_alone(tmp_path, monkeypatch):
    csv_path, runs = hand_made(tmp_path)
    repo = git_repo(tmp_path / "repo")
    monkeypatch.setattr(rows, "REPO", repo["root"])
    text = csv_path.read_text()
    csv_path.write_text(text.replace("abc1234", repo["code"]).replace("def5678", repo["other code"]))
    retired = tmp_path / "retired.csv"
    first, second = rows.read_rows(csv_path)[:2]
    gone = {**first, "wall_s": "55.5", "commit": "0ld0ld0", "retired_in": "bdae7f3", "reason": "rerun at lower load"}
    stamped = {**second, "commit": "0ld0ld0", "retired_in": "2026-12-05T16:51:58+00:00",
               "reason": "code of 0ld0ld0 differs"}  # fmt: skip
    study.append(retired, [gone, stamped], RETIRED_COLUMNS)
    report, figures = tmp_path / "report.md", tmp_path / "figures"
    out = write_report(csv_path, runs, report, figures, retired)
    assert report.read_text() == out
    assert "| fp16 | 3 | - | 0.800 | 0.800 | 1.000 | 0.800 | 0.500 | 1.000 | 0.600 |" in out
    assert "| cerar_c16 | 1 | - | 1.200 | never at s1 |" in out
    assert "| fp16 | 3 | 4.6547 | +0.100 % [-0.148, +0.348] % |" in out and "| cerar_c16 | 1 | 6.3000 |" in out
    assert "**Rows from 2 commits**, their code differs" in out and f"{repo['other code']}: fp16 (s3)" in out
    assert "nccl s1 of 0ld0ld0 (56 s, load 0.00 -> 0.00) retired in bdae7f3, replaced by" in out
    assert "retired at 2026-12-05T16:51:58+00:00, replaced" in out  # the launcher's stamp is a time, not a commit
    assert "Why: code of 0ld0ld0 differs / rerun at lower load." in out
    assert "The 1-minute load ran from 0.00 to 2.00" in out
    assert "**fp16**: time to the target 0.800x" in out and "whose code differs" in out
    assert "Status: a pilot" in out and "lab-4x2:tiny" in out and "--plan headline" in out
    assert (figures / f"time_to_loss_{LAB.key}.png").stat().st_size > 10_000
    assert write_report(csv_path, runs, report, figures, retired) == out  # the same inputs, the same report


@pytest.mark.quick
def test_an_aggregator_keeps_its_colour_in_every_figure(tmp_path, monkeypatch):
    """A reader follows an aggregator from figure to figure by its colour: fp16's must not change because a
    setting lacks cerar_c16 or lists it first. Two figures of the hand-made study, the second with nccl and fp16
    alone in the reverse order; every line's colour read back from matplotlib as it is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from scripts.studies.ttl.figures import COLOURS, figure

    csv_path, runs = hand_made(tmp_path)
    drawn: list[dict[str, str]] = []
    plot = Axes.plot

    def recording(ax, *args, **kwargs):
        if kwargs.get("label") in AGGREGATORS:
            drawn[-1][kwargs["label"]] = matplotlib.colors.to_hex(kwargs["color"])
        return plot(ax, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording)
    full = summarize(rows.read_rows(csv_path), runs / LAB.key, warmup=10)
    two = dict(full, aggregators={n: full["aggregators"][n] for n in ("fp16", "nccl")})
    for summary in (full, two):
        drawn.append({})
        assert figure(LAB, summary, runs, tmp_path / f"f{len(drawn)}.png")
    assert set(drawn[0]) == {"nccl", "fp16", "cerar_c16", "auto"} and set(drawn[1]) == {"fp16", "nccl"}
    assert drawn[1] == {n: drawn[0][n] for n in ("fp16", "nccl")}
    assert len(set(drawn[0].values())) == 4
    assert len(set(COLOURS.values())) == len(AGGREGATORS)  # none in the catalogue shares one


@pytest.mark.quick
def test_the_report_prices_a_setting_it_has_not_run_from_the_next_smaller_models_runs():
    """pythia-14m and pythia-31m have 14,067,712 and 30,494,720 parameters (EleutherAI's Pythia model cards and
    paper, table 1): two hours of pythia-14m runs on the lab price the same runs at pythia-31m at 2 x 2.168 h;
    tiny prices nothing (its steps are mostly fixed costs), nor does a model measured on other links only, nor a
    run to a longer horizon than the plans' 300 steps (issue 53's 1,500-step run is not one of "the same runs")."""
    assert model_parameters("pythia-14m") == 14_067_712 and model_parameters("pythia-31m") == 30_494_720
    measured = [{"links": "lab", "model": "pythia-14m", "steps": "300", "wall_s": "3600"}] * 2
    measured += [{"links": "loopback", "model": "tiny", "steps": "300", "wall_s": "3600"}]
    measured += [{"links": "lab", "model": "pythia-14m", "steps": "1500", "wall_s": "9000"}]
    text = unmeasured_cost(measured, ["lab:pythia-31m", "loopback:pythia-14m", "loopback:pythia-31m"])
    assert (
        "lab:pythia-31m (30.5 M parameters, 2.2x pythia-14m's): the 2 runs measured at pythia-14m there "
        "took 2.0 h, the same at pythia-31m about 4.3 h" in text
    )
    assert "loopback" not in text
    assert unmeasured_cost(measured[2:3], ["loopback:pythia-14m"]) == ""


# ------------------------------------------------------------------ the order, the plan, resuming


def git_repo(root: Path) -> dict:
    """A real git repository of three commits: the code, a commit that changes only docs (the same code), and one
    that changes train/ (other code)."""
    root.mkdir(parents=True)

    def git(*args):
        return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    out = {"root": root}
    for name, path, text in (("code", "train/a.py", "x = 1\n"), ("same code", "docs/a.md", "notes\n"),
                             ("other code", "train/a.py", "x = 2\n")):  # fmt: skip
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
        git("add", "-A")
        git("commit", "-q", "-m", name)
        out[name] = git("rev-parse", "--short=7", "HEAD")
    return out


def study_args(tmp_path: Path, aggregators, seeds, code_dir=None, **more) -> argparse.Namespace:
    args = argparse.Namespace(
        aggregators=aggregators, seeds=seeds, micro_batch=2, extra=[], timeout=120.0, mtu=9000,
        csv=tmp_path / "t.csv", runs=tmp_path / "runs", commit="test", code_dir=code_dir,
        code_cache=tmp_path / "code", order="rotated", order_seed=0, retire_stale=False,
        retired_csv=tmp_path / "retired.csv", retired_runs=tmp_path / "retired",
    )  # fmt: skip
    vars(args).update(more)
    args.eval_for = lambda s: 2
    args.micro_batch_for = lambda s: 2
    return args


@pytest.mark.quick
def test_runs_already_in_the_csv_are_not_launched_again(tmp_path, monkeypatch):
    csv_path, runs = hand_made(tmp_path)
    launched = []
    monkeypatch.setattr(study, "launch", lambda *a, **k: launched.append(a) or (False, "not run", ""))
    loopback = Setting("loopback", None, 1, 2, "tiny", steps=4)
    args = study_args(tmp_path, ["nccl", "fp16"], [1, 2], code_dir=tmp_path)
    shutil.rmtree(runs / LAB.key / "fp16_s2")  # the row is what counts, not its folder
    assert planning.run_study(args, [LAB]) == 0 and launched == []  # every run is a row already
    before = [rows.run_key(r) for r in rows.read_rows(csv_path)]
    # a run finished but not yet a row (its nccl still to come) is not launched again either
    write_run(runs / loopback.key / "fp16_s1", [(4, 10.0, 5.0)], 5.0, 10.0, steps=4)
    args.seeds = [1]
    planning.run_study(args, [loopback])
    assert [a[1][0] for a in launched] == ["aggregator=nccl"]  # nccl only, launched once
    assert [rows.run_key(r) for r in rows.read_rows(csv_path)][: len(before)] == before  # rows only appended


@pytest.mark.quick
def test_the_aggregators_run_interleaved_rotated_or_shuffled_by_seed(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(study, "launch", lambda setting, argv, *a: order.append(argv[0]) or (False, "not run", ""))
    args = study_args(tmp_path, ["nccl", "fp16", "int8"], [1, 2, 3], code_dir=tmp_path)
    assert planning.run_study(args, [Setting("loopback", None, 1, 2, "tiny", steps=4)]) == 1  # every launch "failed"
    names = ["aggregator=nccl", "aggregator=fp16", "aggregator=int8"]
    assert order == names + names[1:] + names[:1] + names[2:] + names[:2]
    record = json.loads((args.runs / "loopback-tiny-4steps" / "int8_s3" / "launch.json").read_text())
    assert len(record["load_before"].split()) == 3 and not record["ok"] and record["cpu_s"] >= 0
    assert record["others_cpu_s"] >= 0 and record["irq_s"] >= 0 and record["cores"] == os.cpu_count()
    assert record["others_procs_s"] >= 0 and record["kthreads_s"] >= 0
    # shuffled: each seed's order a permutation of the setting's list, drawn afresh per seed, the same per command
    shuffled = [planning.order(FLAT, LAB, seed, "shuffled") for seed in (1, 2, 3)]
    assert all(sorted(o) == sorted(FLAT) for o in shuffled) and len({tuple(o) for o in shuffled}) == 3
    assert shuffled == [planning.order(FLAT, LAB, seed, "shuffled") for seed in (1, 2, 3)]
    assert planning.order(FLAT, LAB, 1, "shuffled", order_seed=1) != shuffled[0]


def stat_line(pid: int, comm: str, ppid: int, seconds: tuple[float, float], start: int, kthread=False) -> str:
    """A /proc/<pid>/stat line as proc(5) writes it: ``seconds`` (own, waited-for children's) as utime and
    cutime in clock ticks (stime and cstime 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    own, kids = (round(x * tick) for x in seconds)
    flags = study.PF_KTHREAD if kthread else 0x400000
    return f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 {flags} 9 0 0 0 {own} 0 {kids} 0 20 0 1 0 {start} 4096 10\n"


def write_proc(root: Path, procs: dict) -> Path:
    """A /proc of ``procs`` {pid: stat_line's arguments after the pid}, with an entry that is not a process."""
    shutil.rmtree(root, ignore_errors=True)
    for pid, args in procs.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(stat_line(pid, *args))
    (root / "self").mkdir()  # not a pid: skipped
    (root / "99").mkdir()  # a process that ended between the listing and the read: no stat, skipped
    return root


@pytest.mark.quick
def test_the_launcher_counts_other_processes_one_by_one(tmp_path):
    """other_processes_cpu_s over two hand-written /procs, summed by hand: init's own growth counts, not its
    children's (orphans it reaped may be the run's); a shell's waited-for job counts in the shell; the launcher
    (``run``) and its descendants do not; a pid reused by a new process counts the new one's seconds from 0; a
    command name with spaces and parentheses parses; kernel threads apart. On this machine, a job that spins 0.5 s
    and is waited for counts where its parent is not the run, and not where it is."""
    before = {1: ("init", 0, (1, 5), 1), 10: ("bash", 1, (2, 10), 50), 20: ("python", 10, (1, 0), 60),
              30: ("a) (b", 1, (3, 0), 70), 40: ("ksoftirqd/0", 2, (4, 0), 2, True), 50: ("old", 1, (7, 0), 100)}
    after = {1: ("init", 0, (1.5, 50), 1), 10: ("bash", 1, (2.5, 14), 50), 20: ("python", 10, (1.2, 100), 60),
             21: ("torchrun", 20, (30, 0), 61), 22: ("pt_main_thread", 21, (20, 0), 62),
             30: ("a) (b", 1, (5, 0), 70), 40: ("ksoftirqd/0", 2, (6, 0), 2, True), 50: ("new", 1, (1, 0), 200),
             60: ("sleep", 10, (0.5, 0), 210)}  # fmt: skip
    snap0 = study.processes(write_proc(tmp_path / "proc0", before))
    snap1 = study.processes(write_proc(tmp_path / "proc1", after))
    assert snap0[(30, 70)] == (1, pytest.approx(3.0), 0.0, False) and snap0[(40, 2)][3] is True
    assert set(snap1) == {(1, 1), (10, 50), (20, 60), (21, 61), (22, 62), (30, 70), (40, 2), (50, 200), (60, 210)}
    # init 0.5 (not its children's 45), bash 0.5 + 4, the daemon "a) (b" 2, the new 50 1, sleep 0.5; ksoftirqd 2
    assert study.other_processes_cpu_s(snap0, snap1, 20) == pytest.approx((8.5, 2.0))
    assert study.processes(tmp_path / "absent") is None
    # a real machine: a job of this process counts as other work only where this process is not the run's
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = study.processes()
        # kthreadd (parent 0, not init) is a kernel thread where the kernel's threads are seen; a container's own
        # pid namespace shows none of them, only its init with parent 0
        kthreadd = [v for (pid, _), v in start.items() if v[0] == 0 and pid != 1]
        assert all(kthread for *_, kthread in kthreadd)
        spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
        subprocess.run([sys.executable, "-c", spin], check=True)
        end = study.processes()
    finally:
        sleeper.kill()
        sleeper.wait()
    beside, _ = study.other_processes_cpu_s(start, end, sleeper.pid)  # the run is the sleeper: the job is other work
    mine, _ = study.other_processes_cpu_s(start, end, os.getpid())  # the run is this process: the job is the run's
    assert beside - mine >= 0.45


@pytest.mark.quick
def test_issue_53s_plans_dry_run(tmp_path, capsys):
    """--plan headline: the flat lab at tiny (200 Mbit/s) and pythia-14m (1000 Mbit/s) and the two tiers at both,
    every aggregator of each at seeds 1, 2, 3, shuffled, stale rows to retire; --plan long: 1,500 steps of the flat
    lab at pythia-14m, evaluated every 75, for nccl, the fastest 16-bit, CERAR c=16 and CERAR over fp16
    messages. --dry-run prints every run and launches nothing."""
    common = ["--csv", str(tmp_path / "none.csv"), "--runs", str(tmp_path / "runs"), "--dry-run"]
    assert cli.main(["--plan", "headline", *common]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ". seed " in line]
    keys = {"lab-200mbit-tiny": FLAT, "lab-1000mbit-pythia-14m": FLAT, "lab-4x2-200mbit-tiny": TWO_TIER,
            "lab-4x2-1000mbit-pythia-14m": TWO_TIER}  # fmt: skip
    planned = [(line.split()[2], line.split()[3].rstrip(":"), line.split()[4].rstrip(":")) for line in lines]
    assert len(planned) == 3 * sum(len(names) for names in keys.values())
    for key, names in keys.items():
        for seed in ("1", "2", "3"):
            got = [n for s, k, n in planned if s == seed and k == key]
            assert sorted(got) == sorted(names), (key, seed, got)
    seed_orders = [[n for s, k, n in planned if s == seed and k == "lab-200mbit-tiny"] for seed in ("1", "2", "3")]
    assert len({tuple(o) for o in seed_orders}) == 3  # re-randomized seed by seed
    assert all(line.endswith(": run") for line in lines)  # an empty CSV: every run launches
    assert cli.main(["--plan", "long", *common]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ". seed " in line]
    assert {line.split()[3] for line in lines} == {"lab-1000mbit-pythia-14m-1500steps:"}
    long = ["nccl", "bf16", "cerar_c16", "cerar16_c8"]
    assert sorted(line.split()[4].rstrip(":") for line in lines) == sorted(long * 3)
    args = cli.parse(["--plan", "long", *common])
    (setting,) = args.setting_list
    assert (setting.steps, args.eval_for(setting), setting.rate_mbit) == (1500, 75, 1000.0)
    assert AGGREGATORS["cerar16_c8"] == ["aggregator=cerar", "c=8", "aggregator.transport=float16"]
    with pytest.raises(SystemExit):
        cli.parse(["--plan", "long", "--seeds", "1", "--dry-run"])  # a flag that disagrees with the plan


@pytest.mark.quick
def test_stale_rows_are_retired_disclosed_and_rerun(tmp_path, monkeypatch):
    """--retire-stale: a row whose commit trained other code (git diff of cerar/, train/, configs/) is planned
    'rerun', one of the same code 'skip'; rerunning moves the row to the retired CSV with its reason and its
    folder aside before the launch."""
    repo = git_repo(tmp_path / "repo")
    monkeypatch.setattr(rows, "REPO", repo["root"])
    csv_path, runs = hand_made(tmp_path)
    csv_path.write_text(csv_path.read_text().replace("abc1234", repo["code"]).replace("def5678", repo["same code"]))
    args = study_args(tmp_path, ["nccl", "fp16"], [1, 3], code_dir=tmp_path, commit=repo["same code"],
                      retire_stale=True)  # fmt: skip
    assert {p.action for p in planning.plan(args, [LAB])} == {"skip"}  # a docs-only commit: the same code
    args.commit = repo["other code"]
    planned = planning.plan(args, [LAB])
    assert {(p.seed, p.name): p.action for p in planned} == {(1, "nccl"): "rerun", (1, "fp16"): "rerun",
                                                             (3, "nccl"): "rerun", (3, "fp16"): "rerun"}
    assert "differs from" in planned[0].why
    launched = []
    monkeypatch.setattr(study, "launch", lambda *a, **k: launched.append(a) or (False, "not run", ""))
    assert planning.run_study(args, [LAB]) == 1 and len(launched) == 4
    retired = rows.read_rows(args.retired_csv, RETIRED_COLUMNS)
    assert sorted((r["aggregator"], r["seed"]) for r in retired) == [("fp16", "1"), ("fp16", "3"), ("nccl", "1"),
                                                                     ("nccl", "3")]  # fmt: skip
    assert all("differs from" in r["reason"] and r["retired_in"] for r in retired)
    assert (args.retired_runs / LAB.key / f"nccl_s1-{repo['code']}" / "metrics.jsonl").exists()
    assert {(r["aggregator"], r["seed"]) for r in rows.read_rows(csv_path)} == {("nccl", "2"), ("fp16", "2"),
                                                                               ("cerar_c16", "1"), ("auto", "1")}


# ------------------------------------------------------------------ what the study will launch


def test_every_configuration_of_the_study_composes_and_validates():
    """Every aggregator of every kind of links, at its world size (the models differ in model= alone, which
    parse_settings checks): a configuration the study would launch for hours is refused here, not at its turn."""
    from tests.runs import composed
    from train.config import validate

    named = {"lab": ["int4", "int4_ef"], "loopback": ["int4", "int4_ef"], "lab-4x2": ["hier_int4", "hier_int4_exact"]}
    assert set(FLAT) | set(TWO_TIER) | {n for ns in named.values() for n in ns} == set(AGGREGATORS)  # named, outside
    for setting in parse_settings("lab:tiny,lab-4x2:tiny,loopback:tiny"):
        for name in setting.aggregators + named[setting.links]:
            extra = [f"aggregator.local_size={setting.ranks_per_host}"] if setting.links == "lab-4x2" else []
            cfg = composed(*AGGREGATORS[name], f"model={setting.model}", *extra)
            validate(cfg, world_size=setting.ranks)
    with pytest.raises(ValueError, match="unknown links 'lan'"):
        parse_settings("lan:tiny", 200.0)
    with pytest.raises(ValueError, match="unknown model"):
        parse_settings("lab:pythia-9b", 200.0)
    with pytest.raises(ValueError, match="no calibrated lab rate for pythia-31m"):
        parse_settings("lab:pythia-31m")


# ------------------------------------------------------------------ one real run


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_one_real_run_through_the_launcher(tmp_path):
    """A 2-rank loopback launch of train/main.py (model=tiny, 4 steps) through run_study, read back into a row
    (15-50 s: 49 s at load 10 on the shared 2 cores; at load 40 its start-up alone outlasted 120 s)."""
    setting = Setting("loopback", None, 1, 2, "tiny", steps=4)
    args = study_args(tmp_path, ["nccl"], [1], code_dir=ROOT)
    args.timeout = 360.0  # the launch's own limit: under the pytest timeout, so the launcher's kill is what ends it
    assert planning.run_study(args, [setting]) == 0
    with open(args.csv, newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["links"] == "loopback" and row["ranks_per_host"] == "2" and row["steps"] == "4"
    assert float(row["wall_s"]) > 0 and 0 < float(row["aggregate_share"]) < 1 and float(row["final_val_loss"]) > 0
    assert 0 < float(row["time_to_target_s"]) <= float(row["wall_s"])  # its own target: its loss at step 2
    assert row["commit"] == "test" and len(row["load_before"].split()) == 3
    launch_record = json.loads((args.runs / setting.key / "nccl_s1" / "launch.json").read_text())
    assert launch_record["ok"] and "--nproc_per_node=2" in launch_record["command"]
    assert launch_record["cpu_s"] > 1.0  # two ranks that imported torch and trained: seconds of CPU
