"""Real multi-process CPU training runs (torchrun + gloo) of model=tiny with every aggregator, and
exact resumption. Several runs share one launch (train/sweep.py) to pay process start-up once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STEP_KEYS = {"step", "train_loss", "time/data", "time/forward", "time/backward", "time/aggregate", "time/optimizer"}
STEP_KEYS |= {"bytes_sent"}
SUMMARY_KEYS = {"final_step", "final_val_loss", "wall_seconds", "tokens", "param_sha256"}
SMALL = [
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "trainer.micro_batch_size=4",
    "trainer.eval_batches=2",
    "data.seq_len=32",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
]


def torchrun(
    nproc: int, script: str, args: list[str], cache: Path, timeout: int, expect_ok: bool = True
) -> subprocess.CompletedProcess:
    """Launch `script` under torchrun on a free rendezvous port (--standalone picks one)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(CERAR_PYTHIA_CACHE=str(cache), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run(
        [*cmd, str(ROOT / "train" / script), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def wandb_records(path: Path):
    """The protobuf records of a W&B .wandb file (a LevelDB-style log: 32 KiB blocks of chunks, each with a
    7-byte header: checksum, length, type 1 full / 2 first / 3 middle / 4 last), read without W&B's servers."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def check_wandb_offline_runs(run_dir: Path, summary: dict, launches: int) -> None:
    """The offline W&B run holds the run's name, group, config (N and the batch too), step-indexed metrics with
    val_loss summarised by its minimum, and the summary; every launch of a resumed run logs to one run id."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == launches, files
    run_ids = set()
    for path in files:
        records = list(wandb_records(path))
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        run_ids.add(run.run_id)
        config = {u.key: json.loads(u.value_json) for u in run.config.update}
        aggregator = config["aggregator"]["name"]
        assert run.display_name == f"tiny_embedded_{aggregator}_n2_s1234" and run.run_group == "tiny_embedded_n2"
        assert (config["world_size"], config["global_batch_size"], config["grad_accum"]) == (2, 8, 1)
        assert config["model"]["name"] == "tiny" and config["trainer"]["max_steps"] == 6
        kinds = [(r.WhichOneof("record_type"), r) for r in records]
        metrics = {r.metric.name or r.metric.glob_name: r.metric for kind, r in kinds if kind == "metric"}
        assert metrics["*"].step_metric == "step" and metrics["val_loss"].summary.min
        steps = [
            json.loads(item.value_json)
            for r in records
            if r.WhichOneof("record_type") == "history"
            for item in r.history.item
            if (item.key or "/".join(item.nested_key)) == "step"
        ]
        assert steps and steps == sorted(steps)
    assert run_ids == {(run_dir / "wandb_id.txt").read_text().strip()}
    final = {}
    for r in wandb_records(files[-1]):
        if r.WhichOneof("record_type") == "summary":
            final.update({(u.key or "/".join(u.nested_key)): json.loads(u.value_json) for u in r.summary.update})
    assert final["final_val_loss"] == summary["final_val_loss"] and final["param_sha256"] == summary["param_sha256"]


def resumed_val_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["final_val_loss"]


def read_run(run_dir: Path) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "summary.json").read_text())


def check_run(run_dir: Path, exact: bool, replicas_agree: bool, flat: bool) -> dict:
    records, summary = read_run(run_dir)
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert set(r) >= STEP_KEYS, set(r)
        assert r["bytes_sent"] > 0
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.1, [r["train_loss"] for r in records]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert set(val) == {3, 6} and val[6] < val[3]
    assert set(summary) >= SUMMARY_KEYS and summary["final_step"] == 6
    assert summary["final_val_loss"] == pytest.approx(val[6])
    assert len(summary["param_sha256"]) == 64
    drift = [r["drift/max_abs"] for r in records if "drift/max_abs" in r]
    assert drift and (max(drift) == 0.0 if replicas_agree else max(drift) > 0.0)
    if flat:
        assert records[-1]["time/aggregate"] > 0
        errors = [r["agg/rel_error_max"] for r in records if "agg/rel_error_max" in r]
        assert errors and (max(errors) < 1e-6 if exact else 0 < max(errors) < 0.5)
    return summary


def aggregator_runs(c: int, c_vandermonde: int) -> list[tuple[str, str, bool, bool, bool]]:
    """(label, overrides, exact, replicas_agree, flat) for every aggregator; three run as DDP hooks.

    exact: equals the exact average; replicas_agree: every rank gets the same aggregate (no drift);
    CERAR is neither: each rank but N-1 receives a slightly different approximation."""
    return [
        ("nccl", "aggregator=nccl", True, True, True),
        ("ring", "aggregator=ring", True, True, True),
        ("cerar", f"aggregator=cerar c={c}", False, False, True),
        ("cerar_vandermonde", f"aggregator=cerar_vandermonde c={c_vandermonde}", False, False, True),
        ("cerar_perturbation", f"aggregator=cerar_perturbation c={c}", False, False, True),
        ("cerar_optimized", f"aggregator=cerar_optimized c={c}", False, False, True),
        ("fp16", "aggregator=fp16", False, True, True),
        ("bf16", "aggregator=bf16", False, True, True),
        ("powersgd", "aggregator=powersgd", False, True, False),
        ("nccl_overlap", "aggregator=nccl trainer.overlap=true", True, True, False),
        ("cerar_overlap", f"aggregator=cerar c={c} trainer.overlap=true", False, False, False),
    ]


@pytest.mark.parametrize(("nproc", "c", "c_vandermonde"), [(2, 4, 4), (4, 8, 3)])
@pytest.mark.timeout(900)
def test_every_aggregator_trains(tmp_path, cache_dir, nproc, c, c_vandermonde):
    runs = aggregator_runs(c, c_vandermonde)
    resync = ("cerar_resync", f"aggregator=cerar c={c} trainer.resync_every=3")
    common = [*SMALL, "trainer.drift_every=3", "trainer.measure_error_every=3", "checkpoint.every=0"]
    torchrun(
        nproc,
        "sweep.py",
        [str(tmp_path), *(f"{label}: {o}" for label, o, *_ in [*runs, resync]), "--", *common],
        cache_dir,
        timeout=850,
    )
    summaries = {}
    for label, _, exact, replicas_agree, flat in runs:
        summaries[label] = check_run(tmp_path / label, exact=exact, replicas_agree=replicas_agree, flat=flat)
        assert summaries[label]["world_size"] == nproc
    # Drift is measured before each resync from rank N-1 (what 3 steps built up); the last resync, at the last
    # step, leaves every rank with rank N-1's parameters.
    resynced, resync_summary = read_run(tmp_path / "cerar_resync")
    resynced = [r for r in resynced if "drift/max_abs" in r]
    assert [r["step"] for r in resynced] == [3, 6] and all(r["drift/max_abs"] > 0 for r in resynced)
    assert len(set(resync_summary["param_sha256_per_rank"])) == 1
    # overlap=true (the aggregator as DDP's hook, inside backward) trains the same model as the separate phase
    assert summaries["nccl_overlap"]["final_val_loss"] == pytest.approx(summaries["nccl"]["final_val_loss"], abs=1e-5)
    nccl_loss = [r["train_loss"] for r in read_run(tmp_path / "nccl")[0]]
    overlap_loss = [r["train_loss"] for r in read_run(tmp_path / "nccl_overlap")[0]]
    assert overlap_loss == pytest.approx(nccl_loss, abs=1e-5)
    # The exact aggregators agree up to float summation order: same loss trajectory to a few digits.
    assert summaries["ring"]["final_val_loss"] == pytest.approx(summaries["nccl"]["final_val_loss"], abs=1e-3)
    cerar_bytes = read_run(tmp_path / "cerar")[0][0]["bytes_sent"]
    ring_bytes = read_run(tmp_path / "ring")[0][0]["bytes_sent"]
    assert cerar_bytes <= ring_bytes if c > nproc else cerar_bytes > 0


@pytest.mark.timeout(600)
def test_resume_matches_uninterrupted_run(tmp_path, cache_dir):
    common = [*SMALL, "checkpoint.every=3", "checkpoint.keep=2"]
    # One launch: the full runs and an interrupted ring run resumed in the same folder.
    torchrun(
        2,
        "sweep.py",
        [
            str(tmp_path),
            "full_nccl: aggregator=nccl wandb.mode=offline",
            "full_ring: aggregator=ring",
            "part_ring: aggregator=ring trainer.stop_after_step=3 wandb.mode=offline",
            "part_ring: aggregator=ring resume=true wandb.mode=offline",
            "--",
            *common,
        ],
        cache_dir,
        timeout=500,
    )
    _, full_ring = read_run(tmp_path / "full_ring")
    records, part_ring = read_run(tmp_path / "part_ring")
    assert part_ring["resumed_from_step"] == 3
    assert part_ring["param_sha256"] == full_ring["param_sha256"]
    assert [r["step"] for r in records] == list(range(1, 7))
    _, full_nccl = read_run(tmp_path / "full_nccl")
    check_wandb_offline_runs(tmp_path / "full_nccl", full_nccl, launches=1)
    check_wandb_offline_runs(tmp_path / "part_ring", part_ring, launches=2)  # the resumed launch: same W&B run

    # The Hydra entry point: hydra.run.dir places everything; a stopped run resumes (resume=auto).
    run_dir = tmp_path / "hydra_nccl"
    for extra in (["trainer.stop_after_step=3"], []):
        # trainer.peak_tflops: a peak for MFU on CPU (it observes; changing it is no reason to refuse a resume)
        args = [*common, f"hydra.run.dir={run_dir}", f"trainer.peak_tflops={0.5 if extra else 0.25}", *extra]
        proc = torchrun(2, "main.py", args, cache_dir, timeout=300)
        assert not (run_dir / "summary.json").exists() or not extra
    assert f"done: 6 steps, val_loss {resumed_val_loss(run_dir):.4f}" in proc.stdout  # the final console line
    assert proc.stdout.strip().endswith(f"run dir {run_dir}")
    records = read_run(run_dir)[0]
    assert all(0 < r["mfu"] < 1 and r["time/data"] >= 0 for r in records)
    _, resumed = read_run(run_dir)
    assert resumed["resumed_from_step"] == 3
    assert resumed["param_sha256"] == full_nccl["param_sha256"]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt")) == ["step-00000003.pt", "step-00000006.pt"]


@pytest.mark.timeout(400)
def test_global_batch_size_trains_with_derived_gradient_accumulation(tmp_path, cache_dir):
    """8 sequences per step on 2 ranks: one micro-batch of 4 each, or (global_batch_size=8, micro-batch 2)
    two accumulated micro-batches of 2 each over the same windows: the same steps up to float rounding."""
    torchrun(
        2,
        "sweep.py",
        [
            str(tmp_path),
            "whole: trainer.micro_batch_size=4",
            # eval_batches=4: the same 8 validation windows per rank as 2 batches of 4
            "accumulated: trainer.micro_batch_size=2 trainer.global_batch_size=8 trainer.eval_batches=4",
            "--",
            *SMALL,
            "checkpoint.every=0",
        ],
        cache_dir,
        timeout=350,
    )
    whole_records, whole = read_run(tmp_path / "whole")
    accumulated_records, accumulated = read_run(tmp_path / "accumulated")
    assert (whole["grad_accum"], whole["global_batch_size"]) == (1, 8)
    assert (accumulated["grad_accum"], accumulated["global_batch_size"]) == (2, 8)
    assert accumulated["tokens"] == whole["tokens"] == 6 * 8 * 32
    for a, b in zip(accumulated_records, whole_records, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-4), (a["step"], a, b)
    assert accumulated["final_val_loss"] == pytest.approx(whole["final_val_loss"], abs=1e-4)
    assert accumulated_records[-1]["train_loss"] < accumulated_records[0]["train_loss"] - 0.1


@pytest.mark.timeout(400)
def test_resume_flags_as_the_readme_promises(tmp_path, cache_dir):
    """resume=true refuses a run directory without checkpoints (at start, one line); resume=false removes the
    old checkpoints and trains afresh, even where the old run's config differs."""
    run_dir = tmp_path / "run"
    base = [*SMALL, "trainer.eval_every=0", f"hydra.run.dir={run_dir}"]
    refused = torchrun(1, "main.py", [*base, "resume=true"], cache_dir, timeout=200, expect_ok=False)
    assert refused.returncode != 0
    assert f"error: resume=true but {run_dir / 'checkpoints'} holds no checkpoint" in refused.stderr
    assert "Traceback" not in refused.stderr.split("error: resume=true")[0][-2000:]
    torchrun(1, "main.py", [*base, "trainer.max_steps=4", "checkpoint.every=1", "checkpoint.keep=9"], cache_dir, 300)
    assert [s for s, _ in ckpt_list(run_dir)] == [4, 3, 2, 1]
    torchrun(1, "main.py", [*base, "trainer.max_steps=2", "model.lr=1e-3", "resume=false"], cache_dir, 300)
    _, summary = read_run(run_dir)
    assert summary["resumed_from_step"] is None and summary["final_step"] == 2
    assert [s for s, _ in ckpt_list(run_dir)] == [2]  # the old run's four are gone; this run's end remains


def ckpt_list(run_dir: Path):
    from train.checkpoint import list_checkpoints

    return list_checkpoints(run_dir)


@pytest.mark.timeout(300)
def test_ranks_with_different_configs_stop_with_one_message(tmp_path, cache_dir):
    # The seed resolves to each rank's own RANK: the ranks' config hashes differ.
    proc = torchrun(
        2,
        "main.py",
        [*SMALL, "seed=${oc.env:RANK}", f"hydra.run.dir={tmp_path}"],
        cache_dir,
        timeout=250,
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert "error: ranks [1] were launched with a config different from rank 0's" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
