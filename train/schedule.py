"""Pythia's learning-rate schedule: linear warmup over a fraction of the steps, cosine decay to min_lr."""

from __future__ import annotations

import math

import torch


def lr_multiplier(step: int, max_steps: int, warmup_fraction: float, min_lr_ratio: float) -> float:
    """The factor on the peak lr at optimizer step `step` (0-based)."""
    warmup = int(round(warmup_fraction * max_steps))
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, max_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, m, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, max_steps, m.warmup_fraction, m.min_lr_ratio)
    )
