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


WINDOW_ATTENTION = "cerar_pythia_causal_sdpa"
"""The attention implementation the trainer's model runs (`attend_whole_windows`): HF's SDPA, causal, no mask."""


def _causal_window_attention(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention with no mask, so SDPA runs causal (``is_causal``: flash attention on a GPU): the training
    windows are whole sequences, never padded. (HF prepares no mask for an attention it has no mask function for:
    ``attention_mask`` arrives as None, whatever the caller gave; the trainer gives none.)"""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def attend_whole_windows(model: GPTNeoXForCausalLM) -> bool:
    """Make the model attend as training needs and nothing more: causal SDPA with no mask built (returns False where
    this transformers has no AttentionInterface and masking_utils, before 4.53: HF's sdpa is kept).

    HF's own mask preparation (``masking_utils.create_causal_mask``) checks every forward whether the batch packs
    several sequences into one row, ``(packed_sequence_mask[:, -1] == 0).all()``, a host read of a device value:
    on a GPU a sync inside every forward (transformers 5.17 and 5.25 alike), and under dynamo it builds an explicit
    (B, 1, T, T) mask that keeps SDPA off its flash kernel (train/compiling.py). An attention registered under a
    name of its own gets no mask prepared at all (``_preprocess_mask_arguments`` returns at once for a name its mask
    functions do not know), and this one calls HF's SDPA attention exactly as HF does when it finds the mask
    unneeded: the logits are the same, bit for bit (tests/test_compiled_step.py). The model so made takes no padding
    mask (HF drops one given to it): it is the trainer's; train/export.py writes its weights for HF's own attention."""
    try:
        import transformers.masking_utils  # noqa: F401
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(WINDOW_ATTENTION, _causal_window_attention)
    model.set_attn_implementation(WINDOW_ATTENTION)
    return True


def build_model(m, device: torch.device | str = "cpu") -> GPTNeoXForCausalLM:
    """A GPTNeoXForCausalLM initialised with the config's init methods, attending causally over whole windows
    (`attend_whole_windows`); on device 'meta' it allocates nothing (for counting)."""
    config = gpt_neox_config(m)
    with torch.device(device):
        model = GPTNeoXForCausalLM(config)
    if torch.device(device).type != "meta":
        initialise_weights(model, m)
    attend_whole_windows(model)
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


def adamw_implementation(device: torch.device | str) -> dict:
    """The AdamW kernels for parameters on ``device``: on CUDA the fused one (``fused=True``: one kernel per group and
    dtype for the whole update, its step counts kept on the GPU, no host read), elsewhere the multi-tensor one
    (``foreach=True``: on a CPU the same arithmetic as torch's per-tensor loop, bit for bit, in fewer dispatches)."""
    return {"fused": True} if torch.device(device).type == "cuda" else {"foreach": True}


def build_optimizer(model: torch.nn.Module, m, device: torch.device | str) -> torch.optim.AdamW:
    """Pythia's AdamW for model config ``m`` (betas, eps, weight decay on matrices only) with the kernels of
    `adamw_implementation`."""
    return torch.optim.AdamW(
        optimizer_param_groups(model, m.weight_decay),
        lr=m.lr,
        betas=(m.adam_beta1, m.adam_beta2),
        eps=m.adam_eps,
        **adamw_implementation(device),
    )


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")
"""The param-group entries that choose AdamW's kernels, not its arithmetic."""


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, keeping this optimizer's kernels. The saved param groups carry the writer's
    `IMPLEMENTATION_KEYS` and ``load_state_dict`` takes a saved group whole, so without this a checkpoint written on a
    GPU (fused) would make a CPU run fused and one written on a CPU (foreach) would keep a GPU run off the fused kernel
    for good. The state is the same in every implementation (exp_avg, exp_avg_sq, and ``step`` as a float32 scalar):
    only where ``step`` lives differs, on the parameter's device for fused (and capturable) kernels, on the CPU
    otherwise (the multi-tensor kernel reads it on the host each step: a read of a GPU tensor there would be a sync)."""
    kept = [{key: group.get(key) for key in IMPLEMENTATION_KEYS} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, implementation in zip(optimizer.param_groups, kept, strict=True):
        group.update(implementation)
        on_device = bool(implementation["fused"] or implementation["capturable"])
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if torch.is_tensor(step):
                optimizer.state[p]["step"] = step.to(device=p.device if on_device else "cpu")
