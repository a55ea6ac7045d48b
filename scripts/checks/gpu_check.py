"""The one-command GPU acceptance check: CERAR's CUDA path on one GPU or several, written to reports/gpu.md.

    python scripts/checks/gpu_check.py                     # on a CUDA machine: one rank per GPU, up to --ranks (8)
    python scripts/checks/gpu_check.py --device cpu --small --out /tmp/gpu.md   # its dry run on the CPU

Checks, each reported PASS / FAIL / NOT RUN (MEASURED where a figure is reported, not judged) with
its numbers. Every result is judged against the exact sum of the inputs, within a bound derived from
the code itself: the code's own error for those inputs (``Code.residuals``) plus kappa times
float32's rounding (``cerar.precision``), never as two implementations agreeing to a fixed
tolerance.

On one device:

1. oracle: ``cerar.simulate`` on the device, (N, c) in {(4, 16), (8, 32)} and every construction
   (one that cannot be built there is reported as such and checked at the largest of c = N, N/2, 2
   that builds);
2. tf32: ``cerar.full_fp32_products`` with TF32 switched on: the guarded result within the bound;
   the unguarded one (the same products without the guard) reported next to it;
3. throughput: one rank's encode/decode arithmetic (transfers replaced by a local copy) in GB/s of
   gradient, next to the device's copy bandwidth, and how much of it runs hidden beside a second
   stream's copies of the same bytes (measured, not judged);
7. training: ``train/main.py`` at world size 1 in bf16 and in fp16 (fp32 on the CPU), deterministic
   kernels on CUDA: an uninterrupted run, and a run killed (SIGKILL) after its first checkpoint and
   resumed, which must end with the same ``param_sha256`` (or, where a kernel has no deterministic
   variant, the same validation loss within ``VAL_LOSS_TOLERANCE``).

Between processes, one rank per device (``cuda:<rank>``, world = min(--ranks, devices)) on NCCL:

4. protocol: ``cerar.all_reduce`` and ``cerar.ring_all_reduce`` with TF32 switched on; bytes as the
   rate table; median times per call against torch's all_reduce;
5. hook: DDP with the CERAR hook (its own thread, stream and group), every bucket judged;
6. stall: the last rank stops (SIGSTOP); every other rank's call must raise CollectiveError within
   the timeout plus ``STALL_SLACK_S`` and leave through torch's abort.

With fewer than two devices sections 4-6 are NOT RUN (a one-rank group exchanges no message), and
the one rank checks the hook's plumbing instead (``hook plumbing (N=1)``); the report says what the
run proved and what it could not. The CPU dry run stands two gloo processes in for two devices.
Every number in the report comes from this run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import cerar  # noqa: E402
from cerar.matrices import device_matrices  # noqa: E402
from cerar.rounds import CodedRingRank  # noqa: E402

SHAPES = [(4, 16), (8, 32)]
THROUGHPUT_CODES = [(4, 4, "exact"), (4, 16, "perturbation"), (4, 16, "optimized"), (8, 32, "optimized")]


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


def resolve_device(name: str, current_cuda_index: int | None = None) -> torch.device:
    """The device a ``--device`` name means, with an index where CUDA needs one: ``cuda`` is the
    current CUDA device (``cuda:<current_cuda_index>``; ``torch.cuda.set_device`` refuses a CUDA
    device without an index), ``cuda:k`` and ``cpu`` are themselves."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        if current_cuda_index is None:
            raise ValueError("--device cuda: the current CUDA device's index is needed to resolve it")
        device = torch.device("cuda", current_cuda_index)
    return device


def worst_error(result: torch.Tensor, G: torch.Tensor) -> float:
    """The worst worker's relative error against the exact sum (in float64)."""
    S = G.double().sum(0)
    return ((result.double().cpu() - S.cpu()).norm(dim=1) / S.norm()).max().item()


def exact_arithmetic_results(G: torch.Tensor, code: cerar.Code) -> torch.Tensor:
    """What each worker of ``code`` receives for gradients G [N, d] in exact arithmetic (float64):
    the exact sum plus the code's own error, S + sum_h R_ih G_(i-h) (the spec's error formula,
    ``Code.residuals``), computed from the code's matrices alone, not by running the rounds."""
    N, d = G.shape
    c, m = code.c, code.m_for(d)
    padded = torch.zeros(N, c * m, dtype=torch.float64)
    padded[:, :d] = G.double().cpu()
    blocks = padded.view(N, c, m)
    S = blocks.sum(0)
    R = torch.from_numpy(code.residuals())
    out = torch.stack(
        [S + sum((R[i, h - 1] @ blocks[(i - h) % N] for h in range(1, N)), torch.zeros_like(S)) for i in range(N)]
    )
    return out.view(N, c * m)[:, :d]


def judge_coded(results: torch.Tensor, G: torch.Tensor, code: cerar.Code, dtype, scale: float = 1.0) -> dict:
    """Each worker's result [N, d] of ``code`` on gradients G (times ``scale``: 1/N for op="avg")
    held to the exact sum: it must lie within the transport's rounding bound
    (``cerar.precision.rounding_bound``, kappa times the dtype's rounding, relative to ||G||_F) of
    the exact sum plus the code's own error for these gradients (``exact_arithmetic_results``).
    Reports the error against the exact sum, the code's part of it, and the rounding deviation."""
    G64 = G.double().cpu()
    S = G64.sum(0) * scale
    predicted = exact_arithmetic_results(G64, code) * scale
    results = results.double().cpu()
    size = (G64.norm() * scale).clamp_min(1e-300)
    deviation = ((results - predicted).norm(dim=1) / size).max().item()
    bound = cerar.precision.rounding_bound(code, dtype)
    return {
        "error": ((results - S).norm(dim=1) / S.norm().clamp_min(1e-300)).max().item(),
        "truncation": ((predicted - S).norm(dim=1) / S.norm().clamp_min(1e-300)).max().item(),
        "deviation": deviation,
        "bound": bound,
        "ok": bool(torch.isfinite(results).all()) and deviation <= bound,
    }


