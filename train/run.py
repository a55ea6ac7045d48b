"""One training run, top to bottom: validate, start the process group, build data, model, optimizer
and aggregator, resume if asked, train, write the summary. Entry points: train/main.py (Hydra) and
train/sweep.py (several runs in one launch).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from train import checkpoint as ckpt
from train import watchdog
from train.aggregation.build import build_aggregator, enable_fused
from train.config import (
    ConfigError,
    code_fingerprint,
    config_fingerprint,
    derived_grad_accum,
    effective_overlap,
    node_layout,
    normalise_resume,
    training_identity,
    validate,
)
from train.data import EMBEDDED_KEY, build_data
from train.distributed import (
    bounded,
    check_same_config,
    deadline_s,
    each_new_group_guarded,
    group_timeout_s,
    group_with_timeout,
    guarded,
    init_process_group,
    launch_from_env,
    pick_device,
    set_deadline,
    set_phase,
)
from train.loop import Trainer
from train.metrics import RunLogger, parameter_sha256
from train.model import build_model, build_optimizer, count_parameters
from train.schedule import build_scheduler

log = logging.getLogger("train")


def run(cfg: DictConfig, run_dir: Path) -> dict | None:
    """One training run writing into run_dir; returns its summary (None when stopped early). From the process
    group on, the host watchdog (train/watchdog.py) watches every phase; it stops when the run returns or raises."""
    try:
        return _run(cfg, run_dir)
    finally:
        watchdog.stop()


def _run(cfg: DictConfig, run_dir: Path) -> dict | None:
    launch = launch_from_env()
    validate(cfg, world_size=launch.world_size)  # before any process group: bad input stops here
    cfg.trainer.grad_accum = derived_grad_accum(cfg, launch.world_size)  # from trainer.global_batch_size if set
    ckpt.check_resume_matches(run_dir, cfg, launch.world_size)  # train/main.py checked already; sweeps did not
    resume = normalise_resume(cfg.resume)
    if launch.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)

    device = pick_device(cfg, launch)
    write_pid_file(run_dir, launch.rank)
    T = cfg.trainer.collective_timeout_s
    watchdog.start(watchdog.Deadlines.of(cfg, launch.world_size, group_timeout_s(device, T)), launch.rank)
    set_phase("start-up: fused kernels")  # local work, before any collective: no rank compiles inside one
    enable_fused(cfg.aggregator, device, say_it=launch.rank == 0)
    set_phase("start-up: process group")
    if not dist.is_initialized():  # train/sweep.py starts the group once for several runs
        init_process_group(launch, device, T)
    set_deadline(T)  # also when the group was started before (sweeps, tests)
    set_phase("start-up")
    check_same_config(config_fingerprint(cfg), code_fingerprint(), device)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DDP also broadcasts rank 0's)

    set_phase("start-up: data")
    data = build_data(cfg, launch.rank, launch.world_size)
    if data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{data.vocab_size} tokens (data={cfg.data.name}); pick a Pythia model or raise it"
        )
    set_phase("start-up: model")
    model = build_model(cfg.model, device)
    log.info(
        "model %s: %s parameters; %d ranks on %s; aggregator %s (c=%s)%s",
        cfg.model.name,
        f"{count_parameters(model):,}",
        launch.world_size,
        device,
        cfg.aggregator.name,
        cfg.c,
        "" if cfg.aggregator.transport == "float32" else f", {cfg.aggregator.transport} messages",
    )
    optimizer = build_optimizer(model, cfg.model, device)  # fused AdamW on CUDA, foreach elsewhere
    scheduler = build_scheduler(optimizer, cfg.model, cfg.trainer.max_steps)
    set_phase("start-up: subgroups")
    with each_new_group_guarded("new_group calls (the aggregator and loop groups)"):  # ncclCommSplit: no work
        aggregator = build_aggregator(cfg, launch.world_size)
        if launch.world_size > 1:  # the loop's gloo groups now, not at the first checkpoint or evaluation
            group_with_timeout(T)
            group_with_timeout(cfg.checkpoint.write_timeout_s)
            group_with_timeout(logger_group_timeout_s(cfg))  # the barriers after the logger's start and close

    overlap = effective_overlap(cfg)
    set_phase("start-up: DDP")
    with guarded("DDP constructor (its shape all-gather and state broadcasts, read on the host)"):
        ddp = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=ddp_bucket_cap_mb(cfg, model, device, overlap),
            **no_forward_buffer_sync(),
        )
    set_phase("start-up: aggregator")

    trainer = Trainer(
        cfg,
        ddp=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        aggregator=aggregator,
        logger=None,
        device=device,
        rank=launch.rank,
        world_size=launch.world_size,
        run_dir=run_dir,
        overlap=overlap,
    )
    if overlap:  # DDP's buckets for every step first, then the hook (Trainer.settle_ddp_buckets)
        set_phase("start-up: DDP buckets")
        trainer.settle_ddp_buckets()
        set_phase("start-up: DDP hook")
        # a hook's state may make groups of its own (cerar/ddp.py, cerar/hierarchical/hook.py): each split under its
        # own 2T, not DDP's 4T
        with each_new_group_guarded("new_group calls (the DDP hook's groups)"):
            aggregator.register_hook(ddp)
    resumed_from = resume_or_start_fresh(trainer, run_dir, resume, launch.rank, device)
    if trainer.auto_c is not None:
        auto = trainer.auto_c
        ring = auto.bytes_by_c[launch.world_size]
        log.info(
            "c=auto: c=%d now; candidates %s (bytes / the ring's); chosen at step %d from error <= %g x noise, "
            "re-checked every %d steps",
            auto.c,
            ", ".join(f"c={c} {auto.bytes_by_c[c] / ring:.3f}" for c in sorted(auto.codes)),
            auto.warmup_steps,
            auto.budget,
            auto.check_every,
        )

    batch = {
        "world_size": launch.world_size,
        "global_batch_size": cfg.trainer.micro_batch_size * cfg.trainer.grad_accum * launch.world_size,
        "grad_accum": cfg.trainer.grad_accum,
    }
    set_phase("start-up: logger")  # W&B's start, bounded by the logger itself (wandb.start_timeout_s)
    trainer.logger = RunLogger(
        cfg, run_dir, launch.world_size, launch.rank == 0, trainer.state.step, device=device, extra_config=batch
    )
    barrier_after_the_logger(cfg, "start", launch.rank)
    result = trainer.fit()
    set_phase("end")
    if trainer.state.step < cfg.trainer.max_steps:  # trainer.stop_after_step: a simulated preemption
        log.warning("stopped after step %d of %d (trainer.stop_after_step)", trainer.state.step, cfg.trainer.max_steps)
        set_phase("end: closing the logger")  # W&B's upload, bounded by the logger itself (wandb.close_timeout_s)
        trainer.logger.close()
        barrier_after_the_logger(cfg, "close", launch.rank)
        return None
    summary = {
        **run_description(cfg, launch.world_size, trainer),
        "final_step": trainer.state.step,
        "final_val_loss": trainer.state.last_val_loss,
        "wall_seconds": result["wall_seconds"],
        "tokens": trainer.state.tokens,
        "param_sha256": parameter_sha256(model),
        "param_sha256_per_rank": gather_param_sha256(model),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),  # torchrun's restarts of this job
        "skipped_steps": trainer.state.skipped_steps,
        "resumed_from_step": resumed_from,
        **batch,
        "parameters": count_parameters(model),
    }
    if device.type == "cuda":
        summary["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    set_phase("end: closing the logger")  # W&B's upload, bounded by the logger itself (wandb.close_timeout_s)
    trainer.logger.summary(summary)
    trainer.logger.close()
    barrier_after_the_logger(cfg, "close", launch.rank)
    if launch.rank == 0 and "auto" in summary:  # aggregator=auto: its choice, predicted beside measured
        auto = summary["auto"]
        log.info(
            "aggregator=auto: %s; seconds per aggregation, predicted / measured: %s",
            auto["fallback"] or f"chose {auto['choice']}",
            ", ".join(
                f"{name} {auto['predicted_s'].get(name, math.nan):.4g} / {seconds:.4g} ({auto['calls'][name]} calls)"
                for name, seconds in auto["measured_s"].items()
            ),
        )
    if launch.rank == 0:  # the one line to read at the end of a long log
        val = summary["final_val_loss"]
        print(
            f"done: {summary['final_step']} steps, val_loss {'n/a' if val is None else f'{val:.4f}'}, "
            f"{summary['wall_seconds']:.0f} s "
            f"this launch, run dir {run_dir}",
            flush=True,
        )
    return summary


def reference_replica(cfg: DictConfig, trainer: Trainer) -> str:
    """What the reference replica (rank N-1: checkpoints keep it, resync broadcasts it, drift and val_loss are
    measured against it) holds: the exact average, or (16-bit transport) the average within the wire's rounding."""
    a = cfg.aggregator
    if a.kind == "auto":
        return f"rank N-1, as aggregator=auto's last choice ({trainer.aggregator.choice.choice}) leaves it"
    if a.kind in ("nccl", "fp16", "bf16", "powersgd"):
        return "rank N-1, as every rank (torch's aggregate)"
    if a.transport != "float32":
        same = "the same bits on every rank" if not trainer.aggregator.replicas_differ else "each rank its own"
        return f"rank N-1, {a.transport}-rounded: within the wire's rounding of the exact average ({same})"
    return "rank N-1, exact (the closed-form constructions' last rank; the exact ring everywhere)"


