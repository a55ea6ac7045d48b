"""What CERAR's per-tensor equilibration (`cerar.ring.equilibrate`, aggregator.equilibrate) costs and buys, on fp32 and
fp16 messages: N gloo ranks on this machine, model=tiny's parameter tensors (their sizes, in the flat gradient's
order), each rank's gradient Gaussian with a per-tensor scale drawn log-uniform over [1e-4, 1] (the spread of a
transformer's weights, biases and norm gains), the same draw on every call.

    .venv/bin/python scripts/bench/bench_equilibrate.py                  # writes reports/equilibrate.md
    .venv/bin/python scripts/bench/bench_equilibrate.py --calls 3 --out -  # print only

Per setting, with and without equilibration: each tensor's own relative error on the worst rank (largest, median),
the whole gradient's, the bytes one rank sends per call, and the host seconds per call (median of --calls, after one
untimed call). The scales' all-reduce and the three passes over the gradient are in the time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {  # name: (c, construction, kappa_max, transport)
    "fp32 messages, optimized c=8, kappa_max 1e4 (default)": (8, "optimized", None, "float32"),
    "fp16 messages, optimized c=5, kappa_max 64 (default)": (5, "optimized", 64.0, "float16"),
}


def tiny_sizes() -> list[int]:
    """model=tiny's parameter tensors' sizes, as the trainer flattens them."""
    from hydra import compose, initialize_config_dir

    from train.config import register_configs
    from train.model import build_model

    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        cfg = compose("config", overrides=["model=tiny"])
    return [p.numel() for p in build_model(cfg.model).parameters() if p.requires_grad]


def gradients(sizes: list[int], N: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(-4, 0, len(sizes))
    return np.concatenate([s * rng.standard_normal((N, n)) for s, n in zip(scales, sizes, strict=True)], 1)


def _worker(rank: int, N: int, port: int, sizes: list[int], calls: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=N)
    from train.aggregation.aggregators import CerarAggregator

    g = torch.from_numpy(gradients(sizes, N)[rank]).float()
    out = {}
    for name, (c, construction, kappa_max, transport) in SETTINGS.items():
        for equilibrate in (False, True):
            agg = CerarAggregator(N, 120.0, c, construction, None, kappa_max, exact_ring=False, transport=transport,
                                  equilibrate=equilibrate)  # fmt: skip
            agg.use_tensors(sizes)
            seconds = []
            for call in range(1 + calls):
                flat = g.clone()
                dist.barrier()
                start = time.perf_counter()
                sent = agg.aggregate(flat)
                if call:
                    seconds.append(time.perf_counter() - start)
            out[name, equilibrate] = (flat.double().numpy(), sent, statistics.median(seconds))
    queue.put((rank, out))
    dist.destroy_process_group()


def measure(N: int, calls: int) -> tuple[list[int], dict]:
    sizes = tiny_sizes()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 2000
    procs = [ctx.Process(target=_worker, args=(r, N, port, sizes, calls, queue)) for r in range(N)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return sizes, [results[r] for r in range(N)]


def local_passes(sizes: list[int], repeats: int = 20) -> float:
    """The fastest of `repeats` runs of equilibration's own arithmetic on one rank, in seconds: the T norms, the
    scaling and the unscaling of the gradient (the scales' all-reduce of T values aside)."""
    from cerar.ring.equilibrate import apply_scales, scales_from, segment_statistics

    torch.set_num_threads(1)
    flat = torch.from_numpy(gradients(sizes, 1)[0]).float()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        scales = scales_from(segment_statistics(flat, sizes, "rms"), sizes, 1, "rms")
        apply_scales(flat, sizes, scales)
        apply_scales(flat, sizes, scales, inverse=True)
        best = min(best, time.perf_counter() - start)
    return best


def table(sizes: list[int], results: list, N: int) -> list[str]:
    G = gradients(sizes, N)
    mean = G.mean(0)
    ends = np.cumsum([0, *sizes])
    header = "| setting | equilibrate | tensor error: worst / median | whole gradient | bytes per call | seconds |"
    rows = [header, "| --- | --- | --- | --- | --- | --- |"]
    for name in SETTINGS:
        for equilibrate in (False, True):
            worst_tensor = np.zeros(len(sizes))
            whole = 0.0
            for r in results:
                got = r[name, equilibrate][0]
                for t, (a, b) in enumerate(zip(ends[:-1], ends[1:], strict=True)):
                    e = np.linalg.norm(got[a:b] - mean[a:b]) / np.linalg.norm(mean[a:b])
                    worst_tensor[t] = max(worst_tensor[t], e)
                whole = max(whole, np.linalg.norm(got - mean) / np.linalg.norm(mean))
            sent = results[0][name, equilibrate][1]
            seconds = max(r[name, equilibrate][2] for r in results)
            rows.append(
                f"| {name} | {str(equilibrate).lower()} | {worst_tensor.max():.3g} / {np.median(worst_tensor):.3g} | "
                f"{whole:.3g} | {sent:,} | {seconds:.4f} |"
            )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--N", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "reports" / "equilibrate.md"), help="'-': print only")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    sizes, results = measure(args.N, args.calls)
    lines = [
        "# CERAR's per-tensor equilibration: what it costs and buys",
        "",
        f"`{' '.join(['.venv/bin/python', 'scripts/bench/bench_equilibrate.py', *(argv or sys.argv[1:])])}`, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()} ({os.cpu_count()} cores, "
        f"load {load:.1f} at the start), N={args.N} gloo ranks, model=tiny's {len(sizes)} tensors "
        f"(d = {sum(sizes):,}), per-tensor scales log-uniform over [1e-4, 1], Gaussian (module docstring).",
        "",
        *table(sizes, results, args.N),
        "",
        f"Equilibration's own arithmetic on one rank (the T norms, scaling, unscaling; fastest of 20, one thread): "
        f"{1e3 * local_passes(sizes):.2f} ms for d = {sum(sizes):,}.",
        "",
        "Tensor error: each tensor's ||g_hat_t - g_bar_t|| / ||g_bar_t|| on the worst rank, the largest over the",
        "tensors and their median; seconds: the slowest rank's median host seconds per call (the machine is shared:",
        "compare the two rows of a setting, measured side by side; on a loaded machine they differ by more than",
        "equilibration's own arithmetic, the line above, which is its cost with the all-reduce of T values). The",
        "scales' all-reduce adds 2 (N-1)/N x 8 T bytes.",
    ]
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
