"""Section "throughput": one rank's encode/decode arithmetic (transfers replaced by a local copy) in
GB/s of gradient, next to the device's copy bandwidth, and how much of it runs hidden beside a
second stream's copies of the same bytes. Measured, not judged (MEASURED). Expected time on one
H200: about 40 s (full sizes: 16, 64, 256 MiB, four codes)."""

from __future__ import annotations

import time

import torch

import cerar
from cerar.coding.matrices import device_matrices
from cerar.ring.graphs import CudaGraphs
from cerar.ring.rounds import DEFAULT_STORAGE, CodedRingRank, default_pipeline_chunks, pipeline_chunks
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


def one_rank_arithmetic(code, d: int, device: torch.device, *, graph: bool | None = None, chunks: int | None = None,
                        storage: str = DEFAULT_STORAGE):  # fmt: skip
    """A callable that runs one rank's L rounds with each transfer replaced by a local copy into the receive
    buffer (one copy of m values per round and chunk), in place on a gradient of d values, as ``cerar.all_reduce``
    runs them (worker N-1's matrices; ``chunks``: as ``cerar.all_reduce``'s, default the device's).

    ``graph`` (default: on CUDA): the whole call captured once into a CUDA graph (``cerar.ring.graphs.CudaGraphs``,
    after one eager call that makes the injection row and cuBLAS's workspaces), and the callable replays it, as
    ``cerar.ring.graphs.GraphedAllReduce`` replays a real NCCL call (NCCL's point-to-point captured under torch's
    ProcessGroupNCCL: ``docs/gpus.md``, and ``captured_selfloop`` checks it); if CUDA refuses the capture, the
    eager callable comes back with the reason in its ``graph_failure``. ``graph=False``: eager, one launch per
    operation, the host's time included (what an eager ``cerar.all_reduce`` pays, its posts left out)."""
    graph = device.type == "cuda" if graph is None else graph
    matrices = device_matrices(code, code.N - 1, torch.float32, device)
    flat = torch.randn(d, device=device)
    m = code.m_for(d)
    workspace = torch.empty(CodedRingRank.workspace_numel(d, code.c, m, code.N, code.L, storage), device=device)

    def run():
        rank = CodedRingRank(matrices, flat, code.c, m, code.N, storage=storage, workspace=workspace, chunks=chunks)
        for t in range(1, code.L + 1):
            for worker in rank.workers:
                worker.while_in_flight(t)
                received = worker.receive_buffer(t)
                received.copy_(worker.message(t))
                worker.receive(t, received)
        rank.write_result(flat)

    if not graph:
        return run
    graphs = CudaGraphs()
    try:
        with cerar.full_fp32_products(device):  # the products' precision is fixed when they are captured
            graphs.eager(run, device)  # the injection row, cuBLAS's handle and workspace on the capture's stream
            captured = graphs.capture(run, device)
    except RuntimeError as error:  # a refused capture is a finding: the eager call, with the reason on it
        run.graph_failure = f"{type(error).__name__}: {error}"[:300]
        return run
    return captured.replay


def arithmetic_prediction(code, d: int, storage: str = DEFAULT_STORAGE, chunks: int = 1,
                          copy_bandwidth: float = 4.0e12) -> dict:  # fmt: skip
    """What the cost model predicts for ``one_rank_arithmetic`` (c dividing d): the arithmetic's passes over d and
    bytes read plus written (``cerar.planning.costmodel.cerar_arithmetic``), the stand-in's with its copies (m
    values read and m written per round: 2 L m in all), each one's memory-traffic bound in seconds at ``copy_bandwidth``
    (bytes read plus written per second, as ``copy_bandwidth()`` measures it: 4.0e12 on an H200), and the
    operations per call (``cerar_operations``; the stand-in adds L x chunks copies)."""
    from cerar.planning.costmodel import cerar_arithmetic, cerar_operations

    arithmetic = cerar_arithmetic(d, code.N, code.c, storage)
    moved = float(arithmetic["values_moved"]) * 4
    stand_in = moved + 2 * code.L * code.m_for(d) * 4
    operations = cerar_operations(code.N, code.c, storage, chunks)["total"]
    return {
        "passes": float(arithmetic["passes"]),
        "bytes": moved,
        "bound_s": moved / copy_bandwidth,
        "stand_in_passes": stand_in / (4 * d),
        "stand_in_bytes": stand_in,
        "stand_in_bound_s": stand_in / copy_bandwidth,
        "operations": operations,
        "stand_in_operations": operations + code.L * chunks,
    }