def run_description(cfg: DictConfig, world_size: int, trainer: Trainer) -> dict:
    """What tells this run from another, for its summary.json: the named fields a reader compares runs by (the
    aggregator, the code it used, resync, the batch in sequences and tokens) and, under `training_identity`,
    every value that changes what is trained (config.training_identity), plus the code that ran."""
    t, a = cfg.trainer, cfg.aggregator
    code = getattr(trainer.aggregator, "code", None)  # CERAR's code at the end of the run (None: exact ring, N=1)
    cerar = a.kind in ("cerar", "hier_cerar")  # hier_cerar: the code for the nodes (None where no code runs)
    description = {
        "model": cfg.model.name,
        "data": cfg.data.name,
        "corpus": EMBEDDED_KEY if cfg.data.kind == "embedded" else cfg.data.kind,
        "seed": cfg.seed,
        "aggregator": a.name,
        "aggregator_kind": a.kind,
        "construction": a.construction if cerar else None,
        "c": cfg.c,  # as asked: an integer or "auto"
        "c_chosen": code.c if cerar and code is not None else None,  # the c that aggregated the last step
        "eps": code.eps if cerar and code is not None else None,  # the code's largest |a^N - 1|
        "kappa": code.kappa if cerar and code is not None else None,
        "kappa_max": a.kappa_max if cerar else None,  # as asked (null: cerar's default)
        "transport": a.transport,  # the wire dtype of cerar's aggregators (docs/cerar-16bit.md)
        "reference_replica": reference_replica(cfg, trainer),
        "resync_every": t.resync_every,
        "overlap": effective_overlap(cfg),
        "precision": t.precision,
        "max_steps": t.max_steps,
        "world_size": world_size,
        "micro_batch_size": t.micro_batch_size,
        "grad_accum": t.grad_accum,
        "global_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "seq_len": cfg.data.seq_len,
        "tokens_per_step": t.micro_batch_size * t.grad_accum * world_size * cfg.data.seq_len,
        "lr": cfg.model.lr,
        "training_identity": training_identity(cfg, world_size),
        "code_fingerprint": code_fingerprint(),
    }
    layout = getattr(trainer.aggregator, "layout", None)  # hier_cerar / hier_ring
    if layout is not None:
        description["nodes"], description["local_size"] = layout.nodes, layout.local_size
        description["method_between_nodes"] = getattr(trainer.aggregator, "method", None)  # auto: per choice
    if trainer.auto_c is not None:
        auto = trainer.auto_c
        description["auto_c"] = {
            "error_budget": auto.budget,
            "warmup_steps": auto.warmup_steps,
            "check_every": auto.check_every,
            "candidates": sorted(auto.codes),
            "bytes_per_step": {c: auto.bytes_by_c[c] for c in sorted(auto.codes)},
            "decisions": auto.state_dict()["decisions"],
        }
    if a.kind == "auto" and world_size > 1:
        description["auto"] = trainer.aggregator.summary()
    return json.loads(json.dumps(description))  # JSON's view: c as string keys, as summary.json will hold them