def judge_sum(results: torch.Tensor, G: torch.Tensor, dtype, scale: float = 1.0) -> dict:
    """Each rank's exact all-reduce result [N, d] held to the exact sum of G (times ``scale``),
    within the rounding of a sum of N values (``cerar.precision.sum_rounding_bound``)."""
    G64 = G.double().cpu()
    S = G64.sum(0) * scale
    size = (G64.norm() * scale).clamp_min(1e-300)
    deviation = ((results.double().cpu() - S).norm(dim=1) / size).max().item()
    bound = cerar.precision.sum_rounding_bound(G.shape[0], dtype)
    return {"deviation": deviation, "bound": bound, "ok": deviation <= bound}


# ------------------------------------------------------------------------------------------------
# 1. the oracle on the device
# ------------------------------------------------------------------------------------------------


def oracle_agreement(device: torch.device, d: int, shapes) -> list[dict]:
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
                row.update(status="NOT RUN", note="cannot be built: " + "; ".join(reasons))
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
                status="PASS" if judged["ok"] else "FAIL",
            )
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------
# 2. throughput
# ------------------------------------------------------------------------------------------------


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


def throughput(device, codes, sizes_mb, repeats) -> list[tuple]:
    rows = []
    with cerar.full_fp32_products(device):
        for N, c, construction in codes:
            code = cerar.make_code(N, c, construction)
            for size_mb in sizes_mb:
                d = size_mb * 2**20 // 4
                seconds = timed(one_rank_arithmetic(code, d, device), device, repeats)
                rows.append((N, c, construction, size_mb, seconds, d * 4 / seconds))
    return rows


def overlap(device: torch.device, code_spec: tuple, size_mb: int, repeats: int) -> dict | None:
    """How much of one rank's encode/decode arithmetic the device hides under transfers: the
    arithmetic alone (T_a, ``one_rank_arithmetic``), its L rounds' message copies alone on a second
    stream (T_c: a stand-in for NCCL's stream, the same bytes), and both issued together (T_both);
    hidden = (T_a + T_c - T_both) / min(T_a, T_c): 1 when the shorter one runs entirely beside the
    other, 0 when they serialise. None on a CPU, which has no streams."""
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


def overlap_lines(overlaps: dict | None) -> list[str]:
    if overlaps is None:
        return ["Overlap of the arithmetic with transfers: not measured (a CPU has no streams)."]
    N, c, construction = overlaps["code"]
    return [
        f"Overlap on the device (N={N}, c={c} {construction}, {overlaps['MiB']} MiB): the arithmetic on the "
        "compute stream beside its messages' bytes copied on a second stream (a stand-in for NCCL's); hidden = "
        "(arithmetic + copies - both) / the shorter of the two (reported, not judged):",
        "",
        "| arithmetic alone (s) | copies alone (s) | both together (s) | hidden |",
        "| --- | --- | --- | --- |",
        f"| {overlaps['arithmetic']:.4f} | {overlaps['copies']:.4f} | {overlaps['both']:.4f} "
        f"| {overlaps['hidden']:.2f} |",
    ]


# ------------------------------------------------------------------------------------------------
# 3. the TF32 guard
# ------------------------------------------------------------------------------------------------


def tf32_guard(device: torch.device, d: int, N: int = 8, c: int = 16) -> dict:
    code = cerar.make_code(N, c, "perturbation")
    G = torch.randn(N, d, generator=torch.Generator().manual_seed(8))
    cpu_error = worst_error(cerar.simulate(G, code), G)
    before = cerar.precision.matmul_precision_settings()
    torch.set_float32_matmul_precision("high")  # TF32 on, as a model might want it
    try:
        unguarded = judge_coded(simulate_unguarded(G.to(device), code), G, code, torch.float32)
        with cerar.full_fp32_products(device):
            inside = cerar.precision.matmul_precision_settings()
            guarded = judge_coded(cerar.simulate(G.to(device), code), G, code, torch.float32)
        after = cerar.precision.matmul_precision_settings()
    finally:
        torch.set_float32_matmul_precision(before[0] or "highest")
    ok = guarded["ok"] and after == ("high", "tf32") and not cerar.precision.reduced_precision_allowed(inside)
    return {
        "N": N,
        "c": c,
        "kappa": code.kappa,
        "cpu_error": cpu_error,
        "unguarded": unguarded["error"],
        "unguarded_deviation": unguarded["deviation"],
        "guarded": guarded["error"],
        "guarded_deviation": guarded["deviation"],
        "bound": guarded["bound"],
        "restored": after == ("high", "tf32"),
        "status": "PASS" if ok else "FAIL",
    }


