"""Training launches the tests share: torchrun and single-process launches of train/, and one launch of
train/sweep.py per world size whose runs several test modules read (the ``sweep`` fixture, tests/conftest.py).

What the runs are: model=tiny, 6 steps of 2 x 4 sequences of 32 tokens per rank, evaluated at steps 3 and 6.
The N-rank launch trains once with every aggregator (``AGGREGATORS``), with CERAR resynchronised every 3
steps, at N=2 also with the same batch through gradient accumulation and as ring and int8 runs stopped after
step 3 and resumed in their folders, and at N=4 as the overlapped nccl run stopped and resumed. Every step
measures the aggregate against an exact all-reduce of the same gradients; drift every 3 steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

from tests.distributed import launch_script, run_script

ROOT = Path(__file__).resolve().parents[1]

SMALL = [
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "trainer.micro_batch_size=4",
    "trainer.eval_batches=2",
    "data.seq_len=32",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
]


def torchrun(
    nproc: int,
    script: str,
    args: list[str],
    cache: Path,
    timeout: int,
    expect_ok: bool = True,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc train/<script> ARGS`, its ranks forked as torchrun's agent
    would start them (tests/distributed.py ``launch_script``: torchrun's environment, a store on a free port, the
    first failure ends the launch), which spares each launch an agent and a torch import per rank. The real
    agent runs where only it can be tested: the README's launch with restarts (the chaos job,
    tests/test_reliability.py), the c10d rendezvous of two agents (tests/test_hierarchical_training.py) and the
    network lab's agents (tests/test_netlab.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(CERAR_PYTHIA_CACHE=str(cache), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = launch_script(ROOT / "train" / script, args, nproc, env, ROOT, timeout)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def composed(*overrides: str):
    """The job's config as train/main.py composes it: configs/ with these overrides, the schemas registered."""
    from hydra import compose, initialize_config_dir

    from train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def single_process(args: list[str], cache: Path, timeout: int, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """`python train/main.py ARGS`: the README's single-process run (a group of one; no torchrun agent to start),
    forked from the forkserver (tests/distributed.py ``run_script``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(CERAR_PYTHIA_CACHE=str(cache), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = run_script(ROOT / "train" / "main.py", args, env, ROOT, timeout)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def read_run(run_dir: Path) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "summary.json").read_text())


# label -> (overrides, construction and which c for CERAR (None otherwise), exact, replicas agree, flat mode)
AGGREGATORS = {
    "nccl": ("aggregator=nccl", None, True, True, True),
    "ring": ("aggregator=ring", None, True, True, True),
    "cerar": ("aggregator=cerar c={c}", ("optimized", "c"), False, False, True),
    "cerar_vandermonde": ("aggregator=cerar_vandermonde c={cv}", ("vandermonde", "cv"), False, False, True),
    "cerar_perturbation": ("aggregator=cerar_perturbation c={c}", ("perturbation", "c"), False, False, True),
    "cerar_optimized": ("aggregator=cerar_optimized c={c}", ("optimized", "c"), False, False, True),
    "fp16": ("aggregator=fp16", None, False, True, True),
    "bf16": ("aggregator=bf16", None, False, True, True),
    "powersgd": ("aggregator=powersgd", None, False, True, False),
    "nccl_overlap": ("aggregator=nccl trainer.overlap=true", None, True, True, False),
    "cerar_overlap": ("aggregator=cerar c={c} trainer.overlap=true", ("optimized", "c"), False, False, False),
}
AGGREGATORS["int8"] = ("aggregator=int8", None, False, True, True)  # issue 25: every rank decodes the same bytes
WORLDS = {2: {"c": 4, "cv": 4}, 4: {"c": 8, "cv": 3}}  # N -> c (c > N: approximate), c for vandermonde
MATRIX = [*SMALL, "trainer.drift_every=3", "trainer.measure_error_every=1", "checkpoint.every=0"]
RESUME = "aggregator=ring checkpoint.every=3 checkpoint.keep=2 wandb.mode=offline"


def sweep_runs(N: int) -> list[str]:
    """Every aggregator, CERAR with resync; at N=2 also what other tests compare with the aggregators' runs:
    the same batch through gradient accumulation, and a ring run and an int8 run each stopped at step 3 and
    resumed (two entries, one folder); at N=4 the nccl run with trainer.overlap=true, stopped and resumed. The nccl
    run keeps an offline W&B log at N=2."""
    runs = [f"{label}: {o.format(**WORLDS[N])}" for label, (o, *_) in AGGREGATORS.items()]
    runs.append(f"cerar_resync: aggregator=cerar c={WORLDS[N]['c']} trainer.resync_every=3")
    if N == 2:
        runs[0] += " wandb.mode=offline"
        # eval_batches=4: the same 8 validation windows per rank as 2 batches of 4
        runs.append("accumulated: trainer.micro_batch_size=2 trainer.global_batch_size=8 trainer.eval_batches=4")
        runs += [f"part_ring: {RESUME} trainer.stop_after_step=3", f"part_ring: {RESUME} resume=true"]
        # the 8-bit all-reduce rounds stochastically: a resumed run must continue its dither (the checkpoint's count)
        part_int8 = RESUME.replace("aggregator=ring", "aggregator=int8").replace(" wandb.mode=offline", "")
        runs += [f"part_int8: {part_int8} trainer.stop_after_step=3", f"part_int8: {part_int8} resume=true"]
    if N == 4:  # overlap: DDP's buckets the same in every launch (needs N >= 3: a sum of two has one order)
        part = RESUME.replace("aggregator=ring", AGGREGATORS["nccl_overlap"][0]).replace(" wandb.mode=offline", "")
        runs += [f"part_nccl_overlap: {part} trainer.stop_after_step=3", f"part_nccl_overlap: {part} resume=true"]
    return runs


def launch_sweep(N: int, out: Path, cache: Path) -> Path:
    """The N-rank launch of ``sweep_runs(N)`` into ``out``."""
    torchrun(N, "sweep.py", [str(out), *sweep_runs(N), "--", *MATRIX], cache, timeout=850)
    return out


@contextlib.contextmanager
def in_process_trainer(corpus, cache, run_dir, *overrides: str, fused: bool = False, overlap: bool = False):
    """A Trainer of the tiny model as train/run.py builds one, in this process, in a process group of one (gloo),
    on the local corpus in folder ``corpus`` (tokenizer cached in ``cache``), with a RunLogger writing to
    ``run_dir``. ``fused``: the AdamW kernels of a CUDA run (torch's fused AdamW runs on the CPU too); ``overlap``:
    trainer.overlap=true (DDP reduces in backward, through the aggregator's hook)."""
    import torch
    import torch.distributed as dist

    from train.aggregation.build import build_aggregator
    from train.data import build_data
    from train.loop import Trainer
    from train.metrics import RunLogger
    from train.model import build_model, build_optimizer
    from train.schedule import build_scheduler

    data = {"path": corpus, "cache_dir": cache, "bpe_vocab_size": 300, "seq_len": 16}
    loop = {"micro_batch_size": 2, "eval_batches": 1, "progress_bar": "false", "overlap": str(overlap).lower()}
    cfg = composed(
        "data=local",
        *(f"data.{key}={value}" for key, value in data.items()),
        *(f"trainer.{key}={value}" for key, value in loop.items()),
        "wandb.mode=disabled",
        "checkpoint.every=0",
        "checkpoint.at_end=false",
        *overrides,
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model)
        optimizer = build_optimizer(model, cfg.model, "cuda" if fused else "cpu")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        aggregator = build_aggregator(cfg, 1)
        trainer = Trainer(
            cfg,
            ddp=ddp,
            optimizer=optimizer,
            scheduler=build_scheduler(optimizer, cfg.model, cfg.trainer.max_steps),
            data=build_data(cfg, 0, 1),
            aggregator=aggregator,
            logger=None,
            device=torch.device("cpu"),
            rank=0,
            world_size=1,
            run_dir=run_dir,
            overlap=overlap,
        )
        if overlap:  # as train/run.py: DDP's buckets settled, then the hook
            trainer.settle_ddp_buckets()
            aggregator.register_hook(ddp)
        trainer.logger = RunLogger(cfg, run_dir, 1, True, 0)
        yield trainer
    finally:
        dist.destroy_process_group()