def logger_wait_s(cfg: DictConfig, which: str) -> float:
    """How long the other ranks wait at the barrier after rank 0's logger ``which`` ("start" or "close"): the
    logger's own deadline (wandb.start_timeout_s, wandb.close_timeout_s) + T; T when W&B is off."""
    T = cfg.trainer.collective_timeout_s
    return T if cfg.wandb.mode == "disabled" else T + cfg.wandb[f"{which}_timeout_s"]


def logger_group_timeout_s(cfg: DictConfig) -> float:
    """The gloo group of both barriers after the logger (made at start-up): gloo's own timeout past either wait."""
    return max(logger_wait_s(cfg, "start"), logger_wait_s(cfg, "close"))


def barrier_after_the_logger(cfg: DictConfig, which: str, rank: int) -> None:
    """Every rank meets after rank 0's logger start or close (W&B's init or finish: online, an upload). The others
    wait as long as the logger may take (`logger_wait_s`), so a slow but live W&B is no stall: before, they
    waited T at the final barrier while rank 0 uploaded, and a finished run ended in exit 3 (and its restart
    evaluated and closed again). Rank 0, there last, waits T for ranks that should already be there. No collective
    follows the close but this barrier, and NCCL's teardown after it finds every rank past the logger (its
    ``ncclCommDestroy`` waits for the peers connected to this rank's proxy: nccl's proxy.cc ``ncclProxyService``
    serves ``while (stop == PROXY_RUNNING || npeers > 0)``, and ``commFree`` joins that thread)."""
    if dist.get_world_size() < 2:
        return
    group = group_with_timeout(logger_group_timeout_s(cfg))
    bounded(
        f"barrier after the logger's {which} (rank 0: W&B, wandb.{which}_timeout_s)",
        lambda: dist.barrier(group=group, async_op=True),
        timeout_s=deadline_s() if rank == 0 else logger_wait_s(cfg, which),
    )