def simulate_unguarded(G: torch.Tensor, code: cerar.Code) -> torch.Tensor:
    """``cerar.simulate`` without its TF32 guard: the products run under the process's own matmul
    settings, to measure what the guard prevents (``cerar.simulate`` always runs guarded)."""
    simulate_module = sys.modules["cerar.simulate"]  # the module: the attribute ``cerar.simulate`` is the function
    with mock.patch.object(simulate_module, "full_fp32_products", contextlib.nullcontext):
        return simulate_module.simulate(G, code)


# ------------------------------------------------------------------------------------------------
# 4, 5 and 6. the protocol, the hook and a stalled peer between processes, one rank per device
# ------------------------------------------------------------------------------------------------

PROTOCOL_CASES = [("exact", 1), ("perturbation", 2)]
"""(construction, c as a multiple of N) for N ranks: the exact code (c = N), and c = 2N with
eps = 0.05, where kappa is about 100, so the rounding bound (about 1e-5) has teeth."""
HOOK_CASE = ("perturbation", 2)
MULTI_RANK_SECTIONS = ("protocol", "hook", "stall")
"""Sections that prove something only between two or more ranks: on fewer they are NOT RUN."""
STALL_TIMEOUT_S = {"cuda": 5.0, "cpu": 2.0}
STALL_SLACK_S = 5.0
"""What a survivor may take beyond the timeout to raise: the rounds before the stall, enqueueing a
look-behind window, the poll's pause, and building the message (measured: well under a second)."""


