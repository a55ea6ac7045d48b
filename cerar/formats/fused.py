"""Fused kernels for the per-call arithmetic of the 8-bit format and the 16-bit wire (issues 35 and 52).

Three ways to run each operation, one chosen per device by ``enable``: eager torch (the reference), the kernel
``torch.compile`` writes from the functions below ("fused", ``COMPILED``), and a hand-written Triton kernel on a GPU
("triton", ``cerar.formats.triton_kernels``: one pass each, the decoders too). Every variant must write the eager
bytes on ``enable``'s sample before it is timed; the fastest runs.

Eager torch runs the 8-bit quantizer as separate passes over the data (the absmax, the products, the rounding, the
clamp, the cast; the dither's sum): on an H200 9x a device copy at nearest rounding and 131x at stochastic (a Python
loop over 2^16-value pieces, since removed), where one loop reads the float32 values once and writes one byte each.
``torch.compile`` (inductor: C++ on a CPU, Triton on a GPU) turns each function below into such loops: for the
quantizer one compiled call per message, the short last block included (on a GPU two kernels: each block's absmax,
scale and inverse, then the values, which read the float32 values a second time: 9 bytes a value, 1.1 copies),
for the 16-bit encode one kernel after torch's own ``aminmax`` (10 bytes a value). The eager
functions in ``cerar.formats.int8_blocks`` and ``cerar.formats.wire`` stay the reference: the fused path must
write their bytes.

Exact by construction, then checked. Every operation of a kernel is one that each backend rounds as IEEE does:
- the divisions (scale = absmax / 127 and the inverse 1 / (scale p)) are taken in float64 and rounded to
  float32, which gives the float32 quotient: for the inverse a double rounding through 53 >= 2 x 24 + 2 bits is
  innocuous; for the scale, absmax / 127 is never a float32 midpoint and lies at least 2^-24 (relative) from one,
  far beyond float64's error even where inductor replaces the division by a constant by a product with its
  reciprocal (lowering.py ``div_prim``, on GPUs). Float32 division is not used: Triton lowers it to the
  approximate ``llvm.nvvm.div.full`` and float64's to the IEEE ``llvm.nvvm.div.rn.d`` (triton-lang/triton
  third_party/nvidia/lib/TritonNVIDIAGPUToLLVM/ElementwiseOpToLLVM.cpp, ``FDivOpConversion``; inductor's
  ``eager_numerics.division_rounding``, off by default, would emit ``div_rn`` instead). The H200 run of
  2026-12-04 found 6 of 16,777,216 int8 values 1 apart, with equal scales, from the float32 inverse;
- no product feeds an addition in float32, so no contraction into a fused multiply-add can change a rounding:
  nearest rounds the product itself; stochastic rounding's r + u is summed in float64 and rounded once to
  float32 (the correctly rounded float32 sum, by the same double-rounding bound), and its products feed only
  that widening. Contraction is also switched off where inductor lets it be: ``emulate_precision_casts=True``
  makes Triton compile with ``enable_fp_fusion=False`` (ptxas --fmad=false; codegen/triton.py
  ``triton_meta_common``), and inductor's C++ compiles with -ffp-contract=off
  (``torch._inductor.config.cpp.enable_floating_point_contract_flag``, its default);
- the rest is exact in any order: the absmax, products by powers of two, the dither's table reads,
  round-to-nearest-even (``libdevice.nearbyint``), floor, the clamp, frexp and 2^k from its bits, the casts to
  int8 (of integers) and to 16 bits (round to nearest even).
``enable`` then checks each compiled kernel against the eager one on a sample built to expose any rounding that
differs (``_sample`` says what it covers) before it may be switched on.

Compiling is not free: on this 2-core machine the first kernels took 76 s the first time at load 10 and 519 s at
load 30-37 (inductor's C++ build), 11-92 s from its cache afterwards at load 10-40 (``TORCHINDUCTOR_CACHE_DIR``,
shared by the ranks of a machine and kept across runs); on the H200, 11 s. So nothing compiles inside a
collective: a rank that compiled there would hold its peers past their round deadlines. A caller enables the
kernels before its first collective (``enable``: it says, in one logged line, what it compiles and why it may
take minutes; the trainer's warm-up, or a script's set-up), and until then, or where compiling fails (no C++
compiler, no Triton), every call takes the eager path, after one logged line saying so. Shapes are dynamic
(``torch._dynamo.mark_dynamic`` on the lengths): the message's length is symbolic, so DDP's buckets of many sizes
share one compiled kernel, and every other size is a constant of it (B: one compile per B). ``enable``'s check
runs lengths that are and are not multiples of B, so no length compiles again later (tests count the graphs).
Calls below ``MIN_VALUES`` values stay eager (a compiled call's overhead is tens of microseconds).
``CERAR_FUSED=0`` in the environment keeps everything eager
(``enable`` then returns at once, saying so).

Faster, not only fused: the eager path on a device is itself one or two passes for some operations (the wire's
product written straight into 16 bits, ``cerar.formats.devices``), so ``enable`` times each checked kernel
against the eager path on the check's sample (``REPEATS`` interleaved repeats, synchronised with the device)
and switches on the faster, saying both times, as multiples of a copy, in its line. On the H200 of 2026-12-04
the fused 16-bit encode took 19.8x a copy at 256 MiB against eager's 4.2x: its absmax was a reduction of the
whole message to one value compiled with a dynamic length, and its time grew with the size (9.7x at 16 MiB, 22x
at 256), as a reduction left unsplit on a few of the GPU's blocks would; the absmax is now torch's own
``aminmax`` and the kernel the rest. Measured: ``scripts/bench/format_timing.py`` on a device,
``scripts/bench/bench_arithmetic.py`` on this CPU (``reports/arithmetic.md``).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time

import torch

from cerar.formats import devices, kernel_cases, wire
from cerar.formats import int4_blocks as q4
from cerar.formats import int8_blocks as q8

log = logging.getLogger("cerar.formats.fused")

MIN_VALUES = 2**14
"""Fewest values for which a fused kernel is called: below, the eager passes cost less than the call."""

KERNELS = (
    "quantize_nearest",
    "quantize_stochastic",
    "wire_encode",
    "dequantize",
    "dequantize_add",
    "wire_decode",
    "int4_quantize_nearest",
    "int4_quantize_stochastic",
    "int4_dequantize",
    "int4_dequantize_add",
)
"""Every operation with a faster variant than its eager form somewhere: ``COMPILED`` ones by ``torch.compile`` (any
device with a compiler), all of them by hand-written Triton (``cerar.formats.triton_kernels``: CUDA)."""

COMPILED = ("quantize_nearest", "quantize_stochastic", "wire_encode")
"""The kernels ``torch.compile`` writes (the variant called "fused"). The decoders are one eager pass already on a
device (int8 x scale and a 16-bit block x 2^-k written into float32, ``cerar.formats.devices``), and eager's
dequantize-and-add is one ``addcmul`` (its rounding the kernel's own): only Triton's variant of them is offered."""

VARIANTS = ("fused", "triton")
"""The variants ``enable`` may switch on besides eager: "fused" (``torch.compile``'s kernel, ``COMPILED``) and
"triton" (``cerar.formats.triton_kernels``)."""

SAMPLE_VALUES = 2**24 + 5 * 128 + 37
"""Values in ``enable``'s check (and timing) sample (``_sample``): 2^24 as in the H200 run that found 6 values
differing, plus five blocks and a short last block of 37, so the message ends neither on a block nor on a
dither chunk. Coverage, measured by planting kernels that round differently (tests/test_fused_formats.py):
- a kernel whose inverse is one unit off in a block changes that block's bytes in every one of the sample's
  65,536 near-boundary blocks (about 55 values each) but in 1 random block of about 3,500;
- a stochastic kernel whose products feed the sum unrounded (contracted into a multiply-add) changes 1
  near-boundary block in 6.
So a kernel that misrounds a fraction f of the blocks, whichever the data picks, passes with probability
(1 - f)^65536 (f = 10^-4: 0.14 %). The H200's 6 values in 2^24 random ones mean about 1 block in 6 had another
inverse there (6 / (131,072 / 3,500)): about 10,000 near-boundary blocks would show it, where 2^24 random values
alone show it with probability 1 - e^-6 (99.75 %)."""

REPEATS = 3
"""Timed calls of each variant at ``enable`` (after one untimed call), interleaved; the median decides."""

_lock = threading.Lock()
_enabled: dict[tuple[str, str, int], object] = {}  # (kernel, device type, block or 0): the compiled function
_timings: dict[tuple[str, str, int], dict] = {}  # the same keys: x a copy, fused and eager, and the choice
_checked: dict[tuple[str, str, int], object] = {}  # the same keys: every compiled function that passed its check
_compiled: dict[tuple[str, str, int], object] = {}  # (kernel, backend, block or 0): its torch.compile wrapper
_CHECK_KEY = kernel_cases.KEY  # the dither key of the check's stochastic messages


# ------------------------------------------------------------------------------------------------
# The kernels: cerar.formats.int8_blocks.quantize_eager and cerar.formats.wire.Wire.encode_eager, each in one loop
# ------------------------------------------------------------------------------------------------


def _per_block(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, p, inverse) per row, as ``int8_blocks.block_scales`` computes them: the absmax (exact), then
    scale = absmax / 127 and inverse = 1 / (scale p) divided in float64 and rounded to float32, which is the
    float32 quotient (module docstring)."""
    absmax = rows.abs().amax(dim=1)
    scale = (absmax.to(torch.float64) / q8.QMAX).to(torch.float32)
    p = torch.where((scale < q8.TINY_SCALE) & (scale > 0), q8.PRESCALE, 1.0)
    inverse = torch.where(scale > 0, torch.reciprocal((scale * p).to(torch.float64)).to(torch.float32), 0.0)
    return scale, p, inverse


def _rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as [ceil(s/B), B] rows, the last one completed with zeros (they change neither its absmax nor the values
    written: masked loads in the kernel, no copy)."""
    nb = (x.shape[0] + block - 1) // block
    return torch.nn.functional.pad(x, (0, nb * block - x.shape[0])).view(nb, block)


def _quantize_nearest(block: int):
    def kernel(x: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """values = round((x p) inverse) held to [-127, 127] (two products, the first exact); returns the
        per-block (scale, p, inverse) (outputs, so that they are computed once a block, not once a value)."""
        rows = _rows(x, block)
        scale, p, inverse = _per_block(rows)
        r = (rows * p.unsqueeze(1)) * inverse.unsqueeze(1)
        values.copy_(r.round().clamp(-q8.QMAX, q8.QMAX).to(torch.int8).view(-1)[: x.shape[0]])
        return scale, p, inverse

    return kernel


def _quantize_stochastic(block: int):
    def kernel(x: torch.Tensor, values: torch.Tensor, table: torch.Tensor, shifts: torch.Tensor) -> tuple:
        """values = floor(r + u) held to [-127, 127], u of row r and column j = table[shifts[r // K] + (r mod K) B
        + j] (``int8_blocks.dither``: ``table`` the message's, twice over, [2 K B]; ``shifts`` its chunks'); r + u
        summed in float64, then rounded to float32 (the correctly rounded float32 sum); returns the per-block
        (scale, p, inverse), as the nearest kernel does."""
        rows = _rows(x, block)
        scale, p, inverse = _per_block(rows)
        K = table.shape[0] // 2 // block
        row = torch.arange(rows.shape[0], device=x.device)
        index = (shifts[row // K] + (row % K) * block).unsqueeze(1) + torch.arange(block, device=x.device)
        r = (rows * p.unsqueeze(1)) * inverse.unsqueeze(1)
        total = (r.to(torch.float64) + table[index].to(torch.float64)).to(torch.float32)
        values.copy_(total.floor().clamp(-q8.QMAX, q8.QMAX).to(torch.int8).view(-1)[: x.shape[0]])
        return scale, p, inverse

    return kernel


def _wire_encode(block: int):  # noqa: ARG001 (the wire has no block size)
    def kernel(x: torch.Tensor, least: torch.Tensor, largest: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """values = x 2^k cast to 16 bits (the product exact, the cast the one rounding), k from the block's least
        and largest value as ``wire.exponent`` finds it (frexp, integers, 2^k from its bits); returns k."""
        _, e = torch.frexp(torch.maximum(largest, least.neg()).abs())
        k = (wire.TARGET_EXPONENT - e).clamp(-wire.K_LIMIT, wire.K_LIMIT)
        values.copy_(x * wire._power_of_two(k))
        return k

    return kernel


_FUNCTIONS = {
    "quantize_nearest": _quantize_nearest,
    "quantize_stochastic": _quantize_stochastic,
    "wire_encode": _wire_encode,
}
"""Each kernel's function of the block size B (a constant of the compiled loop)."""


def _dynamic(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of ``tensors`` with their length marked dynamic (symbolic in the compiled kernel: one kernel for
    every length; every other size, B and the dither table's, a constant). Views, so the caller's tensors keep
    no mark."""
    views = tuple(t.view(-1) for t in tensors)
    for view in views:
        torch._dynamo.mark_dynamic(view, 0)
    return views


def _run_quantize(fn, message: torch.Tensor, x: torch.Tensor, block: int, rounding: str, offset: int) -> None:
    """``message`` = x in the block format through ``fn``: one compiled call for every block (the short last one
    too; on a GPU two kernels: the blocks' absmax and per-block numbers, then the values), which returns the
    scales; for stochastic rounding the message's dither table and its chunks' shifts first (``message_dither``,
    ``chunk_shifts``: four operations on 2^17 and ceil(s / 2^16) + 1 values; the one more shift than chunks
    keeps that length above 1, which a dynamic length must be)."""
    s = x.numel()
    scales, values = q8.parts(message, s, block)
    if rounding == "nearest":
        scales.copy_(fn(*_dynamic(x, values))[0])
    else:
        table = q8.message_dither(block, offset, x.device)
        chunks = -(-q8.blocks(s, block) // (table.numel() // 2 // block))
        shifts = q8.chunk_shifts(block, offset, x.device, 0, chunks + 1)
        scales.copy_(fn(*_dynamic(x, values), table, *_dynamic(shifts))[0])


def _run_wire(fn, block: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the wire message of ``block`` through ``fn``: the least and the largest value in one read
    (``aminmax``), then one kernel for k and the values, and k into the header."""
    least, largest = torch.aminmax(block)
    x, values = _dynamic(block, out[wire.HEADER :])
    out[0].copy_(fn(x, least, largest, values))


# ------------------------------------------------------------------------------------------------
# Enabling: compile, check against the eager reference, time both, switch on the faster
# ------------------------------------------------------------------------------------------------


def available() -> tuple[bool, str]:
    """Whether this process may compile: (False, why) when ``CERAR_FUSED=0`` or torch.compile is missing."""
    if os.environ.get("CERAR_FUSED", "1") == "0":
        return False, "CERAR_FUSED=0"
    if not hasattr(torch, "compile"):
        return False, "torch.compile is not in this torch"
    return True, ""


def _compiled_function(name: str, block: int, backend: str):
    """The torch.compile wrapper of kernel ``name`` for block size ``block`` (one per process, backend and B;
    dynamic shapes; with inductor, contraction into fused multiply-adds off where this torch has the switch:
    module docstring)."""
    key = (name, backend, 0 if name == "wire_encode" else block)
    with _lock:
        if key not in _compiled:
            options = None
            if backend == "inductor":
                import torch._inductor.config as inductor_config

                if hasattr(inductor_config, "emulate_precision_casts"):
                    options = {"emulate_precision_casts": True}
            _compiled[key] = torch.compile(
                _FUNCTIONS[name](block), dynamic=None, fullgraph=True, backend=backend, options=options
            )
        return _compiled[key]


def _sample(block: int, rounding: str | None, n: int = SAMPLE_VALUES) -> torch.Tensor:
    """The check's n float32 values (on the CPU), blocks of B from the first value:
    - blocks 0-3: zeros; exact halves (absmax 127: scale 1; ties to even); a subnormal scale (absmax 1e-40); a
      huge one (3e38);
    - the even blocks from 4: random, normal values times a log-normal magnitude per block (decades apart),
      every 7th value 1e-3 of that (the data of the H200 run that found 6 of 16,777,216 values differing);
    - the odd blocks from 5, for the quantizers (``rounding``; None: the wire's check, random only): near a
      rounding boundary. A block's absmax A = 127 S (S log-normal, not a power of two) sits at a random column and
      sets scale = fl(A / 127); every other value is fl(t scale) with t = k + 1/2 (nearest) or t = k - u
      (stochastic, u the dither of its position in a message of key ``_CHECK_KEY``: r + u is then an integer),
      k a random integer in [-125, 125]. So the exact r (or r + u) lies within 127 x 2^-24 of a rounding
      boundary, a few units in r's last place (``SAMPLE_VALUES``: what this catches)."""
    g = torch.Generator().manual_seed(35)
    nb = -(-n // block)
    magnitude = torch.exp(3 * torch.randn(nb, generator=g))
    x = (torch.randn(nb, block, generator=g) * magnitude.unsqueeze(1)).view(-1)[:n].clone()
    x[::7] *= 1e-3
    rows = x[: n // block * block].view(-1, block)
    if rounding is not None and rows.shape[0] > 5:  # float32 throughout: t and the scale are float32 numbers,
        near = rows[5::2]  # so each product below is rounded once, as fl(t scale)
        m = near.shape[0]
        absmax = 127 * magnitude[5::2][:m] * (1 + torch.rand(m, generator=g))
        scale = absmax / torch.full((1,), 127.0)  # IEEE division (a tensor divisor), as the format's
        t = torch.randint(-125, 126, (m, block), generator=g, dtype=torch.int32).float()
        if rounding == "nearest":
            t += 0.5
        else:
            t -= q8.dither(block, _CHECK_KEY, "cpu", 0, rows.shape[0])[5::2]
        torch.mul(t, scale.unsqueeze(1), out=near)
        column = torch.randint(0, block, (m,), generator=g)
        near[torch.arange(m), column] = torch.where(torch.rand(m, generator=g) < 0.5, -absmax, absmax)
    rows[0].zero_()
    rows[1] = torch.arange(block) - block / 2 + 0.5
    rows[1, 0] = 127.0  # scale 1: the values exact halves, ties to even
    rows[2] *= 1e-40 / rows[2].abs().max()  # a subnormal scale
    rows[3] *= 3e38 / rows[3].abs().max()
    return x


def _runners(name: str, block: int, device: torch.device, backend: str, triton: bool) -> dict:
    """{variant: runner} of kernel ``name`` on ``device`` (``VARIANTS``), each with its eager reference's signature:
    quantize (message, x, block, rounding, offset); dequantize (message, s, block, out); wire_encode (x, out);
    wire_decode (message, out). The compiled one compiles at its first call (inside ``enable``'s check)."""
    runners = {}
    if name in COMPILED:
        fn = _compiled_function(name, block, backend)
        runners["fused"] = (
            (lambda message, x, block, rounding, offset: _run_quantize(fn, message, x, block, rounding, offset))
            if name.startswith("quantize")
            else (lambda x, out: _run_wire(fn, x, out))
        )
        runners["fused"].compiled = fn
    if triton:
        from cerar.formats import triton_kernels as tk

        if name.startswith("int4") and block & (block - 1):
            pass  # the 4-bit kernels take whole pairs of a power-of-two block (triton_kernels._tiling4)
        elif name.startswith("int4_quantize"):  # the scale as the CPU's quotient, else as CUDA's reciprocal product
            runners["triton"] = [functools.partial(tk.quantize4, reciprocal=r) for r in (False, True)]
        elif name.startswith("int4_dequantize"):
            add = name == "int4_dequantize_add"
            runners["triton"] = [
                lambda message, s, block, out, rotate, seed, fma=fma: tk.dequantize4(
                    message, s, block, out, add, rotate, seed, fma=fma
                )
                for fma in ((True, False) if add else (True,))
            ]
        elif name.startswith("quantize"):
            runners["triton"] = tk.quantize
        elif name == "wire_encode":
            runners["triton"] = tk.wire_encode
        elif name == "wire_decode":
            runners["triton"] = tk.wire_decode
        elif name == "dequantize":
            runners["triton"] = tk.dequantize
        else:  # the add as one fused multiply-add (CUDA's addcmul), else as a product and a sum: _check keeps one
            runners["triton"] = [
                lambda message, s, block, out, fma=fma: tk.dequantize(message, s, block, out, add=True, fma=fma)
                for fma in (True, False)
            ]
    return runners


def _differing(want: torch.Tensor, got: torch.Tensor) -> int:
    """How many elements' bytes differ (compared as integers: a NaN equals its own bits)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[want.element_size()]
    return int((want.view(as_int) != got.view(as_int)).sum())


def _check(name: str, fn, block: int, device, n: int) -> None:
    """Run ``fn`` (a runner of kernel ``name``: ``_runners``) against the eager reference (``kernel_cases``) on
    ``_sample`` (n values) and on two shorter messages (new lengths, one of them a whole number of blocks: whatever a
    length can make a compiled kernel compile again is compiled here, not in a collective); the 4-bit ones rotated
    and not, the wire's on both dtypes and on messages of subnormals (k clamped at 126) and of huge values (k near
    -85); raise AssertionError naming the kernel, the message and how many bytes differ, where any does."""
    sizes = (n, MIN_VALUES + 3 * block + 1, MIN_VALUES + 5 * block)  # a new length, and a whole number of blocks
    kind = name.split("_")[1] if name.startswith("quantize") else None
    kind = "stochastic" if name.startswith("dequantize") else kind  # the 8-bit sample is built for its rounding
    x = _sample(block, kind, n).to(device)
    base = torch.randn(n, generator=torch.Generator().manual_seed(36)).to(device)
    if name.startswith("wire"):  # one graph per wire dtype: both compiled here, not in a collective
        inputs = [(x, True), (x[: sizes[1]] * 1e-42, True), (x[: sizes[1]] * 1e30, True)]
    else:
        inputs = [(x[:s], rotate) for rotate in ((True, False) if name.startswith("int4") else (True,)) for s in sizes]
    for values, rotate in inputs:
        for case in kernel_cases.cases(values, block, [name], rotate=rotate, base=base[: values.numel()]):
            want, got = case.fresh(), case.fresh()
            case.eager(want)
            case.run(fn, got)
            differ = _differing(want, got)
            if differ:
                raise AssertionError(f"the {name} kernel differs from the eager reference in {differ} of "
                                     f"{want.numel()} ({case.what}, s={values.numel()}, B={block})")  # fmt: skip


def _checked_runner(name: str, fn, block: int, device, n: int):
    """``fn`` once it passed ``_check``; for a list of forms (the dequantize-and-add's), the first that passes,
    else the first form's failure."""
    if not isinstance(fn, list):
        _check(name, fn, block, device, n)
        return fn
    failure = None
    for form in fn:
        try:
            _check(name, form, block, device, n)
            return form
        except AssertionError as error:
            failure = failure or error
    raise failure


def _timing(name: str, runners: dict, block: int, device: torch.device, n: int) -> dict:
    """Eager ``name`` and each of its checked ``runners`` on n values of ``_sample`` against a copy of them: each as
    a multiple of the copy's time, "copy_s", and "chosen" (the fastest)."""
    x = _sample(block, None, n).to(device)
    copy = torch.empty_like(x)
    case = kernel_cases.cases(x, block, [name], dtypes=("float16",))[0]
    out = case.fresh()
    calls = {v: (lambda fn=fn: case.run(fn, out)) for v, fn in runners.items()}
    calls["eager"] = lambda: case.eager(out)
    seconds = devices.side_by_side_seconds({"copy": lambda: copy.copy_(x), **calls}, device, REPEATS)
    row = {k: seconds[k] / seconds["copy"] for k in calls}
    row.update(copy_s=seconds["copy"], chosen=min(calls, key=lambda k: (row[k], k == "eager")))
    return row


def enable(
    device="cpu",
    block: int = q8.DEFAULT_BLOCK,
    kernels=KERNELS,
    *,
    say=None,
    backend: str = "inductor",
    pick: str = "faster",
    sample_values: int = SAMPLE_VALUES,
    triton: bool | None = None,
) -> dict[str, float]:
    """Compile ``kernels`` for ``device`` and block size ``block``, check each against its eager reference on
    ``sample_values`` values (``_sample``), and switch it on where it is the faster (``pick="faster"``: both
    timed on that sample, ``REPEATS`` times, synchronised with the device) or wherever it passes its check
    (``pick="fused"``); returns the seconds each took (0 for one already decided). Call it before the first
    collective (module docstring). A kernel that fails to compile or to match stays eager, said in the line (and
    logged at WARNING). ``say``: where the lines go (default: this module's logger at INFO where logging shows
    it, else stderr). ``backend``: torch.compile's; "eager" traces the kernels with dynamo but runs torch's own
    operations, in seconds, which the tests use to check the kernels' arithmetic and the dispatch without a C++
    build. ``triton``: offer the hand-written Triton kernels (``cerar.formats.triton_kernels``); None: where they
    compile (CUDA with Triton); True: on the CPU too, in Triton's interpreter (the tests). Each variant that passes
    its check is timed; "chosen" is the fastest of eager and them."""
    say = say or _announce
    device = torch.device(device)
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise ValueError(f"cerar.formats.fused.enable: unknown kernels {unknown}; the kernels are {KERNELS}")
    q8.check_block(block, "cerar.formats.fused.enable")
    if pick not in ("faster", "fused"):
        raise ValueError(f"cerar.formats.fused.enable: pick must be 'faster' or 'fused', got {pick!r}")
    if isinstance(sample_values, bool) or not isinstance(sample_values, int) or sample_values < 2 * MIN_VALUES:
        raise ValueError(f"cerar.formats.fused.enable: sample_values must be an integer >= {2 * MIN_VALUES}, "
                         f"got {sample_values!r}")  # fmt: skip
    ok, why = available()
    if not ok:
        say(f"cerar.formats.fused: the eager arithmetic is used ({why})")
        return {}
    if triton is False:
        triton_why = "not asked for"
    else:
        from cerar.formats import triton_kernels

        triton, triton_why = triton_kernels.usable(device, interpreter=bool(triton))
        if block > triton_kernels.MAX_BLOCK:
            triton, triton_why = False, f"B={block} is above its MAX_BLOCK={triton_kernels.MAX_BLOCK}"
    todo = [k for k in kernels if _key(k, device, block) not in _timings and (triton or k in COMPILED)]
    without = [k for k in kernels if not triton and k not in COMPILED]
    if not todo:
        return dict.fromkeys(kernels, 0.0)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "the default inductor cache")
    say(
        f"cerar.formats.fused: compiling {len(todo)} kernels ({', '.join(todo)}) for {device.type}, B={block}, "
        f"with torch.compile ({backend})" + (" and Triton by hand" if triton else "")
        + f": on a small busy CPU minutes the first time (76-519 s measured on 2 cores at load 10-35), seconds once "
        f"cached in {cache}; then each is checked on {sample_values} values and "
        + ("timed against the eager path" if pick == "faster" else "switched on")
    )  # fmt: skip
    seconds, said = {}, []
    for name in todo:
        start = time.perf_counter()
        row, passed = {}, {}
        for variant, fn in _runners(name, block, device, backend, triton).items():
            try:  # compiling is optional: the eager path is always there
                passed[variant] = _checked_runner(name, fn, block, device, sample_values)
            except Exception as error:
                reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
                log.warning("cerar.formats.fused: the %s %s stays off on %s: %s", variant, name, device.type, reason)
                row["failed" if variant == "fused" else f"{variant}_failed"] = reason
        if pick == "faster" and passed:
            row.update(_timing(name, passed, block, device, sample_values))
        else:
            row["chosen"] = next(iter(passed), "eager")
        seconds[name] = time.perf_counter() - start
        with _lock:
            _timings[_key(name, device, block)] = row
            _checked[_key(name, device, block)] = passed
            if row["chosen"] != "eager":
                _enabled[_key(name, device, block)] = passed[row["chosen"]]
        said.append(_said(name, row, seconds[name]))
    if without:
        said.append(f"no kernel for {', '.join(without)} here ({triton_why})")
    timed = f" (x a copy, median of {REPEATS} at {sample_values} values, synchronised)" if pick == "faster" else ""
    say(f"cerar.formats.fused: on {device.type}, B={block}{timed}: " + "; ".join(said))
    return seconds


def _said(name: str, row: dict, seconds: float) -> str:
    """One kernel's part of ``enable``'s line: what runs, its time, the others' (or why each variant is off)."""
    failed = [f"{k.removesuffix('_failed').replace('failed', 'fused')} failed: {v}" for k, v in row.items()
              if k.endswith("failed")]  # fmt: skip
    timed = [k for k in ("eager", *VARIANTS) if k in row]
    if not timed:
        return f"{name} {row['chosen']} ({'; '.join([*failed, f'{seconds:.1f} s'])})"
    chosen = row["chosen"]
    others = [f"{k} {row[k]:.2f}" for k in timed if k != chosen]
    return f"{name} {chosen} {row[chosen]:.2f} ({', '.join(others + failed)}; {seconds:.1f} s)"


def _key(name: str, device, block: int) -> tuple[str, str, int]:
    return name, torch.device(device).type, 0 if name.startswith("wire") else block


def _announce(line: str) -> None:
    """A line the user must see before a wait of minutes: to this module's logger at INFO where logging is set
    up to show it, else to stderr (Python's default handler would drop an INFO line)."""
    if log.isEnabledFor(logging.INFO) and (log.handlers or logging.getLogger().handlers):
        log.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def disable() -> None:
    """Switch every fused kernel off and forget the choices (the eager references run; ``enable`` decides again);
    the compiled code stays cached."""
    with _lock:
        _enabled.clear()
        _timings.clear()
        _checked.clear()


def enabled() -> list[tuple[str, str, int]]:
    """The kernels switched on: (name, device type, block; 0 for the wire's)."""
    with _lock:
        return sorted(_enabled)


def choices() -> dict[tuple[str, str, int], dict]:
    """What ``enable`` decided per kernel (the keys of ``enabled``): "chosen" ("eager", "fused" or "triton"), and
    where it timed them each checked variant and "eager" as multiples of a copy and "copy_s"; "failed" (why the
    compiled one is off) or "triton_failed"."""
    with _lock:
        return {k: dict(v) for k, v in sorted(_timings.items())}


def checked_kernel(name: str, device, block: int = q8.DEFAULT_BLOCK):
    """The compiled function of kernel ``name`` that passed ``enable``'s check on ``device`` (also where another
    path was chosen: for benchmarks, through ``_run_quantize`` or ``_run_wire``), or None."""
    with _lock:
        runner = _checked.get(_key(name, device, block), {}).get("fused")
    return getattr(runner, "compiled", None)


def checked_variants(name: str, device, block: int = q8.DEFAULT_BLOCK) -> dict:
    """{variant: runner} of kernel ``name`` that passed ``enable``'s check on ``device`` (``_runners`` has the
    signatures): what a benchmark times beside eager and the chosen path."""
    with _lock:
        return dict(_checked.get(_key(name, device, block), {}))


# ------------------------------------------------------------------------------------------------
# The dispatch from cerar.formats.int8_blocks and cerar.formats.wire: True when the fused kernel did the work
# ------------------------------------------------------------------------------------------------


def quantize(message: torch.Tensor, x: torch.Tensor, block: int, rounding: str, offset: int) -> bool:
    if x.numel() < MIN_VALUES:
        return False
    fn = _enabled.get((f"quantize_{rounding}", x.device.type, block))
    if fn is None:
        return False
    fn(message, x, block, rounding, offset)
    return True


def wire_encode(block: torch.Tensor, out: torch.Tensor) -> bool:
    if block.numel() < MIN_VALUES:
        return False
    fn = _enabled.get(("wire_encode", block.device.type, 0))
    if fn is None:
        return False
    fn(block, out)
    return True


def wire_decode(message: torch.Tensor, out: torch.Tensor) -> bool:
    if out.numel() < MIN_VALUES:
        return False
    fn = _enabled.get(("wire_decode", out.device.type, 0))
    if fn is None:
        return False
    fn(message, out)
    return True


def dequantize(message: torch.Tensor, s: int, block: int, out: torch.Tensor, add: bool) -> bool:
    if s < MIN_VALUES:
        return False
    fn = _enabled.get(("dequantize_add" if add else "dequantize", out.device.type, block))
    if fn is None:
        return False
    fn(message, s, block, out)
    return True


def quantize4(message, x, block: int, rounding: str, key: int, rotate: bool, seed: int) -> bool:
    if x.numel() < MIN_VALUES:
        return False
    fn = _enabled.get((f"int4_quantize_{rounding}", x.device.type, block))
    if fn is None:
        return False
    fn(message, x, block, rounding, key, rotate, seed)
    return True


def dequantize4(message, s: int, block: int, out, add: bool, rotate: bool, seed: int) -> bool:
    if s < MIN_VALUES:
        return False
    fn = _enabled.get(("int4_dequantize_add" if add else "int4_dequantize", out.device.type, block))
    if fn is None:
        return False
    fn(message, s, block, out, rotate, seed)
    return True


q8.FUSED_QUANTIZE = quantize  # the formats ask through these; they never import this module
q4.FUSED_QUANTIZE = quantize4
q4.FUSED_DEQUANTIZE = dequantize4
q8.FUSED_DEQUANTIZE = dequantize
wire.FUSED_ENCODE = wire_encode
wire.FUSED_DECODE = wire_decode

__all__ = [
    "KERNELS",
    "MIN_VALUES",
    "SAMPLE_VALUES",
    "available",
    "checked_kernel",
    "checked_variants",
    "choices",
    "disable",
    "enable",
    "enabled",
]
