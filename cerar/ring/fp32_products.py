"""CERAR's products in full float32, whatever the process's TF32 settings.

The decode amplifies the rounding of the encoding and decoding products by up to the code's
condition number kappa (1e4 by default). TensorFloat-32 rounds float32 matmul inputs to 10 mantissa
bits: with it, N=8, c=16 goes from a worst-rank relative error of about 7e-4 to about 1. Users and
images switch it on globally for their models, through

- ``torch.backends.cuda.matmul.allow_tf32 = True`` (legacy),
- ``torch.set_float32_matmul_precision("high" | "medium")``,
- ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` or ``torch.backends.fp32_precision = "tf32"``,
- the environment variable ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``, which cuBLAS reads and nothing
  at run time can undo.

``full_fp32_products(device)`` wraps CERAR's arithmetic: when one of the run-time settings allows
reduced precision it switches matmuls to full float32 (``set_float32_matmul_precision("highest")``,
the one setter that leaves torch's legacy and new precision flags consistent) and restores the
caller's settings on exit; on a CUDA device with the override variable set it refuses with a
``PrecisionError`` naming the variable. The settings are process-wide: while a guarded call runs
(e.g. on the DDP hook's thread), other threads' float32 matmuls run in full precision too, slower
but never less accurate. Nested and concurrent guards share one switch (a count under a lock).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch

TF32_OVERRIDE_VARIABLE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"


class PrecisionError(RuntimeError):
    """CERAR cannot run its products in full float32 in this process."""


def _read(getter):
    try:
        return getter()
    except RuntimeError:  # torch refuses to read a mix of its legacy and new precision settings
        return None
    except AttributeError:  # torch before the fp32_precision flags
        return None


def matmul_precision_settings() -> tuple[str | None, str | None]:
    """The caller's float32 matmul settings: (legacy precision, new-style CUDA matmul precision);
    None where torch refuses to read one (a mix of its legacy and new APIs) or has no such flag."""
    legacy = _read(torch._C._get_float32_matmul_precision)
    new = _read(lambda: torch.backends.cuda.matmul.fp32_precision)
    return legacy, new


def reduced_precision_allowed(settings: tuple[str | None, str | None] | None = None) -> bool:
    """Whether the settings let float32 matmuls round their inputs (TF32 or bfloat16)."""
    legacy, new = matmul_precision_settings() if settings is None else settings
    return legacy != "highest" or new not in (None, "ieee", "none")


def check_no_tf32_override(device: torch.device, environ=None) -> None:
    """Refuse CUDA work when cuBLAS is forced to TF32 by the environment (not undoable at run time)."""
    environ = os.environ if environ is None else environ
    value = environ.get(TF32_OVERRIDE_VARIABLE, "")
    if torch.device(device).type == "cuda" and value not in ("", "0"):
        raise PrecisionError(
            f"{TF32_OVERRIDE_VARIABLE}={value} forces TF32 in cuBLAS for the whole process, which would amplify "
            "CERAR's decoding error by up to kappa (about 1 instead of 1e-3 relative at N=8, c=16); "
            f"unset {TF32_OVERRIDE_VARIABLE} (or set it to 0) for CERAR on CUDA"
        )


_lock = threading.Lock()
_active = {"count": 0, "saved": None}


def _restore(saved: tuple[str | None, str | None]) -> None:
    legacy, new = saved
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy)
    if new is not None and _read(lambda: torch.backends.cuda.matmul.fp32_precision) != new:
        torch.backends.cuda.matmul.fp32_precision = new


@contextmanager
def full_fp32_products(device: torch.device):
    """Run the enclosed matmuls in full float32 (see the module docstring); refuse on CUDA when
    the TF32 override variable is set. Does nothing when full precision is already the setting."""
    check_no_tf32_override(device)
    with _lock:
        if _active["count"] == 0:
            settings = matmul_precision_settings()
            if reduced_precision_allowed(settings):
                _active["saved"] = settings
                torch.set_float32_matmul_precision("highest")
        _active["count"] += 1
    try:
        yield
    finally:
        with _lock:
            _active["count"] -= 1
            if _active["count"] == 0 and _active["saved"] is not None:
                saved, _active["saved"] = _active["saved"], None
                _restore(saved)
