"""Real multi-process CPU training runs (torchrun + gloo) of model=tiny with every aggregator, and
exact resumption. Several runs share one launch (train/sweep.py) to pay process start-up once."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.runs import AGGREGATORS, SMALL, WORLDS, read_run, single_process, torchrun

pytestmark = pytest.mark.slow

STEP_KEYS = {"step", "train_loss", "time/data", "time/forward", "time/backward", "time/aggregate", "time/optimizer"}
STEP_KEYS |= {"bytes_sent"}
SUMMARY_KEYS = {"final_step", "final_val_loss", "wall_seconds", "tokens", "param_sha256"}


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


# ------------------------------------------------------------------------ what each aggregator may err by

FLOAT32_UNIT_ROUNDOFF = 2.0**-24
SIXTEEN_BIT = {  # unit roundoff, and half the spacing of the smallest subnormals (an absolute rounding)
    "fp16": (2.0**-11, 2.0**-25),
    "bf16": (2.0**-8, 2.0**-134),
}


def gradient_spread(record: dict, N: int) -> float:
    """sqrt(sum_r ||g_r||^2) / ||sum_r g_r||, from the step's logged noise nu (the relative standard deviation
    of the mean: sum_r ||g_r - g_bar||^2 = N (N-1) nu^2 ||g_bar||^2, so sum_r ||g_r||^2 = N (1 + (N-1) nu^2)
    ||g_bar||^2). Every error below is bounded in units of the ranks' gradients; this turns it into a
    fraction of the exact sum the error is logged against."""
    nu = record["noise/rel_std_mean"]
    return math.sqrt((1 + (N - 1) * nu**2) / N)


def cerar_error_bound(code, record: dict) -> float:
    """The worst rank's ||S_hat_i - S|| / ||S|| that the code allows. Rank i errs by sum_h R_ih G_{i-h}
    (``Code.residuals``: the spec's D_i E_h(A_{i-h}) - I), at most sqrt(sum_h ||R_ih||_2^2) times
    sqrt(sum_r ||G_r||^2) (Cauchy-Schwarz), plus float32 rounding amplified by kappa (the suite's
    kappa x 2^-24 x (sqrt(c + L) + N), tests/test_spec_reference.py), in the same unit."""
    R = code.residuals()
    truncation = max(math.sqrt(sum(np.linalg.norm(R[i, h], 2) ** 2 for h in range(code.N - 1))) for i in range(code.N))
    rounding = code.kappa * FLOAT32_UNIT_ROUNDOFF * (math.sqrt(code.c + code.L) + code.N)
    return (truncation + rounding) * gradient_spread(record, code.N)


def sixteen_bit_error_bound(kind: str, record: dict, N: int, d: int) -> float:
    """The worst rank's ||g_hat - g_bar|| / ||g_bar|| for the cast-to-16-bit all-reduce
    (train/aggregation/aggregators.py:
    g_r / N cast, summed in 16 bits, cast back): N roundings of each value (the cast and N-1 additions), each
    at most the unit roundoff u of a partial sum (|partial| <= sum_r |g_r| / N) or, below the normal range,
    half a subnormal spacing. So ||error|| <= u (1 + N u) sum_r ||g_r|| + N half_spacing sqrt(d), and
    sum_r ||g_r|| <= sqrt(N) sqrt(sum_r ||g_r||^2), with ||g_bar|| = ||sum_r g_r|| / N."""
    u, half_spacing = SIXTEEN_BIT[kind]
    relative = u * (1 + N * u) * N * math.sqrt(N) * gradient_spread(record, N)
    return relative + N * half_spacing * math.sqrt(d) / record["noise/grad_norm"]


def int8_error_bound(record: dict, N: int, block: int = 128) -> float:
    """The worst rank's ||g_hat - g_bar|| / ||g_bar|| for aggregator=int8 (cerar.int8.all_reduce,
    tests/test_quantized.py
    derives it value by value): per value of block b of shard j, at most sum_{i != j} a_b(g_i) / (254 N) +
    a_b(R_j) / 254 with a_b the block's absmax, a_b(R_j) <= a_b(g_bar) + sum_i a_b(g_i) / (254 N), and a_b(x) <=
    ||x_b||_2. By Minkowski, ||error|| <= sqrt(B)/254 ((1 + sqrt(B)/254) sum_r ||g_r|| / N + ||g_bar||), with
    sum_r ||g_r|| <= sqrt(N) N ||g_bar|| gradient_spread; plus the exact sum's own rounding."""
    r = math.sqrt(block) / 254
    return r * ((1 + r) * math.sqrt(N) * gradient_spread(record, N) + 1) * (1 + 1e-3) + exact_sum_order_bound(record, N)


