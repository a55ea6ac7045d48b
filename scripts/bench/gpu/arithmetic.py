"""Section "arithmetic": one rank's CERAR rounds with each transfer replaced by a local copy
(``scripts.checks.gpu.throughput.one_rank_arithmetic``, called through its public name whatever its signature
becomes: ``arithmetic_call``), as ``../shared/device-runs/h200-2026-12-04/cerar-arithmetic-profile.txt`` measured
it: N=4 c=16 at 64 and 256 MiB, N=8 c=32 at 256 MiB, construction "optimized".

Per row: the kernels one call launches (CUDA activity under ``torch.profiler``; the stand-in copies counted
apart), the top-level aten operations it dispatches (the same count on any device), the GPU's busy time (the
union of its kernels' intervals), the call's time (CUDA events, the median of timed calls after warm-up), busy
over that time, the call's time as a multiple of a device copy of the same gradient (``y.copy_(x)``) and of its
memory-traffic bound (``scripts.checks.gpu.throughput.arithmetic_prediction``: the bytes the arithmetic and the
stand-in's copies read and write, at the copy's measured bandwidth), and the kernels that took the most GPU time.

Each configuration runs with torch's products (cuBLAS) and then, on CUDA where it passes its check, with the Triton
product (``cerar.ring.products``, switched on once with ``pick="checked"`` after torch's rows, off at the section's
end): issue 52's 2x of the bound at 64 MiB is what it is for."""

from __future__ import annotations

import inspect

import torch

import cerar
from cerar.ring import products
from scripts.bench.gpu.measure import synchronize, timed

SECTION = "arithmetic"
CONFIGS = [(4, 16, 64), (4, 16, 256), (8, 32, 256)]  # N, c, MiB of float32 gradient
SMALL_CONFIGS = [(4, 16, 0.25), (8, 32, 0.25)]
CONSTRUCTION = "optimized"
ESTIMATE_S = 6.0  # one row on an H200: the code, warm-up, timed calls, one profiled call


def graph_variants(device: torch.device) -> list:
    """The ``graph=`` settings to measure: where ``one_rank_arithmetic`` takes one (a call replayed from a CUDA
    graph), both on CUDA, replayed first; else the function's only way (None)."""
    from scripts.checks.gpu.throughput import one_rank_arithmetic

    takes = "graph" in inspect.signature(one_rank_arithmetic).parameters
    return [True, False] if takes and device.type == "cuda" else [None]


