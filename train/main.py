"""Train a Pythia-family model with data-parallel replicas and a chosen gradient aggregator.

    torchrun --nproc_per_node=4 train/main.py aggregator=cerar c=16 model=pythia-70m data=pile

Hydra composes configs/config.yaml with the overrides against the typed schema (train/config.py):
an unknown option, a typo or a wrong type stops here. Then `validate` checks the values, still
before torch or any process group is touched, and `train.run.run` does the run (train/run.py).

`preflight` does all of that once more before Hydra starts the job, so that every refusal (Hydra's
composition errors included, and an output directory that cannot be written) is one line on stderr
and exit status 2, before any run directory, data cache or process group exists. A collective that
fails during the run (a peer died or stalled) aborts the process groups and exits with status 3 and
one line naming it, before any teardown (`train.distributed.exit_after_collective_failure`); so does a
logger (W&B) that does not start or close within its deadline (wandb.start_timeout_s, wandb.close_timeout_s).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (torchrun train/main.py): import `train` from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from train.config import UserError, register_configs, validate

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

register_configs()


def fail(message: str, code: int = 2) -> None:
    """One clear line on stderr and a non-zero exit, no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


@hydra.main(config_path="../configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))  # fails fast: nothing heavy imported
        from train.run import finish, run  # torch, transformers, datasets: only for a valid config

        try:
            run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except RuntimeError as err:
            if is_collective_failure(err) or is_logger_failure(err):  # before any teardown, which could hang on
                from train.distributed import exit_after_collective_failure  # NCCL (or wait for W&B's thread)

                exit_after_collective_failure(err, code=3)
            raise
        finally:
            finish()
    except UserError as err:
        fail(str(err))
    except RuntimeError as err:
        if is_collective_failure(err):  # a collective of the teardown itself
            from train.distributed import exit_after_collective_failure

            exit_after_collective_failure(err, code=3)
        raise


def is_collective_failure(err: BaseException) -> bool:
    """A peer died or stalled: the loop's TrainCollectiveError, or cerar's CollectiveError raised outside it."""
    from cerar import CollectiveError
    from train.distributed import TrainCollectiveError

    return isinstance(err, (TrainCollectiveError, CollectiveError))


def is_logger_failure(err: BaseException) -> bool:
    """W&B did not start or close within its deadline, or failed to (train.metrics.LoggerError): its thread may
    still be inside W&B, so the process leaves as after a collective failure (one line, exit 3)."""
    from train.metrics import LoggerError

    return isinstance(err, LoggerError)


def one_line(message: str) -> str:
    """Hydra's multi-line composition errors as one line (the field, the problem, the options)."""
    lines = []
    for raw in str(message).splitlines():
        line = raw.strip()
        if line.startswith(("Config search path", "provider=")):
            break
        if line and not line.startswith(("full_key:", "reference_type=", "object_type=", "To append")):
            lines.append(line)
    return " ".join(lines).replace(" Available options in", "; options in")


def preflight(argv: list[str]) -> None:
    """Compose and validate the config, and check the run directory can be written, before Hydra runs."""
    if any(a.startswith("-") for a in argv):  # Hydra's own flags (--cfg, --help, -m): leave them to Hydra
        return
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=argv, return_hydra_config=True)
    except Exception as err:  # Hydra's and OmegaConf's composition errors: unknown names, wrong types
        fail(one_line(f"{err}\n{err.__cause__}" if err.__cause__ is not None else str(err)))
    try:
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    except UserError as err:
        fail(str(err))
    run_dir = Path(OmegaConf.select(cfg, "hydra.run.dir"))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        fail(f"hydra.run.dir={run_dir} is not a writable directory ({err.strerror or err})")
    from train.checkpoint import check_resume_matches, recorded_world_size
    from train.config import normalise_resume

    world_size, written_by = int(os.environ.get("WORLD_SIZE", 1)), recorded_world_size(run_dir)
    if normalise_resume(cfg.resume) != "false" and written_by not in (None, world_size):
        fail(
            f"{run_dir} holds checkpoints written by {written_by} ranks; this launch has {world_size} "
            "(resume=false starts afresh there, or pick another hydra.run.dir)"
        )
    from train.checkpoint import checkpoint_dir, list_checkpoints

    if normalise_resume(cfg.resume) == "true" and not list_checkpoints(run_dir):
        fail(f"resume=true but {checkpoint_dir(run_dir)} holds no checkpoint (resume=auto starts afresh there)")
    try:
        check_resume_matches(run_dir, cfg, world_size)  # a changed lr, batch, aggregator, ...: one line
        prepare_local_data(cfg, world_size)  # a bad .jsonl line, a corpus too small: one line, no process group
    except UserError as err:
        fail(str(err))


def prepare_local_data(cfg, world_size: int) -> None:
    """Build or find the token cache of data=embedded/local now, showing progress on rank 0's console."""
    import logging

    from train.data import prepare_data

    if cfg.data.kind not in ("embedded", "local"):
        return
    if os.environ.get("RANK", "0") == "0":
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    prepare_data(cfg, world_size)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    preflight(sys.argv[1:])
    main()
