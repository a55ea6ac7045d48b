"""The training loop: micro-batches, gradient aggregation, optimizer step, evaluation, diagnostics.

overlap=false (the paper's measurement): backward runs under DDP's `no_sync`, so DDP reduces nothing;
the parameters' `.grad` are views of one persistent flat buffer (`FlatGradients`), which is aggregated
in place once per step (no concatenation, no copy back). Each phase (forward, backward, aggregate,
optimizer) is timed by CUDA events read once per step (`PhaseTimer`). overlap=true: the aggregator is DDP's
communication hook and runs inside backward; `time/aggregate` is then 0 (it is part of backward).

Diagnostics of approximate aggregation, where replicas can differ (CERAR: only rank N-1, the
*reference replica* that checkpoints keep and resync broadcasts, is exact; with 16-bit messages,
aggregator.transport, it is the 16-bit-rounded replica instead: every rank's aggregate, its own included,
is within the wire's rounding of the exact average or further, and summary.json's `reference_replica`
says which; docs/cerar-16bit.md):
- `val_loss` is the reference replica's loss on the whole validation set; `val_loss_worst_replica`
  the worst replica's (each rank then evaluates the whole set with its own parameters: `eval/each_replica` 1,
  from the first step whose aggregate may differ between ranks until a resync; else the ranks split the set, 0).
- `drift/max_abs` and `drift/rel_l2` measure every replica against the reference replica:
  max |theta_r - theta_ref| and ||theta_r - theta_ref|| / ||theta_ref||, worst rank; at a step that
  also resyncs, before the resync (the most the replicas drifted apart in the interval).
- every `trainer.measure_error_every` steps (overlap=false): `agg/rel_error_max`, the worst rank's
  ||g_hat_r - g_bar|| / ||g_bar|| against an exact all-reduce, beside the SGD noise the step already
  carries: `noise/rel_std_mean`, the estimated standard deviation of the averaged gradient g_bar
  around its expectation, sqrt(sum_r ||g_r - g_bar||^2 / (N (N-1))) / ||g_bar||; and the same per
  parameter tensor, as Adam sees it (train/aggregation/tensor_errors.py): `tensor/<name>`, each tensor's error
  against its own noise (worst rank), `agg/tensor_error_to_noise_max` and `agg/worst_tensor` (the worst of them and
  its name), `agg/tensor_rel_error_max`, and `agg/tensor_error_to_adam_max`, the worst tensor's error
  against the root of Adam's second moment.

c=auto (train/aggregation/auto_c.py): at its checks, before aggregating, `measure_auto_c` measures each tensor's
noise and each candidate code's worst rank's worst tensor's error against it on the step's own gradients, and the
aggregator switches to the code the decision names for this step on; every step logs `auto_c/c`, the c it aggregated
with, and a check logs its evidence (`auto_c/noise`, `auto_c/allowed_error`, `auto_c/error_c<c>`, their standard
errors) and its cost (`time/auto_c`). The choice is checkpointed and restored with the run.

aggregator=auto (train/aggregation/auto_aggregator.py) the same way, one level up: at its checks `check` measures
each tensor's noise and every candidate aggregator's worst tensor's error against it and switches to the fastest
that fits; every step logs `auto/choice` and `auto/predicted_s`, a check its evidence (`auto/noise`,
`auto/error/<candidate>`) and its cost (`time/auto`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cerar.int8.all_reduce import dither_calls, set_dither_calls
from cerar.ring.rounds import PhaseTimer as StreamPhaseTimer
from train import checkpoint as ckpt
from train import compiling
from train.aggregation.feedback_window import feedback_window, measured_step
from train.aggregation.tensor_errors import TensorLayout, per_tensor_figures
from train.compiling import next_token_loss
from train.config import effective_compile
from train.distributed import (
    bounded,
    deadline_s,
    first_line,
    group_with_timeout,
    guarded,
    set_phase,
    set_step,
)
from train.loss_scale import build_loss_scaler
from train.model import load_optimizer_state
from train.watchdog import COMPILE_PHASE

log = logging.getLogger(__name__)


class PhaseTimer(StreamPhaseTimer):
    """Seconds per phase of one step. On CUDA, from a pair of events recorded on the current stream around
    each phase and read once (`collect`, after the step's last bounded wait, when they wait only for this
    rank's own kernels; the loop reads them while the next step's kernels run): a ``torch.cuda.synchronize``
    at each phase boundary would block the host on a collective that a stalled peer never completes, outside
    any deadline of ours, until torch's watchdog aborts the process (train/distributed.py). On the CPU, the
    host's clock. ``current`` names the phase the host is in, for the failure message
    (`train.distributed.set_phase`)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.device = device
        self.seconds = {"data": 0.0, "forward": 0.0, "backward": 0.0, "aggregate": 0.0, "optimizer": 0.0}

    @contextlib.contextmanager
    def phase(self, name: str):
        set_phase(name)
        with super().phase(name):
            yield
        set_phase(f"after {name}")

    def collect(self) -> dict[str, float]:
        """Add the phases recorded on the stream since the last call (waits for the last event: call it
        once every collective the step's kernels wait on has passed its bounded wait)."""
        self.totals()
        return self.seconds