def arithmetic_call(code, d: int, device: torch.device, graph: bool | None = None):
    """The callable ``one_rank_arithmetic`` makes for ``code`` on ``d`` values on ``device`` (and ``graph``, where
    not None): by keyword where its parameters keep these names, else by position; a tuple's first callable where
    it returns more."""
    from scripts.checks.gpu.throughput import one_rank_arithmetic

    given = {"code": code, "d": d, "device": device}
    extra = {} if graph is None else {"graph": graph}
    parameters = inspect.signature(one_rank_arithmetic).parameters
    if all(name in parameters for name in given):
        made = one_rank_arithmetic(**given, **extra)
    else:
        made = one_rank_arithmetic(code, d, device, **extra)
    if callable(made):
        return made
    for item in made if isinstance(made, (tuple, list)) else ():
        if callable(item):
            return item
    raise TypeError(f"one_rank_arithmetic returned {type(made).__name__}, not a callable or a tuple holding one")


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (microseconds)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def profiled(run, device: torch.device) -> dict:
    """One call under ``torch.profiler``: its device activity (kernels and copies, the busy time) and its
    top-level aten operations."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        synchronize(device)
    events = list(prof.events())
    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    aten = [
        e for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]  # fmt: skip
    names: dict[str, int] = {}
    spent: dict[str, float] = {}
    for e in on_device:
        names[e.name[:60]] = names.get(e.name[:60], 0) + 1
        spent[e.name[:60]] = spent.get(e.name[:60], 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    busy = _busy_us([(e.time_range.start, e.time_range.end) for e in on_device]) / 1e3 if on_device else None
    return {
        "kernels": len(on_device) if device.type == "cuda" else None,
        "copies": sum(e.name.startswith("Memcpy") for e in on_device) if device.type == "cuda" else None,
        "aten_ops": len(aten),
        "busy_ms": busy,
        "top_kernels": sorted(names.items(), key=lambda kv: -kv[1])[:6],
        "kernel_ms": sorted(spent.items(), key=lambda kv: -kv[1])[:6],
    }


def run(bench) -> None:
    from scripts.checks.gpu.throughput import arithmetic_prediction

    repeats, warmup = (3, 1) if bench.small else (10, 3)
    configs = SMALL_CONFIGS if bench.small else CONFIGS
    variants = ["torch", "triton"] if bench.device.type == "cuda" else ["torch"]
    products.disable()  # torch's rows first, whatever ran before
    todo = [(v, config, g) for v in variants for config in configs for g in graph_variants(bench.device)]
    for variant, (N, c, mib), graph in todo:  # torch's products first, then the Triton one's, switched on once
        if variant == "triton" and not products.enabled():
            said: list[str] = []
            on = products.enable(bench.device, pick="checked", say=said.append)
            bench.record(SECTION, "the Triton product's check", "measured", summary=said[0])
            if not on:
                break
        how = {None: "", True: ", replayed from a CUDA graph", False: ", eager (graph=False)"}[graph]
        what = (f"one rank's rounds, N={N} c={c} {CONSTRUCTION}, {mib:g} MiB, transfers as local copies{how}, "
                f"{variant}'s products")  # fmt: skip
        if not bench.fits(SECTION, what, ESTIMATE_S):
            continue
        try:
            torch.manual_seed(bench.seed)
            code = cerar.make_code(N, c, CONSTRUCTION)
            d = int(mib * 2**20 / 4)
            x = torch.randn(d, device=bench.device)
            y = torch.empty_like(x)
            copy = timed(lambda x=x, y=y: y.copy_(x), bench.device, warmup, repeats)
            with cerar.full_fp32_products(bench.device):
                call = arithmetic_call(code, d, bench.device, graph)
                wall = timed(call, bench.device, warmup, repeats)
                seen = profiled(call, bench.device)
        except Exception as error:
            bench.record(SECTION, what, "FAILED", reason=f"{type(error).__name__}: {error}")
            continue
        finally:
            x = y = None
        bandwidth = 2 * 4 * d / (copy["median_ms"] / 1e3)  # bytes read and written per second by the copy
        bound_ms = arithmetic_prediction(code, d, copy_bandwidth=bandwidth)["stand_in_bound_s"] * 1e3
        busy = seen["busy_ms"]
        ratio = busy / wall["median_ms"] if busy is not None else None
        kernels = f"{seen['kernels']} kernels ({seen['copies']} copies), " if seen["kernels"] is not None else ""
        bench.record(
            SECTION,
            what,
            N=N,
            c=c,
            graph=graph,
            products=variant,
            L=code.L,
            MiB=mib,
            d=d,
            **seen,
            wall_ms=wall["median_ms"],
            wall=wall,
            copy_ms=copy["median_ms"],
            x_copy=wall["median_ms"] / copy["median_ms"],
            bound_ms=bound_ms,
            x_bound=wall["median_ms"] / bound_ms,
            busy_over_wall=ratio,
            summary=f"{kernels}{seen['aten_ops']} aten ops, wall {wall['median_ms']:.2f} ms"
            + (f", GPU busy {busy:.2f} ms ({100 * ratio:.0f} %)" if busy is not None else "")
            + f", {wall['median_ms'] / copy['median_ms']:.1f} x a copy, {wall['median_ms'] / bound_ms:.2f} x its "
            "memory-traffic bound",
        )
    products.disable()
