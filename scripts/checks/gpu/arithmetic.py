"""Section "arithmetic": CERAR's encode/decode arithmetic on the device, against the exact sum.

- oracle: ``cerar.simulate`` on the device, (N, c) in {(4, 16), (8, 32)} and every construction (one
  that cannot be built there is reported as such and checked at the largest of c = N, N/2, 2 that
  builds), each worker's result within the float32 rounding bound of the exact sum plus the code's
  own error (``judge.judge_coded``);
- tf32: the same with TF32 switched on (``torch.set_float32_matmul_precision("high")``): inside
  ``cerar.full_fp32_products`` within the bound and the caller's settings restored; the unguarded
  products reported next to it;
- fused: ``cerar.formats.fused`` (issue 35) compiled for the device (Triton on a GPU; on the CPU dry run
  traced only, backend "eager"), every kernel switched on after ``enable``'s byte-for-byte check,
  its bytes again equal to the eager reference's on 64 MiB of float32 (int8 quantize, nearest and
  stochastic; the 16-bit wire's encode), and its time against a device copy of the same tensor.

One device, no transfer: proves the device's arithmetic, nothing about NCCL. Expected time on one
H200: about 20 s (two processes, each a few seconds of CUDA start-up)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

import cerar
from scripts.checks.gpu.cases import FAIL, NOT_RUN, PASS, Case, Context
from scripts.checks.gpu.judge import judge_coded, worst_error

SECTION = "arithmetic"
QUICK = True
EXPECTED_S = 20
SHAPES = [(4, 16), (8, 32)]

PROVES = {
    "oracle": "the device's encode/decode arithmetic gives every construction's exact-arithmetic result within "
    "float32's rounding bound",
    "tf32": "with TF32 switched on, CERAR's products still run in full float32 and the caller's settings come back",
    "fused": "the formats' kernels (compiled, and Triton's by hand on a GPU) that pass enable's check write the eager "
    "bytes on other data too, and run at a measured multiple of a device copy",
}


def cases(ctx: Context) -> list[Case]:
    d = 4096 if ctx.small else 2**20
    shapes = [(4, 16)] if ctx.small else SHAPES
    return [
        Case(SECTION, "oracle", "arithmetic:oracle_agreement", {"device": ctx.device, "d": d, "shapes": shapes}, 300),
        Case(
            SECTION,
            "tf32",
            "arithmetic:tf32_guard",
            {"device": ctx.device, "d": d, **({"N": 4, "c": 8} if ctx.small else {})},
            300,
        ),
        Case(SECTION, "fused", "arithmetic:fused_kernels", {"device": ctx.device, "small": ctx.small}, 900),
    ]


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def oracle_agreement(device: str, d: int, shapes, out: str) -> dict:  # noqa: ARG001
    device = _device(device)
    rows = []
    for N, c in shapes:
        for construction in cerar.CONSTRUCTIONS:
            row = {"N": N, "c": c, "construction": construction}
            code, reasons = None, []
            for smaller in dict.fromkeys((c, N, N // 2, 2)):  # the asked c, else the largest that builds
                try:
                    code = cerar.make_code(N, smaller, construction)
                    break
                except ValueError as error:
                    reasons.append(f"c={smaller}: {str(error).split(';')[0]}")
            if code is None:
                row.update(status=NOT_RUN, note="cannot be built: " + "; ".join(reasons))
                rows.append(row)
                continue
            if code.c != c:
                row.update(c=code.c, note=f"cannot be built at {reasons[0]}; checked at c={code.c}")
            G = torch.randn(N, d, generator=torch.Generator().manual_seed(N * 100 + code.c))
            with cerar.full_fp32_products(device):
                on_cpu = cerar.simulate(G, code)
                on_device = cerar.simulate(G.to(device), code).cpu()
            judged = judge_coded(on_device, G, code, torch.float32)
            row.update(
                kappa=code.kappa,
                difference=((on_device - on_cpu).norm() / on_cpu.norm()).item(),
                cpu_error=worst_error(on_cpu, G),
                device_error=judged["error"],
                deviation=judged["deviation"],
                bound=judged["bound"],
                status=PASS if judged["ok"] else FAIL,
            )
            rows.append(row)
    failed = [
        f"N={r['N']} c={r['c']} {r['construction']}: deviation {r['deviation']:.2e} > bound {r['bound']:.2e}"
        for r in rows
        if r["status"] == FAIL
    ]
    return {"status": FAIL if failed else PASS, "d": d, "rows": rows, "reason": "; ".join(failed)}


def simulate_unguarded(G: torch.Tensor, code: cerar.Code) -> torch.Tensor:
    """``cerar.simulate`` without its TF32 guard: the products run under the process's own matmul
    settings, to measure what the guard prevents (``cerar.simulate`` always runs guarded)."""
    import cerar.ring.oracle

    with mock.patch.object(cerar.ring.oracle, "full_fp32_products", contextlib.nullcontext):
        return cerar.simulate(G, code)


def tf32_guard(device: str, d: int, out: str, N: int = 8, c: int = 16) -> dict:  # noqa: ARG001
    device = _device(device)
    code = cerar.make_code(N, c, "perturbation")
    G = torch.randn(N, d, generator=torch.Generator().manual_seed(8))
    cpu_error = worst_error(cerar.simulate(G, code), G)
    before = cerar.ring.fp32_products.matmul_precision_settings()
    torch.set_float32_matmul_precision("high")  # TF32 on, as a model might want it
    try:
        unguarded = judge_coded(simulate_unguarded(G.to(device), code), G, code, torch.float32)
        with cerar.full_fp32_products(device):
            inside = cerar.ring.fp32_products.matmul_precision_settings()
            guarded = judge_coded(cerar.simulate(G.to(device), code), G, code, torch.float32)
        after = cerar.ring.fp32_products.matmul_precision_settings()
    finally:
        torch.set_float32_matmul_precision(before[0] or "highest")
    ok = guarded["ok"] and after == ("high", "tf32") and not cerar.ring.fp32_products.reduced_precision_allowed(inside)
    return {
        "N": N,
        "c": c,
        "d": d,
        "kappa": code.kappa,
        "cpu_error": cpu_error,
        "unguarded": unguarded["error"],
        "unguarded_deviation": unguarded["deviation"],
        "guarded": guarded["error"],
        "guarded_deviation": guarded["deviation"],
        "bound": guarded["bound"],
        "restored": after == ("high", "tf32"),
        "status": PASS if ok else FAIL,
        "reason": ""
        if ok
        else f"guarded deviation {guarded['deviation']:.2e} (bound {guarded['bound']:.2e}), settings restored: "
        f"{after == ('high', 'tf32')} (after: {after}), reduced precision allowed inside the guard: "
        f"{cerar.ring.fp32_products.reduced_precision_allowed(inside)}",
    }


def _timed(fn, device: torch.device, reps: int = 7) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU, the thread's CPU time elsewhere), after one warm call."""
    import time

    from scripts.bench.gpu.measure import timed

    return timed(fn, device, warmup=1, repeats=reps, cpu_clock=time.thread_time)["median_ms"] / 1e3