def _gradients(N: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(N, d, generator=torch.Generator().manual_seed(seed))


def _code(N: int, construction: str, multiple: int) -> cerar.Code:
    return cerar.make_code(N, multiple * N, construction, eps=0.05 if construction == "perturbation" else None)


def multi_rank_verdicts(world: int, judged: dict[str, bool] | None) -> dict[str, str]:
    """The verdicts of the multi-rank sections: NOT RUN on fewer than two ranks whatever ran there
    (one rank exchanges no message, so its protocol and hook prove nothing between ranks); else
    PASS or FAIL as judged (FAIL for a section that has no judgement)."""
    if world < 2:
        return dict.fromkeys(MULTI_RANK_SECTIONS, "NOT RUN")
    judged = judged or {}
    return {section: "PASS" if judged.get(section) else "FAIL" for section in MULTI_RANK_SECTIONS}


class _Captured:
    def __init__(self, state):
        self.state, self.inputs, self.results = state, [], []


def _capturing_hook(captured, bucket):
    from cerar.ddp import cerar_hook

    captured.inputs.append(bucket.buffer().detach().cpu().clone())

    def keep(future):
        captured.results.append(future.value().detach().cpu().clone())
        return future.value()

    return cerar_hook(captured.state, bucket).then(keep)


def _timings(device: torch.device, world: int, d: int, repeats: int) -> dict:
    """Median seconds per call of CERAR (c = 2N), the exact ring and torch's all_reduce on d values,
    and CERAR's ``seconds_comm`` (on CUDA: the time the compute stream waited for transfers, so
    what the transfers did not hide) and encode + decode seconds."""
    import torch.distributed as dist

    code = _code(world, *HOOK_CASE)
    tensor = torch.randn(d, device=device)
    samples: dict[str, list[float]] = {"cerar": [], "ring": [], "torch": [], "cerar_comm": [], "cerar_arith": []}
    for _ in range(repeats + 1):  # the first call of each is a warm-up
        for name, call in (
            ("cerar", lambda: cerar.all_reduce(tensor, code, op="avg", timeout=60)),
            ("ring", lambda: cerar.ring_all_reduce(tensor, op="avg", timeout=60)),
            ("torch", lambda: dist.all_reduce(tensor)),
        ):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            stats = call()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
            if name == "cerar":
                samples["cerar_comm"].append(stats.seconds_comm)
                samples["cerar_arith"].append(stats.seconds_encode + stats.seconds_decode)
    return {name: sorted(values[1:])[len(values[1:]) // 2] for name, values in samples.items()}


def _distributed_worker(rank: int, world: int, port: int, backend: str, d: int, options: dict, results) -> None:
    """One rank: on CUDA its own device, cuda:<rank>. Reports ("ok", results), then, with
    ``options["stall"]``, takes part in the stall: the last rank stops (SIGSTOP), the others report
    ("stall", (message, seconds)) and leave through torch's abort and ``os._exit``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    from cerar.ddp import CerarHookState

    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("gpu-check/", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
            device_id=device if device.type == "cuda" else None,
        )
        torch.set_float32_matmul_precision("high")  # TF32 on: CERAR's products must not use it
        out = {"protocol": [], "hook": None, "timings": None}
        for k, (construction, multiple) in enumerate(PROTOCOL_CASES):
            code = _code(world, construction, multiple)
            G = _gradients(world, d, seed=k)
            mine = G[rank].clone().to(device)
            stats = cerar.all_reduce(mine, code, timeout=60)
            ring = G[rank].clone().to(device)
            ring_stats = cerar.ring_all_reduce(ring, timeout=60)
            out["protocol"].append((mine.cpu(), int(stats.bytes_sent), ring.cpu(), int(ring_stats.bytes_sent)))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).to(device)
        ddp = DDP(model, device_ids=[rank] if device.type == "cuda" else None, bucket_cap_mb=0.05)
        hook_code = _code(world, *HOOK_CASE)
        captured = _Captured(
            CerarHookState(c=hook_code.c, construction=hook_code.construction, eps=hook_code.eps, timeout=60)
        )
        ddp.register_comm_hook(captured, _capturing_hook)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank)).to(device)
        for _ in range(3):
            ddp.zero_grad()
            ddp(x).square().mean().backward()
        synchronize(device)
        out["hook"] = (captured.inputs, captured.results)
        if world > 1 and options["timing_d"]:
            out["timings"] = _timings(device, world, options["timing_d"], options["repeats"])
        buffer = io.BytesIO()  # plain bytes: tensors must not travel as shared memory of an exiting process
        torch.save(out, buffer)
        results.put((rank, "ok", buffer.getvalue()))
        if options["stall"] and world > 1:
            _stall(rank, world, device, store, options["stall_timeout_s"], results)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _stall(rank: int, world: int, device: torch.device, store, timeout_s: float, results) -> None:
    """The last rank stops mid-training (SIGSTOP) between two calls; every other rank's next call
    must raise CollectiveError within the timeout plus ``STALL_SLACK_S``. Survivors then abort
    every group with torch's abort (NCCL: cancels the kernels that wait for the stopped rank) and
    end at once, as the trainer does: no teardown may wait on the stopped rank."""
    import torch.distributed as dist

    victim = world - 1
    code = _code(world, *HOOK_CASE)
    tensor = torch.ones(2**20 + 3, device=device)
    cerar.all_reduce(tensor, code, timeout=timeout_s)  # connected and agreed before the stall
    synchronize(device)
    store.set(f"stall/ready/{rank}", "1")
    if rank == victim:
        store.wait([f"stall/ready/{r}" for r in range(world)], timedelta(seconds=60))
        # This rank's results, sent by the queue's feeder thread, must be in the pipe before it stops: a message
        # cut off by SIGSTOP would hold the parent in mid-read, and the queue's lock from the other ranks, forever.
        results.close()
        results.join_thread()
        os.kill(os.getpid(), signal.SIGSTOP)
    store.wait([f"stall/ready/{victim}"], timedelta(seconds=60))
    start = time.monotonic()
    try:
        cerar.all_reduce(tensor, code, timeout=timeout_s)
        synchronize(device)
        outcome = "no error"
    except cerar.CollectiveError as error:
        outcome = f"CollectiveError: {error}"
    results.put((rank, "stall", (outcome, time.monotonic() - start)))
    results.close()
    results.join_thread()  # the report is in the pipe before os._exit, which would end the queue's feeder thread
    with contextlib.suppress(Exception):
        dist.distributed_c10d._abort_process_group()
    os._exit(0)


def run_processes(world: int, backend: str, d: int, options: dict, timeout_s: float) -> dict:
    """Run ``_distributed_worker`` on ``world`` processes; {rank: {"ok": value, "stall": value}} or
    {rank: {"error": text}}. The processes meet in a TCPStore this process holds (on a port the
    kernel picks: nothing can race for it)."""
    import torch.distributed as dist

    context = mp.get_context("spawn")
    results = context.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    processes = [
        context.Process(
            target=_distributed_worker, args=(r, world, store.port, backend, d, options, results), daemon=True
        )
        for r in range(world)
    ]
    for p in processes:
        p.start()
    stalling = options["stall"] and world > 1
    wanted = {(r, "ok") for r in range(world)} | ({(r, "stall") for r in range(world - 1)} if stalling else set())
    collected: dict[int, dict] = {r: {} for r in range(world)}
    deadline = time.monotonic() + timeout_s
    try:
        while wanted and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if status == "ok":
                value = torch.load(io.BytesIO(value), weights_only=False)
            collected[rank][status] = value
            wanted.discard((rank, status))
            if status == "error":
                break
    finally:
        for p in processes:
            p.join(timeout=10 if not stalling else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    for rank, status in sorted(wanted):
        collected[rank].setdefault("error", f"rank {rank} did not report {status!r} within {timeout_s:g}s")
    return collected


def judge_processes(collected: dict, world: int, d: int) -> tuple[list[dict], dict]:
    """Each rank's protocol and ring results, and each hook bucket, held to the exact sum of the
    ranks' inputs within a bound derived from the code (``judge_coded``, ``judge_sum``)."""
    protocol = []
    for k, (construction, multiple) in enumerate(PROTOCOL_CASES):
        code = _code(world, construction, multiple)
        G = _gradients(world, d, seed=k)
        per_rank = [collected[r]["ok"]["protocol"][k] for r in range(world)]
        coded = judge_coded(torch.stack([p[0] for p in per_rank]), G, code, torch.float32)
        ring = judge_sum(torch.stack([p[2] for p in per_rank]), G, torch.float32)
        bytes_ok = all(
            sent == code.L * code.m_for(d) * 4 and ring_sent == 2 * (world - 1) * -(-d // world) * 4
            for _, sent, _, ring_sent in per_rank
        )
        protocol.append(
            {
                "c": code.c,
                "construction": construction,
                "kappa": code.kappa,
                **coded,
                "ring": ring["deviation"],
                "ring_bound": ring["bound"],
                "bytes": bytes_ok,
                "status": "PASS" if coded["ok"] and ring["ok"] and bytes_ok else "FAIL",
            }
        )
    inputs = [collected[r]["ok"]["hook"][0] for r in range(world)]
    outputs = [collected[r]["ok"]["hook"][1] for r in range(world)]
    code = _code(world, *HOOK_CASE)
    buckets = len(inputs[0])
    judged = [
        judge_coded(
            torch.stack([outputs[r][k] for r in range(world)]),
            torch.stack([inputs[r][k] for r in range(world)]),
            code,
            torch.float32,
            scale=1.0 / world,
        )
        for k in range(buckets)
    ]
    hook = {
        "buckets": buckets,
        "c": code.c,
        "kappa": code.kappa,
        "error": max((j["error"] for j in judged), default=float("nan")),
        "deviation": max((j["deviation"] for j in judged), default=float("nan")),
        "bound": cerar.precision.rounding_bound(code, torch.float32),
        "status": "PASS" if buckets and all(j["ok"] for j in judged) else "FAIL",
    }
    return protocol, hook


def judge_plumbing(collected: dict) -> dict:
    """One rank: every call returns its input (a ring of one sums nothing) and the hook's futures
    hand DDP back each bucket unchanged, through its thread, stream and future."""
    out = collected[0]["ok"]
    unchanged = all(torch.equal(mine, ring) for mine, _, ring, _ in out["protocol"])
    inputs, results = out["hook"]
    hook_ok = bool(inputs) and len(inputs) == len(results) and all(map(torch.equal, inputs, results))
    return {"buckets": len(inputs), "status": "PASS" if unchanged and hook_ok else "FAIL"}


def judge_stall(collected: dict, world: int, timeout_s: float) -> dict:
    survivors = range(world - 1)
    rows = [(r, *collected[r].get("stall", ("did not report", float("nan")))) for r in survivors]
    ok = all(
        message.startswith("CollectiveError") and seconds <= timeout_s + STALL_SLACK_S for _, message, seconds in rows
    )
    return {"victim": world - 1, "timeout": timeout_s, "rows": rows, "status": "PASS" if ok else "FAIL"}


def distributed_checks(device: torch.device, world: int, d: int, options: dict, timeout_s: float) -> dict:
    """The multi-rank sections on ``world`` ranks (one per device), or, on one rank, the plumbing only."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    collected = run_processes(world, backend, d, options, timeout_s)
    errors = {r: v["error"] for r, v in collected.items() if "error" in v}
    result = {"world": world, "backend": backend, "errors": errors}
    if any("ok" not in collected[r] for r in range(world)):
        return result
    if world == 1:
        return {**result, "plumbing": judge_plumbing(collected)}
    protocol, hook = judge_processes(collected, world, d)
    result.update(protocol=protocol, hook=hook, timings=collected[0]["ok"]["timings"])
    if options["stall"]:
        result["stall"] = judge_stall(collected, world, options["stall_timeout_s"])
    return result


# ------------------------------------------------------------------------------------------------
# 7. training: a kill and a resume end where an uninterrupted run does
# ------------------------------------------------------------------------------------------------

DETERMINISM_CALLBACK = '''
"""Written by scripts/checks/gpu_check.py: makes a training run's CUDA kernels deterministic (a Hydra callback)."""
from hydra.experimental.callback import Callback


class Deterministic(Callback):
    def on_job_start(self, config, **kwargs):
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.enable_flash_sdp(False)  # the math attention, whose backward has no atomics
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
'''
VAL_LOSS_TOLERANCE = 1e-3
"""Relative difference of the final validation loss allowed between the uninterrupted and the killed and
resumed run when their parameters are not bitwise equal (a kernel without a deterministic variant):
rounding differences grow to about 1e-4 over 200 steps of the tiny model; a resume that lost the
optimizer state, the data position or the RNG moves the loss by more."""


def _launch(overrides: list[str], env: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train/main.py"]
    return subprocess.Popen(
        [*command, *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return -9, output
    return process.returncode, output


def training_run(device: torch.device, precision: str, workdir: Path, small: bool, timeout_s: float) -> dict:
    steps, every = (24, 4) if small else (200, 20)  # small: enough steps after the first checkpoint to kill mid-run
    overrides = [
        "model=tiny",
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.micro_batch_size=4",
        "trainer.eval_batches=2",
        "data.seq_len=64",
        "trainer.progress_bar=false",
        "wandb.mode=disabled",
        f"trainer.device={device.type}",
        f"trainer.precision={precision}",
        f"checkpoint.every={every}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    if device.type == "cuda":  # deterministic kernels, so that a resumed run can end bit for bit where the other did
        (workdir / "gpu_check_determinism.py").write_text(DETERMINISM_CALLBACK)
        env.update(CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONPATH=f"{workdir}{os.pathsep}{ROOT}")
        overrides.append("+hydra.callbacks.deterministic._target_=gpu_check_determinism.Deterministic")
    full_dir, killed_dir = workdir / f"full_{precision}", workdir / f"killed_{precision}"
    row = {"precision": precision, "steps": steps}

    code, output = _finish(_launch([*overrides, f"hydra.run.dir={full_dir}"], env), timeout_s)
    if code != 0:
        return {**row, "status": "FAIL", "note": f"uninterrupted run exited {code}: {output[-1500:]}"}
    full = json.loads((full_dir / "summary.json").read_text())

    process = _launch([*overrides, f"hydra.run.dir={killed_dir}"], env)
    # the checksum is written after the checkpoint's rename: once it exists the checkpoint is whole (a kill
    # between the two leaves one that resume rightly ignores, and the check would fail on a race of its own)
    first = killed_dir / "checkpoints" / f"step-{every:08d}.pt.sha256"
    deadline = time.monotonic() + timeout_s
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    killed_at = None
    if process.poll() is None:
        # torchrun may start its worker in a session of its own: kill the worker by its pid file, then the agent
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((killed_dir / "pids" / "rank0.pid").read_text()), signal.SIGKILL)
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        killed_at = every
    if killed_at is None or (killed_dir / "summary.json").exists():
        return {**row, "status": "FAIL", "note": "the run ended before it could be killed after its first checkpoint"}
    code, output = _finish(_launch([*overrides, f"hydra.run.dir={killed_dir}"], env), timeout_s)
    if code != 0:
        return {**row, "status": "FAIL", "note": f"resumed run exited {code}: {output[-1500:]}"}
    resumed = json.loads((killed_dir / "summary.json").read_text())
    bitwise = resumed["param_sha256"] == full["param_sha256"]
    loss, resumed_loss = full.get("final_val_loss"), resumed.get("final_val_loss")
    close = loss is not None and resumed_loss is not None and abs(resumed_loss - loss) <= VAL_LOSS_TOLERANCE * abs(loss)
    return {
        **row,
        "resumed_from": resumed.get("resumed_from_step"),
        "full_sha": full["param_sha256"][:16],
        "resumed_sha": resumed["param_sha256"][:16],
        "val_loss": loss,
        "resumed_val_loss": resumed_loss,
        "bitwise": bitwise,
        "status": "PASS" if (bitwise or close) and resumed.get("resumed_from_step") else "FAIL",
    }


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------


def _section(name: str, fn, statuses: dict, *args):
    start = time.monotonic()
    try:
        value = fn(*args)
    except Exception:
        statuses[name] = "FAIL"
        return None, traceback.format_exc(), time.monotonic() - start
    return value, None, time.monotonic() - start


def proved(statuses: dict[str, str], world: int, devices: int, backend: str) -> list[str]:
    """What this run proved, and what it could not, one line each, from the sections' verdicts."""
    one = {
        "oracle": "the device's encode/decode arithmetic gives every construction's exact-arithmetic result "
        "within float32's rounding bound",
        "tf32": "with TF32 switched on, CERAR's products still run in full float32 and the caller's settings come back",
        "throughput": "encode/decode throughput measured against the device's copy bandwidth",
        "hook plumbing (N=1)": "the DDP hook's thread, stream and future hand each bucket back on one rank",
    }
    lines = [f"- {text} ({statuses[key]})" for key, text in one.items() if statuses.get(key) in ("PASS", "MEASURED")]
    lines += [
        f"- training in {key.split()[-1]}: an uninterrupted run and one killed after a checkpoint and resumed "
        f"end alike ({status})"
        for key, status in statuses.items()
        if key.startswith("training") and status == "PASS"
    ]
    several = {
        "protocol": f"cerar.all_reduce and ring_all_reduce between {world} ranks on {backend}, one per device, "
        "every rank's result within the rounding bound of the exact sum plus the code's error, bytes as the rate "
        "table",
        "hook": f"the DDP hook between {world} ranks, every bucket within the bound",
        "stall": f"a rank stopped (SIGSTOP) mid-training: every other rank raised CollectiveError within the "
        f"timeout plus {STALL_SLACK_S:g} s and left through torch's abort",
    }
    if world < 2:
        lines.append(
            f"- NOT RUN (needs two devices; this machine has {devices}): {', '.join(several)}; a one-rank "
            "group exchanges no message, so nothing between ranks was proved"
        )
    else:
        lines += [f"- {text} ({statuses.get(key, 'NOT RUN')})" for key, text in several.items()]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--ranks", type=int, default=8, help="ranks wanted between processes (default 8)")
    parser.add_argument("--small", action="store_true", help="small sizes: a quick check of the script itself")
    parser.add_argument("--out", type=Path, default=Path("reports/gpu.md"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", nargs="*", default=[], choices=["throughput", "distributed", "stall", "training"])
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu for a dry run)")
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    device = resolve_device(args.device, torch.cuda.current_device() if torch.cuda.is_available() else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    devices = torch.cuda.device_count() if device.type == "cuda" else 2  # the CPU dry run: two gloo processes
    world = min(args.ranks, devices)
    started = time.monotonic()
    statuses: dict[str, str] = {}
    d = 4096 if args.small else 2**20
    shapes = [(4, 16)] if args.small else SHAPES

    oracle, oracle_error, oracle_s = _section("oracle", oracle_agreement, statuses, device, d, shapes)
    if oracle:
        statuses["oracle"] = "PASS" if all(r["status"] in ("PASS", "NOT RUN") for r in oracle) else "FAIL"
    tf32, tf32_error, tf32_s = _section("tf32", tf32_guard, statuses, device, d, *((4, 8) if args.small else (8, 16)))
    if tf32:
        statuses["tf32"] = tf32["status"]
    rates = bandwidth = overlaps = throughput_error = None
    if "throughput" not in args.skip:
        codes = THROUGHPUT_CODES[2:3] if args.small else THROUGHPUT_CODES
        sizes_mb = [1] if args.small else [16, 64, 256]
        rates, throughput_error, _ = _section("throughput", throughput, statuses, device, codes, sizes_mb, args.repeats)
        bandwidth = copy_bandwidth(device, (16 if args.small else 1024) * 2**20, args.repeats)
        overlaps = overlap(device, codes[-1], 1 if args.small else 64, args.repeats)
        if rates is not None:
            statuses["throughput"] = "MEASURED"  # reported, not judged
    distributed = distributed_error = None
    if "distributed" not in args.skip:
        options = {
            "stall": "stall" not in args.skip,
            "stall_timeout_s": STALL_TIMEOUT_S[device.type],
            "timing_d": 2**16 if args.small else 2**24,
            "repeats": 1 if args.small else args.repeats,
        }
        distributed, distributed_error, _ = _section(
            "protocol", distributed_checks, statuses, device, world, 1000 if args.small else 2**20 + 3, options, 600
        )
        judged = None
        if distributed and world >= 2 and "protocol" in distributed:
            judged = {
                "protocol": all(r["status"] == "PASS" for r in distributed["protocol"]),
                "hook": distributed["hook"]["status"] == "PASS",
                "stall": distributed.get("stall", {}).get("status") == "PASS",
            }
        statuses.update(multi_rank_verdicts(world, judged))
        if not options["stall"] and world >= 2:
            statuses["stall"] = "NOT RUN"
        if world == 1:
            plumbing = (distributed or {}).get("plumbing")
            statuses["hook plumbing (N=1)"] = plumbing["status"] if plumbing else "FAIL"
    trainings = []
    if "training" not in args.skip:
        precisions = ("bf16", "fp16") if device.type == "cuda" else ("fp32",)
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
            for precision in precisions:
                row, error, _ = _section(
                    f"training {precision}", training_run, statuses, device, precision, Path(workdir), args.small, 240
                )
                trainings.append(row or {"precision": precision, "status": "FAIL", "note": error[-1500:]})
                statuses[f"training {precision}"] = trainings[-1]["status"]

    backend = "nccl" if device.type == "cuda" else "gloo"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    command = " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# CERAR on GPUs: acceptance check",
        "",
        f"Made by `python scripts/checks/gpu_check.py {command}` on {devices} x {name}, torch {torch.__version__}"
        + (
            f", CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
            if device.type == "cuda"
            else " (a dry run: two gloo processes stand for two devices)"
        )
        + f", in {time.monotonic() - started:.0f} s. Multi-rank sections on {world} rank(s), one per device.",
        "",
        "| check | result |",
        "| --- | --- |",
        *[f"| {check} | {status} |" for check, status in statuses.items()],
        "",
        "What this run proved:",
        "",
        *proved(statuses, world, devices, backend),
        "",
        "## 1. The oracle on the device against the exact sum",
        "",
        f"d = {d}; the worst worker's relative error against the exact sum (CPU and device), and the device's "
        "deviation from the exact sum plus the code's own error for these gradients (its exact-arithmetic result), "
        "relative to ||G||_F; PASS when that deviation is within the float32 rounding bound kappa * 2^-24 * "
        f"(sqrt(c + L) + N) (`cerar.precision.rounding_bound`). {oracle_s:.1f} s.",
        "",
        "| N | c | construction | kappa | rel. difference device vs CPU | CPU error | device error "
        "| device rounding deviation | bound | result | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in oracle or []:
        if r["status"] == "NOT RUN":
            lines.append(f"| {r['N']} | {r['c']} | {r['construction']} | | | | | | | NOT RUN | {r.get('note', '')} |")
        else:
            lines.append(
                f"| {r['N']} | {r['c']} | {r['construction']} | {r['kappa']:.3g} | {r['difference']:.2e} | "
                f"{r['cpu_error']:.2e} | {r['device_error']:.2e} | {r['deviation']:.2e} | {r['bound']:.2e} "
                f"| {r['status']} | {r.get('note', '')} |"
            )
    if oracle_error:
        lines += ["", "```", oracle_error[-3000:], "```"]
    lines += ["", "## 2. The TF32 guard with TF32 switched on", ""]
    if tf32:
        lines += [
            f"`torch.set_float32_matmul_precision('high')`, N={tf32['N']}, c={tf32['c']} perturbation, "
            f"d={d} ({tf32_s:.1f} s):",
            "",
            f"kappa {tf32['kappa']:.3g}; errors against the exact sum; deviations from the code's exact-arithmetic "
            f"result relative to ||G||_F, against the float32 rounding bound {tf32['bound']:.2e}. Unguarded: "
            "`cerar.simulate` with its guard taken out, the products under TF32 (on a CPU, which has no TF32, "
            "the same as guarded). PASS: the guarded deviation within the bound and the caller's settings restored.",
            "",
            "| CPU error | device error, unguarded (deviation) | device error, inside `cerar.full_fp32_products` "
            "(deviation) | settings restored | result |",
            "| --- | --- | --- | --- | --- |",
            f"| {tf32['cpu_error']:.2e} | {tf32['unguarded']:.2e} ({tf32['unguarded_deviation']:.1e}) "
            f"| {tf32['guarded']:.2e} ({tf32['guarded_deviation']:.1e}) | {tf32['restored']} | {tf32['status']} |",
        ]
    else:
        lines += ["```", (tf32_error or "")[-3000:], "```"]
    if rates is not None:
        lines += [
            "",
            "## 3. One rank's encode + decode arithmetic (transfers replaced by a local copy)",
            "",
            f"Device copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s.",
            "",
            "| N | c | construction | MiB | seconds | GB/s of gradient | fraction of copy bandwidth |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *[
                f"| {N} | {c} | {k} | {mb} | {s:.4f} | {rate / 1e9:.1f} | {rate / bandwidth:.3f} |"
                for N, c, k, mb, s, rate in rates
            ],
            "",
            *overlap_lines(overlaps),
        ]
    elif throughput_error:
        lines += ["", "## 3. One rank's encode + decode arithmetic", "", "```", throughput_error[-3000:], "```"]
    lines += distributed_lines(distributed, distributed_error, world, devices)
    if trainings:
        lines += [
            "",
            "## 7. Training at world size 1: killed after a checkpoint, resumed",
            "",
            (
                "Deterministic kernels on CUDA (`CUBLAS_WORKSPACE_CONFIG=:4096:8`, "
                "`torch.use_deterministic_algorithms(True, warn_only=True)`, the math attention) through a Hydra "
                "callback; PASS when the resumed run's parameters are bitwise those of the uninterrupted run, or, "
                f"where a kernel has no deterministic variant, its final validation loss is within "
                f"{VAL_LOSS_TOLERANCE:g} (relative) of it."
                if device.type == "cuda"
                else "PASS when the resumed run's parameters are bitwise those of the uninterrupted run."
            ),
            "",
            "| precision | steps | resumed from | param_sha256 uninterrupted | param_sha256 killed + resumed "
            "| bitwise | final val loss (resumed) | result |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for t in trainings:
            lines.append(
                f"| {t['precision']} | {t.get('steps', '')} | {t.get('resumed_from', '')} | {t.get('full_sha', '')} | "
                f"{t.get('resumed_sha', '')} | {t.get('bitwise', '')} | {t.get('val_loss', '')} "
                f"({t.get('resumed_val_loss', '')}) | {t['status']} |"
            )
        for t in trainings:
            if t.get("note"):
                lines += ["", f"{t['precision']}:", "", "```", t["note"], "```"]
    lines.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if all(status in ("PASS", "NOT RUN", "MEASURED") for status in statuses.values()) else 1


def distributed_lines(distributed: dict | None, error: str | None, world: int, devices: int) -> list[str]:
    """Sections 4-6 of the report."""
    lines = ["", "## 4-6. The protocol, the DDP hook and a stalled peer between processes (TF32 switched on)", ""]
    if distributed is None and not error:
        return []
    if world < 2:
        lines += [
            f"NOT RUN: one rank per device, and this machine has {devices} device(s). A one-rank group exchanges "
            "no message: `all_reduce` and `ring_all_reduce` return before any round, so nothing between ranks "
            "can be proved here.",
            "",
        ]
    if distributed is not None:
        for rank, text in sorted(distributed["errors"].items()):
            lines += [f"rank {rank} failed:", "", "```", str(text)[-2000:], "```", ""]
        if "plumbing" in distributed:
            p = distributed["plumbing"]
            lines += [
                f"One rank on {distributed['backend']}: the agreement check, and the DDP hook's thread, stream and "
                f"future over {p['buckets']} buckets, each handed back unchanged: {p['status']}.",
            ]
        if "protocol" in distributed:
            lines += [
                f"Ran on {distributed['world']} ranks, {distributed['backend']}, one per device. Every rank's result "
                "against the exact sum of the ranks' inputs: CERAR's error, and its deviation from the code's "
                "exact-arithmetic result relative to ||G||_F within kappa * 2^-24 * (sqrt(c + L) + N); the exact "
                "ring's deviation within the rounding of a sum of N values, ((N-1) sqrt(N) + 1) 2^-24.",
                "",
                "| c | construction | kappa | worst error vs exact sum | rounding deviation | bound "
                "| exact ring's deviation | bound | bytes as the rate table | result |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
                *[
                    f"| {r['c']} | {r['construction']} | {r['kappa']:.3g} | {r['error']:.2e} | {r['deviation']:.2e} "
                    f"| {r['bound']:.2e} | {r['ring']:.2e} | {r['ring_bound']:.2e} | {r['bytes']} | {r['status']} |"
                    for r in distributed["protocol"]
                ],
                "",
                f"Hook (c={distributed['hook']['c']} perturbation, kappa {distributed['hook']['kappa']:.3g}): "
                f"{distributed['hook']['buckets']} buckets, worst error against the exact average "
                f"{distributed['hook']['error']:.2e}, worst rounding deviation {distributed['hook']['deviation']:.2e} "
                f"(bound {distributed['hook']['bound']:.2e}): {distributed['hook']['status']}.",
            ]
            timings = distributed.get("timings")
            if timings:
                lines += [
                    "",
                    "Median seconds per call (op=avg) on every rank's tensor; CERAR's comm is the time its compute "
                    "waited for transfers (CUDA: the stream's wait, from events), what the transfers did not hide:",
                    "",
                    "| cerar (c=2N) | of which comm | of which encode + decode | cerar.ring_all_reduce "
                    "| torch all_reduce |",
                    "| --- | --- | --- | --- | --- |",
                    f"| {timings['cerar']:.4f} | {timings['cerar_comm']:.4f} | {timings['cerar_arith']:.4f} "
                    f"| {timings['ring']:.4f} | {timings['torch']:.4f} |",
                ]
        if "stall" in distributed:
            s = distributed["stall"]
            lines += [
                "",
                f"Stall: rank {s['victim']} stopped (SIGSTOP) between two calls; timeout {s['timeout']:g} s; every "
                f"other rank must raise CollectiveError within the timeout plus {STALL_SLACK_S:g} s: {s['status']}.",
                "",
                "| rank | seconds to raise | message |",
                "| --- | --- | --- |",
                *[f"| {r} | {seconds:.2f} | {message[:300]} |" for r, message, seconds in s["rows"]],
            ]
    if error:
        lines += ["```", error[-3000:], "```"]
    return lines


if __name__ == "__main__":
    sys.exit(main())