def write_pid_file(run_dir: Path, rank: int) -> None:
    """<run dir>/pids/rank<r>.pid: which process is which rank (tests and scripts/checks/chaos.py signal them)."""
    folder = run_dir / "pids"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".rank{rank}.pid.tmp"
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, folder / f"rank{rank}.pid")


def gather_param_sha256(model: torch.nn.Module) -> list[str]:
    """Every rank's parameter fingerprint, in rank order (equal under exact aggregators or after a resync)."""
    shas = [None] * dist.get_world_size()
    with guarded("all_gather_object of parameter fingerprints"):
        dist.all_gather_object(shas, parameter_sha256(model), group=group_with_timeout(deadline_s()))  # gloo
    return shas


def no_forward_buffer_sync() -> dict:
    """DDP's argument that stops it broadcasting the module's buffers at the start of every forward that follows a
    synchronised backward (trainer.overlap=true: every step). GPTNeoX's only buffers are the rotary frequencies,
    constants computed alike on every rank, and that broadcast is a collective outside the trainer's deadline: on
    gloo it blocks the host until gloo's own timeout, so a peer stalled in a step's data ended the survivors
    there with a traceback, not exit 3. torch 2.13 names it `forward_sync_buffers` (which keeps DDP's start-up
    sync), earlier versions `broadcast_buffers`."""
    import inspect

    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def ddp_bucket_cap_mb(cfg: DictConfig, model: torch.nn.Module, device, overlap: bool) -> float:
    """trainer.bucket_cap_mb; when unset, DDP's 25 MiB, or for CERAR `cerar.ddp.default_bucket_cap_mb` (its
    rounds carry d/c values, not d/N). PowerSGD on gloo gets one bucket: its chained collectives, issued from
    future callbacks of several buckets, can interleave differently on different ranks there."""
    from cerar.ddp import DDP_DEFAULT_BUCKET_CAP_MB, default_bucket_cap_mb

    cap = cfg.trainer.bucket_cap_mb
    if cap is None:
        cerar_hook = overlap and cfg.aggregator.kind == "cerar"  # c=auto is flat-only (config.validate)
        cap = default_bucket_cap_mb(dist.get_world_size(), cfg.c) if cerar_hook else DDP_DEFAULT_BUCKET_CAP_MB
        if overlap and cfg.aggregator.kind == "hier_cerar":  # each rail's rounds carry d/(G c): scaled for n nodes
            cap = default_bucket_cap_mb(node_layout(cfg, dist.get_world_size()).nodes, cfg.c)
    cap = float(cap)
    if overlap and cfg.aggregator.kind == "powersgd" and device.type == "cpu":
        model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        cap = max(cap, model_mb + 1.0)
    return cap


def resume_or_start_fresh(trainer: Trainer, run_dir: Path, resume: str, rank: int, device) -> int | None:
    """resume=auto: continue from the newest valid checkpoint if any; true: require one; false: fresh."""
    if resume == "false":
        bounded("barrier before removing checkpoints", lambda: dist.barrier(async_op=True))
        if rank == 0 and (removed := ckpt.discard_checkpoints(run_dir)):
            log.warning("resume=false: removed %d old checkpoint(s) in %s", removed, run_dir)
        bounded("barrier after removing checkpoints", lambda: dist.barrier(async_op=True))
        return None
    set_phase("start-up: reading the checkpoint")
    loaded = ckpt.load_latest_checkpoint(run_dir)  # on CPU; restore() copies it onto this run's device
    if loaded is None:
        if resume == "true":
            raise ckpt.CheckpointError(f"resume=true but {ckpt.checkpoint_dir(run_dir)} holds no valid checkpoint")
        return None
    state, path = loaded
    set_phase("start-up: restoring the checkpoint")  # copies to the device: behind DDP's broadcasts on its stream
    trainer.restore(state)
    log.info("resumed from %s (step %d)", path, trainer.state.step)
    return trainer.state.step


def finish() -> None:
    """Tear down the process group if this process started one, watched by the host watchdog with T (on NCCL
    ``destroy_process_group`` flushes what is in flight, and can wait on kernels that wait for a peer that has
    gone, until torch's watchdog SIGABRTs: `train.watchdog.Deadlines`, ``DESTROY``)."""
    if dist.is_initialized():
        with watchdog.watching_again(watchdog.DESTROY):
            dist.destroy_process_group()
