"""Section "formats": every per-call format of ``cerar.formats`` against a device copy of the same float32
gradient, through its public functions (``int8_blocks.quantize_into`` and ``dequantize``, ``wire.Wire``'s
``encode`` and ``decode``), eager (``cerar.formats.fused.disable``) and after ``cerar.formats.fused.enable``
(whatever it switched on for the device; an operation it has no kernel for runs eagerly either way, and its row
says so). 64 and 256 MiB on a GPU, as ``../shared/device-runs/h200-2026-12-04/formats_bench.py`` measured them.
A fused row also says whether its bytes equal the eager ones (for quantize and encode, the outputs compared).

Where the tree has the formats' own timing entry, ``scripts.bench.format_timing.formats_against_copy`` (issue 52
part 3: eager, fused and "chosen", what ``fused.enable`` picked per kernel), its rows are recorded instead
(``from_format_timing``), each saying so."""

from __future__ import annotations

import importlib
import inspect
import time

import torch

from scripts.bench.gpu.measure import timed

SECTION = "formats"
SIZES_MIB = (64, 256)
SMALL_SIZES_MIB = (0.25,)
ESTIMATE_S = 45.0  # one size, every variant, on an H200 (enable compiled in about 11 s the first time, Triton too now)


def _gradient(n: int, block: int, seed: int, device: torch.device) -> torch.Tensor:
    """n float32 values whose blocks span magnitudes (as a gradient's tensors do), one block of zeros."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp(3 * torch.randn(-(-n // block), generator=g)).repeat_interleave(block)[:n]
    x = torch.randn(n, generator=g) * scales
    x[:block] = 0.0
    return x.to(device)


def operations(x: torch.Tensor, block: int):
    """(name, kernel that fuses it or None, the call, its output) for every format operation on x."""
    from cerar.formats import int8_blocks as q8
    from cerar.formats.wire import Wire

    n = x.numel()
    message = q8.new_message(n, block, x.device)
    out = torch.empty_like(x)
    ops = [
        ("int8 quantize, nearest", "quantize_nearest",
         lambda: q8.quantize_into(message, x, block, "nearest", 7), message),
        ("int8 quantize, stochastic", "quantize_stochastic",
         lambda: q8.quantize_into(message, x, block, "stochastic", 7), message),
        ("int8 dequantize", None, lambda: q8.dequantize(message, n, block, out), out),
        ("int8 dequantize-add", None, lambda: q8.dequantize(message, n, block, out, add=True), out),
    ]  # fmt: skip
    for dtype in ("float16", "bfloat16"):
        wire = Wire(dtype)
        encoded = wire.empty(n, x)
        ops += [
            (f"{dtype} wire encode", "wire_encode", lambda w=wire, e=encoded: w.encode(x, e), encoded),
            (f"{dtype} wire decode", None, lambda w=wire, e=encoded: w.decode(e, out), out),
        ]
    return ops


def from_format_timing(bench, entry, sizes, repeats: int) -> None:
    """Every row of ``formats_against_copy(device, mib=sizes, ...)`` (only the options it takes are passed)."""
    options = {"mib": tuple(sizes), "reps": repeats, "backend": "inductor" if bench.cuda else "eager",
               "say": lambda line: bench.say(f"formats: {line}")}  # fmt: skip
    if not bench.cuda:
        options["sample_values"] = 2**16  # enable's check sample at the dry run's size
    accepted = inspect.signature(entry).parameters
    result = entry(bench.device, **{k: v for k, v in options.items() if k in accepted})
    copies = {r["MiB"]: r["ms"] for r in result["rows"] if r["operation"] == "copy"}
    for r in result["rows"]:
        if r["operation"] == "copy":
            continue
        name, mib, variant, ms = r["operation"], r["MiB"], r["variant"], r["ms"]
        bench.record(
            SECTION,
            f"{name}, {mib:g} MiB of float32, {variant} (scripts.bench.format_timing)",
            operation=name,
            variant=variant,
            runs=variant,
            MiB=mib,
            ms=ms,
            copy_ms=copies.get(mib),
            x_copy=r["x_copy"],
            gbps_of_gradient=mib * 2**20 / (ms / 1e3) / 1e9,
            bytes_equal_to_eager=None if variant == "eager" else r.get("same_bytes"),
            measured_by="scripts.bench.format_timing.formats_against_copy",
            enable_s=result.get("enable"),
            choices=result.get("choices"),
            summary=f"{ms:.3f} ms, {r['x_copy']:.1f} x a copy",
        )


def run(bench) -> None:
    from cerar.formats import fused
    from cerar.formats import int8_blocks as q8

    sizes = SMALL_SIZES_MIB if bench.small else SIZES_MIB
    try:
        entry = importlib.import_module("scripts.bench.format_timing").formats_against_copy
    except (ImportError, AttributeError):
        entry = None
    if entry is not None:
        if bench.fits(SECTION, f"every format at {', '.join(f'{m:g}' for m in sizes)} MiB", ESTIMATE_S * len(sizes)):
            from_format_timing(bench, entry, sizes, 3 if bench.small else 20)
        return

    block = q8.DEFAULT_BLOCK
    repeats, warmup = (3, 1) if bench.small else (20, 5)
    backend = "inductor" if bench.cuda else "eager"  # eager on a CPU: dynamo traces, torch's own ops run (seconds)
    for mib in sizes:
        if not bench.fits(SECTION, f"every format at {mib:g} MiB", ESTIMATE_S):
            continue
        n = int(mib * 2**20 / 4)
        x = _gradient(n, block, bench.seed, bench.device)
        y = torch.empty_like(x)
        copy = timed(lambda x=x, y=y: y.copy_(x), bench.device, warmup, repeats)
        eager_bytes = {}
        for variant in ("eager", "fused"):
            fused.disable()
            if variant == "fused":
                lines: list[str] = []
                started = time.perf_counter()
                seconds = fused.enable(bench.device, block, backend=backend, say=lines.append)
                on = {name for name, kind, _ in fused.enabled() if kind == bench.device.type}
                bench.say(f"formats: fused.enable ({backend}) in {time.perf_counter() - started:.1f} s: "
                          f"{', '.join(sorted(on)) or 'nothing'} on")  # fmt: skip
            else:
                seconds, on, lines = {}, set(), []
            for name, kernel, call, output in operations(x, block):
                what = f"{name}, {mib:g} MiB of float32, {variant}"
                try:
                    call()
                    equal = None
                    if kernel is not None and variant == "eager":
                        eager_bytes[name] = output.clone()
                    elif kernel is not None and name in eager_bytes:
                        equal = bool(torch.equal(output.view(torch.uint8), eager_bytes[name].view(torch.uint8)))
                    t = timed(call, bench.device, warmup, repeats)
                except Exception as error:
                    bench.record(SECTION, what, "FAILED", reason=f"{type(error).__name__}: {error}")
                    continue
                runs = "fused" if kernel in on else "eager"
                bench.record(
                    SECTION,
                    what,
                    operation=name,
                    variant=variant,
                    runs=runs,  # what did the work: a variant "fused" without a kernel for the operation runs eagerly
                    MiB=mib,
                    values=n,
                    ms=t["median_ms"],
                    timing=t,
                    copy_ms=copy["median_ms"],
                    x_copy=t["median_ms"] / copy["median_ms"],
                    gbps_of_gradient=4 * n / (t["median_ms"] / 1e3) / 1e9,
                    bytes_equal_to_eager=equal,
                    compile_s=seconds.get(kernel) if kernel else None,
                    enable_said=lines,
                    summary=f"{t['median_ms']:.3f} ms, {t['median_ms'] / copy['median_ms']:.1f} x a copy ({runs})"
                    + ("" if equal is None else f", bytes equal to eager: {equal}"),
                )
        fused.disable()
        x = y = None
