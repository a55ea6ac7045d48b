"""CERAR on one GPU: the oracle and the encode/decode arithmetic on CUDA, against the CPU.

One GPU cannot form an NCCL ring of two ranks, so this checks what one device can: that
``cerar.simulate`` gives on CUDA what it gives on the CPU, and how fast one rank's encoding and
decoding run (every round's arithmetic with the transfer replaced by a local copy), in GB/s of
gradient, next to the device's measured copy bandwidth.

    python scripts/gpu_check.py                      # on a CUDA machine: writes reports/gpu.md
    python scripts/gpu_check.py --device cpu --small --out /tmp/gpu.md   # the same code on the CPU

Every number in the report comes from this run.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

import cerar
from cerar.matrices import device_matrices
from cerar.rounds import CodedRingRank

CODES = [(4, 4, "exact"), (4, 16, "perturbation"), (4, 16, "optimized"), (8, 32, "optimized")]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up."""
    fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def oracle_agreement(codes, device: torch.device, d: int) -> list[tuple]:
    rows = []
    for N, c, construction in codes:
        code = cerar.make_code(N, c, construction)
        G = torch.randn(N, d, generator=torch.Generator().manual_seed(N * 100 + c))
        on_cpu = cerar.simulate(G, code)
        on_device = cerar.simulate(G.to(device), code).cpu()
        difference = ((on_device - on_cpu).norm() / on_cpu.norm()).item()
        S = G.double().sum(0)
        error = ((on_device.double() - S).norm(dim=1) / S.norm()).max().item()
        rows.append((N, c, construction, code.kappa, difference, error))
    return rows


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true", help="small sizes: a quick check of the script itself")
    parser.add_argument("--out", type=Path, default=Path("reports/gpu.md"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu for a dry run)")
    sizes_mb = [1, 4] if args.small else [16, 64, 256]
    codes = CODES[:3] if args.small else CODES

    agreement = oracle_agreement(codes, device, d=4096 if args.small else 2**20)
    bandwidth = copy_bandwidth(device, (16 if args.small else 1024) * 2**20, args.repeats)
    throughput = []
    for N, c, construction in codes:
        code = cerar.make_code(N, c, construction)
        for size_mb in sizes_mb:
            d = size_mb * 2**20 // 4
            seconds = timed(one_rank_arithmetic(code, d, device), device, args.repeats)
            throughput.append((N, c, construction, size_mb, seconds, d * 4 / seconds))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    lines = [
        "# CERAR on one GPU",
        "",
        f"Made by `python scripts/gpu_check.py {' '.join(argv if argv is not None else sys.argv[1:])}` on "
        f"{name}, torch {torch.__version__}.",
        "",
        "## The oracle on the device against the CPU",
        "",
        "| N | c | construction | kappa | rel. difference device vs CPU | worst worker's rel. error |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {N} | {c} | {k} | {kappa:.3g} | {diff:.2e} | {err:.2e} |" for N, c, k, kappa, diff, err in agreement],
        "",
        "## One rank's encode + decode arithmetic (transfers replaced by a local copy)",
        "",
        f"Device copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s.",
        "",
        "| N | c | construction | MiB | seconds | GB/s of gradient | fraction of copy bandwidth |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *[
            f"| {N} | {c} | {k} | {mb} | {s:.4f} | {rate / 1e9:.1f} | {rate / bandwidth:.3f} |"
            for N, c, k, mb, s, rate in throughput
        ],
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
