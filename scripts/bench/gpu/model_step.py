"""Section "model_step": the plain training step that ``../shared/device-runs/h200-2026-12-04/diag.py mfu`` timed,
pythia-160m at micro-batch 16 and sequence 2048: ``train.model.build_model``, bf16 autocast, ``AdamW(fused=True)``,
random tokens, forward, backward, step; eager, and with ``torch.compile(model)`` (the compile cache of the run:
``TORCHINDUCTOR_CACHE_DIR``). Next to the trainer's rows it shows what the trainer's loop costs beyond its model.
Per mode: the warm-up steps' seconds (compiling, for the compiled one), then the median of timed steps (CUDA
events), tokens/s and MFU against the GPU's peak (``train.metrics``: the trainer's own FLOPs per token and peak)."""

from __future__ import annotations

import time

import torch

from scripts.bench.gpu.measure import ROOT, timed

SECTION = "model_step"
MODEL, MICRO, SEQ = "pythia-160m", 16, 2048
SMALL = ("tiny", 2, 64)
ESTIMATE_S = {"eager": 12.0, "compiled": 45.0}  # on an H200, the inductor cache cold (diag.py: 26 s warm-up)
VOCAB = 8192  # the embedded corpus's BPE vocabulary, as diag.py drew its tokens


def step_fn(model, optimizer, ids, device):
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def step():
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run(bench) -> None:
    from omegaconf import OmegaConf

    from train.config import ModelConfig
    from train.metrics import KNOWN_PEAK_TFLOPS, model_flops_per_token
    from train.model import build_model

    name, micro, seq = SMALL if bench.small else (MODEL, MICRO, SEQ)
    m = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "configs" / "model" / f"{name}.yaml"))
    flops_per_token = model_flops_per_token(m, seq)
    peak = None
    if bench.cuda:
        gpu = torch.cuda.get_device_name(bench.device)
        peak = next((half * 1e12 for fragment, (half, _) in KNOWN_PEAK_TFLOPS.items() if fragment in gpu), None)
    warmup, repeats = (1, 2) if bench.small else (3, 10)
    for mode in ("eager", "compiled"):
        what = f"{name} step, micro-batch {micro}, seq {seq}, {mode}" + (
            ", bf16 autocast, AdamW(fused=True)" if bench.cuda else ", fp32"
        )
        if not bench.fits(SECTION, what, ESTIMATE_S[mode]):
            continue
        try:
            torch.manual_seed(bench.seed)
            model = build_model(m, bench.device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=bench.cuda)
            # on a CPU dynamo traces and torch's own operations run (backend "eager"): seconds, not inductor's minutes
            forward = model if mode == "eager" else torch.compile(model, backend="inductor" if bench.cuda else "eager")
            ids = torch.randint(0, VOCAB, (micro, seq), device=bench.device,
                                generator=torch.Generator(bench.device).manual_seed(bench.seed))  # fmt: skip
            step = step_fn(forward, optimizer, ids, bench.device)
            started = time.perf_counter()
            for _ in range(warmup):
                step()
            if bench.cuda:
                torch.cuda.synchronize(bench.device)
            warm_s = time.perf_counter() - started
            t = timed(step, bench.device, 0, repeats)
        except Exception as error:
            bench.record(SECTION, what, "FAILED", reason=f"{type(error).__name__}: {error}")
            continue
        finally:
            model = optimizer = forward = step = None
            if bench.cuda:
                torch.cuda.empty_cache()
        tokens_per_s = micro * seq / (t["median_ms"] / 1e3)
        mfu = tokens_per_s * flops_per_token / peak if peak else None
        bench.record(
            SECTION,
            what,
            model=name,
            mode=mode,
            micro_batch=micro,
            seq_len=seq,
            warmup_steps=warmup,
            warmup_s=warm_s,
            step_ms=t["median_ms"],
            timing=t,
            tokens_per_s=tokens_per_s,
            mfu=mfu,
            summary=(f"mfu {100 * mfu:.1f} %, " if mfu is not None else "")
            + f"{tokens_per_s:.0f} tokens/s, {t['median_ms']:.1f} ms a step, warm-up {warm_s:.1f} s",
        )
