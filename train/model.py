"""Build a GPTNeoX causal LM (the Pythia architecture) from a ModelConfig, randomly initialised.

Nothing is downloaded: the Hugging Face config is written out field by field from our YAML, so
`model=pythia-70m` is the architecture of EleutherAI/pythia-70m with fresh weights.
"""

from __future__ import annotations

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM


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


def build_model(m, device: torch.device | str = "cpu") -> GPTNeoXForCausalLM:
    """A randomly initialised GPTNeoXForCausalLM; on device 'meta' it allocates nothing (for counting)."""
    config = gpt_neox_config(m)
    with torch.device(device):
        model = GPTNeoXForCausalLM(config)
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