def exact_sum_order_bound(record: dict, N: int) -> float:
    """||g_hat - g_bar|| / ||g_bar|| between two exact all-reduces (cerar's ring, torch's) that add the same
    N values in different orders: each average errs by at most (N-1) u sum_r |g_r| / N per value in the sum
    and u |g_bar| in the division, so the two differ by at most 2 u sum_r |g_r| (first order), in norm
    2 u sqrt(N) sqrt(sum_r ||g_r||^2) = 2 u sqrt(N) N ||g_bar|| gradient_spread."""
    u = FLOAT32_UNIT_ROUNDOFF
    return 2 * u * (1 + N * u) * N * math.sqrt(N) * gradient_spread(record, N)


# ------------------------------------------------------------------------ one launch per world size


def tiny_parameter_names() -> set[str]:
    """The parameter tensors of the runs' model (model=tiny), by their names in the module."""
    from tests.runs import composed
    from train.model import build_model

    return {name for name, p in build_model(composed("model=tiny").model).named_parameters() if p.requires_grad}


def code_for(N: int, label: str):
    """The code the run used, built as train/ builds it (the aggregator's yaml: eps and kappa_max unset)."""
    import cerar

    construction, which_c = AGGREGATORS[label][1]
    return cerar.make_code(N, WORLDS[N][which_c], construction)


CASES = [(N, label) for N in WORLDS for label in AGGREGATORS]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("N", "label"), CASES, ids=[f"n{N}-{label}" for N, label in CASES])
def test_every_aggregator_trains(sweep, N, label):
    """Steps, metrics and the summary are there; the loss falls; drift appears exactly where ranks receive
    different aggregates; each step's aggregate (flat mode: measured against an exact all-reduce of the
    same gradients every step) is exact, or errs within the aggregator's own bound, never more."""
    _, _, exact, replicas_agree, flat = AGGREGATORS[label]
    records, summary = read_run(sweep(N) / label)
    assert summary["world_size"] == N
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert set(r) >= STEP_KEYS, set(r)
        assert r["bytes_sent"] > 0
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.1, [r["train_loss"] for r in records]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert set(val) == {3, 6} and val[6] < val[3]
    # ranks whose aggregates may differ each evaluate the whole set; ranks given the same bits split it
    assert {r["eval/each_replica"] for r in records if "val_loss" in r} == {0 if replicas_agree else 1}
    assert set(summary) >= SUMMARY_KEYS and summary["final_step"] == 6
    assert summary["final_val_loss"] == pytest.approx(val[6])
    assert len(summary["param_sha256"]) == 64
    drift = [r["drift/max_abs"] for r in records if "drift/max_abs" in r]
    assert drift and (max(drift) == 0.0 if replicas_agree else max(drift) > 0.0)
    if not flat:
        return
    assert records[-1]["time/aggregate"] > 0
    errors = [r["agg/rel_error_max"] for r in records]
    names = tiny_parameter_names()
    for r in (
        records
    ):  # per tensor (train/aggregation/tensor_errors.py): every tensor has its figure, and the worst tensor's
        # error/noise is never below the whole gradient's (a sum of ratios' numerators over denominators)
        tensors = {k.removeprefix("tensor/"): v for k, v in r.items() if k.startswith("tensor/")}
        assert set(tensors) == names and r["agg/worst_tensor"] in names
        assert r["agg/tensor_error_to_noise_max"] == max(tensors.values())
        whole = r["agg/rel_error_max"] / r["noise/rel_std_mean"]
        assert r["agg/tensor_error_to_noise_max"] >= whole * (1 - 1e-6), (r, whole)
    if label == "nccl" or (exact and N == 2):  # the same sum (two values add the same either way) as the reference
        assert max(errors) == 0.0, errors
    elif exact:
        bounds = [exact_sum_order_bound(r, N) for r in records]
        assert all(e <= b for e, b in zip(errors, bounds, strict=True)), (errors, bounds)
    else:
        if label in SIXTEEN_BIT:
            bounds = [sixteen_bit_error_bound(label, r, N, summary["parameters"]) for r in records]
        elif label == "int8":
            bounds = [int8_error_bound(r, N) for r in records]
        else:
            bounds = [cerar_error_bound(code_for(N, label), r) for r in records]
        assert all(0 < e <= b for e, b in zip(errors, bounds, strict=True)), (errors, bounds)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("N", list(WORLDS))