def captured_selfloop(N: int = 4, c: int = 8, d: int = 2**20 + 3, replays: int = 3, out: str = "") -> dict:  # noqa: ARG001
    """NCCL's point-to-point captured into a CUDA graph under torch's ProcessGroupNCCL and replayed (CUDA only):
    CERAR's rounds over N logical workers on a one-rank group's self-loop (worker i's message a self-send into
    worker i+1's receive buffer, as ``selfloop.selfloop_all_reduce``), issued through ``_Rounds`` under the
    stream-ordered contract. First eagerly (NCCL connects the self-loop), then captured with ``host_polls=False``
    and replayed ``replays`` times, each on fresh gradients copied into the workers' buffers; every result held to
    the spec's protocol (``selfloop.spec_judged``). PASS when the capture succeeds and every replay is within the
    bound; the host's seconds per eager call and per replay are reported."""
    import dataclasses

    from cerar.ring.rounds import PhaseTimer
    from cerar.ring.transport import _Ring, _Rounds
    from scripts.checks.gpu.selfloop import one_rank_group, spec_judged

    if not torch.cuda.is_available():
        return {"status": "NOT RUN", "reason": "needs CUDA"}
    device = one_rank_group()
    code = cerar.make_code(N, c, "perturbation", eps=0.05)
    m, L = code.m_for(d), code.L
    matrices = [device_matrices(code, i, torch.float32, device) for i in range(N)]
    flats = [torch.empty(d, device=device) for _ in range(N)]
    ring = _Ring.of(None, 60.0, "captured self-loop")
    captured_ring = dataclasses.replace(ring, contract=dataclasses.replace(ring.contract, host_polls=False))

    def call(on_ring) -> _Rounds:
        ranks = [CodedRingRank(matrices[i], flats[i], c, m, N, start=False) for i in range(N)]
        rounds = _Rounds(on_ring, PhaseTimer(device, enabled=False))
        for rank in ranks:
            rounds.issue(rank.start)
        chunks = range(len(ranks[0].workers))

        def post(t):
            return [
                rounds.post(ranks[i].workers[p].message(t), ranks[(i + 1) % N].workers[p].receive_buffer(t), f"{t}")
                for i in range(N)
                for p in chunks
            ]

        handles = post(1)
        for rank in ranks:
            for worker in rank.workers:
                rounds.issue(worker.while_in_flight, 1)
        for t in range(1, L + 1):
            for handle in handles:  # every post of the round arrives before any worker reads its buffer
                rounds.arrive(handle, f"round {t}/{L}")
            for rank in ranks:
                for worker in rank.workers:
                    rounds.issue(worker.receive, t, worker.receive_buffer(t))
            if t < L:
                handles = post(t + 1)
                for rank in ranks:
                    for worker in rank.workers:
                        rounds.issue(worker.while_in_flight, t + 1)
        for rank in ranks:
            rounds.issue(rank.write_result, rank.flat)
        return rounds

    def gradients(seed):
        G = torch.randn(N, d, generator=torch.Generator().manual_seed(seed))
        for i in range(N):
            flats[i].copy_(G[i])
        return G

    results, graphs = [], CudaGraphs()
    with torch.no_grad(), cerar.full_fp32_products(device):
        G = gradients(0)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        graphs.eager(lambda: call(ring).finish(), device)  # on the stream the capture uses
        eager_s = time.perf_counter() - start
        results.append(spec_judged(torch.stack([f.cpu() for f in flats]), G, code))
        torch.cuda.synchronize(device)
        try:
            graph = graphs.capture(lambda: call(captured_ring), device)
        except Exception as error:  # noqa: BLE001  the finding: what torch or NCCL refused, in one line
            return {"status": "FAIL", "reason": f"capture failed: {type(error).__name__}: {error}"[:400]}
        replay_s = []
        for k in range(1, replays + 1):
            G = gradients(k)
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            graph.replay()
            replay_s.append(time.perf_counter() - start)
            torch.cuda.synchronize(device)
            results.append(spec_judged(torch.stack([f.cpu() for f in flats]), G, code))
    ok = all(r["ok"] for r in results)
    worst = max(r["spec_deviation"] for r in results)
    return {
        "status": "PASS" if ok else "FAIL",
        "N": N,
        "c": c,
        "d": d,
        "posts_per_call": N * L * len(pipeline_chunks(m, default_pipeline_chunks(device))),
        "eager_host_s": eager_s,
        "replay_host_s": replay_s,
        "spec_deviation": worst,
        "bound": results[0]["bound"],
        "reason": "" if ok else f"a replay deviates from the spec by {worst:.2e} (bound {results[0]['bound']:.2e})",
    }


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
