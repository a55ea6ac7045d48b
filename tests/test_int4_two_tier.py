"""The two-tier 8/4 all-reduce (cerar.int4.two_tier) and the 4-bit DDP hooks (cerar.int4.hook) against the float64
oracle of tests/test_int4_all_reduce.py.

Two tiers on N = n G ranks: shard l (s = ceil(d/G) values of the zero-padded tensor) is reduced inside each node,
then all-reduced over rail l with 4 bits, the nodes' values as the n contributions, then all-gathered exactly. Inside
the node the sum is exact (float32: G u of the summed magnitudes) or 8-bit: local rank l adds the G - 1 other ranks'
shard l rounded once to 8 bits (blocks of B8 from the shard's start, step absmax / 127, at most k steps each, k = 1
stochastic, 1/2 nearest), so the node's mean moves by at most sum_{g != l} k step8_g / G per value. The oracle takes
that move as its spread: the rail's contributions may lie that far from the exact node means, which widens each
block's step (a rotated block's absmax by the sum of its values' moves) and adds the mean move to the bound.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cerar.planning.costmodel import two_tier_features
from tests.distributed import run_workers
from tests.test_int4_all_reduce import U, check_against_oracle, gradient_like

SIZES = (3, 389, 4099)
B, B8, SEED = 32, 16, 5


def int8_moves(v: np.ndarray, k: float) -> np.ndarray:
    """Per value of a shard v, the most its 8-bit rounding moves it: k absmax / 127 of its block (blocks of B8 from
    the shard's first value), widened by float32's rounding (the 8-bit format's bound, 2^-24 of 128 steps, twice)."""
    out = np.empty(v.size)
    for lo in range(0, v.size, B8):
        out[lo : lo + B8] = np.abs(v[lo : lo + B8]).max() / 127 * (k + 4 * 128 * U)
    return out


def check_two_tiers(out: torch.Tensor, per_rank: torch.Tensor, G: int, intra: str, rounding: str, label: str):
    """Each shard l held to the rail's oracle with the nodes' means as contributions, spread by the tier inside."""
    N, d = per_rank.shape
    n = N // G
    s = math.ceil(d / G)
    padded = np.zeros((N, G * s))
    padded[:, :d] = per_rank.double().numpy()
    k = 0.5 if rounding == "nearest" else 1.0
    for l in range(G):
        where = slice(l * s, min(d, (l + 1) * s))
        if where.start >= where.stop:
            continue
        shard = padded[:, l * s : (l + 1) * s].reshape(n, G, s)
        node_means = shard.mean(axis=1)
        spread = 2 * G * U * np.abs(shard).sum(axis=1) / G  # float32's sums inside the node
        if intra == "int8":
            spread += sum(int8_moves(shard[:, g, :].reshape(-1), k).reshape(n, s) for g in range(G) if g != l) / G
        width = where.stop - where.start
        check_against_oracle(out[where], torch.from_numpy(node_means[:, :width]), B, rounding, True, SEED,
                             f"{label} shard {l}", spread[:, :width])  # fmt: skip


def check_8_bit_node(results, N: int, rounding: str) -> None:
    """One node of N ranks, 8 bits inside: every value within sum_{g != l} k step8_g / N of the mean (plus float32's
    sums), and the squared error at least a quarter of uniform rounding's, sum_{g != l} step8_g^2 t / N^2 (a 4-bit
    tier inside, 18x coarser, fails the bound; an exact one the error's floor)."""
    out = results[0]["one node"]
    assert all(torch.equal(out, r["one node"]) for r in results)
    per_rank = torch.stack([gradient_like(r, 4099) for r in range(N)]).double().numpy()
    s = math.ceil(4099 / N)
    padded = np.zeros((N, N * s))
    padded[:, :4099] = per_rank
    k, t = (0.5, 1 / 12) if rounding == "nearest" else (1.0, 1 / 6)
    bound, typical = np.zeros(N * s), 0.0
    for l in range(N):
        shard = padded[:, l * s : (l + 1) * s]
        moves = [int8_moves(shard[g], k) for g in range(N) if g != l]
        bound[l * s : (l + 1) * s] = sum(moves) / N + 2 * N * U * np.abs(shard).sum(axis=0) / N
        typical += float(sum((m / (k + 4 * 128 * U)) ** 2 for m in moves).sum()) * t / N**2
    error = np.abs(out.double().numpy() - per_rank.mean(axis=0))
    assert np.all(error <= bound[:4099]), float((error - bound[:4099]).max())
    assert error @ error >= 0.25 * typical, (error @ error, typical)


def _two_tier_worker(rank, N, intra, rounding, with_hooks):
    from cerar.hierarchical import NodeLayout
    from cerar.int4.two_tier import hierarchical_int4_all_reduce, hierarchical_int4_bytes
    from tests.nccl_emulation import transport_log

    layout = NodeLayout(nodes=2, local_size=N // 2)

    def call(x):
        return hierarchical_int4_all_reduce(x, layout, op="avg", timeout=30, block=B, intra=intra, intra_block=B8,
                                            rounding=rounding, rotate=True, seed=SEED)  # fmt: skip

    results = {}
    for d in SIZES:
        x = gradient_like(rank, d)
        before = transport_log()["bytes_isend"]
        stats = call(x)
        tiers = {"intra_node": stats.intra_node.bytes_sent, "inter_node": stats.inter_node.bytes_sent}
        on_wire = transport_log()["bytes_isend"] - before
        results[d] = (x, tiers, on_wire, hierarchical_int4_bytes(d, layout, B, intra, B8))
    half = gradient_like(rank, 256)
    twice = torch.cat([half, half])  # both rails reduce the same values: their dithers must still differ
    call(twice)
    results["rails"] = twice
    if intra == "int8":  # one node of N ranks: the 8-bit reduce-scatter and the exact all-gather alone
        x = gradient_like(rank, 4099)
        hierarchical_int4_all_reduce(x, NodeLayout(nodes=1, local_size=N), timeout=30, block=B, intra="int8",
                                     intra_block=B8, rounding=rounding, seed=SEED)  # fmt: skip
        results["one node"] = x
    if with_hooks:
        results["hooks"] = _ddp_steps(rank, layout)
    return results


def _ddp_steps(rank, layout):
    """One backward through DDP with each 4-bit hook: the averaged gradients (flat, then two tiers)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from cerar.int4.hook import HierarchicalInt4HookState, Int4HookState, hierarchical_int4_hook, int4_hook

    grads = []
    for state, hook in (
        (Int4HookState(timeout=30, block=B, seed=SEED), int4_hook),
        (HierarchicalInt4HookState(timeout=30, block=B, seed=SEED, layout=layout, intra="int8", intra_block=B8),
         hierarchical_int4_hook),
    ):  # fmt: skip
        torch.manual_seed(0)
        model = torch.nn.Linear(37, 29, bias=False)  # one parameter: the bucket is its gradient
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(state, hook)
        ddp(gradient_like(rank, 5 * 37).view(5, 37)).square().sum().backward()
        dist.barrier()
        grads.append(model.weight.grad.clone())
    return grads


def _local_gradient(rank):
    torch.manual_seed(0)
    model = torch.nn.Linear(37, 29, bias=False)
    model(gradient_like(rank, 5 * 37).view(5, 37)).square().sum().backward()
    return model.weight.grad.reshape(-1)


@pytest.mark.parametrize(
    ("contract", "intra", "rounding"), [("gloo", "int8", "stochastic"), ("nccl", "exact", "nearest")]
)
def test_two_tiers_2x2_are_within_the_bound_the_same_on_every_rank_and_send_the_formula(contract, intra, rounding):
    N, G = 4, 2
    with_hooks = contract == "gloo"
    results = run_workers(_two_tier_worker, N, args=(intra, rounding, with_hooks), contract=contract, timeout_s=150)
    for d in SIZES:
        outs = [r[d][0] for r in results]
        assert all(torch.equal(outs[0], o) for o in outs), (d, "ranks differ")
        per_rank = torch.stack([gradient_like(r, d) for r in range(N)])
        check_two_tiers(outs[0], per_rank, G, intra, rounding, f"{contract} {intra} d={d}")
        s = math.ceil(d / G)
        s_rail = math.ceil(s / 2)
        inside = (G - 1) * (s + 4 * math.ceil(s / B8)) + (G - 1) * s * 4 if intra == "int8" else 2 * (G - 1) * s * 4
        between = 2 * (2 - 1) * (math.ceil(s_rail / 2) + 4 * math.ceil(s_rail / B))
        formula = {"intra_node": inside, "inter_node": between}
        for r in results:
            assert r[d][1] == r[d][3] == formula and r[d][2] == sum(formula.values()), (d, r[d][1:], formula)
        priced = two_tier_features("hier_int4", d, 2, G, nics_per_node=G, block=B, intra=intra, intra_block=B8)
        assert (priced[1], priced[3]) == (inside, between), (d, priced)  # the cost model's count, one NIC a rail
    if intra == "int8":
        check_8_bit_node(results, N, rounding)
    rails = results[0]["rails"]
    assert all(torch.equal(rails, r["rails"]) for r in results)
    if rounding == "stochastic":  # the rails' messages are keyed by their senders' global ranks
        assert not torch.equal(rails[:256], rails[256:])
    if with_hooks:
        flat, two_tiers = results[0]["hooks"]
        assert all(torch.equal(flat, r["hooks"][0]) and torch.equal(two_tiers, r["hooks"][1]) for r in results)
        per_rank = torch.stack([_local_gradient(r) for r in range(N)])
        check_against_oracle(flat.reshape(-1), per_rank, B, "stochastic", True, SEED, "flat hook")
        check_two_tiers(two_tiers.reshape(-1), per_rank, G, "int8", "stochastic", "two-tier hook")


def test_bad_intra_methods_are_refused_before_any_collective():
    from cerar.int4.two_tier import hierarchical_int4_all_reduce

    with pytest.raises(ValueError, match="intra must be one of"):
        hierarchical_int4_all_reduce(torch.ones(8), intra="int4")
    with pytest.raises(ValueError, match="block must be an integer >= 1"):
        hierarchical_int4_all_reduce(torch.ones(8), intra="int8", intra_block=0)
