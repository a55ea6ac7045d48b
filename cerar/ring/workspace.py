"""Working storage the rounds reuse from call to call, so that a CPU call does not fault in fresh pages.

A CERAR call needs about (1 + (N+1)/c) d values of working storage (``cerar.ring.rounds``). On CPU a
buffer that large comes straight from the kernel (mmap) and is returned to it when freed, so every
call pays page faults and the kernel's zeroing for all of it: about as much as two passes over it,
on the critical path of every round-1 encoding. CUDA's caching allocator already keeps device
memory, so only CPU storage is pooled here. The 4-bit format's eager path takes its two scratch
buffers from the same pool (``cerar.formats.int4_blocks``: the rotation's stages, the dither, the
unpacked values; without it, 2^22 values faulted in about 8,900 fresh pages per quantization).

A buffer is taken for one call and given back when the call ends, so concurrent calls (the DDP
hook's thread beside the training loop, two process groups) never share one. The pool keeps the
``keep`` largest buffers per (device, dtype); ``release_workspaces()`` frees them.
"""

from __future__ import annotations

import contextlib
import threading

import torch

KEEP_PER_KIND = 2
"""Buffers kept per (device, dtype): one per call that may run at the same time on a rank."""


class WorkspacePool:
    """Flat buffers by (device, dtype); ``take`` the smallest that is large enough, ``give`` it back."""

    def __init__(self, keep: int = KEEP_PER_KIND):
        self.keep = keep
        self._free: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of at least ``numel`` values (uninitialised; pooled only on CPU)."""
        device = torch.device(device)
        if device.type == "cpu":
            with self._lock:
                free = self._free.get((str(device), dtype), [])
                fits = [k for k, b in enumerate(free) if b.numel() >= numel]
                if fits:
                    return free.pop(min(fits, key=lambda k: free[k].numel()))
        return torch.empty(numel, dtype=dtype, device=device)

    @contextlib.contextmanager
    def borrowed(self, numel: int, dtype: torch.dtype, device: torch.device):
        """``take`` for the length of a ``with`` block: the buffer is given back when it ends, an error included."""
        buffer = self.take(numel, dtype, device)
        try:
            yield buffer
        finally:
            self.give(buffer)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from ``take``; the pool keeps the largest ``keep`` of each kind."""
        if buffer.device.type != "cpu" or self.keep <= 0:
            return
        with self._lock:
            free = self._free.setdefault((str(buffer.device), buffer.dtype), [])
            free.append(buffer)
            free.sort(key=torch.Tensor.numel, reverse=True)
            del free[self.keep :]

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


POOL = WorkspacePool()


def release_workspaces() -> int:
    """Free the working storage CERAR keeps between calls; returns the bytes released."""
    held = POOL.held_bytes()
    POOL.clear()
    return held
