"""Checkpoints: atomic, checksummed, the last K kept, a corrupt latest falling back to the previous.

Layout: <run_dir>/checkpoints/step-00000100.pt and its checksum file step-00000100.pt.sha256.
A checkpoint is complete only when both exist and the digest matches; the payload is written to a
temporary file, fsync'd and renamed, then the checksum likewise, then the directory is fsync'd.

The state (built by the loop) holds the model, optimizer and scheduler of the exactly-aggregating
rank N-1 (under CERAR the only replica with the exact aggregate; under exact aggregators all ranks
agree) and every rank's own data position and RNG states, so each rank resumes its own stream.
Only rank N-1 writes; all ranks read (the run directory must be on a shared file system across nodes).

Loading never executes pickled code: `torch.load(weights_only=True)` accepts tensors and plain Python
containers and numbers, plus the NumPy array types of the RNG state in checkpoints written before the
NumPy state was stored as plain Python (allow-listed in SAFE_GLOBALS). Everything loads to CPU, whatever
device wrote it; the caller copies model and optimizer state onto its own device, and the RNG states stay
CPU ByteTensors (what torch.set_rng_state requires), so a run checkpointed on GPUs resumes on CPU and back.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from train.config import UserError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8})\.pt$")


class CheckpointError(UserError, RuntimeError):
    """No usable checkpoint where one is required, or one that does not fit this run."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` so that readers see the old file or the whole new one: a
    temporary file in the same folder, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint payload in the run dir, newest first (complete or not)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def save_checkpoint(run_dir: str | Path, step: int, state: dict, keep: int) -> Path:
    """Write `state` as the checkpoint of `step` atomically with its SHA-256; keep the newest `keep`."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path = folder / f"step-{step:08d}.pt"
    atomic_write(path, payload)
    digest = hashlib.sha256(payload).hexdigest()
    atomic_write(path.with_name(path.name + ".sha256"), f"{digest}  {path.name}\n".encode())
    _fsync_dir(folder)
    for _, old in list_checkpoints(run_dir)[keep:]:
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    if "world_size" in state:  # read by the start-up checks (train/main.py) without loading a checkpoint
        atomic_write(folder / "world_size", f"{state['world_size']}\n".encode())
    if "training_identity" in state:  # likewise: what these checkpoints trained (config.training_identity)
        text = json.dumps(state["training_identity"], indent=1, sort_keys=True)
        atomic_write(folder / TRAINING_IDENTITY_FILE, f"{text}\n".encode())
    for stale in folder.glob(".step-*.tmp*"):  # temporary files of writers killed mid-write (earlier attempts)
        if not stale.name.endswith(f".tmp{os.getpid()}"):
            stale.unlink(missing_ok=True)
    return path


def _read_verified(path: Path) -> bytes:
    """The payload of a checkpoint whose checksum file exists and matches; raise otherwise."""
    sidecar = path.with_name(path.name + ".sha256")
    if not sidecar.exists():
        raise CheckpointError(f"{path.name} has no checksum file (an interrupted write?)")
    expected = sidecar.read_text().split()[0]
    payload = path.read_bytes()
    actual = hashlib.sha256(payload).hexdigest()
    if actual != expected:
        raise CheckpointError(f"{path.name} fails its SHA-256 check ({len(payload)} bytes; corrupt or truncated)")
    return payload


def _numpy_safe_globals() -> list:
    """The NumPy types an ndarray pickles through (older checkpoints' NumPy RNG state)."""
    core = getattr(np, "_core", None) or np.core
    types = [np.ndarray, np.dtype, core.multiarray._reconstruct]
    dtype_class = getattr(getattr(np, "dtypes", None), "UInt32DType", None)
    return types + ([dtype_class] if dtype_class is not None else [])


SAFE_GLOBALS = _numpy_safe_globals()
"""The only non-builtin types a checkpoint may hold besides tensors."""


def load_checkpoint_file(path: Path) -> dict:
    """A verified checkpoint's state, on CPU, without executing pickled code; raise if damaged or unsafe."""
    payload = _read_verified(path)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def load_latest_checkpoint(run_dir: str | Path) -> tuple[dict, Path] | None:
    """The newest checkpoint that verifies and loads safely, on CPU, falling back over damaged ones with a
    warning; None if none."""
    for _, path in list_checkpoints(run_dir):
        try:
            state = load_checkpoint_file(path)
        except Exception as err:  # a damaged file of any kind: try the previous one
            log.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, err)
            continue
        return state, path
    return None


def recorded_world_size(run_dir: str | Path) -> int | None:
    """The number of ranks that wrote the run dir's checkpoints (None when there are none)."""
    path = checkpoint_dir(run_dir) / "world_size"
    if not list_checkpoints(run_dir) or not path.exists():
        return None
    try:
        return int(path.read_text().strip())
    except ValueError:
        return None


TRAINING_IDENTITY_FILE = "training_identity.json"


def run_record(cfg, world_size: int) -> dict:
    """What a checkpoint records of its run: the resolved config, and the values that change what is
    trained (config.training_identity), which a resumed run must match."""
    from omegaconf import OmegaConf

    from train.config import training_identity

    return {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "training_identity": training_identity(cfg, world_size),
    }


def recorded_training_identity(run_dir: str | Path) -> dict | None:
    """What the run dir's checkpoints trained (None when there are none, or they predate the record)."""
    path = checkpoint_dir(run_dir) / TRAINING_IDENTITY_FILE
    if not list_checkpoints(run_dir) or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def check_resume_matches(run_dir: str | Path, cfg, world_size: int) -> None:
    """Refuse, naming the fields, to resume checkpoints that trained something else than `cfg` asks for:
    resuming would silently continue the old run (its scheduler keeps the old lr) under the new config."""
    from train.config import identity_differences, normalise_resume, training_identity

    if normalise_resume(cfg.resume) == "false":
        return
    recorded = recorded_training_identity(run_dir)
    if recorded is None:
        return
    changes = identity_differences(recorded, training_identity(cfg, world_size))
    if changes:
        raise CheckpointError(
            f"{run_dir} holds checkpoints of another training setup: {'; '.join(changes)} "
            "(resume=false starts afresh there, or pick another hydra.run.dir)"
        )


def discard_checkpoints(run_dir: str | Path) -> int:
    """Remove every checkpoint of the run dir (a fresh run, resume=false, must not be resumed into later)."""
    removed = 0
    for _, path in list_checkpoints(run_dir):
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".sha256").unlink(missing_ok=True)
        removed += 1
    (checkpoint_dir(run_dir) / TRAINING_IDENTITY_FILE).unlink(missing_ok=True)
    return removed


def rng_states() -> dict:
    """This process's random number generator states (torch, CUDA, Python, NumPy): CPU tensors and plain
    Python values only, so that a weights_only load accepts them."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached_gaussian)),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def _byte_tensor(state) -> torch.Tensor:
    """torch.set_rng_state wants a CPU ByteTensor, wherever the state was loaded to."""
    return torch.as_tensor(state).to(device="cpu", dtype=torch.uint8)


def set_rng_states(state: dict) -> None:
    """Restore rng_states(). CUDA states are restored on as many GPUs as both machines have, and ignored on
    a machine without CUDA (a GPU run resumed on CPU)."""
    torch.set_rng_state(_byte_tensor(state["torch"]))
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached_gaussian)))
    if state.get("cuda") and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_byte_tensor(cuda_state), index)


def _as_tuples(value):
    """random.setstate needs tuples where a round trip through some serialisers gives lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value
