"""How the GPU check judges a result: every coded result against the exact sum of its inputs, within
a bound derived from the code itself (its own error for those inputs, ``Code.residuals``, plus kappa
times the transport dtype's rounding, ``cerar.ring.precision``), never two implementations agreeing to a
fixed tolerance. Shared by every section."""

from __future__ import annotations

import time

import torch

import cerar


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up."""
    fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def resolve_device(name: str, current_cuda_index: int | None = None) -> torch.device:
    """The device a ``--device`` name means, with an index where CUDA needs one: ``cuda`` is the
    current CUDA device (``cuda:<current_cuda_index>``; ``torch.cuda.set_device`` refuses a CUDA
    device without an index), ``cuda:k`` and ``cpu`` are themselves."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        if current_cuda_index is None:
            raise ValueError("--device cuda: the current CUDA device's index is needed to resolve it")
        device = torch.device("cuda", current_cuda_index)
    return device


def worst_error(result: torch.Tensor, G: torch.Tensor) -> float:
    """The worst worker's relative error against the exact sum (in float64)."""
    S = G.double().sum(0)
    return ((result.double().cpu() - S.cpu()).norm(dim=1) / S.norm()).max().item()


def exact_arithmetic_results(G: torch.Tensor, code: cerar.Code) -> torch.Tensor:
    """What each worker of ``code`` receives for gradients G [N, d] in exact arithmetic (float64):
    the exact sum plus the code's own error, S + sum_h R_ih G_(i-h) (the spec's error formula,
    ``Code.residuals``), computed from the code's matrices alone, not by running the rounds."""
    N, d = G.shape
    c, m = code.c, code.m_for(d)
    padded = torch.zeros(N, c * m, dtype=torch.float64)
    padded[:, :d] = G.double().cpu()
    blocks = padded.view(N, c, m)
    S = blocks.sum(0)
    R = torch.from_numpy(code.residuals())
    out = torch.stack(
        [S + sum((R[i, h - 1] @ blocks[(i - h) % N] for h in range(1, N)), torch.zeros_like(S)) for i in range(N)]
    )
    return out.view(N, c * m)[:, :d]


def judge_coded(results: torch.Tensor, G: torch.Tensor, code: cerar.Code, dtype, scale: float = 1.0) -> dict:
    """Each worker's result [N, d] of ``code`` on gradients G (times ``scale``: 1/N for op="avg")
    held to the exact sum: it must lie within the transport's rounding bound
    (``cerar.ring.precision.rounding_bound``, kappa times the dtype's rounding, relative to ||G||_F) of
    the exact sum plus the code's own error for these gradients (``exact_arithmetic_results``).
    Reports the error against the exact sum, the code's part of it, and the rounding deviation."""
    G64 = G.double().cpu()
    S = G64.sum(0) * scale
    predicted = exact_arithmetic_results(G64, code) * scale
    results = results.double().cpu()
    size = (G64.norm() * scale).clamp_min(1e-300)
    deviation = ((results - predicted).norm(dim=1) / size).max().item()
    bound = cerar.ring.precision.rounding_bound(code, dtype)
    return {
        "error": ((results - S).norm(dim=1) / S.norm().clamp_min(1e-300)).max().item(),
        "truncation": ((predicted - S).norm(dim=1) / S.norm().clamp_min(1e-300)).max().item(),
        "deviation": deviation,
        "bound": bound,
        "ok": bool(torch.isfinite(results).all()) and deviation <= bound,
    }


def judge_sum(results: torch.Tensor, G: torch.Tensor, dtype, scale: float = 1.0) -> dict:
    """Each rank's exact all-reduce result [N, d] held to the exact sum of G (times ``scale``),
    within the rounding of a sum of N values (``cerar.ring.precision.sum_rounding_bound``)."""
    G64 = G.double().cpu()
    S = G64.sum(0) * scale
    size = (G64.norm() * scale).clamp_min(1e-300)
    deviation = ((results.double().cpu() - S).norm(dim=1) / size).max().item()
    bound = cerar.ring.precision.sum_rounding_bound(G.shape[0], dtype)
    return {"deviation": deviation, "bound": bound, "ok": deviation <= bound}
