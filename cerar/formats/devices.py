"""How the formats' eager arithmetic is written for each kind of device: in few passes, or in vectorized ones.

On CUDA a reduction of two results (``aminmax``: the least and the largest value) is one read, and a product
written with ``out=`` into another dtype (int8 x float32 into float32, float32 into a 16-bit wire) is one kernel:
TensorIterator computes in the common dtype and casts as it stores. Reading a value back on the host would
synchronise with the device. On a CPU the same calls are slower than the passes they replace (``aminmax`` along
rows of 128 5x slower than ``amax`` and ``amin``; a mixed-dtype product runs torch's unvectorized loop, the int8
decode 2.7x slower, measured on this machine's AVX-512 CPU), and a host read is free. The bytes are the same
either way: the same float32 operations, each rounded once (tests force both forms on the CPU and compare).

Here too the timer that chooses between a kernel and torch's operations on a device (``side_by_side_seconds``).
"""

from __future__ import annotations

import statistics
import time

import torch


def one_pass(device) -> bool:
    """Whether the eager arithmetic on ``device`` takes the one-pass forms and never reads the host (every device
    but the CPU)."""
    return torch.device(device).type != "cpu"


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA); a CPU's work is done when its call returns."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def side_by_side_seconds(calls: dict, device, repeats: int = 3) -> dict[str, float]:
    """The median seconds of each of ``calls`` (name -> function), ``repeats`` times each after one untimed call,
    interleaved so that a moment of load slows every one, each call between two device synchronisations: how
    ``cerar.formats.fused`` and ``cerar.ring.products`` choose between a kernel and torch's operations."""
    times = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