def test_resync_leaves_every_rank_with_the_last_ranks_parameters(sweep, N):
    """Drift is measured before each resync from rank N-1 (what 3 steps built up); the last resync, at the last
    step, leaves every rank with rank N-1's parameters."""
    records, summary = read_run(sweep(N) / "cerar_resync")
    measured = [r for r in records if "drift/max_abs" in r]
    assert [r["step"] for r in measured] == [3, 6] and all(r["drift/max_abs"] > 0 for r in measured)
    assert len(set(summary["param_sha256_per_rank"])) == 1


@pytest.mark.timeout(900)
@pytest.mark.parametrize("N", list(WORLDS))
def test_exact_aggregators_train_the_same_model_step_by_step(sweep, N):
    """torch's all-reduce, cerar's exact ring, and torch's all-reduce as DDP's hook inside backward (overlap):
    every step's loss. At N=2 a sum of two values is the same whichever adds it and dividing by 2 is exact,
    so the three are bit-identical; at N=4 they add in different orders (every step's aggregate is held to
    that rounding by test_every_aggregator_trains), and the trajectories agree to a few digits."""
    runs = {label: read_run(sweep(N) / label) for label in ("nccl", "ring", "nccl_overlap")}
    losses = {label: [r["train_loss"] for r in records] for label, (records, _) in runs.items()}
    final = {label: summary["final_val_loss"] for label, (_, summary) in runs.items()}
    if N == 2:
        assert losses["ring"] == losses["nccl"] == losses["nccl_overlap"], losses
        assert len({summary["param_sha256"] for _, summary in runs.values()}) == 1
    else:
        assert losses["nccl_overlap"] == pytest.approx(losses["nccl"], abs=1e-5)
        assert losses["ring"] == pytest.approx(losses["nccl"], abs=1e-4)
        assert final["nccl_overlap"] == pytest.approx(final["nccl"], abs=1e-5)
        assert final["ring"] == pytest.approx(final["nccl"], abs=1e-3)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("N", list(WORLDS))
def test_cerar_sends_no_more_than_the_ring_once_c_exceeds_N(sweep, N):
    """Up to the agreement on the per-tensor scales (aggregator.equilibrate): an all-reduce of one float64 per
    parameter tensor, 2 (N-1)/N x T x 8 bytes (224 for model=tiny's 28 tensors at N=2, where CERAR's rate is the
    ring's, L/c = 1), under 1e-4 of the gradient's bytes."""
    cerar_bytes = read_run(sweep(N) / "cerar")[0][0]["bytes_sent"]
    ring_bytes = read_run(sweep(N) / "ring")[0][0]["bytes_sent"]
    assert 0 < cerar_bytes <= ring_bytes * (1 + 1e-4)


