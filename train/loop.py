"""The training loop: micro-batches, gradient aggregation, optimizer step, evaluation, diagnostics.

overlap=false (the paper's measurement): backward runs under DDP's `no_sync`, so DDP reduces nothing;
then all gradients are flattened and aggregated once. Each phase (forward, backward, aggregate,
optimizer) is timed between device synchronisations. overlap=true: the aggregator is DDP's
communication hook and runs inside backward; `time/aggregate` is then 0 (it is part of backward).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.functional import cross_entropy

from train import checkpoint as ckpt
from train.distributed import all_reduce_max, all_reduce_mean, all_reduce_sum, guarded, set_step
from train.loss_scale import build_loss_scaler

log = logging.getLogger(__name__)


class PhaseTimer:
    """Seconds per phase, measured between device synchronisations."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = {"data": 0.0, "forward": 0.0, "backward": 0.0, "aggregate": 0.0, "optimizer": 0.0}


@dataclass
class TrainState:
    """What a checkpoint restores besides the model, optimizer and scheduler."""

    step: int = 0
    skipped_steps: int = 0
    tokens: int = 0
    last_val_loss: float | None = None
    history: dict = field(default_factory=dict)


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def write_flat_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def flat_params(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def write_flat_params(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a (B, T+1) window batch."""
    logits = model(input_ids=batch[:, :-1]).logits
    return cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


class Trainer:
    """Runs cfg.trainer.max_steps optimizer steps of a DDP-wrapped model with a chosen aggregator."""

    def __init__(
        self,
        cfg,
        *,
        ddp,
        optimizer,
        scheduler,
        data,
        aggregator,
        logger,
        device,
        rank,
        world_size,
        run_dir,
        overlap: bool,
    ):
        self.cfg, self.t = cfg, cfg.trainer
        self.ddp, self.model = ddp, ddp.module
        self.optimizer, self.scheduler, self.data = optimizer, scheduler, data
        self.aggregator, self.logger, self.device = aggregator, logger, device
        self.rank, self.world_size, self.run_dir, self.overlap = rank, world_size, run_dir, overlap
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.state = TrainState()
        self.timer = PhaseTimer(device)
        precision = cfg.trainer.precision
        use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
        low = torch.bfloat16 if use_bf16 else torch.float16 if precision == "fp16" else None
        self.autocast = (lambda: torch.autocast(device.type, dtype=low)) if low is not None else contextlib.nullcontext
        # fp16: the loss is scaled; a step whose (scaled) gradients hold inf/nan anywhere is skipped on every
        # rank and the scale backs off on every rank alike (see _skip_in_scaler).
        self.scaler = build_loss_scaler(cfg.trainer, device) if precision == "fp16" else None  # Pythia's scaler
        self.tokens_per_step = self.t.micro_batch_size * self.t.grad_accum * cfg.data.seq_len * world_size

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> dict:
        """Model/optimizer/scheduler of this rank plus every rank's data position and RNG (gathered)."""
        mine = {"data": self.data.train.state_dict(), "rng": ckpt.rng_states()}
        per_rank = [None] * self.world_size
        with guarded("checkpoint all_gather_object"):
            dist.all_gather_object(per_rank, mine)
        return {
            "step": self.state.step,
            "skipped_steps": self.state.skipped_steps,
            "tokens": self.state.tokens,
            "last_val_loss": self.state.last_val_loss,
            "world_size": self.world_size,
            **ckpt.run_record(self.cfg, self.world_size),  # the resolved config; resume safety
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "ranks": per_rank,
        }

    def save_checkpoint(self) -> None:
        state = self.checkpoint_state()  # collective: every rank takes part
        if self.rank == self.world_size - 1:  # the rank that always holds the exact aggregate
            path = ckpt.save_checkpoint(self.run_dir, self.state.step, state, self.cfg.checkpoint.keep)
            log.info("checkpoint %s", path)
        with guarded("checkpoint barrier"):
            dist.barrier()

    def restore(self, state: dict) -> None:
        if state["world_size"] != self.world_size:
            raise ckpt.CheckpointError(
                f"the checkpoint was written by {state['world_size']} ranks; this run has "
                f"{self.world_size} (start a fresh run with resume=false)"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        mine = state["ranks"][self.rank]
        self.data.train.load_state_dict(mine["data"])
        ckpt.set_rng_states(mine["rng"])
        self.state = TrainState(
            step=state["step"],
            skipped_steps=state["skipped_steps"],
            tokens=state["tokens"],
            last_val_loss=state["last_val_loss"],
        )

    # ------------------------------------------------------------------ one step

    def _forward_backward(self) -> float:
        """All micro-batches of one step; returns this rank's mean loss."""
        total = 0.0
        for micro in range(self.t.grad_accum):
            with self.timer.phase("data"):  # time/data: waiting for the next batch
                batch = self.data.train.next_batch(self.t.micro_batch_size).to(self.device, non_blocking=True)
            last = micro == self.t.grad_accum - 1
            sync = self.overlap and last  # overlap: DDP's hook reduces on the last micro-batch only
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with self.timer.phase("forward"), self.autocast():
                    loss = lm_loss(self.ddp, batch) / self.t.grad_accum
                scaled = self.scaler.scale(loss) if self.scaler is not None else loss
                with (
                    self.timer.phase("backward"),
                    guarded(f"backward with {self.aggregator.name} hook") if sync else (contextlib.nullcontext()),
                ):
                    scaled.backward()
            total += float(loss.detach())
        return total

    def _grads_finite_everywhere(self, flat: torch.Tensor | None) -> bool:
        """One all-reduce of a flag: every rank skips a step alike if any rank saw inf/nan."""
        local_bad = (
            not bool(torch.isfinite(flat).all())
            if flat is not None
            else any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in self.params)
        )
        return all_reduce_max(float(local_bad), self.device, "non-finite flag all_reduce") == 0.0

    def _maybe_inject_nonfinite(self, step: int) -> None:
        """trainer.inject_nonfinite_at_step (testing/chaos only): at that step one gradient of one rank is inf."""
        t = self.t
        if t.inject_nonfinite_at_step == step and self.rank == t.inject_nonfinite_rank:
            grad = self.params[0].grad
            if grad is not None:
                grad.view(-1)[0] = float("inf")
                log.warning("step %d: injected an inf gradient on rank %d (testing option)", step, self.rank)

    def _skip_in_scaler(self) -> None:
        """fp16, a step skipped because some rank saw inf/nan: make every rank's scaler see an inf so that
        all back off alike (GradScaler reads only its own rank's gradients), then let it skip and update."""
        self.params[0].grad = torch.full_like(self.params[0], float("nan"))
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)  # sees the inf: does not step
        self.scaler.update()

    def train_step(self) -> dict:
        self.timer.reset()
        step = self.state.step + 1
        set_step(step)
        loss = self._forward_backward()
        self._maybe_inject_nonfinite(step)
        record: dict = {}
        measure = (
            not self.overlap
            and self.t.measure_error_every > 0
            and step % self.t.measure_error_every == 0
            and self.world_size > 1
        )
        if self.overlap:
            bytes_sent = self.aggregator.bytes_sent_by_hook(self.numel)
            finite = self._grads_finite_everywhere(None)
        else:
            flat = flat_grads(self.params)
            finite = self._grads_finite_everywhere(flat)  # before aggregation
            bytes_sent = 0
            if finite:
                if self.scaler is not None:  # aggregate true gradients, not scaled ones
                    self.scaler.unscale_(self.optimizer)
                    flat = flat_grads(self.params)
                exact = None
                if measure:
                    exact = flat.clone()
                    with guarded("exact all_reduce (agg/rel_error)"):
                        dist.all_reduce(exact)
                    exact.div_(self.world_size)
                with self.timer.phase("aggregate"), guarded(f"aggregate ({self.aggregator.name})"):
                    bytes_sent = self.aggregator.aggregate(flat)
                with self.timer.phase("aggregate"):
                    write_flat_grads(self.params, flat)
                if exact is not None:
                    rel = float((flat - exact).norm() / exact.norm().clamp_min(1e-30))
                    record["agg/rel_error_max"] = all_reduce_max(rel, self.device)
                    record["agg/rel_error_rank0"] = rel if self.rank == 0 else None
        with self.timer.phase("optimizer"):
            if finite:
                if self.scaler is not None and self.overlap:
                    self.scaler.unscale_(self.optimizer)
                if self.cfg.model.grad_clip > 0:
                    record["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.model.grad_clip))
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)  # the gradients are finite everywhere: it steps
                    self.scaler.update()
                else:
                    self.optimizer.step()
                self.scheduler.step()
            else:
                self.state.skipped_steps += 1
                if self.scaler is not None:
                    self._skip_in_scaler()
                log.warning("step %d: non-finite gradients on some rank; step skipped on every rank", step)
            if self.scaler is not None:
                record["amp/scale"] = float(self.scaler.get_scale())
            self.optimizer.zero_grad(set_to_none=True)
        self.state.step = step
        self.state.tokens += self.tokens_per_step
        record.update({"train_loss_local": loss, "bytes_sent": bytes_sent, "skipped_steps": self.state.skipped_steps})
        return {k: v for k, v in record.items() if v is not None}

    # ------------------------------------------------------------------ diagnostics

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the fixed validation set (each rank its share; summed across ranks)."""
        self.model.eval()
        loss_sum, count = 0.0, 0
        for batch in self.data.val_batches:
            batch = batch.to(self.device)
            with self.autocast():
                loss = lm_loss(self.model, batch)
            n = batch[:, 1:].numel()
            loss_sum, count = loss_sum + float(loss) * n, count + n
        self.model.train()
        total, tokens = all_reduce_sum([loss_sum, float(count)], self.device, "evaluation all_reduce")
        return total / tokens

    @torch.no_grad()
    def replica_drift(self) -> float:
        """max over ranks of max |theta_rank - theta_0|: how far approximate aggregation let replicas part."""
        theta = flat_params(self.params).float()
        theta0 = theta.clone()
        with guarded("drift broadcast from rank 0"):
            dist.broadcast(theta0, src=0)
        return all_reduce_max(float((theta - theta0).abs().max()), self.device, "drift all_reduce")

    @torch.no_grad()
    def resync_from_exact_rank(self) -> None:
        """Broadcast the parameters of rank N-1 (exact under CERAR) to every replica."""
        theta = flat_params(self.params)
        with guarded(f"resync broadcast from rank {self.world_size - 1}"):
            dist.broadcast(theta, src=self.world_size - 1)
        write_flat_params(self.params, theta)

    # ------------------------------------------------------------------ the loop

    def _due(self, every: int, step: int) -> bool:
        return every > 0 and step % every == 0

    def fit(self) -> dict:
        t, start_wall, start_step = self.t, time.perf_counter(), self.state.step
        bar = None
        if self.rank == 0 and t.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.model.train()
        while self.state.step < t.max_steps:
            step_start = time.perf_counter()
            record = self.train_step()
            step = self.state.step
            step_seconds = time.perf_counter() - step_start
            if self.world_size > 1 and self._due(t.resync_every, step):
                self.resync_from_exact_rank()
            last = step == t.max_steps
            if self._due(t.log_every, step) or last or self._due(t.eval_every, step):
                (train_loss,) = all_reduce_mean([record.pop("train_loss_local")], self.device, "train-loss all_reduce")
                out = {"step": step, "train_loss": train_loss, "lr": self.scheduler.get_last_lr()[0]}
                out.update({f"time/{k}": v for k, v in self.timer.seconds.items()})
                out["time/step"] = step_seconds
                out["tokens_per_s"] = self.tokens_per_step / step_seconds
                out.update(record)
                if self.world_size > 1 and self._due(t.drift_every, step):
                    out["drift/max_abs"] = self.replica_drift()
                if self._due(t.eval_every, step) or last:
                    self.state.last_val_loss = self.evaluate()
                    out["val_loss"] = self.state.last_val_loss
                if not math.isfinite(train_loss):
                    log.warning("step %d: train loss is %s", step, train_loss)
                self.logger.log(out)
                if bar is not None:
                    bar.set_postfix(loss=f"{train_loss:.3f}", refresh=False)
            if self._due(self.cfg.checkpoint.every, step) or (last and self.cfg.checkpoint.at_end):
                self.save_checkpoint()
            if bar is not None:
                bar.update(1)
            if t.stop_after_step and start_step < t.stop_after_step <= step and not last:
                break
        if bar is not None:
            bar.close()
        finished = self.state.step == t.max_steps
        if finished and (self.state.last_val_loss is None or start_step == t.max_steps):
            self.state.last_val_loss = self.evaluate()
        return {
            "wall_seconds": time.perf_counter() - start_wall,
            "steps_this_run": self.state.step - start_step,
        }
