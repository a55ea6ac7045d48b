"""Build a GPTNeoX causal LM (the Pythia architecture) from a ModelConfig, randomly initialised as Pythia was.

Nothing is downloaded: the Hugging Face config is written out field by field from our YAML, so
`model=pythia-70m` is the architecture of EleutherAI/pythia-70m with fresh weights. The weights are then
initialised with GPT-NeoX's methods named in the config (Pythia: `small_init` for every weight matrix and
embedding, `wang_init` for the two projections that write into the residual stream), not with HF's
normal(0.02), which for pythia-1.4b's output projections is ten times too large.
"""

from __future__ import annotations

import math

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from train.config import INIT_METHODS


def gpt_neox_config(m) -> GPTNeoXConfig:
    """The transformers config of a Pythia-family model (dropout off, as in Pythia)."""
    return GPTNeoXConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        intermediate_size=m.intermediate_size or 4 * m.hidden_size,
        hidden_act="gelu",
        rotary_pct=m.rotary_pct,
        rotary_emb_base=m.rotary_emb_base,
        max_position_embeddings=m.max_position_embeddings,
        layer_norm_eps=m.layer_norm_eps,
        use_parallel_residual=m.use_parallel_residual,
        tie_word_embeddings=m.tie_word_embeddings,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )


OUTPUT_LAYER_SUFFIXES = ("attention.dense", "mlp.dense_4h_to_h")
"""The projections that add into the residual stream: GPT-NeoX gives them `output_layer_init_method`."""


def init_std(method: str, num_layers: int, hidden_size: int) -> float:
    """The standard deviation of GPT-NeoX's init `method` for a model of this depth and width."""
    if method == "small_init":  # Nguyen & Salazar, "Transformers without Tears": sqrt(2 / (5 d))
        return math.sqrt(2 / (5 * hidden_size))
    if method == "wang_init":  # Wang (Mesh-Transformer-JAX): 2 / (L sqrt(d))
        return 2 / num_layers / math.sqrt(hidden_size)
    if method == "normal":
        return 0.02
    raise ValueError(f"unknown init method {method!r}; expected one of {', '.join(INIT_METHODS)}")


@torch.no_grad()
def initialise_weights(model: GPTNeoXForCausalLM, m) -> None:
    """Pythia's initialisation: normal(0, std(init_method)) for embeddings and weight matrices,
    normal(0, std(output_layer_init_method)) for attention.dense and mlp.dense_4h_to_h, zero biases,
    LayerNorm weight 1 and bias 0. Draws from torch's global generator (seeded by the caller)."""
    std = init_std(m.init_method, m.num_layers, m.hidden_size)
    output_std = init_std(m.output_layer_init_method, m.num_layers, m.hidden_size)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.normal_(0.0, output_std if name.endswith(OUTPUT_LAYER_SUFFIXES) else std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, torch.nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, torch.nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()


def build_model(m, device: torch.device | str = "cpu") -> GPTNeoXForCausalLM:
    """A GPTNeoXForCausalLM initialised with the config's init methods; on device 'meta' it allocates
    nothing (for counting)."""
    config = gpt_neox_config(m)
    with torch.device(device):
        model = GPTNeoXForCausalLM(config)
    if torch.device(device).type != "meta":
        initialise_weights(model, m)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; biases and LayerNorm weights are not decayed (as GPT-NeoX does)."""
    decay, no_decay = [], []
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