def read_on_host(values: torch.Tensor) -> list[float]:
    """The values of a small device tensor, on the host: one blocking copy to the CPU (on CUDA a sync: it waits for
    every kernel queued before it). Made as ``aten._to_copy`` to the CPU on every device, the CPU too, so that a
    dispatch mode counts it where no GPU is (tests/test_compiled_step.py)."""
    return values.to("cpu", copy=True).tolist()


class HostValue:
    """A device scalar on its way to the host: a non-blocking copy into pinned memory, then (CUDA) an event after it.
    ``float()`` waits for that event only, i.e. for the step that made the value, not for the kernels queued since:
    the loop reads a step's values while the next step's forward and backward run."""

    def __init__(self, value: torch.Tensor):
        self.host = value.detach().to("cpu", non_blocking=True, copy=True)
        self.event = None
        if value.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def __float__(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.host.tolist())  # a host tensor: no device read


@dataclass
class StepRecord:
    """What one step leaves for its log line: host values (train_loss: the mean over the ranks, read with the
    non-finite flag), device values on their way to the host (`HostValue`: grad_norm) and the step's phase timer,
    read once the line is written."""

    values: dict
    timer: PhaseTimer

    def __getitem__(self, key: str):
        return self.values[key]

    def line(self) -> dict:
        """The record with every value on the host and the phases' seconds (waits for this step's kernels only)."""
        out = {k: float(v) if isinstance(v, HostValue) else v for k, v in self.values.items()}
        out.update({f"time/{k}": v for k, v in self.timer.collect().items()})
        return out


@dataclass
class TrainState:
    """What a checkpoint restores besides the model, optimizer and scheduler."""

    step: int = 0
    skipped_steps: int = 0
    tokens: int = 0
    last_val_loss: float | None = None
    history: dict = field(default_factory=dict)


class FlatGradients:
    """One persistent flat gradient buffer whose slices are the parameters' `.grad`.

    Backward accumulates straight into it and the aggregator averages it in place, so a step makes no
    flat copy of the gradient and writes nothing back (two passes over d values and a second d-sized
    buffer saved against concatenating the gradients each step). Zeroing keeps the views alive.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.attach()

    def attach(self) -> None:
        """Make every parameter's `.grad` its slice of the buffer (again, if something replaced one)."""
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is not view:
                p.grad = view

    def zero_(self) -> None:
        self.flat.zero_()
        self.attach()


def local_nonfinite(params: list[torch.nn.Parameter], flat: torch.Tensor | None) -> torch.Tensor:
    """A device flag, true when any gradient holds inf or nan: one fused reduction, no host sync."""
    if flat is not None:
        return ~torch.isfinite(flat).all()
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.bool, device=params[0].device)
    largest = torch._foreach_norm(grads, float("inf"))  # max |g| per tensor: inf or nan exactly when one is
    return ~torch.isfinite(torch.stack(largest)).all()


def exact_mean(local: torch.Tensor) -> torch.Tensor:
    """g_bar, the exact mean of every rank's `local` (a new tensor), by torch's all-reduce."""
    exact = local.clone()
    bounded("exact all_reduce (g_bar)", lambda: dist.all_reduce(exact, async_op=True))
    return exact.div_(dist.get_world_size())


def gradient_noise(local: torch.Tensor, exact: torch.Tensor) -> float:
    """The SGD noise of the averaged gradient g_bar: its standard deviation around its expectation, estimated
    from the spread of the N per-rank gradients g_r, sqrt(sum_r ||g_r - g_bar||^2 / (N (N-1))), relative to
    ||g_bar||. It shrinks as 1/sqrt(batch); CERAR's aggregation error does not. Every rank gets the same value."""
    N = dist.get_world_size()
    spread = (local - exact).square().sum().double().reshape(1)
    bounded("noise all_reduce", lambda: dist.all_reduce(spread, async_op=True))
    return math.sqrt(float(spread) / (N * (N - 1))) / max(float(exact.norm()), 1e-30)


def error_and_noise(local: torch.Tensor, aggregated: torch.Tensor, exact: torch.Tensor, rank: int) -> dict:
    """This rank's aggregation error against the exact mean g_bar, beside the SGD noise of g_bar
    (`gradient_noise`).

    local: this rank's gradient g_r; aggregated: what the aggregator gave this rank; exact: g_bar, the
    exact mean (equal on every rank).
    """
    g_bar_norm = exact.norm()
    error = (aggregated - exact).norm() / g_bar_norm.clamp_min(1e-30)
    worst = error.double().reshape(1)
    bounded("error all_reduce", lambda: dist.all_reduce(worst, op=dist.ReduceOp.MAX, async_op=True))
    return {
        "agg/rel_error_max": float(worst),
        "agg/rel_error_rank0": float(error) if rank == 0 else None,
        "noise/rel_std_mean": gradient_noise(local, exact),
        "noise/grad_norm": float(g_bar_norm),
    }


