"""`python -m train.export RUN_DIR OUT_DIR`: a trained run becomes a Hugging Face model directory that
transformers loads offline, with the run's tokenizer, and computes the same logits as the trained model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog. Wikipedia is a free online encyclopedia."


def _run(args: list[str], cache_dir: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
        "CERAR_PYTHIA_CACHE": str(cache_dir),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.timeout(900)
def test_export_round_trips_through_from_pretrained(sweep, tmp_path, cache_dir, monkeypatch):
    """The suite's two-rank ring run that stopped after step 3 and resumed (tests/runs.py): checkpoints at
    steps 3 and 6; the export takes the newest."""
    run_dir, out_dir = sweep(2) / "part_ring", tmp_path / "hf"
    done = _run(["-m", "train.export", str(run_dir), str(out_dir)], cache_dir, timeout=200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "step 6" in done.stdout
    assert (out_dir / "model.safetensors").exists() and (out_dir / "config.json").exists()

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, GPTNeoXForCausalLM

    from train import checkpoint as ckpt
    from train.model import build_model

    exported = GPTNeoXForCausalLM.from_pretrained(out_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    # The tokenizer is the run's: the same ids as the BPE the run trained and cached.
    cached = next(p for p in cache_dir.glob("embedded-*bpe8192-*") if p.is_dir()) / "tokenizer.json"
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == Tokenizer.from_file(str(cached)).encode(TEXT).ids and len(ids) > 10
    assert tokenizer.decode(ids) == TEXT

    # The weights are the newest checkpoint's, rebuilt here through the harness's own model builder.
    state, path = ckpt.load_latest_checkpoint(run_dir)
    assert path.name == "step-00000006.pt" and ckpt.list_checkpoints(run_dir)[-1][0] == 3
    trained = build_model(OmegaConf.create(state["config"]).model)
    trained.load_state_dict(state["model"])
    trained.eval()
    batch = torch.tensor([ids])
    with torch.no_grad():
        expected = trained(input_ids=batch).logits
        actual = exported(input_ids=batch).logits
    assert torch.equal(actual, expected)
    exported_state = exported.state_dict()
    assert all(torch.equal(exported_state[name], tensor) for name, tensor in state["model"].items())


def test_export_of_a_run_without_checkpoints_is_refused(tmp_path, cache_dir):
    (tmp_path / "run").mkdir()
    done = _run(["-m", "train.export", str(tmp_path / "run"), str(tmp_path / "hf")], cache_dir, timeout=100)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {tmp_path / 'run' / 'checkpoints'} holds no valid checkpoint to export"
    assert not (tmp_path / "hf").exists()