@pytest.mark.timeout(900)
def test_global_batch_size_trains_with_derived_gradient_accumulation(sweep):
    """8 sequences per step on 2 ranks: one micro-batch of 4 each (the nccl run), or (global_batch_size=8,
    micro-batch 2) two accumulated micro-batches of 2 each over the same windows: the same steps up to float
    rounding."""
    accumulated_records, accumulated = read_run(sweep(2) / "accumulated")
    whole_records, whole = read_run(sweep(2) / "nccl")
    assert (whole["grad_accum"], whole["global_batch_size"]) == (1, 8)
    assert (accumulated["grad_accum"], accumulated["global_batch_size"]) == (2, 8)
    assert accumulated["tokens"] == whole["tokens"] == 6 * 8 * 32
    for a, b in zip(accumulated_records, whole_records, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-4), (a["step"], a, b)
    assert accumulated["final_val_loss"] == pytest.approx(whole["final_val_loss"], abs=1e-4)
    assert accumulated_records[-1]["train_loss"] < accumulated_records[0]["train_loss"] - 0.1


@pytest.mark.timeout(900)
def test_resume_matches_uninterrupted_run(sweep, tmp_path, cache_dir):
    # In the N=2 launch: a ring run and an int8 run stopped after step 3 and resumed in their folders, and the full
    # runs.
    records, part_ring = read_run(sweep(2) / "part_ring")
    _, full_ring = read_run(sweep(2) / "ring")
    assert part_ring["resumed_from_step"] == 3
    assert part_ring["param_sha256"] == full_ring["param_sha256"]
    # int8's stochastic rounding continues from the checkpoint's count of 8-bit calls: the same bytes, the same model
    _, part_int8 = read_run(sweep(2) / "part_int8")
    _, full_int8 = read_run(sweep(2) / "int8")
    assert part_int8["resumed_from_step"] == 3 and part_int8["param_sha256"] == full_int8["param_sha256"]
    assert [r["step"] for r in records] == list(range(1, 7))
    _, full_nccl = read_run(sweep(2) / "nccl")
    check_wandb_offline_runs(sweep(2) / "nccl", full_nccl, launches=1)
    check_wandb_offline_runs(sweep(2) / "part_ring", part_ring, launches=2)  # the resumed launch: same W&B run

    # The Hydra entry point: hydra.run.dir places everything; a stopped run resumes (resume=auto).
    common = [*SMALL, "checkpoint.every=3", "checkpoint.keep=2"]
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


@pytest.mark.timeout(900)
def test_an_overlapped_run_resumes_to_the_uninterrupted_runs_bits(sweep):
    """trainer.overlap=true at N=4: every launch settles DDP's buckets before its first step
    (`Trainer.settle_ddp_buckets`), so the launch resumed after step 3 reduces step 4 in the buckets the
    uninterrupted run used from its step 2 on, and ends with its parameters, bit for bit. Left to DDP, a launch
    reduces its first step in one bucket of every parameter: other sums of four (tried: another param_sha256)."""
    records, part = read_run(sweep(4) / "part_nccl_overlap")
    _, full = read_run(sweep(4) / "nccl_overlap")
    assert part["resumed_from_step"] == 3 and [r["step"] for r in records] == list(range(1, 7))
    assert part["param_sha256"] == full["param_sha256"]


def resumed_val_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["final_val_loss"]


@pytest.mark.timeout(400)
def test_resume_flags_as_the_readme_promises(tmp_path, cache_dir):
    """resume=true refuses a run directory without checkpoints (at start, one line); resume=false removes the
    old checkpoints and trains afresh, even where the old run's config differs."""
    run_dir = tmp_path / "run"
    base = [*SMALL, "trainer.eval_every=0", f"hydra.run.dir={run_dir}"]
    refused = single_process([*base, "resume=true"], cache_dir, timeout=200, expect_ok=False)
    assert refused.returncode != 0
    assert f"error: resume=true but {run_dir / 'checkpoints'} holds no checkpoint" in refused.stderr
    assert "Traceback" not in refused.stderr.split("error: resume=true")[0][-2000:]
    single_process([*base, "trainer.max_steps=4", "checkpoint.every=1", "checkpoint.keep=9"], cache_dir, 300)
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