def fused_kernels(device: str, small: bool, out: str) -> dict:  # noqa: ARG001
    from cerar.formats import fused, kernel_cases
    from cerar.formats import int8_blocks as q8

    device = _device(device)
    backend = "eager" if device.type == "cpu" and small else "inductor"
    lines: list[str] = []
    def say(line: str) -> None:  # into the value (the report) and the case's log
        lines.append(line)
        print(line, flush=True)

    sample = 2 * fused.MIN_VALUES if small else fused.SAMPLE_VALUES  # the dry run: the check's smallest sample
    # every variant (compiled, Triton) is checked by enable on its sample; each that passed is then held to the
    # eager bytes here, on other data (64 MiB on a GPU), and timed beside eager
    seconds = fused.enable(device, q8.DEFAULT_BLOCK, backend=backend, say=say, sample_values=sample,
                           triton=None if device.type == "cuda" else False)  # fmt: skip
    choices = {name: row for (name, kind, _), row in fused.choices().items() if kind == device.type}
    n = 2**16 if small else 2**24  # 64 MiB of float32 on a GPU
    B = q8.DEFAULT_BLOCK
    g = torch.Generator().manual_seed(35)
    x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n // B, generator=g)).repeat_interleave(B)
    x[:B] = 0.0
    x[B : 2 * B] *= 1e-40 / x[B : 2 * B].abs().max()  # a subnormal scale
    x = x.to(device)
    y = torch.empty_like(x)
    copy_s = _timed(lambda: y.copy_(x), device)
    base = torch.randn(n, generator=g).to(device)
    rows = []
    for case in kernel_cases.every_case(x, B, base):  # each writes its output from the same input
        want, out = case.fresh(), case.fresh()
        case.eager(want)
        row = {"kernel": case.what, "name": case.name, "chosen": choices.get(case.name, {}).get("chosen", "eager"),
               "eager": _timed(lambda c=case, o=out: c.eager(o), device) / copy_s, "variants": {},
               "off": {k: v for k, v in choices.get(case.name, {}).items() if k.endswith("failed")}}  # fmt: skip
        for variant, fn in fused.checked_variants(case.name, device, B).items():
            got = case.fresh()
            case.run(fn, got)
            t = _timed(lambda c=case, fn=fn, o=out: c.run(fn, o), device)
            row["variants"][variant] = {"differ": fused._differing(want, got), "of": want.numel(), "x_copy": t / copy_s}
        rows.append(row)
    fused.disable()
    wrong = [f"{r['kernel']} {v}: {d['differ']} of {d['of']} bytes differ from eager's on 64 MiB after enable's "
             "check passed" for r in rows for v, d in r["variants"].items() if d["differ"]]  # fmt: skip
    compiled_on_cuda = device.type == "cuda" or not small
    missing = [f"{r['kernel']}: no variant passed enable's check ("
               + "; ".join(f"{k}: {v}" for k, v in r["off"].items()) + ")"
               for r in rows if compiled_on_cuda and not r["variants"] and r["name"] in fused.COMPILED]  # fmt: skip
    return {
        "status": FAIL if wrong or missing else PASS,
        "reason": "; ".join(wrong + missing),
        "backend": backend,
        "values": n,
        "copy_s": copy_s,
        "copy_gbps": 8 * n / copy_s / 1e9,
        "compile_s": seconds,
        "log": lines,
        "rows": rows,
    }


