"""Section "hierarchical": ``cerar.hierarchical_all_reduce`` on four ranks, one per GPU, as two
nodes of two (``NodeLayout(nodes=2, local_size=2)``): the exact reduce-scatter inside each node,
CERAR between the nodes on each rail (``coded_on_two_nodes=True``: on two nodes the call would
otherwise run the exact ring there), the all-gather inside each node; and
``cerar.hierarchical_ring_all_reduce`` on the same layout.

Judged against the exact arithmetic: node k's sum of its ranks' gradients, S_k, is what the code
carries; rail s reduces shard s of (S_0, S_1) with node k as worker k, so every rank of node k
must hold, shard by shard, the exact-arithmetic result of worker k (``judge.
exact_arithmetic_results``) within sqrt(G) x ``cerar.ring.precision.rounding_bound`` (relative to the
coded inputs, whose norm is at most sqrt(G) ||G||_F) plus ``sum_rounding_bound(G)`` for the sum
inside a node, both relative to the Frobenius norm of all ranks' gradients; the exact ring's within
``sum_rounding_bound(4)``. Needs four GPUs; 2 x 2 whatever their number. Expected time on four
H200s: about 40 s."""

from __future__ import annotations

import io
import math
import queue
import time
import traceback
from datetime import timedelta

import torch

import cerar
from scripts.checks.gpu.cases import FAIL, PASS, Case, Context, Needs
from scripts.checks.gpu.judge import exact_arithmetic_results, judge_sum

SECTION = "hierarchical"
QUICK = False
EXPECTED_S = 40
NODES, LOCAL = 2, 2
PROVES = {
    "2 x 2": "cerar.hierarchical_all_reduce and hierarchical_ring_all_reduce on two nodes of two GPUs, every "
    "rank's result within the rounding bound of the exact arithmetic"
}


def cases(ctx: Context) -> list[Case]:
    d = 2 * (4096 + 1) if ctx.small else 2 * (2**19 + 1)
    return [Case(SECTION, "2 x 2", "hierarchical:run", {"device": ctx.device, "d": d}, 300, Needs(ranks=NODES * LOCAL))]


def _code() -> cerar.Code:
    return cerar.make_code(NODES, 2 * NODES, "perturbation", eps=0.05)


def _gradients(d: int) -> torch.Tensor:
    return torch.randn(NODES * LOCAL, d, generator=torch.Generator().manual_seed(22))


def _rank(rank: int, world: int, port: int, backend: str, d: int, results) -> None:
    import torch.distributed as dist

    from cerar.hierarchical import NodeLayout, hierarchical_all_reduce, hierarchical_ring_all_reduce

    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("gpu-check-hier/", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
            device_id=device if device.type == "cuda" else None,
        )
        layout = NodeLayout(nodes=NODES, local_size=LOCAL)
        G = _gradients(d)
        coded = G[rank].clone().to(device)
        stats = hierarchical_all_reduce(coded, _code(), layout, coded_on_two_nodes=True, timeout=60)
        exact = G[rank].clone().to(device)
        hierarchical_ring_all_reduce(exact, layout, timeout=60)
        buffer = io.BytesIO()
        torch.save({"coded": coded.cpu(), "exact": exact.cpu(), "method": stats.inter_node_method}, buffer)
        results.put((rank, "ok", buffer.getvalue()))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def judge(coded: torch.Tensor, exact: torch.Tensor, G: torch.Tensor, code: cerar.Code) -> dict:
    """Every rank's results [4, d] against the exact arithmetic of the two tiers (module docstring)."""
    d = G.shape[1]
    shard = d // LOCAL
    sums = G.double().view(NODES, LOCAL, d).sum(1)  # S_k, node k's exact sum
    per_node = torch.cat(
        [exact_arithmetic_results(sums[:, s * shard : (s + 1) * shard], code) for s in range(LOCAL)], dim=1
    )
    expected = per_node.repeat_interleave(LOCAL, dim=0)  # rank r is on node r // LOCAL
    size = G.double().norm()
    deviation = ((coded.double() - expected).norm(dim=1) / size).max().item()
    bound = math.sqrt(LOCAL) * cerar.ring.precision.rounding_bound(
        code, torch.float32
    ) + cerar.ring.precision.sum_rounding_bound(LOCAL, torch.float32)
    S = G.double().sum(0)
    error = ((coded.double() - S).norm(dim=1) / S.norm()).max().item()
    ring = judge_sum(exact, G, torch.float32)
    ok = bool(torch.isfinite(coded).all()) and deviation <= bound and ring["ok"]
    return {"deviation": deviation, "bound": bound, "error": error, "ring": ring["deviation"],
            "ring_bound": ring["bound"], "ok": ok}  # fmt: skip


def run(device: str, d: int, out: str) -> dict:  # noqa: ARG001
    from scripts.checks.gpu.cases import start_ranks

    world = NODES * LOCAL
    backend = "nccl" if device == "cuda" else "gloo"
    processes, results, store = start_ranks(_rank, world, (backend, d))  # store: held until the ranks end
    collected, errors = {}, {}
    deadline = time.monotonic() + 240
    try:
        while len(collected) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if status == "ok":
                collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value[-2000:]
                break
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    if len(collected) < world:
        return {
            "status": FAIL,
            "reason": f"ranks {sorted(set(range(world)) - set(collected))} failed",
            "errors": errors,
        }
    code = _code()
    judged = judge(
        torch.stack([collected[r]["coded"] for r in range(world)]),
        torch.stack([collected[r]["exact"] for r in range(world)]),
        _gradients(d),
        code,
    )
    methods = {collected[r]["method"] for r in range(world)}
    ok = judged["ok"] and methods == {"cerar"}
    return {
        **judged,
        "methods": sorted(methods),
        "c": code.c,
        "kappa": code.kappa,
        "d": d,
        "status": PASS if ok else FAIL,
        "reason": "" if ok else f"deviation {judged['deviation']:.2e} (bound {judged['bound']:.2e}), methods {methods}",
    }


def report(results) -> list[str]:
    lines = []
    for r in results:
        v = r.value or {}
        for rank, text in sorted(v.get("errors", {}).items()):
            lines += [f"rank {rank} failed:", "", "```", text, "```", ""]
        if "deviation" in v:
            lines += [
                f"2 x 2, d = {v['d']}, between the nodes c = {v['c']} perturbation (kappa {v['kappa']:.3g}), method "
                f"{', '.join(v['methods'])}: worst error against the exact sum {v['error']:.2e}; deviation from the "
                f"exact arithmetic of the two tiers {v['deviation']:.2e} (bound {v['bound']:.2e}); the hierarchical "
                f"exact ring's deviation {v['ring']:.2e} (bound {v['ring_bound']:.2e}): {r.status}.",
                "",
            ]
    return lines
