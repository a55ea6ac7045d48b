"""What each kernel of ``cerar.formats.fused`` computes, once: its input, its output, its eager reference, its runner's
call and the format's public function, for one vector of values.

``fused.enable``'s check and timing, the GPU check's fused case (``scripts/checks/gpu/arithmetic.py``) and the
formats' timing (``scripts/bench/format_timing.py``) all run the same calls on the same kind of data; each builds its
rows from ``cases`` instead of writing the calls again. A ``Case`` writes into an output it is handed, so its caller
decides how many outputs it needs (one per variant, a fresh one per check) and what it compares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from cerar.formats import int4_blocks as q4
from cerar.formats import int8_blocks as q8
from cerar.formats import wire as wires

KEY = 12345
"""The dither key of the cases' stochastic messages."""

SEED = 7
"""The rotation's seed of the cases' 4-bit messages."""

WIRE_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel (``name``, one of ``fused.KERNELS``) on one input, ``what`` it is in words. ``fresh()``: a new
    output (the decoders' holds the case's ``base`` values, which the adding ones add to); ``eager(out)``: the
    unfused path writes it (the bytes every variant must match); ``run(fn, out)``: a runner with ``fused._runners``'
    signature for ``name`` writes it; ``public(out)``: the format's own function (the variant ``enable`` chose).
    ``accumulates``: the output grows with each call (dequantize-and-add): compare it after one call only."""

    name: str
    what: str
    fresh: Callable[[], torch.Tensor]
    eager: Callable[[torch.Tensor], None]
    run: Callable[[Callable, torch.Tensor], None]
    public: Callable[[torch.Tensor], None]
    accumulates: bool = False


def _family(name: str) -> str:
    return "wire" if name.startswith("wire") else "int4" if name.startswith("int4") else "int8"


def cases(x: torch.Tensor, block: int, names, *, rotate: bool = True, base: torch.Tensor | None = None,
          dtypes=WIRE_DTYPES) -> list[Case]:  # fmt: skip
    """The ``Case`` of each kernel in ``names`` on x (float32, contiguous, on its device): the quantizers quantize x;
    the decoders decode x's message (quantized stochastically with ``KEY``) into a copy of ``base`` (default zeros);
    the 4-bit ones rotate (``SEED``) where ``rotate``; the wire's run once per dtype of ``dtypes``, the decode on x's
    encoded message."""
    s, device = x.numel(), x.device
    base = torch.zeros_like(x) if base is None else base
    out: list[Case] = []
    message8 = message4 = None
    for name in names:
        family = _family(name)
        if name.startswith(("quantize", "int4_quantize")):
            rounding = name.rsplit("_", 1)[1]
            if family == "int8":
                out.append(Case(
                    name, f"int8 quantize, {rounding}", lambda: q8.new_message(s, block, device),
                    lambda o, r=rounding: q8.quantize_eager(o, x, block, r, KEY),
                    lambda fn, o, r=rounding: fn(o, x, block, r, KEY),
                    lambda o, r=rounding: q8.quantize_into(o, x, block, r, KEY)))  # fmt: skip
            else:
                out.append(Case(
                    name, f"int4 quantize, {rounding}{', rotated' if rotate else ''}",
                    lambda: q4.new_message(s, block, device),
                    lambda o, r=rounding: q4.quantize_eager(o, x, block, r, KEY, rotate, SEED),
                    lambda fn, o, r=rounding: fn(o, x, block, r, KEY, rotate, SEED),
                    lambda o, r=rounding: q4.quantize_into(o, x, block, r, KEY, rotate, SEED)))  # fmt: skip
        elif family == "int8":  # the 8-bit decoders
            if message8 is None:
                message8 = q8.new_message(s, block, device)
                q8.quantize_eager(message8, x, block, "stochastic", KEY)
            add = name == "dequantize_add"
            out.append(Case(
                name, f"int8 {'dequantize and add' if add else 'dequantize'}", base.clone,
                lambda o, m=message8, add=add: q8.dequantize_eager(m, s, block, o, add=add),
                lambda fn, o, m=message8: fn(m, s, block, o),
                lambda o, m=message8, add=add: q8.dequantize(m, s, block, o, add=add), accumulates=add))  # fmt: skip
        elif family == "int4":  # the 4-bit decoders
            if message4 is None:
                message4 = q4.new_message(s, block, device)
                q4.quantize_eager(message4, x, block, "stochastic", KEY, rotate, SEED)
            add = name == "int4_dequantize_add"
            out.append(Case(
                name, f"int4 {'dequantize and add' if add else 'dequantize'}{', rotated' if rotate else ''}",
                base.clone,
                lambda o, m=message4, add=add: q4.dequantize_eager(m, s, block, o, add=add, rotate=rotate, seed=SEED),
                lambda fn, o, m=message4: fn(m, s, block, o, rotate, SEED),
                lambda o, m=message4, add=add: q4.dequantize(m, s, block, o, add=add, rotate=rotate, seed=SEED),
                accumulates=add))  # fmt: skip
        else:
            for dtype in dtypes:
                w = wires.Wire(dtype)
                unfused = w._encode_host if device.type == "cpu" else w.encode_eager  # encode's own unfused path
                if name == "wire_encode":
                    out.append(Case(
                        name, f"wire {dtype} encode", lambda w=w: w.empty(s, x), lambda o, e=unfused: e(x, o),
                        lambda fn, o: fn(x, o), lambda o, w=w: w.encode(x, o)))  # fmt: skip
                else:
                    message = w.empty(s, x)
                    unfused(x, message)
                    out.append(Case(
                        name, f"wire {dtype} decode", lambda: torch.empty_like(x),
                        lambda o, w=w, m=message: w.decode_eager(m, o), lambda fn, o, m=message: fn(m, o),
                        lambda o, w=w, m=message: w.decode(m, o)))  # fmt: skip
    return out


FORMAT_KERNELS = ("quantize_nearest", "quantize_stochastic", "dequantize", "dequantize_add", "int4_quantize_nearest",
                  "int4_quantize_stochastic", "int4_dequantize", "int4_dequantize_add")  # fmt: skip
"""The block formats' kernels, in the order the reports list them."""


def every_case(x: torch.Tensor, block: int, base: torch.Tensor | None = None) -> list[Case]:
    """Every kernel's case on x, as the reports list them: the 8-bit and 4-bit formats' (rotated), then each wire
    dtype's encode and decode."""
    formats = cases(x, block, FORMAT_KERNELS, base=base)
    return formats + [c for dtype in WIRE_DTYPES for c in cases(x, block, ("wire_encode", "wire_decode"),
                                                                  dtypes=(dtype,))]  # fmt: skip
