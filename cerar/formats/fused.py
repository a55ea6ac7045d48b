"""Fused kernels for the per-call arithmetic of the 8-bit format and the 16-bit wire (issue 35).

Eager torch runs the 8-bit quantizer as separate passes over the data (the largest value, the product,
the rounding, the cast): 3.5x the time of a plain copy of the same bytes on this CPU (12x before the
passes were rewritten), where one fused loop reads the float32 values twice (the block's absmax, then the
values) and writes one byte each. ``torch.compile`` (inductor: C++ on a CPU, Triton on a GPU) fuses each
function below into that loop. The eager functions in ``cerar.formats.int8_blocks`` and ``cerar.formats.wire`` stay the
reference: every kernel computes the same float32 operations in the same order (inductor keeps IEEE
semantics: no fast-math, no contraction into fused multiply-adds), so the bytes are the same, and
``enable`` checks that on a sample before it switches a kernel on.

Compiling is not free: on this 2-core machine the three kernels took 76 s the first time at load 10 and 519
s at load 30-37 (inductor's C++ build), 11-92 s from its cache afterwards at load 10-40
(``TORCHINDUCTOR_CACHE_DIR``, shared by the ranks of a machine and kept across runs). So nothing compiles
inside a collective: a rank that compiled there would hold its peers past their round deadlines. A caller
enables the kernels before its first collective (``enable``: it says, in one logged line, what it compiles
and why it may take minutes; the trainer's warm-up, or a script's set-up), and until then, or where
compiling fails (no C++ compiler, no Triton), every call takes the eager path, after one logged line saying
so. Shapes are dynamic (``dynamic=True``): the number of blocks is symbolic, so DDP's buckets of many sizes
share one compiled kernel; the block size B is a constant of the kernel. Calls below ``MIN_VALUES`` values
stay eager (a compiled call's overhead is tens of microseconds). ``CERAR_FUSED=0`` in the environment keeps
everything eager (``enable`` then returns at once, saying so).

Measured (``scripts/bench/bench_arithmetic.py``, ``reports/arithmetic.md``): the decision to fuse each
operation, or to keep it eager, is made there from the ratios against a copy.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from cerar.formats import int8_blocks as q8
from cerar.formats import wire

log = logging.getLogger("cerar.formats.fused")

MIN_VALUES = 2**14
"""Fewest values for which a fused kernel is called: below, the eager passes cost less than the call."""

KERNELS = ("quantize_nearest", "quantize_stochastic", "wire_encode")
"""Dequantizing is one eager pass already (about a copy's time), and eager's dequantize-and-add is a fused
multiply-add on CPUs (``addcmul``, one rounding), which inductor's C++ does not emit (a product, then a sum):
neither is fused here (``reports/arithmetic.md``)."""

_lock = threading.Lock()
_enabled: dict[tuple[str, str, int], object] = {}  # (kernel, device type, block or 0): the compiled function
_compiled: dict[tuple[str, str], object] = {}  # (function, backend): its torch.compile wrapper
_said: set[str] = set()


# ------------------------------------------------------------------------------------------------
# The kernels, written as the eager references compute (cerar.formats.int8_blocks, cerar.formats.wire)
# ------------------------------------------------------------------------------------------------


def _block_scales(rows: torch.Tensor, scales: torch.Tensor, prescale: torch.Tensor, inverse: torch.Tensor) -> None:
    """Per block: scale = absmax / 127 into ``scales``, the prescale p (2^64 below ``TINY_SCALE``, else 1)
    and the inverse 1 / (scale p) (0 for a zero block), as ``quantize_rows`` computes them. A kernel of its
    own, so that the values' loop reads two numbers per block instead of dividing twice per vector."""
    scale = rows.abs().amax(dim=1) / q8.QMAX
    p = torch.where((scale < q8.TINY_SCALE) & (scale > 0), q8.PRESCALE, 1.0)
    scales.copy_(scale)
    prescale.copy_(p)
    inverse.copy_(torch.where(scale > 0, 1 / (scale * p), 0.0))


def _quantize_nearest(rows: torch.Tensor, prescale: torch.Tensor, inverse: torch.Tensor, values: torch.Tensor) -> None:
    r = (rows * prescale.unsqueeze(1)) * inverse.unsqueeze(1)
    values.copy_(r.round().clamp(-q8.QMAX, q8.QMAX).to(torch.int8))


def _quantize_stochastic(
    rows: torch.Tensor, prescale: torch.Tensor, inverse: torch.Tensor, values: torch.Tensor, table: torch.Tensor
) -> None:
    u = table[torch.arange(rows.shape[0], device=rows.device) % table.shape[0]]  # the message's dither, [K, B]
    r = (rows * prescale.unsqueeze(1)) * inverse.unsqueeze(1)
    values.copy_((r + u).floor().clamp(-q8.QMAX, q8.QMAX).to(torch.int8))


def _wire_scale(block: torch.Tensor, header: torch.Tensor, scale: torch.Tensor) -> None:
    """k from the block's largest magnitude into ``header`` (the message's first value) and 2^k into ``scale``."""
    from cerar.formats.wire import K_LIMIT, TARGET_EXPONENT, _power_of_two

    _, e = torch.frexp(block.abs().amax())
    k = (TARGET_EXPONENT - e).clamp(-K_LIMIT, K_LIMIT)
    header.copy_(k.view(1))
    scale.copy_(_power_of_two(k).view(1))


def _wire_cast(block: torch.Tensor, scale: torch.Tensor, values: torch.Tensor) -> None:
    values.copy_(block * scale)


_FUNCTIONS = {
    "block_scales": _block_scales,
    "quantize_nearest": _quantize_nearest,
    "quantize_stochastic": _quantize_stochastic,
    "wire_scale": _wire_scale,
    "wire_cast": _wire_cast,
}
_PARTS = {
    "quantize_nearest": ("block_scales", "quantize_nearest"),
    "quantize_stochastic": ("block_scales", "quantize_stochastic"),
    "wire_encode": ("wire_scale", "wire_cast"),
}
"""The compiled functions each kernel of ``KERNELS`` runs: a reduction over the blocks, then the values' loop."""


def _run_quantize(fns, rows, scales, values, rounding: str, block: int, offset: int) -> None:
    nb = rows.shape[0]
    torch._dynamo.mark_static(rows, 1)  # B is a constant of the kernel (fixed-length inner loops); nb is not
    torch._dynamo.mark_static(values, 1)
    prescale = torch.empty(nb, dtype=torch.float32, device=rows.device)
    inverse = torch.empty_like(prescale)
    fns[0](rows, scales, prescale, inverse)
    if rounding == "nearest":
        fns[1](rows, prescale, inverse, values)
    else:
        fns[1](rows, prescale, inverse, values, q8.dither_table(block, offset, rows.device, 0, nb))


def _run_wire(fns, block: torch.Tensor, out: torch.Tensor) -> None:
    scale = torch.empty(1, dtype=torch.float32, device=block.device)
    fns[0](block, out[:1], scale)
    fns[1](block, scale, out[1:])


# ------------------------------------------------------------------------------------------------
# Enabling: compile, check against the eager reference, switch on
# ------------------------------------------------------------------------------------------------


def available() -> tuple[bool, str]:
    """Whether this process may compile: (False, why) when ``CERAR_FUSED=0`` or torch.compile is missing."""
    if os.environ.get("CERAR_FUSED", "1") == "0":
        return False, "CERAR_FUSED=0"
    if not hasattr(torch, "compile"):
        return False, "torch.compile is not in this torch"
    return True, ""


def _compiled_functions(name: str, backend: str) -> tuple:
    """The torch.compile wrappers of kernel ``name``'s parts (one per process and backend, dynamic shapes)."""
    with _lock:
        for part in _PARTS[name]:
            if (part, backend) not in _compiled:
                _compiled[(part, backend)] = torch.compile(
                    _FUNCTIONS[part], dynamic=True, fullgraph=True, backend=backend
                )
        return tuple(_compiled[(part, backend)] for part in _PARTS[name])


def _sample(block: int, device, nb: int) -> torch.Tensor:
    """Adversarial values for the check: normal blocks spanning decades, zeros, ties, a tiny block."""
    g = torch.Generator().manual_seed(35)
    x = torch.randn(nb * block, generator=g) * torch.exp(3 * torch.randn(nb, generator=g)).repeat_interleave(block)
    x[:block] = 0.0
    x[block : 2 * block] = torch.arange(block) - block / 2 + 0.5  # exact halves once scaled
    x[2 * block : 3 * block] *= 1e-40 / x[2 * block : 3 * block].abs().max()  # a subnormal scale
    return x.to(device)


def _check(name: str, fns, block: int, device) -> None:
    """Run the compiled kernel against the eager reference on two sizes (the second a new block count:
    no recompiling) and raise AssertionError naming the kernel where a byte differs."""
    from cerar.formats.wire import Wire

    for nb in (3 * MIN_VALUES // block + 3, 2 * MIN_VALUES // block + 1):
        x = _sample(block, device, nb)
        s = x.numel()
        if name.startswith("quantize"):
            rounding = name.split("_")[1]
            want, got = q8.new_message(s, block, device), q8.new_message(s, block, device)
            q8.quantize_eager(want, x, block, rounding, 12345)
            scales, values = q8.parts(got, s, block)
            _run_quantize(fns, x.view(-1, block), scales, values.view(-1, block), rounding, block, 12345)
            if not torch.equal(want, got):
                raise AssertionError(f"the compiled {name} differs from the eager reference (nb={nb}, B={block})")
        else:
            for dtype in ("float16", "bfloat16"):  # one graph per wire dtype: both compiled here, not in a collective
                wire = Wire(dtype)
                want, got = wire.empty(s, x), wire.empty(s, x)
                wire.encode_eager(x, want)
                _run_wire(fns, x, got)
                if not torch.equal(want.view(torch.int16), got.view(torch.int16)):
                    raise AssertionError(f"the compiled {name} ({dtype}) differs from the eager reference (s={s})")


def enable(
    device="cpu", block: int = q8.DEFAULT_BLOCK, kernels=KERNELS, *, say=None, backend: str = "inductor"
) -> dict[str, float]:
    """Compile ``kernels`` for ``device`` and block size ``block``, check each against its eager reference
        and switch it on; returns the seconds each took (0 for one already on). Call it before the first
        collective (module docstring). A kernel that fails to compile or to match stays eager, said in one
        line. ``say``: where the lines go (default: this module's logger at INFO where logging shows it, else
    stderr; a kernel left eager is also logged at WARNING).
        ``backend``: torch.compile's; "eager" traces the kernels with dynamo but runs torch's own operations,
        in seconds, which the tests use to check the kernels' arithmetic and the dispatch without a C++ build."""
    say = say or _announce
    device = torch.device(device)
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise ValueError(f"cerar.formats.fused.enable: unknown kernels {unknown}; the kernels are {KERNELS}")
    q8.check_block(block, "cerar.formats.fused.enable")
    ok, why = available()
    if not ok:
        say(f"cerar.formats.fused: the eager arithmetic is used ({why})")
        return {}
    todo = [k for k in kernels if (k, device.type, 0 if k == "wire_encode" else block) not in _enabled]
    if not todo:
        return dict.fromkeys(kernels, 0.0)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "the default inductor cache")
    say(
        f"cerar.formats.fused: compiling {len(todo)} fused kernels ({', '.join(todo)}) for {device.type}, B={block}, "
        f"with torch.compile ({backend}): on a small busy CPU minutes the first time (76-519 s measured on 2 cores "
        f"at load 10-35), seconds once cached in {cache}"
    )
    seconds = {}
    for name in todo:
        start = time.perf_counter()
        try:
            fn = _compiled_functions(name, backend)
            _check(name, fn, block, device)
        except Exception as error:  # compiling is optional: the eager path is always there
            log.warning(
                "cerar.formats.fused: %s stays eager on %s: %s", name, device.type, str(error).splitlines()[0][:200]
            )
            seconds[name] = time.perf_counter() - start
            continue
        seconds[name] = time.perf_counter() - start
        with _lock:
            _enabled[(name, device.type, 0 if name == "wire_encode" else block)] = fn
    say(
        "cerar.formats.fused: "
        + ", ".join(f"{k} {'on' if _on(k, device, block) else 'eager'} ({v:.1f} s)" for k, v in seconds.items())
    )
    return seconds


def _announce(line: str) -> None:
    """A line the user must see before a wait of minutes: to this module's logger at INFO where logging is set
    up to show it, else to stderr (Python's default handler would drop an INFO line)."""
    if log.isEnabledFor(logging.INFO) and (log.handlers or logging.getLogger().handlers):
        log.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _on(name: str, device, block: int) -> bool:
    return (name, torch.device(device).type, 0 if name == "wire_encode" else block) in _enabled


def disable() -> None:
    """Switch every fused kernel off (the eager references run); the compiled code stays cached."""
    with _lock:
        _enabled.clear()


def enabled() -> list[tuple[str, str, int]]:
    """The kernels switched on: (name, device type, block; 0 for the wire's)."""
    with _lock:
        return sorted(_enabled)


# ------------------------------------------------------------------------------------------------
# The dispatch from cerar.formats.int8_blocks and cerar.formats.wire: True when the fused kernel did the work
# ------------------------------------------------------------------------------------------------


def quantize(message: torch.Tensor, x: torch.Tensor, block: int, rounding: str, offset: int) -> bool:
    full = x.numel() // block
    if full * block < MIN_VALUES:
        return False
    fns = _enabled.get((f"quantize_{rounding}", x.device.type, block))
    if fns is None:
        return False
    s = x.numel()
    scales, values = q8.parts(message, s, block)
    rows = x[: full * block].view(full, block)
    _run_quantize(fns, rows, scales[:full], values[: full * block].view(full, block), rounding, block, offset)
    if s > full * block:  # the short last block, eagerly (its dither row follows the full rows')
        tail = x[full * block :].view(1, -1)
        q8.quantize_rows(tail, scales[full:], values[full * block :].view(1, -1), block, full, rounding, offset)
    return True


def wire_encode(block: torch.Tensor, out: torch.Tensor) -> bool:
    if block.numel() < MIN_VALUES:
        return False
    fns = _enabled.get(("wire_encode", block.device.type, 0))
    if fns is None:
        return False
    _run_wire(fns, block, out)
    return True


q8.FUSED_QUANTIZE = quantize  # the formats ask through these; they never import this module
wire.FUSED_ENCODE = wire_encode

__all__ = ["KERNELS", "MIN_VALUES", "available", "disable", "enable", "enabled"]
