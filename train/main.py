"""Train a Pythia-family model with data-parallel replicas and a chosen gradient aggregator.

    torchrun --nproc_per_node=4 train/main.py aggregator=cerar c=16 model=pythia-70m data=pile

Hydra composes configs/config.yaml with the overrides against the typed schema (train/config.py):
an unknown option, a typo or a wrong type stops here. Then `validate` checks the values, still
before torch or any process group is touched, and `train.run.run` does the run (train/run.py).
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
        finally:
            finish()
    except UserError as err:
        fail(str(err))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
