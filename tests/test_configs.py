"""The Hydra configs: Pythia parameter counts, every group option composes and validates, and each
invalid override stops the run at start with one clear message (no traceback, no process group)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.distributed import run_script
from tests.runs import composed
from train.config import ConfigError, config_fingerprint, validate

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


PYTHIA_PARAMETERS = {
    "pythia-70m": 70_426_624,
    "pythia-160m": 162_322_944,
    "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632,
    "pythia-1.4b": 1_414_647_808,
}


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(PYTHIA_PARAMETERS))
def test_pythia_parameter_counts_on_meta_device(name):
    from train.model import build_model, count_parameters  # transformers' GPTNeoX: seconds, not at collection

    cfg = composed(f"model={name}")
    model = build_model(cfg.model, device="meta")
    assert count_parameters(model) == PYTHIA_PARAMETERS[name]
    hf = model.config
    assert hf.num_hidden_layers == cfg.model.num_layers and hf.vocab_size == 50304
    assert hf.use_parallel_residual and not hf.tie_word_embeddings
    assert hf.max_position_embeddings == 2048


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_every_group_option_composes_and_validates(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("some text")
    assert {
        "nccl",
        "ring",
        "cerar",
        "cerar_vandermonde",
        "cerar_perturbation",
        "cerar_optimized",
        "powersgd",
        "fp16",
        "bf16",
    } <= set(_options("aggregator"))
    assert {
        "embedded",
        "pile",
        "local",
    } == set(_options("data"))
    for model in _options("model"):
        validate(composed(f"model={model}"))
    for data in _options("data"):
        validate(composed(f"data={data}", f"data.path={tmp_path}", "model=pythia-70m"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as torchrun sets it: the hierarchical options need the layout
    for aggregator in _options("aggregator"):
        cfg = composed(f"aggregator={aggregator}", "c=4")
        validate(cfg, world_size=4 if aggregator != "cerar_vandermonde" else 2)


@pytest.mark.quick
def test_root_defaults_are_the_cpu_quick_start():
    cfg = composed()
    assert (cfg.model.name, cfg.data.name, cfg.aggregator.name) == ("tiny", "embedded", "nccl")
    assert cfg.c == 16 and cfg.wandb.mode == "offline" and cfg.resume == "auto"
    assert composed("c=16", "aggregator=cerar").aggregator.construction == "optimized"  # reports/fidelity.md


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["c=0"], "c=0 must be >= 1"),
        (["aggregator=cerar", "aggregator.kappa_max=0.5"], "aggregator.kappa_max=0.5"),
        (["aggregator=cerar", "aggregator.construction=magic"], "aggregator.construction='magic'"),
        (["data=local"], "data.path is required"),
        (["trainer.max_steps=0"], "trainer.max_steps=0"),
        (["resume=maybe"], "resume='maybe'"),
        (["wandb.mode=sometimes"], "wandb.mode='sometimes'"),
        (["wandb.close_timeout_s=0"], "wandb.close_timeout_s=0.0 must be > 0"),
        (["wandb.start_timeout_s=-1"], "wandb.start_timeout_s=-1.0 must be > 0"),
        (["data.cache_lock_timeout_s=0"], "data.cache_lock_timeout_s=0.0 must be > 0"),
        (["aggregator=powersgd", "trainer.overlap=false"], "needs trainer.overlap=true"),
        (["data.seq_len=4096"], "data.seq_len=4096"),
        (["model.num_heads=5"], "divisible by model.num_heads=5"),
        (["trainer.compile_backend=tvm"], "trainer.compile_backend='tvm' is not one of inductor, aot_eager, eager"),
        (["trainer.compile_timeout_s=0"], "trainer.compile_timeout_s=0.0 must be > 0"),
    ],
)
@pytest.mark.quick
def test_validate_names_the_bad_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate(composed(*overrides))


@pytest.mark.quick
def test_cerar_code_is_judged_by_cerar_before_start():
    # kappa_max=1.5 at c=4 > N=2: cerar's optimized search finds no code at once (c=16 at N=2 is unreachable
    # too, but the search takes tens of seconds to say so)
    with pytest.raises(ConfigError, match=r"aggregator=cerar with N=2, c=4: kappa_max=1.5 is unreachable"):
        validate(composed("aggregator=cerar", "c=4", "aggregator.kappa_max=1.5"), world_size=2)
    validate(composed("aggregator=cerar", "c=4"), world_size=2)
    validate(composed("aggregator=cerar", "c=16"), world_size=4)


@pytest.mark.quick
def test_global_batch_size_derives_grad_accum():
    from train.config import derived_grad_accum

    # Pythia's batch: 1024 sequences = 16 per GPU x 64 GPUs (1b, 1.4b) or 32 x 32 (the small sizes).
    pythia = composed("trainer.global_batch_size=1024", "trainer.micro_batch_size=16")
    assert derived_grad_accum(pythia, world_size=64) == 1
    assert derived_grad_accum(pythia, world_size=8) == 8
    assert derived_grad_accum(composed("trainer.grad_accum=3"), world_size=2) == 3  # no global batch: as given
    with pytest.raises(ConfigError, match=r"global_batch_size=1024 is not a multiple of .* x N=3 = 48"):
        validate(pythia, world_size=3)
    with pytest.raises(ConfigError, match="trainer.grad_accum=2 contradicts trainer.global_batch_size=1024"):
        validate(composed("trainer.global_batch_size=1024", "trainer.micro_batch_size=16", "trainer.grad_accum=2"), 8)
    validate(composed("trainer.global_batch_size=1024", "trainer.micro_batch_size=16", "trainer.grad_accum=8"), 8)


@pytest.mark.quick
def test_resume_accepts_booleans():
    validate(composed("resume=true"))
    validate(composed("resume=false"))


@pytest.mark.quick
def test_fingerprint_changes_with_any_override():
    assert config_fingerprint(composed()) == config_fingerprint(composed())
    assert config_fingerprint(composed()) != config_fingerprint(composed("seed=1"))


def _run_main(overrides: list[str], tmp: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CERAR_PYTHIA_CACHE": str(tmp / "cache"), **(env_extra or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None) if not env_extra or key not in env_extra else None
    argv = [*overrides, f"hydra.run.dir={tmp / 'run'}", "wandb.mode=disabled"]
    return run_script(ROOT / "train" / "main.py", argv, env, ROOT, timeout_s=120)


# Invalid overrides as real processes of train/main.py (exit 2, one line, nothing created): test_reliability.py,
# test_bad_configurations_are_refused_at_start_with_one_line.


@pytest.mark.timeout(120)
def test_cerar_code_rejected_before_process_group(tmp_path):
    # WORLD_SIZE as torchrun sets it, but no rendezvous exists: reaching init_process_group would hang/fail.
    overrides = ["aggregator=cerar", "c=4", "aggregator.kappa_max=1.5"]  # unreachable: cerar says so at once
    proc = _run_main(overrides, tmp_path, {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert proc.returncode == 2
    assert "error: aggregator=cerar with N=2, c=4: kappa_max=1.5 is unreachable" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- resume safety


def _checkpointed_run_dir(tmp: Path, world_size: int, *overrides: str) -> Path:
    """A run dir holding one checkpoint of the run `overrides` describe, as the loop writes it."""
    from train import checkpoint as ckpt

    run_dir = tmp / "run"
    state = {"step": 3, "world_size": world_size, **ckpt.run_record(composed(*overrides), world_size)}
    ckpt.save_checkpoint(run_dir, 3, state, keep=1)
    return run_dir


def test_resuming_with_a_changed_training_value_is_refused_naming_the_fields(tmp_path):
    from train.checkpoint import CheckpointError, check_resume_matches

    run_dir = _checkpointed_run_dir(tmp_path, 2, "model.lr=3e-3", "trainer.micro_batch_size=8")
    with pytest.raises(CheckpointError) as refused:
        check_resume_matches(run_dir, composed("model.lr=1e-3", "trainer.max_steps=400", "c=8"), 2)
    message = str(refused.value)
    assert "model.lr 0.003 -> 0.001" in message and "trainer.max_steps 300 -> 400" in message
    assert "c 16 -> 8" in message and "model.weight_decay" not in message
    with pytest.raises(CheckpointError, match="aggregator.kind 'nccl' -> 'cerar'"):
        check_resume_matches(run_dir, composed("aggregator=cerar"), 2)
    with pytest.raises(CheckpointError, match="trainer.global_batch_size 16 -> 32"):
        check_resume_matches(run_dir, composed("trainer.global_batch_size=32"), 2)
    # What does not change training is free to change; so is another spelling of the same batch.
    check_resume_matches(run_dir, composed("trainer.global_batch_size=16", "trainer.eval_every=7"), 2)
    check_resume_matches(run_dir, composed("trainer.device=cpu", "wandb.mode=disabled", "trainer.log_every=5"), 2)
    check_resume_matches(run_dir, composed("model.lr=1e-3", "resume=false"), 2)  # starts afresh anyway


@pytest.mark.timeout(120)
def test_rerun_with_a_changed_lr_stops_at_start_with_one_line(tmp_path):
    run_dir = _checkpointed_run_dir(tmp_path, 1)
    env = {**os.environ, "CERAR_PYTHIA_CACHE": str(tmp_path / "cache")}
    proc = run_script(ROOT / "train" / "main.py", ["model.lr=1e-3", f"hydra.run.dir={run_dir}"], env, ROOT, 100)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "model.lr 0.003 -> 0.001" in lines[0] and "resume=false starts afresh" in lines[0]
    assert not (run_dir / "metrics.jsonl").exists() and not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------------- bad data, as a new user meets it


@pytest.mark.timeout(200)
def test_bad_local_data_stops_at_start_with_one_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text("A short document about rivers and stones. " * 5)
    (corpus / "extra.jsonl").write_text('{"text": "one"}\n{"text": "two"\n')
    small = tmp_path / "small"
    small.mkdir()
    for i in range(3):
        (small / f"doc{i}.txt").write_text("Too few words here. " * 3)
    cases = [
        ([f"data.path={corpus}"], f"error: {corpus / 'extra.jsonl'} line 2: not valid JSON"),
        ([f"data.path={small}", "data.seq_len=128"], "fewer than one window of data.seq_len + 1 = 129"),
    ]
    for extra, message in cases:
        proc = _run_main(["data=local", *extra], tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert lines[-1].startswith(message) or message in lines[-1], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "run" / "pids").exists()  # the run (and its process group) never started