_NONE = {"differ": "", "of": "", "x_copy": float("nan")}
"""A row's variant columns where no variant passed enable's check."""


def report(results) -> list[str]:
    lines = []
    for r in results:
        v = r.value or {}
        if r.case.name == "oracle" and v.get("rows"):
            lines += [
                f"**oracle** (d = {v['d']}): the worst worker's relative error against the exact sum (CPU and "
                "device), and the device's deviation from the exact sum plus the code's own error for these "
                "gradients, relative to ||G||_F; PASS when within the float32 rounding bound kappa * 2^-24 * "
                "(sqrt(c + L) + N) (`cerar.ring.precision.rounding_bound`).",
                "",
                "| N | c | construction | kappa | rel. difference device vs CPU | CPU error | device error "
                "| device rounding deviation | bound | result | note |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            ]
            for row in v["rows"]:
                if row["status"] == NOT_RUN:
                    lines.append(
                        f"| {row['N']} | {row['c']} | {row['construction']} | | | | | | | NOT RUN | {row['note']} |"
                    )
                else:
                    lines.append(
                        f"| {row['N']} | {row['c']} | {row['construction']} | {row['kappa']:.3g} "
                        f"| {row['difference']:.2e} | {row['cpu_error']:.2e} | {row['device_error']:.2e} "
                        f"| {row['deviation']:.2e} | {row['bound']:.2e} | {row['status']} | {row.get('note', '')} |"
                    )
            lines.append("")
        if r.case.name == "tf32" and "kappa" in v:
            lines += [
                f"**tf32**: `torch.set_float32_matmul_precision('high')`, N={v['N']}, c={v['c']} perturbation, "
                f"d={v['d']}, kappa {v['kappa']:.3g}; deviations from the code's exact-arithmetic result relative "
                f"to ||G||_F against the bound {v['bound']:.2e}. Unguarded: the products under TF32 (on a CPU, "
                "which has no TF32, the same as guarded).",
                "",
                "| CPU error | device error, unguarded (deviation) | inside `cerar.full_fp32_products` (deviation) "
                "| settings restored | result |",
                "| --- | --- | --- | --- | --- |",
                f"| {v['cpu_error']:.2e} | {v['unguarded']:.2e} ({v['unguarded_deviation']:.1e}) "
                f"| {v['guarded']:.2e} ({v['guarded_deviation']:.1e}) | {v['restored']} | {v['status']} |",
                "",
            ]
        if r.case.name == "fused" and "rows" in v:
            compiled = ", ".join(f"{k} {s:.1f} s" for k, s in v["compile_s"].items()) or "nothing compiled"
            lines += [
                f"**fused** (`cerar.formats.fused`: torch.compile backend {v['backend']} and Triton by hand; enable "
                f"took {compiled}): {v['values']} float32 values; a device copy of them took "
                f"{1e3 * v['copy_s']:.3f} ms ({v['copy_gbps']:.0f} GB/s counting 4 bytes read and 4 written per "
                "value). Every variant that passed enable's check, held to the eager bytes on these values and timed "
                "beside eager, as multiples of that copy; *chosen*: what enable switched on (the fastest).",
                "",
                "| operation | chosen | eager x copy | variant | differing bytes | x copy | off (why) |",
                "| --- | --- | --- | --- | --- | --- | --- |",
                *(
                    f"| {row['kernel']} | {row['chosen']} | {row['eager']:.2f} | {variant} "
                    f"| {d['differ']} of {d['of']} | {d['x_copy']:.2f} | "
                    + "; ".join(f"{k}: {w}" for k, w in row["off"].items()) + " |"
                    for row in v["rows"]
                    for variant, d in (row["variants"].items() or [("-", _NONE)])
                ),
                "",
            ]
    return lines
