"""Process-group setup for torchrun (or a plain single process) and the small collectives the loop needs.

Backend: NCCL when the job runs on GPUs, gloo on CPU. Every collective inherits the process group's
timeout (`trainer.collective_timeout_s`). A plain `python train/main.py` runs as a group of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from train.config import ConfigError


@dataclass
class Launch:
    rank: int
    local_rank: int
    world_size: int


def launch_from_env() -> Launch:
    """Rank and world size as torchrun sets them (single process when absent)."""
    return Launch(
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def pick_device(cfg, launch: Launch) -> torch.device:
    want = cfg.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(launch.local_rank)
        return torch.device("cuda", launch.local_rank)
    return torch.device("cpu")


def init_process_group(launch: Launch, device: torch.device, timeout_s: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(
            backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    else:  # a plain single process: a group of one with an in-memory store
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def check_same_config(fingerprint: str, device: torch.device) -> None:
    """Every rank must run the same resolved config; otherwise stop all ranks with one clear error."""
    mine = torch.tensor(list(bytes.fromhex(fingerprint)), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    differing = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if differing:
        raise ConfigError(
            f"ranks {differing} were launched with a config different from rank 0's "
            "(compare the overrides given to each node)"
        )


def all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_mean(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
