"""Every aggregator's per-call arithmetic against a plain copy of the same bytes, side by side (issue 35).

    .venv/bin/python scripts/bench/bench_arithmetic.py                 # 16 MiB of float32, one thread
    .venv/bin/python scripts/bench/bench_arithmetic.py --no-fused      # the eager paths only (no compiling)
    python scripts/bench/bench_arithmetic.py --device cuda              # on a GPU: reports/arithmetic_cuda.md

One thread, one process, 16 MiB of float32 (4 Mi values). Each operation is timed beside a copy of the same
float32 tensor (``y.copy_(x)``: 4 bytes read and 4 written per value), interleaved, rep after rep, so that
a moment of load slows both; a row's ratio is the median over the reps of (its time / the copy's time in
the same rep). Times are the thread's CPU time (``time.thread_time``): on a 2-core machine shared with other
work, wall-clock intervals of a millisecond mostly measure who else was scheduled; CPU time does not count
the slices another process took (their traffic through the shared cache and memory still shows).

Rows: the 8-bit format's quantize (nearest and stochastic), dequantize and dequantize-add
(``cerar.formats.int8_blocks``), the 4-bit format's with and without its rotation, and the rotation alone
(``scripts/bench/int4_arithmetic.py``), the 16-bit wire's encode, decode and round trip (``cerar.formats.wire``),
one rank's CERAR arithmetic per round (``cerar.ring.rounds``, N=4, c=8, over float32 and float16 messages: the
encoding and decoding products and the per-round additions, plus the wire's casts), the exact ring's addition and
the two tiers' divide and copy. Variants: ``before`` (the eager code as of commit f2c0f42, kept here),
``eager`` (today's eager reference) and ``fused`` (``cerar.formats.fused``, torch.compile). Every fused row is
first checked byte for byte against the eager one.

Projected GPU column: the bytes each operation moves per value (the eager ones counted on the dispatched
operations, as tests/test_quantized.py counts them; the fused ones from what the kernel reads and writes)
over an HBM bandwidth (H200, 4.8 TB/s by default), against a copy's 8 bytes: memory-bound operations at
full bandwidth, which is an assumption, not a measurement. The host's Python time per CERAR round is
measured separately at a tiny d. The machine's load average (1, 5, 15 minutes) before and after is
recorded in the report. Writes reports/arithmetic.md and reports/data/arithmetic.csv.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cerar.formats import fused  # noqa: E402
from cerar.formats import int8_blocks as q8  # noqa: E402
from cerar.formats.wire import Wire  # noqa: E402

FIELDS = ["family", "operation", "variant", "ratio_to_copy", "ratio_p10", "ratio_p90", "ms", "copy_ms",
          "bytes_per_value", "gpu_ratio", "gpu_us", "note"]  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The code before issue 35 (commit f2c0f42), for the "before" rows
# ------------------------------------------------------------------------------------------------


def quantize_before(message, x, block):
    s = x.numel()
    scales, values = q8.parts(message, s, block)
    for rows, which in q8._rows(x, block):
        scale = scales[which]
        torch.linalg.vector_norm(rows, ord=float("inf"), dim=1, out=scale)
        scale.div_(q8.QMAX)
        inverse = torch.where(scale > 0, 1 / scale, 0.0)
        ratio = rows * inverse.unsqueeze(1)
        ratio.round_()
        values[which.start * block : which.start * block + ratio.numel()].view(ratio.shape).copy_(ratio)


def encode_before(block, out):
    from cerar.formats.wire import K_LIMIT, TARGET_EXPONENT, _power_of_two

    _, e = torch.frexp(block.abs().amax())
    k = (TARGET_EXPONENT - e).clamp_(-K_LIMIT, K_LIMIT)
    out[0].copy_(k)
    out[1:].copy_(block * _power_of_two(k))


def decode_before(message, out):
    from cerar.formats.wire import _power_of_two

    k = message[0].to(torch.int32)
    out.copy_(message[1:])
    out.mul_(_power_of_two(-k))


# ------------------------------------------------------------------------------------------------
# Counting the bytes the eager operations move (for the GPU projection)
# ------------------------------------------------------------------------------------------------


class Traffic(TorchDispatchMode):
    """Bytes the dispatched operations read and write, over tensors of at least ``least`` values; an
    in-place op reads and writes its first operand, a copy and an ``out=`` operand are only written, an allocation
    moves nothing (tests/test_quantized.py and tests/test_costmodel_int4.py count with it)."""

    ALLOCATIONS = frozenset({"empty", "empty_like", "new_empty", "empty_strided"})

    def __init__(self, least: int):
        super().__init__()
        self.least, self.bytes = least, 0

    def _b(self, t) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) and t.numel() >= self.least else 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.overloadpacket.__name__ in self.ALLOCATIONS:
            return out
        reads = [a for k, a in (*enumerate(args), *kwargs.items()) if isinstance(a, torch.Tensor) and k != "out"]
        if func.overloadpacket.__name__ == "copy_":
            reads = reads[1:]
        written = kwargs.get("out", out)
        written = written if isinstance(written, (tuple, list)) else [written]
        self.bytes += sum(self._b(a) for a in reads) + sum(self._b(w) for w in written)
        return out


# ------------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------------


@dataclass
class Case:
    family: str
    operation: str
    variant: str
    run: object  # () -> None
    count: object = None  # () -> None on small tensors, for the traffic count; None: bytes given
    bytes_per_value: float | None = None
    note: str = ""


def int8_cases(n: int, block: int, with_fused: bool) -> list[Case]:
    x = torch.randn(n) * torch.exp(2 * torch.randn(n // block)).repeat_interleave(block)
    out = torch.empty(n)
    m = q8.new_message(n, block, "cpu")
    small = 64 * block
    xs, outs, ms = x[:small].clone(), torch.empty(small), q8.new_message(small, block, "cpu")
    cases = [
        Case("int8", "quantize, nearest", "before", lambda: quantize_before(m, x, block),
             lambda: quantize_before(ms, xs, block)),
        Case("int8", "quantize, nearest", "eager", lambda: q8.quantize_eager(m, x, block),
             lambda: q8.quantize_eager(ms, xs, block)),
        Case("int8", "quantize, stochastic", "eager", lambda: q8.quantize_eager(m, x, block, "stochastic", 9),
             lambda: q8.quantize_eager(ms, xs, block, "stochastic", 9)),
        Case("int8", "dequantize", "eager", lambda: q8.dequantize_eager(m, n, block, out),
             lambda: q8.dequantize_eager(ms, small, block, outs)),
        Case("int8", "dequantize and add", "eager", lambda: q8.dequantize_eager(m, n, block, out, add=True),
             lambda: q8.dequantize_eager(ms, small, block, outs, add=True)),
    ]  # fmt: skip
    if with_fused:
        for rounding in ("nearest", "stochastic"):
            kernel = fused.checked_kernel(f"quantize_{rounding}", "cpu", block)
            if kernel is not None:  # the compiled kernel, also where enable chose the eager path as the faster
                cases.append(Case(
                    "int8", f"quantize, {rounding}", "fused",
                    lambda k=kernel, r=rounding: fused._run_quantize(k, m, x, block, r, 9), bytes_per_value=9,
                    note="one compiled call: the values read for their block's absmax, read again, one byte written"
                    + ("; the dither table (512 KiB) stays in cache" if rounding == "stochastic" else ""),
                ))  # fmt: skip
    return cases


def wire_cases(n: int, with_fused: bool) -> list[Case]:
    cases = []
    for dtype in ("float16", "bfloat16"):
        wire = Wire(dtype)
        x = torch.randn(n)
        out, msg = torch.empty(n), wire.empty(n, x)
        small = 2**13
        xs, outs, msgs = x[:small].clone(), torch.empty(small), wire.empty(small, x)
        name = "wire " + dtype
        cases += [
            Case(name, "encode", "before", lambda w=wire, x=x, msg=msg: encode_before(x, msg),
                 lambda xs=xs, msgs=msgs: encode_before(xs, msgs)),
            Case(name, "encode", "eager", lambda w=wire, x=x, msg=msg: w.encode_eager(x, msg),
                 lambda w=wire, xs=xs, msgs=msgs: w.encode_eager(xs, msgs)),
            Case(name, "decode", "before", lambda msg=msg, out=out: decode_before(msg, out),
                 lambda msgs=msgs, outs=outs: decode_before(msgs, outs)),
            Case(name, "decode", "eager", lambda w=wire, msg=msg, out=out: w.decode(msg, out),
                 lambda w=wire, msgs=msgs, outs=outs: w.decode(msgs, outs)),
        ]  # fmt: skip
        kernel = fused.checked_kernel("wire_encode", "cpu") if with_fused else None
        if kernel is not None:
            cases += [
                Case(name, "encode", "fused", lambda k=kernel, x=x, msg=msg: fused._run_wire(k, x, msg),
                     bytes_per_value=10, note="aminmax read, then read and written in 16 bits"),
                Case(name, "round trip", "fused + eager decode",
                     lambda k=kernel, w=wire, x=x, msg=msg, out=out: (fused._run_wire(k, x, msg), w.decode(msg, out)),
                     bytes_per_value=16),
            ]  # fmt: skip
        cases.append(
            Case(
                name,
                "round trip",
                "eager",
                lambda w=wire, x=x, msg=msg, out=out: (w.encode_eager(x, msg), w.decode(msg, out)),
                lambda w=wire, xs=xs, msgs=msgs, outs=outs: (w.encode_eager(xs, msgs), w.decode(msgs, outs)),
            )  # fmt: skip
        )
    return cases


def cerar_call(d: int, N: int, c: int, transport: str | None):
    """One rank's arithmetic of a CERAR call (rank 1 of N, code ``optimized``) without the transport: the
    encoding, every round's additions and the decoding products, and with a 16-bit wire the encode of
    each message sent and the decode of each received. Returns (run, rounds)."""
    import cerar
    from cerar.coding.matrices import device_matrices
    from cerar.ring.rounds import CodedRingRank

    code = cerar.make_code(N, c, "optimized", kappa_max=cerar.default_kappa_max(transport or "float32"))
    m = code.m_for(d)
    matrices = device_matrices(code, 1, torch.float32, "cpu")
    g = torch.randn(d)
    flat = g.clone()
    wire = Wire(transport) if transport else None
    workspace = torch.empty(CodedRingRank.workspace_numel(d, c, m, N, code.L))

    def run():
        flat.copy_(g)
        rank = CodedRingRank(matrices, flat, c, m, N, workspace=workspace)
        messages = [(wire.empty(w.message(1).numel(), flat), wire.empty(w.message(1).numel(), flat))
                    for w in rank.workers] if wire else None  # fmt: skip
        for t in range(1, code.L + 1):
            for p, worker in enumerate(rank.workers):
                if wire:
                    wire.encode(worker.message(t), messages[p][0])
                worker.while_in_flight(t)
                y = worker.receive_buffer(t)
                if wire:
                    wire.decode(messages[p][0], y)  # its own message stands in for the neighbour's
                worker.receive(t, y)
        rank.write_result(flat, 1.0 / N)

    return run, code.L


def cerar_cases(n: int) -> tuple[list[Case], dict]:
    cases, rounds = [], {}
    wire_fused = any(name == "wire_encode" for name, _, _ in fused.enabled())
    for transport in (None, "float16"):
        run, L = cerar_call(n, 4, 8, transport)
        label = f"one call, N=4 c=8, {transport or 'float32'} messages"
        rounds[label] = L
        variant = "eager, fused encode" if transport and wire_fused else "eager"
        cases.append(Case("cerar", label, variant, run, bytes_per_value=None, note=f"{L} rounds"))
    return cases, rounds


def ring_cases(n: int) -> list[Case]:
    a, b, y = torch.randn(n), torch.randn(n), torch.empty(n)
    return [
        Case("exact ring", "add a received block", "eager", lambda: a.add_(b), bytes_per_value=12),
        Case("two tiers", "divide by N (op=avg)", "eager", lambda: a.div_(4.0), bytes_per_value=8),
        Case("two tiers", "copy back", "eager", lambda: y.copy_(a), bytes_per_value=8),
    ]


def host_seconds_per_round(reps: int = 30) -> dict[str, float]:
    """Seconds per round of one rank's CERAR arithmetic at d = 16 c (c = 8) (the tensors are tiny: the host's
    Python and dispatch time), over float32 and float16 messages, and over float16 with the wire's k kept in
    tensors (``encode_eager`` and the decode before issue 35: eight small tensor operations a message); the
    three interleaved."""
    from unittest import mock

    variants = {
        "float32 messages": (cerar_call(16 * 8, 4, 8, None), False),
        "float16 messages": (cerar_call(16 * 8, 4, 8, "float16"), False),
        "float16 messages, k in tensors (before)": (cerar_call(16 * 8, 4, 8, "float16"), True),
    }
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, ((run, L), before) in variants.items():
            with (
                mock.patch.object(Wire, "_encode_host", staticmethod(lambda b, o: encode_before(b, o))) if before
                else contextlib.nullcontext(),
                mock.patch.object(Wire, "decode", lambda self, m, o: decode_before(m, o)) if before
                else contextlib.nullcontext(),
            ):  # fmt: skip
                run()
                t0 = time.thread_time()
                run()
                times[name].append((time.thread_time() - t0) / L)
    return {name: statistics.median(t) for name, t in times.items()}


# ------------------------------------------------------------------------------------------------
# Timing, side by side
# ------------------------------------------------------------------------------------------------


def measure(cases: list[Case], n: int, reps: int) -> list[dict]:
    x, y = torch.randn(n), torch.empty(n)

    def copy():
        y.copy_(x)

    ratios = {id(c): [] for c in cases}
    ms = {id(c): [] for c in cases}
    copies = []
    for case in cases:  # warm: first-touch pages, caches
        case.run()
    clock = time.thread_time  # this thread's CPU time: a slice given to another process is not counted
    for _ in range(reps):
        for case in cases:
            t0 = clock()
            copy()
            t1 = clock()
            case.run()
            t2 = clock()
            ratios[id(case)].append((t2 - t1) / (t1 - t0))
            ms[id(case)].append(1e3 * (t2 - t1))
            copies.append(1e3 * (t1 - t0))
    rows = []
    for case in cases:
        r = sorted(ratios[id(case)])
        rows.append({"case": case, "ratio": statistics.median(r), "p10": r[len(r) // 10],
                     "p90": r[min(len(r) - 1, 9 * len(r) // 10)], "ms": statistics.median(ms[id(case)])})  # fmt: skip
    return rows, statistics.median(copies)


def traffic_of(case: Case) -> float | None:
    if case.bytes_per_value is not None or case.count is None:
        return case.bytes_per_value
    counter = Traffic(least=64)
    with counter:
        case.count()
    values = 64 * 128 if case.family in ("int8", "int4") else 2**13
    return counter.bytes / values


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, nargs="+", default=None,
                   help="float32 MiB per operation (default 16 on the CPU; 64 and 256 on a device)")
    p.add_argument("--device", default="cpu",
                   help="cpu (this report), or e.g. cuda: every format against a device copy "
                        "(scripts/bench/format_timing.py), written to reports/arithmetic_<device>.md")
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--block", type=int, default=q8.DEFAULT_BLOCK)
    p.add_argument("--no-fused", action="store_true", help="eager rows only: nothing compiles")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth of the projected GPU (H200: 4.8)")
    p.add_argument("--md", default=str(ROOT / "reports" / "arithmetic.md"))
    p.add_argument("--csv", default=str(ROOT / "reports" / "data" / "arithmetic.csv"))
    args = p.parse_args()

    if args.device != "cpu":
        device_report(args)
        return
    args.mib = 16.0 if args.mib is None else args.mib[0]
    torch.set_num_threads(1)
    n = int(args.mib * 2**20) // 4 // args.block * args.block
    load_before = os.getloadavg()
    compile_seconds, said = {}, []
    args.enable_lines = said
    if not args.no_fused:
        t0 = time.perf_counter()
        compile_seconds = fused.enable("cpu", args.block, say=lambda line: (print(line), said.append(line)))
        compile_seconds["total"] = time.perf_counter() - t0
    from scripts.bench.int4_arithmetic import int4_cases

    cases = int8_cases(n, args.block, not args.no_fused) + int4_cases(n, args.block, Case)
    cases += wire_cases(n, not args.no_fused)
    more, rounds = cerar_cases(n)
    cases += more + ring_cases(n)
    with torch.no_grad():
        rows, copy_ms = measure(cases, n, args.reps)
        host = host_seconds_per_round()
    load_after = os.getloadavg()

    copy_gpu_us = 8 * n / (args.hbm_tbps * 1e12) * 1e6
    table = []
    for r in rows:
        case = r["case"]
        b = traffic_of(case)
        table.append({
            "family": case.family, "operation": case.operation, "variant": case.variant,
            "ratio_to_copy": round(r["ratio"], 3), "ratio_p10": round(r["p10"], 3), "ratio_p90": round(r["p90"], 3),
            "ms": round(r["ms"], 3), "copy_ms": round(copy_ms, 3),
            "bytes_per_value": "" if b is None else round(b, 2),
            "gpu_ratio": "" if b is None else round(b / 8, 3),
            "gpu_us": "" if b is None else round(b / 8 * copy_gpu_us, 1), "note": case.note,
        })  # fmt: skip
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(table)
    write_md(args, table, n, copy_ms, copy_gpu_us, load_before, load_after, compile_seconds, host, rounds)
    print(Path(args.md).read_text())


def device_report(args) -> None:
    """Every format against a copy on ``args.device`` (``format_timing.formats_against_copy``), written to
    reports/arithmetic_<device>.md and reports/data/arithmetic_<device>.csv unless --md / --csv say otherwise."""
    from scripts.bench.format_timing import formats_against_copy

    kind = torch.device(args.device).type
    default_md, default_csv = str(ROOT / "reports" / "arithmetic.md"), str(ROOT / "reports" / "data" / "arithmetic.csv")
    md = Path(args.md) if args.md != default_md else ROOT / "reports" / f"arithmetic_{kind}.md"
    csv_path = Path(args.csv) if args.csv != default_csv else ROOT / "reports" / "data" / f"arithmetic_{kind}.csv"
    lines_said = []
    result = formats_against_copy(args.device, args.mib or (64.0, 256.0), args.reps, with_fused=not args.no_fused,
                                  block=args.block, say=lines_said.append)  # fmt: skip
    rows = result["rows"]
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    name = torch.cuda.get_device_name(args.device) if kind == "cuda" else kind
    lines = [
        f"# Every format against a device copy ({name})",
        "",
        f"`{' '.join(['python', 'scripts/bench/bench_arithmetic.py', *sys.argv[1:]])}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}. Each row the median of "
        f"{args.reps} calls between CUDA events (scripts/bench/format_timing.py says how), x copy = its time over "
        "`y.copy_(x)` of the same float32 bytes; the target is at most 2x for quantize, encode and decode at 64 MiB "
        "and above (issue 52). Variants: eager (the reference), fused (the compiled kernel), chosen (what the "
        "formats run after `cerar.formats.fused.enable` picked the faster). Every fused and chosen row wrote the "
        "eager row's bytes unless `same bytes` says no.",
        "",
        *[f"`{line}`" for line in lines_said],
        "",
        "| MiB | operation | variant | ms | x copy | same bytes |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {r['MiB']:g} | {r['operation']} | {r['variant']} | {r['ms']:.3f} | **{r['x_copy']:.2f}** | "
          f"{'yes' if r['same_bytes'] else 'NO'} |" for r in rows],  # fmt: skip
        "",
    ]
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines))
    print(md.read_text())


def write_md(args, table, n, copy_ms, copy_gpu_us, before, after, compile_seconds, host, rounds) -> None:
    lines = [
        "# Per-call arithmetic against a copy (issue 35)",
        "",
        f"`{' '.join(['.venv/bin/python', 'scripts/bench/bench_arithmetic.py', *sys.argv[1:]])}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), one thread.",
        f"{n * 4 / 2**20:.0f} MiB of float32 ({n} values) per operation, B = {args.block}; each row timed beside a "
        f"copy of the same float32 tensor in every rep ({args.reps} reps, interleaved), the ratio the median of "
        f"the per-rep ratios (p10-p90 beside it); the thread's CPU time. Copy: {copy_ms:.2f} ms median.",
        f"Load average (1, 5, 15 min) before {before[0]:.2f}, {before[1]:.2f}, {before[2]:.2f}; after "
        f"{after[0]:.2f}, {after[1]:.2f}, {after[2]:.2f} (2 cores shared with other work: the ratios, taken side "
        "by side, hold better than the milliseconds).",
        "",
    ]
    if compile_seconds:
        lines += [
            "Compiling the fused kernels (`cerar.formats.fused.enable`, torch.compile, dynamic shapes; the cache "
            f"`TORCHINDUCTOR_CACHE_DIR`={os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(default)')}): "
            + ", ".join(f"{k} {v:.1f} s" for k, v in compile_seconds.items())
            + " (each: compile, check on its sample, time against the eager path). Its lines:",
            "",
            *[f"`{line}`" for line in args.enable_lines],
            "",
        ]
    lines += [
        f"Projected GPU: bytes moved per value / 8 (a copy's), at {args.hbm_tbps} TB/s HBM (a copy of these "
        f"{n * 4 / 2**20:.0f} MiB: {copy_gpu_us:.1f} us), assuming every operation memory-bound at full bandwidth; "
        "eager bytes counted on the dispatched operations, fused ones from the kernel's reads and writes.",
        "",
        "| family | operation | variant | x copy (CPU) | p10-p90 | ms | bytes/value | x copy (GPU, projected) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in table:
        lines.append(
            f"| {r['family']} | {r['operation']} | {r['variant']} | **{r['ratio_to_copy']:.2f}** | "
            f"{r['ratio_p10']:.2f}-{r['ratio_p90']:.2f} | {r['ms']:.2f} | {r['bytes_per_value']} | {r['gpu_ratio']} | "
            f"{r['note']} |"
        )
    lines += [
        "",
        "CERAR rows: one rank's whole call (rank 1 of 4, c = 8, d = the tensor) without the transport: "
        + "; ".join(f"{k}: {v} rounds" for k, v in rounds.items())
        + ". Per round, divide the ratio by the rounds. Host time per round (Python and dispatch, measured at "
        "d = 128 where the arithmetic is nothing): "
        + ", ".join(f"{k} {1e6 * v:.0f} us" for k, v in host.items())
        + ".",
        "",
    ]
    from scripts.bench.int4_arithmetic import rotation_line

    lines += rotation_line(table)
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
