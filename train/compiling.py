"""``trainer.compile``: which parts of the model torch.compile compiles, how, and what happens when it cannot.

What is compiled (regional compilation):

- each transformer layer, in place (``nn.Module.compile``). Every layer has the same code and the same shapes, so
  dynamo compiles the first and reuses its graph for the others (the parameters are inputs of the graph): one
  compile, not L. In place means no ``_orig_mod.`` wrapper: ``state_dict``, ``named_parameters``, the checkpoints
  and ``param_sha256`` are the eager model's, with compile on or off.
- the loss (`next_token_loss`), apart: the float32 cross entropy of the bf16 logits in one pass over them, where
  eager makes a float32 copy of B x T x V values (1.6 G at pythia-160m, micro-batch 16, 2048 tokens) and a
  float32 log-softmax beside it.
- not the rest: the embedding (a lookup), the final norm and the unembedding (one matrix product, cuBLAS's either
  way) stay eager.

Why not the whole model: HF's GPTNeoX builds its causal mask before the layers, and under dynamo in torch < 2.14
``transformers.masking_utils._ignore_causal_mask_sdpa`` cannot skip it (dynamo traces
``torch.compiler.is_exporting()`` as True, its comment says), so a whole-model graph calls SDPA with an explicit
(B, 1, T, T) mask and ``is_causal=False``: no flash attention, and all T x T scores computed where the causal
kernel computes half. Compiled alone, the layers get the mask the eager model makes, None, and SDPA runs with
``is_causal=True`` (tests/test_compiling.py reads it from the traced graph).

DDP: with ``trainer.overlap=true`` each compiled layer's backward is its own autograd node, so DDP's hooks fire
layer by layer as in eager; dynamo's DDPOptimizer, which splits a graph compiled inside DDP's forward at DDP's bucket
size, would only cut the layers further, so it is switched off (``torch._dynamo.config.optimize_ddp``). The flat
gradient (``FlatGradients``: every ``.grad`` a view of one buffer) is untouched: the compiled backward returns the
gradients and autograd's AccumulateGrad adds them into the existing ``.grad``, the views.

When: the trainer compiles before its first step (`Trainer.compile_before_first_step`): one forward and backward of
a batch of the step's shape, outside any collective (a rank compiling inside one would hold its peers past T), in
a phase of its own bounded by ``trainer.compile_timeout_s``, the ranks then meeting at a barrier with that bound.
The step's shapes never change, so nothing recompiles later. Evaluation runs eagerly (`eager`): its no-grad,
eval-mode graph would be a compile inside the evaluation, where the peers wait in a collective bounded by T.

Cache: inductor's (``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``), shared by the ranks of a
machine and kept across runs; its FX-graph and AOTAutograd caches make a second start seconds (as
``cerar.formats.fused``'s kernels). Deterministic runs (``torch.use_deterministic_algorithms(True)``, the GPU
check's resume case) get inductor's deterministic mode, which skips the on-device benchmarking of kernel variants
that would change the numerics from one process to the next.

Fallback: a compile that raises (no C++ compiler for a CPU, no Triton, an operation dynamo cannot trace) leaves the
model eager, said in one line on every rank; a compile that hangs ends the rank at the phase's deadline (exit 3).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.nn.functional import cross_entropy

NOTICE_PREFIX = "trainer.compile"


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of (B, T, V) logits against (B, T) targets, computed in float32."""
    return cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer layers of a GPTNeoXForCausalLM: what `compile_model` compiles."""
    return model.gpt_neox.layers


def available() -> tuple[bool, str]:
    """Whether this torch can compile the model as this module does: (False, why) where it cannot."""
    if not hasattr(torch, "compile") or not hasattr(torch.nn.Module, "compile"):
        return False, f"torch {torch.__version__} has no nn.Module.compile (torch >= 2.2)"
    if not hasattr(torch.compiler, "set_stance"):
        return False, f"torch {torch.__version__} has no torch.compiler.set_stance (torch >= 2.6)"
    return True, ""


def compile_model(model: torch.nn.Module, backend: str):
    """Compile the layers of ``model`` in place and return the compiled `next_token_loss`. Nothing compiles yet:
    dynamo traces at the first call (`Trainer.compile_before_first_step` makes it)."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.config.optimize_ddp = False  # the layers already give DDP one backward node each (module docstring)
    if torch.are_deterministic_algorithms_enabled():
        torch._inductor.config.deterministic = True
    for layer in layers(model):
        layer.compile(backend=backend, dynamic=False)
    return torch.compile(next_token_loss, backend=backend, dynamic=False)


def uncompile_model(model: torch.nn.Module) -> None:
    """Undo `compile_model`: every layer's call eager again (``nn.Module.compile`` keeps the compiled call in the
    module's ``_compiled_call_impl``, which ``__call__`` takes when set)."""
    for layer in layers(model):
        layer._compiled_call_impl = None


def is_compiled(model: torch.nn.Module) -> bool:
    return any(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers(model))


def root_cause(error: BaseException) -> BaseException:
    """The error behind dynamo's wrappers (``BackendCompilerFailed`` keeps the backend's own as ``inner_exception``;
    others chain it as their cause): what the fallback's line quotes."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
        error = inner
    return error


def eager():
    """A context in which compiled functions run eagerly, compiling nothing (evaluation: module docstring)."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def cache_location() -> str:
    """Where inductor keeps what it compiled, for the notice."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "inductor's default cache (/tmp/torchinductor_<user>)"


def notice(device: torch.device, num_layers: int, backend: str, timeout_s: float) -> str:
    """The one line said before compiling: what, why, how long it may take."""
    return (
        f"{NOTICE_PREFIX}: compiling the model for {device.type} with torch.compile ({backend}): its {num_layers} "
        "layers as one graph and the loss, for fused kernels and fewer launches; tens of seconds on a GPU the first "
        f"time, minutes on a small CPU, seconds once cached in {cache_location()}; the ranks then wait for each other "
        f"(trainer.compile_timeout_s={timeout_s:g})"
    )
