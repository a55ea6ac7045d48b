"""Pythia as EleutherAI trained it: every `model=pythia-*` composes to the values of the released
GPT-NeoX config of that size, transcribed below from EleutherAI/pythia `models/<size>/pythia-<size>.yml`
(read at the commits named in each row), not from our YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
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


@pytest.mark.quick
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


# Released init: "init_method": "small_init", "output_layer_init_method": "wang_init". GPT-NeoX's
# megatron/model/init_functions.py: small_init std = sqrt(2 / (5 d)), wang_init std = 2 / L / sqrt(d).
# (L, d) -> (small_init std, wang_init std), the numbers worked out by hand.
EXPECTED_INIT_STD = {
    "pythia-14m": (6, 128, 0.0559017, 0.0294628),  # sqrt(2/640), 2/6/11.3137
    "tiny": (2, 64, 0.0790569, 0.125),  # sqrt(2/320), 2/2/8
}


def _pooled_std(tensors) -> float:
    flat = torch.cat([t.detach().double().flatten() for t in tensors])
    return flat.std().item()


@pytest.mark.parametrize("name", sorted(EXPECTED_INIT_STD))
def test_built_model_has_pythia_init(name):
    from train.model import build_model  # transformers' GPTNeoX: seconds, not at collection

    layers, hidden, small_std, wang_std = EXPECTED_INIT_STD[name]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        m = compose(config_name="config", overrides=[f"model={name}"]).model
    assert (m.num_layers, m.hidden_size, m.init_method, m.output_layer_init_method) == (
        layers,
        hidden,
        "small_init",
        "wang_init",
    )
    torch.manual_seed(0)
    model = build_model(m)
    params = dict(model.named_parameters())
    unembedding = model.get_output_embeddings().weight  # embed_out (transformers 4) / lm_head (5)
    output = [p for n, p in params.items() if n.endswith(("attention.dense.weight", "mlp.dense_4h_to_h.weight"))]
    inner = [p for n, p in params.items() if n.endswith(("query_key_value.weight", "mlp.dense_h_to_4h.weight"))]
    assert len(output) == len(inner) == 2 * layers
    assert _pooled_std(output) == pytest.approx(wang_std, rel=0.03)
    assert _pooled_std(inner) == pytest.approx(small_std, rel=0.03)
    assert _pooled_std([params["gpt_neox.embed_in.weight"]]) == pytest.approx(small_std, rel=0.03)
    assert _pooled_std([unembedding]) == pytest.approx(small_std, rel=0.03)
    for n, p in params.items():
        if n.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, n
        if "layernorm" in n or "layer_norm" in n:
            assert torch.all(p == (1.0 if n.endswith(".weight") else 0.0)), n


@pytest.mark.quick
def test_init_method_normal_restores_hf_default():
    from train.model import build_model  # transformers' GPTNeoX: seconds, not at collection

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        m = compose(
            config_name="config",
            overrides=["model=pythia-14m", "model.init_method=normal", "model.output_layer_init_method=normal"],
        ).model
    torch.manual_seed(0)
    params = dict(build_model(m).named_parameters())
    output = [p for n, p in params.items() if n.endswith("attention.dense.weight")]
    assert _pooled_std(output) == pytest.approx(0.02, rel=0.03)


# ----------------------------------------------------------------------------- experiment= presets


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_pythia_preset_is_the_released_training_setup():
    from train.config import derived_grad_accum, validate

    for size in RELEASED:
        cfg = composed("experiment=pythia", f"model=pythia-{size}")
        assert cfg.model.name == f"pythia-{size}" and cfg.data.name == "pile"
        assert (cfg.data.seq_len, cfg.trainer.global_batch_size, cfg.trainer.max_steps) == (2048, 1024, 143000)
        assert cfg.trainer.precision == "fp16" and cfg.trainer.fp16_hysteresis == 2
        assert cfg.trainer.fp16_initial_scale_power == 12 and cfg.trainer.fp16_loss_scale_window == 1000
        validate(cfg, world_size=8)
        assert derived_grad_accum(cfg, 8) * cfg.trainer.micro_batch_size * 8 == RELEASED_GLOBAL_BATCH


def test_presets_compose_with_every_other_override():
    from train.config import validate

    cfg = composed("experiment=pythia", "model=pythia-410m", "trainer.max_steps=50", "data=embedded")
    assert (cfg.model.name, cfg.trainer.max_steps, cfg.data.name, cfg.trainer.global_batch_size) == (
        "pythia-410m",
        50,
        "embedded",
        1024,
    )
    paper = composed("experiment=cerar-paper")
    assert (paper.model.name, paper.aggregator.name, paper.c, paper.data.name) == ("pythia-1.4b", "nccl", 16, "pile")
    cerar = composed("experiment=cerar-paper", "aggregator=cerar_optimized")
    assert (cerar.aggregator.kind, cerar.aggregator.construction, cerar.c) == ("cerar", "optimized", 16)
    assert cerar.trainer.max_steps == paper.trainer.max_steps  # the same iterations for both
    validate(cerar, world_size=8)
    assert composed("experiment=cerar-paper", "aggregator=cerar_perturbation", "c=8").aggregator.construction == (
        "perturbation"
    )
    # cpu-smoke spells out the root defaults
    assert composed("experiment=cpu-smoke") == composed()
    assert composed("experiment=cpu-smoke", "aggregator=cerar", "c=4").aggregator.kind == "cerar"