def measure_auto_c(
    auto_c, local: torch.Tensor, step: int, seed: int, sample_values: int, layout=None, scales=None
) -> dict:
    """One c=auto check on this step's per-rank gradients `local` (every rank calls it): each parameter tensor's
    noise (train/aggregation/tensor_errors.py, `layout`: the model's tensors, one tensor when None), each candidate's
    worst
    rank's worst tensor's error against its noise on a seeded `TensorSample` of columns gathered from every
    rank, computed for candidate k by rank k mod N and summed so every rank holds the same numbers, then the
    decision. `scales` (per tensor, the aggregator's equilibration, `tensor_scales`; None: none) are applied as
    the call applies them. Returns the record to log."""
    from train.aggregation import tensor_errors as te

    N, rank = dist.get_world_size(), dist.get_rank()
    layout = layout or te.TensorLayout.single(local.numel())
    exact = exact_mean(local)
    noise = gradient_noise(local, exact)
    sigma = te.tensor_noise(local, exact, layout)
    zero = layout.zero(exact, sigma)  # the tensors zero on every rank, which the aggregator returns as zeros
    candidates = auto_c.to_measure()
    samples = []
    for c in candidates:
        generator = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + c) % 2**63)
        k = te.per_tensor_units(sample_values, len(layout.sizes), c)
        samples.append(te.TensorSample.draw(te.unit_sizes(local, 1, c, 1), layout, 1, c, 1, generator, k))
    mine = torch.cat([sample.values(local) for sample in samples]).float()
    gathered = [torch.empty_like(mine) for _ in range(N)]
    bounded("c=auto all_gather of gradient samples", lambda: dist.all_gather(gathered, mine, async_op=True))
    G = torch.stack(gathered).cpu()
    measured = torch.zeros(len(candidates) + 1, 3, dtype=torch.float64, device=local.device)
    if rank == 0:  # every rank then decides from rank 0's noise, bit for bit
        measured[-1, 0] = noise
    offset = 0
    for k, (c, sample) in enumerate(zip(candidates, samples, strict=True)):
        size = sample.indices.numel()
        if k % N == rank:
            part = G[:, offset : offset + size].contiguous()
            s = None if scales is None else sample.scales(scales.cpu())
            measured[k] = torch.tensor(te.worst_rank_tensor_error(part, auto_c.codes[c], sample, sigma, s, zero))
        offset += size
    bounded("c=auto all_reduce of candidate errors", lambda: dist.all_reduce(measured, async_op=True))
    *numbers, (noise, _, _) = measured.tolist()
    decision = auto_c.decide(
        step, noise, {c: tuple(numbers[k][:2]) for k, c in enumerate(candidates)},
        {c: layout.names[int(numbers[k][2])] for k, c in enumerate(candidates)},
    )  # fmt: skip
    if rank == 0:
        log.info("%s", auto_c.describe(decision))
    record = {"auto_c/noise": noise, "auto_c/allowed_error": decision["allowed"]}
    record.update({f"auto_c/error_c{c}": e for c, e in decision["errors"].items()})
    record.update({f"auto_c/error_se_c{c}": e for c, e in decision["standard_errors"].items()})
    record["auto_c/columns_sampled"] = sum(sample.count for sample in samples)
    return record


