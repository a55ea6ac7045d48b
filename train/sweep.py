"""Several training runs in one launch: one process group, imports paid once, runs side by side.

    torchrun --nproc_per_node=4 train/sweep.py outputs/sweep \\
        "nccl: aggregator=nccl" "ring: aggregator=ring" "cerar16: aggregator=cerar c=16" \\
        -- model=pythia-14m trainer.max_steps=20

The first argument is the folder that receives one sub-folder per run; each run is "LABEL: OVERRIDES"
(positional, so torchrun's own options cannot swallow them); everything after `--` applies to every
run. All configs are composed and validated before the process group starts. The host watchdog (train/watchdog.py)
watches the process group's start and its teardown as train/run.py does, and every run between them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import `train` from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from hydra import compose, initialize_config_dir

from cerar import CollectiveError
from train import watchdog
from train.config import ConfigError, UserError, register_configs, validate
from train.distributed import (
    TrainCollectiveError,
    exit_after_collective_failure,
    group_timeout_s,
    init_process_group,
    launch_from_env,
    pick_device,
)
from train.main import fail
from train.metrics import LoggerError
from train.run import finish, run

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    common: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, common = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder that receives one sub-folder per run")
    parser.add_argument("runs", nargs="+", metavar="LABEL: OVERRIDES", help="a run's label and its overrides")
    args = parser.parse_args(argv)
    parsed = []
    for spec in args.runs:
        label, sep, overrides = spec.partition(":")
        if not sep or not label.strip():
            parser.error(f"run {spec!r} is not of the form 'LABEL: OVERRIDES'")
        parsed.append((label.strip(), overrides))
    args.runs = parsed
    return args, common


def compose_runs(args: argparse.Namespace, common: list[str]):
    register_configs()
    runs = []
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for label, overrides in args.runs:
            cfg = compose(config_name="config", overrides=common + shlex.split(overrides))
            runs.append((label, cfg))
    return runs


def main(argv: list[str]) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args, common = parse_args(argv)
    launch = launch_from_env()
    try:
        runs = compose_runs(args, common)
        for label, cfg in runs:
            try:
                validate(cfg, world_size=launch.world_size)
            except ConfigError as err:
                raise ConfigError(f"run {label}: {err}") from None
        device = pick_device(runs[0][1], launch)
        T = max(cfg.trainer.collective_timeout_s for _, cfg in runs)
        deadlines = watchdog.Deadlines(T=T, group_timeout_s=group_timeout_s(device, T))
        with watchdog.watching(deadlines, launch.rank, "start-up: process group"):  # as train/run.py starts it
            init_process_group(launch, device, T)
        summaries = {}
        for label, cfg in runs:
            summaries[label] = run(cfg, Path(args.out) / label)
        if launch.rank == 0:
            print(json.dumps({"sweep": summaries}, indent=2))
    except UserError as err:
        fail(str(err))
    except (TrainCollectiveError, CollectiveError, LoggerError) as err:  # a peer died or stalled, or W&B: exit 3
        exit_after_collective_failure(err, code=3)  # before the teardown below, which could hang on NCCL
    except Exception as err:  # hydra composition errors (unknown option, bad type) and the like
        if type(err).__module__.startswith(("hydra", "omegaconf")):
            fail(f"{type(err).__name__}: {err}")
        raise
    finally:
        finish()  # the teardown under the host watchdog (`train.run.finish`)


if __name__ == "__main__":
    main(sys.argv[1:])
