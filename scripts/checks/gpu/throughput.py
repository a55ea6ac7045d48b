"""Section "throughput": one rank's encode/decode arithmetic (transfers replaced by a local copy) in
GB/s of gradient, next to the device's copy bandwidth, and how much of it runs hidden beside a
second stream's copies of the same bytes. Measured, not judged (MEASURED). Expected time on one
H200: about 40 s (full sizes: 16, 64, 256 MiB, four codes)."""

from __future__ import annotations

import torch

import cerar
from cerar.coding.matrices import device_matrices
from cerar.ring.rounds import CodedRingRank
from scripts.checks.gpu.arithmetic import _device
from scripts.checks.gpu.cases import MEASURED, Case, Context
from scripts.checks.gpu.judge import timed

SECTION = "throughput"
QUICK = True
EXPECTED_S = 40
THROUGHPUT_CODES = [(4, 4, "exact"), (4, 16, "perturbation"), (4, 16, "optimized"), (8, 32, "optimized")]

PROVES = {"encode/decode rate": "encode/decode throughput measured against the device's copy bandwidth"}


def cases(ctx: Context) -> list[Case]:
    codes = THROUGHPUT_CODES[2:3] if ctx.small else THROUGHPUT_CODES
    kwargs = {
        "device": ctx.device,
        "codes": codes,
        "sizes_mb": [1] if ctx.small else [16, 64, 256],
        "copy_mb": 16 if ctx.small else 1024,
        "overlap_mb": 1 if ctx.small else 64,
        "repeats": ctx.repeats,
    }
    return [Case(SECTION, "encode/decode rate", "throughput:measure", kwargs, 400)]


def one_rank_arithmetic(code, d: int, device: torch.device):
    """A callable that runs one rank's L rounds with each transfer replaced by a local copy."""
    matrices = device_matrices(code, code.N - 1, torch.float32, device)
    flat = torch.randn(d, device=device)
    m = code.m_for(d)

    def run():
        rank = CodedRingRank(matrices, flat, code.c, m, code.N)
        for t in range(1, code.L + 1):
            for worker in rank.workers:
                worker.while_in_flight(t)
                received = worker.receive_buffer(t)
                received.copy_(worker.message())
                worker.receive(t, received)
        out = torch.empty_like(flat)
        rank.write_result(out)

    return run


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    source = torch.empty(nbytes // 4, device=device)
    target = torch.empty_like(source)
    seconds = timed(lambda: target.copy_(source), device, repeats)
    return 2 * nbytes / seconds


def overlap(device: torch.device, code_spec, size_mb: int, repeats: int) -> dict | None:
    """How much of one rank's encode/decode arithmetic the device hides under transfers: the
    arithmetic alone (T_a), its L rounds' message copies alone on a second stream (T_c: a stand-in
    for NCCL's stream, the same bytes), and both issued together (T_both); hidden = (T_a + T_c -
    T_both) / min(T_a, T_c): 1 when the shorter one runs entirely beside the other, 0 when they
    serialise. None on a CPU, which has no streams."""
    if device.type != "cuda":
        return None
    N, c, construction = code_spec
    code = cerar.make_code(N, c, construction)
    d = size_mb * 2**20 // 4
    arithmetic = one_rank_arithmetic(code, d, device)
    source = torch.empty(code.m_for(d), device=device)
    target = torch.empty_like(source)
    side = torch.cuda.Stream(device)

    def copies():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(code.L):
                target.copy_(source)
        torch.cuda.current_stream(device).wait_stream(side)

    def both():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(code.L):
                target.copy_(source)
        arithmetic()
        torch.cuda.current_stream(device).wait_stream(side)

    with cerar.full_fp32_products(device):
        alone, moved, together = (timed(fn, device, repeats) for fn in (arithmetic, copies, both))
    hidden = (alone + moved - together) / min(alone, moved)
    return {"code": code_spec, "MiB": size_mb, "arithmetic": alone, "copies": moved, "both": together, "hidden": hidden}


def measure(device: str, codes, sizes_mb, copy_mb: int, overlap_mb: int, repeats: int, out: str) -> dict:  # noqa: ARG001
    device = _device(device)
    rows = []
    with cerar.full_fp32_products(device):
        for N, c, construction in codes:
            code = cerar.make_code(N, c, construction)
            for size_mb in sizes_mb:
                d = size_mb * 2**20 // 4
                seconds = timed(one_rank_arithmetic(code, d, device), device, repeats)
                rows.append((N, c, construction, size_mb, seconds, d * 4 / seconds))
    bandwidth = copy_bandwidth(device, copy_mb * 2**20, repeats)
    return {
        "status": MEASURED,
        "rows": rows,
        "bandwidth": bandwidth,
        "overlap": overlap(device, tuple(codes[-1]), overlap_mb, repeats),
    }


def report(results) -> list[str]:
    lines = []
    for r in results:
        v = r.value or {}
        if "rows" not in v:
            continue
        lines += [
            f"Device copy bandwidth (read + write): {v['bandwidth'] / 1e9:.1f} GB/s.",
            "",
            "| N | c | construction | MiB | seconds | GB/s of gradient | fraction of copy bandwidth |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *[
                f"| {N} | {c} | {k} | {mb} | {s:.4f} | {rate / 1e9:.1f} | {rate / v['bandwidth']:.3f} |"
                for N, c, k, mb, s, rate in v["rows"]
            ],
            "",
        ]
        o = v["overlap"]
        if o is None:
            lines += ["Overlap of the arithmetic with transfers: not measured (a CPU has no streams).", ""]
        else:
            N, c, construction = o["code"]
            lines += [
                f"Overlap (N={N}, c={c} {construction}, {o['MiB']} MiB): the arithmetic on the compute stream beside "
                "its messages' bytes copied on a second stream (a stand-in for NCCL's); hidden = (arithmetic + "
                "copies - both) / the shorter of the two (reported, not judged):",
                "",
                "| arithmetic alone (s) | copies alone (s) | both together (s) | hidden |",
                "| --- | --- | --- | --- |",
                f"| {o['arithmetic']:.4f} | {o['copies']:.4f} | {o['both']:.4f} | {o['hidden']:.2f} |",
                "",
            ]
    return lines
