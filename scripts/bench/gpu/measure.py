"""How the GPU benchmark times and labels what it measures: medians of timed repeats after warm-up (CUDA events
on a GPU, the wall clock on the CPU), and each row's provenance (the tree's commit, the seed, the device, the
versions of torch, CUDA, NCCL and Triton)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int = 3, repeats: int = 10, cpu_clock=time.perf_counter) -> dict:
    """``fn`` run ``warmup`` times, then ``repeats`` times each timed on its own (the device idle before each):
    CUDA events around the call on a GPU, so the figure is the GPU's time from the call's first kernel to its
    last, including the gaps where it waited for the host; ``cpu_clock`` (seconds) on the CPU. Milliseconds:
    the median, the least and the most."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = cpu_clock()
            fn()
            samples.append(1e3 * (cpu_clock() - t0))
    return {
        "median_ms": statistics.median(samples),
        "min_ms": min(samples),
        "max_ms": max(samples),
        "warmup": warmup,
        "repeats": repeats,
        "clock": "CUDA events" if device.type == "cuda" else cpu_clock.__name__,
    }


def commit() -> str:
    """``CERAR_BENCH_COMMIT`` where the command sets it (a device machine's copy of the tree carries a .git that
    need not be the tree's: on the H200 of 2026-12-04 git read e259866+dirty in a copy of 084fa14); else the tree's
    commit (``+dirty`` with uncommitted changes to tracked files); else "unknown"."""
    named = os.environ.get("CERAR_BENCH_COMMIT")
    if named:
        return named
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True,
                timeout=10,
            )  # fmt: skip
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def provenance(device: torch.device, seed: int) -> dict:
    """What every row of a run says about where it was measured."""
    cuda = device.type == "cuda"
    nccl = None
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL
            nccl = None
    return {
        "commit": commit(),
        "seed": seed,
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
    }
