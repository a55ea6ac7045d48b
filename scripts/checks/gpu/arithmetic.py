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
    "fused": "the fused int8 quantizer and 16-bit encode compile for the device, write the eager bytes, and run at "
    "a measured multiple of a device copy",
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
    from cerar.formats import fused
    from cerar.formats import int8_blocks as q8
    from cerar.formats.wire import Wire

    device = _device(device)
    backend = "eager" if device.type == "cpu" and small else "inductor"
    lines: list[str] = []
    def say(line: str) -> None:  # into the value (the report) and the case's log
        lines.append(line)
        print(line, flush=True)

    sample = 2 * fused.MIN_VALUES if small else fused.SAMPLE_VALUES  # the dry run: the check's smallest sample
    # pick="fused": every kernel that passes its check is switched on, so that its bytes are compared below
    seconds = fused.enable(device, q8.DEFAULT_BLOCK, backend=backend, say=say, pick="fused",
                           sample_values=sample)  # fmt: skip
    on = {name for name, kind, _ in fused.enabled() if kind == device.type}
    n = 2**16 if small else 2**24  # 64 MiB of float32 on a GPU
    B = q8.DEFAULT_BLOCK
    g = torch.Generator().manual_seed(35)
    x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n // B, generator=g)).repeat_interleave(B)
    x[:B] = 0.0
    x[B : 2 * B] *= 1e-40 / x[B : 2 * B].abs().max()  # a subnormal scale
    x = x.to(device)
    y = torch.empty_like(x)
    copy_s = _timed(lambda: y.copy_(x), device)
    rows = []
    for rounding in ("nearest", "stochastic"):
        got, want = q8.new_message(n, B, device), q8.new_message(n, B, device)
        q8.quantize_into(got, x, B, rounding, 12345)
        q8.quantize_eager(want, x, B, rounding, 12345)
        equal = bool(torch.equal(got, want))
        (got_scales, got_values), (want_scales, want_values) = q8.parts(got, n, B), q8.parts(want, n, B)
        rows.append({
            "kernel": f"int8 quantize, {rounding}", "on": f"quantize_{rounding}" in on, "equal": equal,
            "differ": f"{int((got_scales != want_scales).sum())} of {want_scales.numel()} scales, "
            f"{int((got_values != want_values).sum())} of {n} values",
            "fused": _timed(lambda got=got, r=rounding: q8.quantize_into(got, x, B, r, 7), device) / copy_s,
            "eager": _timed(lambda want=want, r=rounding: q8.quantize_eager(want, x, B, r, 7), device) / copy_s,
        })  # fmt: skip
    for dtype in ("float16", "bfloat16"):
        wire = Wire(dtype)
        got, want = wire.empty(n, x), wire.empty(n, x)
        wire.encode(x, got)
        wire.encode_eager(x, want)
        differ = int((got.view(torch.int16) != want.view(torch.int16)).sum())
        rows.append({
            "kernel": f"wire encode, {dtype}", "on": "wire_encode" in on, "equal": differ == 0,
            "differ": f"{differ} of {got.numel()} wire values",
            "fused": _timed(lambda w=wire, got=got: w.encode(x, got), device) / copy_s,
            "eager": _timed(lambda w=wire, want=want: w.encode_eager(x, want), device) / copy_s,
        })  # fmt: skip
    fused.disable()
    ok = all(r["on"] and r["equal"] for r in rows)
    wrong = [f"{r['kernel']}: " + ("bytes differ from the eager reference's: " + r["differ"] if r["on"] else
             "not switched on (enable's own check or its compile failed: see the log)")
             for r in rows if not (r["on"] and r["equal"])]  # fmt: skip
    return {
        "status": PASS if ok else FAIL,
        "reason": "; ".join(wrong),
        "backend": backend,
        "values": n,
        "copy_s": copy_s,
        "copy_gbps": 8 * n / copy_s / 1e9,
        "compile_s": seconds,
        "log": lines,
        "rows": rows,
    }


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
                f"**fused** (`cerar.formats.fused`, torch.compile backend {v['backend']}; {compiled}): "
                f"{v['values']} float32 "
                f"values; a device copy of them took {1e3 * v['copy_s']:.3f} ms ({v['copy_gbps']:.0f} GB/s counting "
                "4 bytes read and 4 written per value). Times as multiples of that copy; bytes compared with the "
                "eager reference's.",
                "",
                "| kernel | switched on | bytes equal | differing | fused x copy | eager x copy |",
                "| --- | --- | --- | --- | --- | --- |",
                *(
                    f"| {row['kernel']} | {row['on']} | {row['equal']} | {row.get('differ', '')} "
                    f"| {row['fused']:.2f} | {row['eager']:.2f} |"
                    for row in v["rows"]
                ),
                "",
            ]
    return lines
