"""Run outputs: metrics.jsonl, summary.json and Weights & Biases, written by rank 0 only.

W&B runs offline by default (files under <run_dir>/wandb, sync later with `wandb sync`); `disabled`
turns it off; `online` needs a logged-in user. The W&B run id is kept in the run directory so a resumed
run continues the same W&B run. Runs compare on `step` (every metric's x axis) and on the minimum
`val_loss`; N, the global batch and grad_accum are in each run's W&B config.

W&B's start (``wandb.init``) and close (``finish``: online, the upload of what is left) talk to its service
and, online, to its server: each runs on a thread of its own and is waited for at most ``wandb.start_timeout_s``
/ ``wandb.close_timeout_s``; past that, or when it fails, one `LoggerError` names W&B, its mode and the setting
(train/main.py: that line and exit 3).

Besides the loop's record each logged step gets `mfu` (model FLOPs utilisation: achieved model FLOP/s per
device over the device's peak, when the peak is known) and, on GPUs, `memory/peak_gib` (rank 0's peak
allocated memory so far).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from train.config import run_identity

KNOWN_PEAK_TFLOPS = {
    # GPU name fragment (torch.cuda.get_device_name): (dense bf16/fp16 tensor-core TFLOP/s, fp32 TFLOP/s),
    # from the vendors' data sheets (dense, no sparsity). Checked in order: more specific names first.
    "H100 PCIe": (756.0, 51.0),
    "H100 NVL": (835.0, 60.0),
    "H100": (989.0, 67.0),  # SXM
    "H200 NVL": (835.0, 60.0),  # the PCIe card: 1,671 bf16 TFLOP/s with sparsity, half that dense
    "H200": (989.0, 67.0),  # SXM (torch names it plainly "NVIDIA H200"): the H100 SXM's rates
    "GH200": (989.0, 67.0),
    "B200": (2250.0, 80.0),
    "A100": (312.0, 19.5),
    "A10G": (70.0, 31.2),
    "A10": (125.0, 31.2),
    "L40S": (362.0, 91.6),
    "L4": (121.0, 30.3),
    "V100": (125.0, 15.7),  # fp16 only (no bf16)
    "T4": (65.0, 8.1),
}


def peak_flops_per_device(cfg, device: torch.device) -> float | None:
    """FLOP/s one device can do at the run's precision: trainer.peak_tflops, or the known GPU's; else None."""
    if cfg.trainer.peak_tflops:
        return float(cfg.trainer.peak_tflops) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    precision = cfg.trainer.precision
    sixteen_bit = precision in ("bf16", "fp16") or precision == "auto"  # auto is bf16 on GPU
    for fragment, (half, single) in KNOWN_PEAK_TFLOPS.items():
        if fragment in name:
            return (half if sixteen_bit else single) * 1e12
    return None


def model_flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward) of a GPTNeoX, as PaLM's MFU counts them (Chowdhery et
    al. 2022, appendix B): 6 per weight of every matrix multiply (all but the input embedding, a lookup)
    plus 12 L d T for attention's scores and weighted sums over a context of T = seq_len."""
    d, layers = m.hidden_size, m.num_layers
    ffn = m.intermediate_size or 4 * d
    per_layer = 4 * d * d + 2 * d * ffn  # query_key_value (3 d^2), dense (d^2), h_to_4h, 4h_to_h
    matmul_weights = layers * per_layer + d * m.vocab_size  # + the unembedding
    return 6.0 * matmul_weights + 12.0 * layers * d * seq_len


def parameter_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of all parameters, by sorted name, raw bytes: a fingerprint to compare runs."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class LoggerError(RuntimeError):
    """The run's logger (W&B) did not start or close within its deadline, or failed to: the message is one line
    naming W&B, its mode, the setting and what to do."""


