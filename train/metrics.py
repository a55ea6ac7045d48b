"""Run outputs: metrics.jsonl, summary.json and Weights & Biases, written by rank 0 only.

W&B runs offline by default (files under <run_dir>/wandb, sync later with `wandb sync`); `disabled`
turns it off; `online` needs a logged-in user. The W&B run id is kept in the run directory so a resumed
run continues the same W&B run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from train.config import run_identity


def parameter_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of all parameters, by sorted name, raw bytes: a fingerprint to compare runs."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class RunLogger:
    """One JSON object per logged step in metrics.jsonl, mirrored to W&B; summary.json at the end."""

    def __init__(self, cfg, run_dir: str | Path, world_size: int, is_main: bool, resumed_step: int):
        self.is_main = is_main
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.wandb_run = None
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resumed_step)
        if cfg.wandb.mode != "disabled":
            import wandb

            os.environ["WANDB_DIR"] = str(self.run_dir)
            os.environ.setdefault("WANDB_SILENT", "true")
            name, group, tags = run_identity(cfg, world_size)
            run_id = self._wandb_run_id(resumed_step)
            self.wandb_run = wandb.init(
                project=cfg.wandb.project,
                entity=cfg.wandb.entity,
                name=name,
                group=group,
                tags=tags,
                config=OmegaConf.to_container(cfg, resolve=True),
                mode=cfg.wandb.mode,
                dir=str(self.run_dir),
                id=run_id,
                resume="allow",
            )

    def _wandb_run_id(self, resumed_step: int) -> str:
        """A resumed run continues its W&B run (id kept in the run dir); a fresh one starts a new id."""
        id_file = self.run_dir / "wandb_id.txt"
        if resumed_step > 0 and id_file.exists():
            return id_file.read_text().strip()
        seed = f"{self.run_dir.resolve()}:{time.time_ns()}:{os.getpid()}"
        run_id = hashlib.sha256(seed.encode()).hexdigest()[:16]
        id_file.write_text(run_id + "\n")
        return run_id

    def _truncate_after(self, step: int) -> None:
        """On resume keep the records up to the checkpoint's step; a fresh run (step 0) starts empty."""
        if not self.metrics_path.exists():
            return
        kept = []
        if step > 0:
            for line in self.metrics_path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line)
                except (ValueError, KeyError):
                    continue  # a torn last line from a killed run
        self.metrics_path.write_text("".join(k + "\n" for k in kept))

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def summary(self, summary: dict) -> None:
        if not self.is_main:
            return
        tmp = self.run_dir / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "summary.json")
        if self.wandb_run is not None:
            self.wandb_run.summary.update(summary)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
