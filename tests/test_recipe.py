"""Pythia as EleutherAI trained it: every `model=pythia-*` composes to the values of the released
GPT-NeoX config of that size, transcribed below from EleutherAI/pythia `models/<size>/pythia-<size>.yml`
(read at the commits named in each row), not from our YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from train.config import register_configs

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
register_configs()

# size: (num-layers, hidden-size, num-attention-heads, lr, min_lr, train_micro_batch_size_per_gpu, GPUs)
# GPUs from each file's "# batch size (trained on K gpus)" comment; gas is 1 in every file.
RELEASED = {
    "14m": (6, 128, 4, 1e-3, 1e-4, 32, 32),  # models/14M/pythia-14m.yml @ 6baee23
    "31m": (6, 256, 8, 1e-3, 1e-4, 32, 32),  # models/31M/pythia-31m.yml @ b9426f2
    "70m": (6, 512, 8, 1e-3, 1e-4, 32, 32),  # models/70M/pythia-70m.yml @ ae1ce75
    "160m": (12, 768, 12, 6e-4, 6e-5, 32, 32),  # models/160M/pythia-160m.yml @ 0075322
    "410m": (24, 1024, 16, 3e-4, 3e-5, 32, 32),  # models/410M/pythia-410m.yml @ ddad623
    "1b": (16, 2048, 8, 2.5e-4, 2.5e-5, 16, 64),  # models/1B/pythia-1b.yml @ b14d5af
    "1.4b": (24, 2048, 16, 2e-4, 2e-5, 16, 64),  # models/1.4B/pythia-1.4b.yml @ 4d0c901
}
# Shared by all seven files: "betas": [0.9, 0.95], "eps": 1.0e-8, "gradient_clipping": 1.0,
# "weight-decay": 0.1 (the paper's 0.01 is a typo: EleutherAI/pythia issue 132), "warmup": 0.01,
# "lr-decay-style": "cosine", "rotary-pct": 0.25, "gpt-j-residual": true, "no-weight-tying": true,
# "seq-length" 2048, "train-iters" 143000, "init_method": "small_init", "output_layer_init_method": "wang_init",
# fp16 with "initial_scale_power": 12, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1.
RELEASED_GLOBAL_BATCH = 1024


def composed_model(size: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=[f"model=pythia-{size}"]).model


@pytest.mark.parametrize("size", sorted(RELEASED))
def test_model_config_is_the_released_recipe(size):
    layers, hidden, heads, lr, min_lr, micro_batch, gpus = RELEASED[size]
    m = composed_model(size)
    assert (m.name, m.num_layers, m.hidden_size, m.num_heads) == (f"pythia-{size}", layers, hidden, heads)
    assert m.intermediate_size == 4 * hidden and m.max_position_embeddings == 2048
    assert m.lr == pytest.approx(lr, rel=1e-12)
    assert m.lr * m.min_lr_ratio == pytest.approx(min_lr, rel=1e-12)
    assert (m.adam_beta1, m.adam_beta2, m.adam_eps) == (0.9, 0.95, 1e-8)
    assert (m.weight_decay, m.grad_clip, m.warmup_fraction) == (0.1, 1.0, 0.01)
    assert m.rotary_pct == 0.25 and m.use_parallel_residual and not m.tie_word_embeddings
    assert micro_batch * gpus == RELEASED_GLOBAL_BATCH  # the table itself is consistent with Pythia's batch