def within(seconds: float, call, expired: str, failed: str):
    """``call()`` on a daemon thread, waited for at most ``seconds``: its result, or LoggerError(``expired``) when
    it is still running then (the thread is left to the process's exit), or LoggerError(``failed``: its error
    appended) when it raised."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # handed to the caller's thread, whatever it is
            box["error"] = err

    thread = threading.Thread(target=target, name="run-logger", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise LoggerError(expired)
    if "error" in box:
        err = box["error"]
        detail = (str(err).strip().splitlines() or [""])[0][:300]
        raise LoggerError(f"{failed}: {type(err).__name__}: {detail}") from err
    return box.get("value")


class RunLogger:
    """One JSON object per logged step in metrics.jsonl, mirrored to W&B; summary.json at the end."""

    def __init__(
        self,
        cfg,
        run_dir: str | Path,
        world_size: int,
        is_main: bool,
        resumed_step: int,
        device: torch.device | None = None,
        extra_config: dict | None = None,
    ):
        self.is_main = is_main
        self.world_size = world_size
        self.device = device if device is not None else torch.device("cpu")
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_flops = peak_flops_per_device(cfg, self.device)
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.wandb_run = None
        self.mode, self.close_timeout_s = cfg.wandb.mode, cfg.wandb.close_timeout_s
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resumed_step)
        if cfg.wandb.mode != "disabled":
            self.wandb_run = self._start_wandb(cfg, world_size, resumed_step, extra_config)

    def _start_wandb(self, cfg, world_size: int, resumed_step: int, extra_config: dict | None):
        """wandb.init, waited for at most wandb.start_timeout_s (`within`), and the metrics' axes."""
        import wandb

        os.environ["WANDB_DIR"] = str(self.run_dir)
        os.environ.setdefault("WANDB_SILENT", "true")
        name, group, tags = run_identity(cfg, world_size)
        run_id = self._wandb_run_id(resumed_step)
        seconds, what = cfg.wandb.start_timeout_s, f"W&B (wandb.mode={self.mode}), the run's logger,"
        online = " (online: the network, its server, the key: `wandb login`)" if self.mode == "online" else ""
        run = within(
            seconds,
            lambda: wandb.init(
                project=cfg.wandb.project,
                entity=cfg.wandb.entity,
                name=name,
                group=group,
                tags=tags,
                config={**OmegaConf.to_container(cfg, resolve=True), **(extra_config or {})},
                mode=cfg.wandb.mode,
                dir=str(self.run_dir),
                id=run_id,
                resume="allow",
            ),
            expired=f"{what} did not start within {seconds:g}s (wandb.start_timeout_s){online}: raise "
            "wandb.start_timeout_s, or run with wandb.mode=offline and `wandb sync` later, or wandb.mode=disabled",
            failed=f"{what} failed to start{online}",
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        run.define_metric("val_loss", step_metric="step", summary="min")
        return run

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
        record = {**record, **self.utilisation(record)}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=record["step"])

    def utilisation(self, record: dict) -> dict:
        """`mfu` from the record's tokens_per_s (all ranks' tokens), and this device's peak memory."""
        extra = {}
        if self.peak_flops and record.get("tokens_per_s"):
            extra["mfu"] = record["tokens_per_s"] * self.flops_per_token / (self.world_size * self.peak_flops)
        if self.device.type == "cuda":
            extra["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return extra

    def summary(self, summary: dict) -> None:
        if not self.is_main:
            return
        tmp = self.run_dir / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "summary.json")
        if self.wandb_run is not None:
            self.wandb_run.summary.update(summary)

    def close(self) -> None:
        """Finish the W&B run (online: its upload), waited for at most wandb.close_timeout_s."""
        if self.wandb_run is None:
            return
        run, self.wandb_run = self.wandb_run, None
        seconds, what = self.close_timeout_s, f"W&B (wandb.mode={self.mode}), the run's logger,"
        files = f"{self.run_dir / 'wandb'}/*run-*-{run.id}"
        within(
            seconds,
            run.finish,
            expired=f"{what} did not close within {seconds:g}s (wandb.close_timeout_s); metrics.jsonl, summary.json "
            f"and the checkpoints are written: upload its files later with `wandb sync {files}`, or raise "
            "wandb.close_timeout_s",
            failed=f"{what} failed to close (its files: {files})",
        )