def flat_params(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def write_flat_params(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def lm_loss(model, batch: torch.Tensor, loss=next_token_loss) -> torch.Tensor:
    """Next-token cross entropy of a (B, T+1) window batch (``loss``: `next_token_loss`, or its compiled form)."""
    return loss(model(input_ids=batch[:, :-1]).logits, batch[:, 1:])


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
        # the parameter tensors, in the flat gradient's order: errors are judged per tensor
        # (train/aggregation/tensor_errors.py)
        self.tensors = TensorLayout.of(self.model.named_parameters())
        aggregator.use_tensors(list(self.tensors.sizes))  # those that scale per tensor scale each apart
        self.window = feedback_window(cfg.aggregator, self.tensors)  # error feedback: judged over windows of steps
        self.state = TrainState()
        set_dither_calls(0)  # this run's 8-bit dither from its own first call, whatever the process ran before
        self.timer = PhaseTimer(device)
        precision = cfg.trainer.precision
        use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
        low = torch.bfloat16 if use_bf16 else torch.float16 if precision == "fp16" else None
        self.autocast = (lambda: torch.autocast(device.type, dtype=low)) if low is not None else contextlib.nullcontext
        # fp16: the loss is scaled; a step whose (scaled) gradients hold inf/nan anywhere is skipped on every
        # rank and the scale backs off on every rank alike (see _skip_in_scaler).
        self.scaler = build_loss_scaler(cfg.trainer, device) if precision == "fp16" else None  # Pythia's scaler
        self.tokens_per_step = self.t.micro_batch_size * self.t.grad_accum * cfg.data.seq_len * world_size
        self.grads = None if overlap else FlatGradients(self.params)  # overlap: DDP's buckets own the reduction
        # trainer.compile (train/compiling.py): the model is compiled before the first step (compile_before_first_step)
        self.compile = effective_compile(cfg, device.type)
        self.loss = next_token_loss  # the step's loss function: compiled with the model
        self.compile_seconds: float | None = None
        self._deferred_line: tuple | None = None  # a log line written during the next step (`_write_deferred_line`)
        # exact under CERAR (hierarchical: every rank of the last node); checkpoints keep it, resync broadcasts it.
        # With 16-bit transport it is the least-error replica, rounded to the wire's precision, not exact
        self.reference_rank = world_size - 1
        # whether the replicas may now differ: from the first step an approximate aggregate was applied (c=auto and
        # aggregator=auto may aggregate exactly, or with the same bits everywhere, for the whole run) until a resync;
        # they start alike (one seed, DDP's broadcast, or one checkpoint read by every rank)
        self.replicas_differ = False
        self._val_all: list[torch.Tensor] | None = None
        self.auto_c = None  # c=auto: which CERAR code aggregates, chosen from the run's gradients (auto_c.py)
        if cfg.c == "auto" and cfg.aggregator.kind == "cerar" and world_size > 1:
            from train.aggregation.auto_c import build_auto_c

            self.auto_c = build_auto_c(world_size, self.numel, cfg.aggregator)
            aggregator.use_code(self.auto_c.code)
        self.chooses = cfg.aggregator.kind == "auto" and world_size > 1  # aggregator=auto (auto_aggregator.py)
        if self.chooses:
            aggregator.prepare(self.numel, device)  # the links measured, every candidate priced

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> dict:
        """Model/optimizer/scheduler of this rank plus every rank's data position and RNG (gathered)."""
        mine = {"data": self.data.train.state_dict(), "rng": ckpt.rng_states()}
        own = self.aggregator.rank_state()  # error feedback's residuals: each rank's own
        if own is not None:
            mine["aggregator"] = own
        per_rank = [None] * self.world_size
        with guarded("checkpoint all_gather_object"):  # gloo: gloo's timeout bounds the size exchange's wait
            dist.all_gather_object(per_rank, mine, group=group_with_timeout(deadline_s()))
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
            "auto_c": self.auto_c.state_dict() if self.auto_c is not None else None,
            "aggregator": self.aggregator.state_dict(),  # aggregator=auto: its choice and evidence
            "int8_dither_calls": dither_calls(),  # the 8-bit all-reduce's dither key: the resumed run continues it
        }

    def save_checkpoint(self) -> None:
        set_phase("checkpoint")
        state = self.checkpoint_state()  # collective: every rank takes part
        wait_s = self.cfg.checkpoint.write_timeout_s  # how long the others wait for the write
        if self.world_size > 1:  # asked by every rank before the write: creating the group is collective
            writing = group_with_timeout(wait_s)
        if self.rank == self.world_size - 1:  # the rank that always holds the exact aggregate
            path = ckpt.save_checkpoint(self.run_dir, self.state.step, state, self.cfg.checkpoint.keep)
            log.info("checkpoint %s", path)
        if self.world_size > 1:
            # The others wait for the write (checkpoint.write_timeout_s); the writer, once written, waits for ranks
            # that should already be there, so at most the trainer's deadline: a peer stalled inside the barrier
            # must not hold the writer for the write's timeout (30 min by default).
            writer = self.rank == self.world_size - 1
            bounded(
                f"checkpoint barrier (rank {self.world_size - 1} writes; checkpoint.write_timeout_s)",
                lambda: dist.barrier(group=writing, async_op=True),
                timeout_s=deadline_s() if writer else wait_s,
            )

    def restore(self, state: dict) -> None:
        if state["world_size"] != self.world_size:
            raise ckpt.CheckpointError(
                f"the checkpoint was written by {state['world_size']} ranks; this run has "
                f"{self.world_size} (start a fresh run with resume=false)"
            )
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])  # this run's AdamW kernels, whoever wrote it
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.auto_c is not None and state.get("auto_c"):  # the c chosen so far, and its evidence
            self.auto_c.load_state_dict(state["auto_c"])
            self.aggregator.use_code(self.auto_c.code)
        if state.get("aggregator") is not None:
            self.aggregator.load_state_dict(state["aggregator"])
        set_dither_calls(int(state.get("int8_dither_calls", 0)))  # (older checkpoints: none kept, 0)
        mine = state["ranks"][self.rank]
        self.aggregator.load_rank_state(mine.get("aggregator"))
        self.data.train.load_state_dict(mine["data"])
        ckpt.set_rng_states(mine["rng"])
        self.state = TrainState(
            step=state["step"],
            skipped_steps=state["skipped_steps"],
            tokens=state["tokens"],
            last_val_loss=state["last_val_loss"],
        )

    # ------------------------------------------------------------------ compiling

    def compile_before_first_step(self) -> None:
        """trainer.compile: compile the model (train/compiling.py) and run it once, forward and backward, on a batch of
        the step's shape, so that dynamo and inductor compile here, in a phase of their own bounded by
        trainer.compile_timeout_s, and not inside the first step, where a peer waits at most T for this rank in a
        collective. The batch is zeros (no data read, no random number drawn), backward runs under ``no_sync`` (DDP
        reduces nothing) and its gradients are then zeroed: the run goes on as if nothing had run. Every rank then
        waits for the others up to trainer.compile_timeout_s. Where compiling raises, this rank's model stays eager,
        said in one line (the ranks' arithmetic may then differ in rounding; their aggregate does not)."""
        t = self.t
        if not self.compile or self.compile_seconds is not None or self.state.step >= t.max_steps:
            return  # off, done already (fit calls it; a caller may have before), or nothing left to train
        set_phase(COMPILE_PHASE)
        waiting = None
        if self.world_size > 1:  # the barrier's gloo group, made now (a collective) while no rank compiles yet
            with guarded("new_group for the compile barrier (trainer.compile_timeout_s)"):
                waiting = group_with_timeout(t.compile_timeout_s)
        if self.rank == 0:
            log.info("%s", compiling.notice(self.device, len(compiling.layers(self.model)), t.compile_backend,
                                            t.compile_timeout_s))  # fmt: skip
        start = time.perf_counter()
        ok, why = compiling.available()
        try:
            if not ok:
                raise RuntimeError(why)
            self.loss = compiling.compile_model(self.model, t.compile_backend)
            self._compile_pass()
        except Exception as error:  # compiling is optional: the eager model is always there
            compiling.uncompile_model(self.model)
            self.loss = next_token_loss
            log.warning("%s: rank %d runs the model eagerly, compiling failed: %s", compiling.NOTICE_PREFIX, self.rank,
                        first_line(compiling.root_cause(error)))  # fmt: skip
        finally:
            if self.grads is None:  # overlap: DDP would add them into step 1's (flat: each step zeroes its buffer)
                for p in self.params:
                    p.grad = None
        self.compile_seconds = time.perf_counter() - start
        if waiting is not None:
            bounded(
                "barrier after compiling the model (trainer.compile_timeout_s)",
                lambda: dist.barrier(group=waiting, async_op=True),
                timeout_s=t.compile_timeout_s,
            )
        if self.rank == 0 and compiling.is_compiled(self.model):
            log.info("%s: compiled in %.1f s", compiling.NOTICE_PREFIX, self.compile_seconds)
        set_phase("start-up")

    def _zero_batch(self) -> torch.Tensor:
        """A batch of the step's shape, all zeros: what the passes before the first step run (no data read)."""
        return torch.zeros(self.t.micro_batch_size, self.cfg.data.seq_len + 1, dtype=torch.long, device=self.device)

    def _compile_pass(self) -> None:
        """One forward and backward of a zero batch of the step's shape through DDP (as the step calls it), outside
        DDP's reduction (``no_sync``): what makes dynamo compile the layers' forward and backward and the loss."""
        batch = self._zero_batch()
        with self.ddp.no_sync():
            with self.autocast():
                loss = lm_loss(self.ddp, batch, self.loss)
            loss.backward()

    def settle_ddp_buckets(self) -> None:
        """trainer.overlap=true, before the aggregator's hook is registered: make DDP build the buckets it keeps for
        the whole run now, so that every step of every launch, first or resumed, reduces in the same buckets.

        Why: torch 2.13's DDP starts with every parameter in one bucket (`_BucketCapacityConfig.
        compute_bucket_size_limits`, torch/nn/parallel/distributed.py: ``[sys.maxsize]`` unless
        find_unused_parameters or static_graph) and rebuilds its buckets once, in the order the gradients became
        ready in its first synchronised backward (`Reducer::autograd_hook` records that order while
        `should_rebuild_buckets()`; `Reducer::rebuild_buckets` cuts it at the bucket size). Left to the first step, a
        restarted process would reduce its first step in the one bucket where the uninterrupted run, past its own
        first step, reduced it in the rebuilt ones, and the bits of a sum depend on where a value falls in its
        bucket (gloo's ring, NCCL's channels): a resumed run would not be the uninterrupted one's bits.

        How: one forward and backward of a zero batch of the step's shape through DDP's own all-reduce (no hook is
        registered yet, so no aggregator's state counts it), its gradients then dropped; no random number is drawn
        (the generators are forked around it). Then the rebuild itself: its broadcast (`Reducer::rebuild_buckets` ->
        `sync_bucket_indices`, which copies rank 0's bucket order to the CPU) blocks the host, so it runs here under
        the host watchdog, and not where DDP would run it, unbounded, in the next forward
        (`DistributedDataParallel._pre_forward`); the steps' forwards find it done (`_rebuild_buckets` returns
        False once `has_rebuilt_bucket_`). Cost: one micro-batch's forward and backward and one all-reduce of the
        gradient, once per launch."""
        self.model.train()
        batch = self._zero_batch()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), guarded("DDP's bucket order pass (its backward's all-reduce)"):
            with self.autocast():
                loss = lm_loss(self.ddp, batch, self.loss)
            loss.backward()
        for p in self.params:
            p.grad = None
        with guarded("DDP bucket rebuild broadcast"):
            if self.ddp.reducer._rebuild_buckets():
                self.ddp._has_rebuilt_buckets = True

    # ------------------------------------------------------------------ one step

    def _forward_backward(self) -> torch.Tensor:
        """All micro-batches of one step; returns this rank's mean loss as a device scalar (no host sync)."""
        total = torch.zeros((), device=self.device)
        for micro in range(self.t.grad_accum):
            with self.timer.phase("data"):  # time/data: waiting for the next batch
                batch = self.data.train.next_batch(self.t.micro_batch_size)
                if self.device.type == "cuda":  # pinned: the copy then runs behind the queued kernels, host free
                    batch = batch.pin_memory()
                batch = batch.to(self.device, non_blocking=True)
            last = micro == self.t.grad_accum - 1
            sync = self.overlap and last  # overlap: DDP's hook reduces on the last micro-batch only
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with self.timer.phase("forward"), self.autocast():
                    loss = lm_loss(self.ddp, batch, self.loss) / self.t.grad_accum
                scaled = self.scaler.scale(loss) if self.scaler is not None else loss
                with (
                    self.timer.phase("backward"),
                    guarded(f"backward with {self.aggregator.name} hook") if sync else (contextlib.nullcontext()),
                ):
                    scaled.backward()
            total += loss.detach()
        return total

    def _grads_finite_everywhere(self, flat: torch.Tensor | None, loss: torch.Tensor) -> tuple[bool, float]:
        """One all-reduce of [non-finite flag, loss] and the step's one host read: whether every rank's gradients
        are finite (every rank skips a step alike if any rank saw inf/nan: the flags' sum is 0 only if none did)
        and the train loss, the mean over the ranks (the loss is ready: backward came after it). The read must
        precede the optimizer step, which it decides, and the aggregation, which must not take inf or nan into
        the aggregators' state or the autos' measurements; it waits for this rank's backward, then the host
        queues the optimizer's few kernels (docs/training.md: what a later read would cost)."""
        pair = torch.stack([local_nonfinite(self.params, flat).to(torch.float64), loss.detach().to(torch.float64)])
        if self.world_size > 1:  # a group of one sums nothing
            bounded("non-finite flag all_reduce (and the train loss)", lambda: dist.all_reduce(pair, async_op=True))
        nonfinite, loss_sum = read_on_host(pair)  # the all-reduce has completed: the read waits for nothing remote
        return nonfinite == 0.0, loss_sum / self.world_size

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
        if self.params[0].grad is None:
            self.params[0].grad = torch.empty_like(self.params[0])
        self.params[0].grad.fill_(float("nan"))
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)  # sees the inf: does not step
        self.scaler.update()

    def train_step(self) -> StepRecord:
        """One optimizer step, as a table of contents: each phase is a method below, timed by `self.timer`."""
        step = self._begin_step()
        loss = self._forward_backward()
        if self._deferred_line is not None:  # the previous step's log line, written while this step's kernels run
            self._write_deferred_line()
            set_phase("after backward")
        self._maybe_inject_nonfinite(step)
        record: dict = {"lr": self.scheduler.get_last_lr()[0]}  # the lr this step's update uses
        if self.overlap:  # DDP's buckets have aggregated during the backward pass (the aggregator's hook)
            bytes_sent, finite = self._after_hook_aggregation(loss, record)
        else:
            bytes_sent, finite = self._aggregate_flat(step, loss, record)
        self._optimizer_step(step, finite, record)
        return self._end_step(step, bytes_sent, record)

    def _begin_step(self) -> int:
        """The step now starting: a timer of its own (the last step's may not be read yet), its number published
        (error lines, the watchdog), gradients zeroed (flat mode: the one buffer every parameter's gradient views)."""
        self.timer = PhaseTimer(self.device)
        step = self.state.step + 1
        set_step(step)
        if self.grads is not None:
            self.grads.zero_()
        return step

    def _after_hook_aggregation(self, loss: torch.Tensor, record: dict) -> tuple[int, bool]:
        """Overlapped mode: the bytes the hook sent and whether the gradients are finite on every rank (and the train
        loss). DDP's buckets were settled before the first step (`settle_ddp_buckets`)."""
        bytes_sent = self.aggregator.bytes_sent_by_hook(self.numel)
        self._note_replicas_differ()
        finite, record["train_loss"] = self._grads_finite_everywhere(None, loss)
        return bytes_sent, finite

    def _aggregate_flat(self, step: int, loss: torch.Tensor, record: dict) -> tuple[int, bool]:
        """Flat mode: skip everywhere if any rank's gradients are not finite; else unscale (fp16), let the autos
        choose before aggregating, aggregate the flat gradient in place, and measure the aggregate's error
        where due. Returns the bytes sent and whether the step may update."""
        flat = self.grads.flat
        finite, record["train_loss"] = self._grads_finite_everywhere(flat, loss)  # before aggregation
        if not finite:
            return 0, False
        if self.scaler is not None:  # aggregate true gradients, not scaled ones (in place, in flat)
            self.scaler.unscale_(self.optimizer)
        self._choose(step, flat, record)
        local = exact = None
        if self._measures_error(step):
            local, exact = flat.clone(), exact_mean(flat)
        with self.timer.phase("aggregate"), guarded(f"aggregate ({self.aggregator.name})"):
            bytes_sent = self.aggregator.aggregate(flat)
        self._note_replicas_differ()
        if exact is not None:
            record.update(error_and_noise(local, flat, exact, self.rank))
            record.update(per_tensor_figures(local, flat, exact, self.tensors, self.optimizer, self.params))
            if self.window is not None:
                record.update(self.window.add(step, local, flat, exact))
            record["noise/sequences_per_step"] = self.t.micro_batch_size * self.t.grad_accum * self.world_size
        return bytes_sent, True

    def _note_replicas_differ(self) -> None:
        """After an aggregation: the replicas may differ from now on if this call's aggregates may (read at every
        call, since the autos switch what aggregates); only a resync makes them alike again."""
        self.replicas_differ |= self.world_size > 1 and self.aggregator.replicas_differ

    def _choose(self, step: int, flat: torch.Tensor, record: dict) -> None:
        """c=auto and aggregator=auto, at their checks: measured on this step's gradients before aggregating,
        since either may switch what aggregates them (train/aggregation/auto_c.py, auto_aggregator.py)."""
        if self.auto_c is not None and self.auto_c.due(step):
            with self.timer.phase("auto_c"):
                a = self.cfg.aggregator
                scales = self.aggregator.tensor_scales(flat)  # CERAR's equilibration (None: none)
                record.update(measure_auto_c(self.auto_c, flat, step, self.cfg.seed, a.auto_sample_values,
                                             self.tensors, scales))  # fmt: skip
                self.aggregator.use_code(self.auto_c.code)
        if self.chooses and self.aggregator.due(step):
            with self.timer.phase("auto"):
                record.update(self.aggregator.check(flat, step, self.cfg.seed, self.tensors))

    def _measures_error(self, step: int) -> bool:
        """Whether this step measures its aggregate against an exact all-reduce of the same gradients."""
        window = None if self.window is None else self.window.window  # under windows, whole windows only
        return not self.overlap and self.world_size > 1 and measured_step(step, self.t.measure_error_every, window)

    def _optimizer_step(self, step: int, finite: bool, record: dict) -> None:
        """Clip, step and schedule where every rank's gradients were finite; else skip the step on every rank
        alike (fp16: every rank's scaler backs off)."""
        with self.timer.phase("optimizer"):
            if finite:
                if self.scaler is not None and self.overlap:
                    self.scaler.unscale_(self.optimizer)
                if self.cfg.model.grad_clip > 0:
                    record["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.model.grad_clip)
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
                record["amp/scale"] = self.scaler.get_scale()
            if self.grads is None:
                self.optimizer.zero_grad(set_to_none=True)

    def _end_step(self, step: int, bytes_sent: int, record: dict) -> StepRecord:
        """The step counted, and its record: what the loop logs when due. Its device values (grad_norm) start
        their copy to the host now, read when the line is written (`HostValue`): no host read here."""
        self.state.step = step
        self.state.tokens += self.tokens_per_step
        record.update({"bytes_sent": bytes_sent, "skipped_steps": self.state.skipped_steps})
        record.update(self.aggregator.step_metrics())  # hierarchical: bytes_sent/intra_node, bytes_sent/inter_node
        if self.auto_c is not None:
            record["auto_c/c"] = self.auto_c.c  # the code this step aggregated with
        values = {k: HostValue(v) if isinstance(v, torch.Tensor) else v for k, v in record.items() if v is not None}
        return StepRecord(values, self.timer)

    # ------------------------------------------------------------------ diagnostics

    @torch.no_grad()
    def _loss_sum(self, batches: list[torch.Tensor]) -> torch.Tensor:
        """[sum of token losses, tokens] over `batches` with this rank's parameters, as a float64 device pair. Eager
        where the model is compiled: a no-grad, eval-mode graph would compile here, while the peers wait (T) in the
        evaluation's collective (train/compiling.py)."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in batches:
            batch = batch.to(self.device)
            with self.autocast(), compiling.eager():
                loss = lm_loss(self.model, batch)
            n = batch[:, 1:].numel()
            total += torch.stack([loss.double() * n, torch.tensor(float(n), dtype=torch.float64, device=self.device)])
        self.model.train()
        return total

    def _whole_validation_set(self) -> list[torch.Tensor]:
        """Every rank's share of the fixed validation set, gathered once (replicas that differ each need all)."""
        if self._val_all is None:
            shares = [None] * self.world_size
            mine = [b.cpu() for b in self.data.val_batches]
            with guarded("all_gather_object of the validation shares"):  # on gloo: bounded by gloo's timeout
                dist.all_gather_object(shares, mine, group=group_with_timeout(deadline_s()))
            self._val_all = [batch for share in shares for batch in share]
        return self._val_all

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss over the fixed validation set: the reference replica's (`val_loss`) and the
        worst replica's. Replicas that agree split the set between them; replicas that may differ
        (CERAR, since its first approximate step) each evaluate the whole set with their own parameters."""
        set_phase("eval")
        if not self.replicas_differ:
            total = self._loss_sum(self.data.val_batches)
            bounded("evaluation all_reduce", lambda: dist.all_reduce(total, async_op=True))
            loss = float(total[0] / total[1])
            return {"val_loss": loss, "val_loss_worst_replica": loss, "eval/each_replica": 0}
        total = self._loss_sum(self._whole_validation_set())
        losses = [torch.empty_like(total) for _ in range(self.world_size)]
        bounded("evaluation all_gather", lambda: dist.all_gather(losses, total, async_op=True))
        per_rank = [float(t[0] / t[1]) for t in losses]
        return {
            "val_loss": per_rank[self.reference_rank],
            "val_loss_worst_replica": max(per_rank),
            "eval/each_replica": 1,
        }

    @torch.no_grad()
    def replica_drift(self) -> dict:
        """How far approximate aggregation let the replicas part from the reference replica (rank N-1):
        max |theta_r - theta_ref| and ||theta_r - theta_ref|| / ||theta_ref||, each the worst rank's."""
        set_phase("drift")
        theta = flat_params(self.params).float()
        reference = theta.clone()
        bounded(
            f"drift broadcast from rank {self.reference_rank}",
            lambda: dist.broadcast(reference, src=self.reference_rank, async_op=True),
        )
        difference = theta - reference
        worst = torch.stack([difference.abs().max(), difference.norm() / reference.norm().clamp_min(1e-30)])
        bounded("drift all_reduce", lambda: dist.all_reduce(worst, op=dist.ReduceOp.MAX, async_op=True))
        max_abs, rel_l2 = worst.tolist()
        return {"drift/max_abs": max_abs, "drift/rel_l2": rel_l2}

    @torch.no_grad()
    def resync_from_exact_rank(self) -> None:
        """Broadcast the parameters of the reference replica, rank N-1 (exact under CERAR), to every replica."""
        set_phase("resync")
        theta = flat_params(self.params)
        bounded(
            f"resync broadcast from rank {self.reference_rank}",
            lambda: dist.broadcast(theta, src=self.reference_rank, async_op=True),
        )
        write_flat_params(self.params, theta)
        self.replicas_differ = False  # every replica now holds the reference replica's parameters

    # ------------------------------------------------------------------ the loop

    def _due(self, every: int, step: int) -> bool:
        return every > 0 and step % every == 0

    def fit(self) -> dict:
        """Steps to trainer.max_steps (or stop_after_step); after each, as due: drift, resync, the log line with
        its evaluation, a checkpoint. A log line without an evaluation is written during the next step, while its
        forward and backward run on the device (`_write_deferred_line`), and before anything that must follow it
        (a checkpoint, the end of this launch): writing it reads nothing the device has still to compute."""
        t, start_wall, start_step = self.t, time.perf_counter(), self.state.step
        bar = None
        if self.rank == 0 and t.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.model.train()
        self.compile_before_first_step()
        logged_once: set[str] = set()
        while self.state.step < t.max_steps:
            step_start = time.perf_counter()
            record = self.train_step()
            step, step_seconds = self.state.step, time.perf_counter() - step_start
            last = step == t.max_steps
            evaluates = self._due(t.eval_every, step) or last
            logged = self._due(t.log_every, step) or evaluates
            if logged and self.compile_seconds is not None and "compile" not in logged_once:
                record.values["time/compile"] = self.compile_seconds  # this launch's compile, before its first step
                logged_once.add("compile")
            drift = {}
            if logged and self.world_size > 1 and self._due(t.drift_every, step):
                drift = self.replica_drift()  # before a resync at this step: the drift its interval built up
            if self.world_size > 1 and self._due(t.resync_every, step):
                self.resync_from_exact_rank()
            if logged:
                line = (step, record, step_seconds, drift, start_wall)
                if evaluates:
                    self._write_deferred_line()
                    self._log_step(*line, evaluates=True)
                else:
                    self._deferred_line = (*line, time.perf_counter() - start_wall)
                if bar is not None:
                    bar.set_postfix(loss=f"{record['train_loss']:.3f}", refresh=False)
            if self._due(self.cfg.checkpoint.every, step) or (last and self.cfg.checkpoint.at_end):
                self._write_deferred_line()  # metrics.jsonl holds the checkpoint's step before a resume reads it
                self.save_checkpoint()
            if bar is not None:
                bar.update(1)
            if t.stop_after_step and start_step < t.stop_after_step <= step and not last:
                break
        self._write_deferred_line()
        if bar is not None:
            bar.close()
        finished = self.state.step == t.max_steps
        if finished and self.state.last_val_loss is None:  # a run resumed at its last step keeps the last one's
            self.state.last_val_loss = self.evaluate()["val_loss"]
        return {
            "wall_seconds": time.perf_counter() - start_wall,
            "steps_this_run": self.state.step - start_step,
        }

    def _write_deferred_line(self) -> None:
        """Write the log line `fit` deferred, if any (local work: its values are on the host or on their way)."""
        if self._deferred_line is not None:
            *line, wall = self._deferred_line
            self._deferred_line = None
            self._log_step(*line, evaluates=False, wall=wall)

    def _log_step(
        self,
        step: int,
        record: StepRecord,
        step_seconds: float,
        drift: dict,
        start_wall: float,
        evaluates: bool,
        wall: float | None = None,
    ) -> float:
        """One line of metrics.jsonl (and W&B): the train loss (the mean over the ranks, read with the step's
        non-finite flag), the phases' seconds, the step's record and drift, and an evaluation when due. ``wall``:
        the seconds since the loop began at the step's end (a deferred line); else measured now, after the
        evaluation. Returns the loss."""
        set_phase("logging")
        values = record.line()  # waits for this step's kernels only (its events, its values' copies)
        train_loss = values.pop("train_loss")
        out = {"step": step, "train_loss": train_loss}
        out.update({k: values.pop(k) for k in list(values) if k.startswith("time/")})
        out["time/step"] = step_seconds
        out["tokens_per_s"] = self.tokens_per_step / step_seconds
        out.update(values)
        out.update(drift)
        if evaluates:
            evaluation = self.evaluate()
            self.state.last_val_loss = evaluation["val_loss"]
            out.update(evaluation)
        # seconds since this launch's loop began, evaluation included: the wall clock a curve of val_loss
        # is drawn against (scripts/studies/time_to_loss.py: the time to reach a loss)
        out["time/wall"] = time.perf_counter() - start_wall if wall is None else wall
        if not math.isfinite(train_loss):
            log.warning("step %d: train loss is %s", step, train_loss)
        self.logger.log(out)
        return train_loss
