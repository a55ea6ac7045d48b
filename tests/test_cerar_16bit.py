"""CERAR and the exact collectives over 16-bit messages (``transport=``, ``cerar.formats.wire``), held to
references independent of the code under test, with bounds derived here from the formats.

What the bounds come from (u16 = 2^-11 for float16, 2^-8 for bfloat16; u32 = 2^-24):

- one cast of a message block moves each value x by at most u16 |x| (the block's power-of-two scale
  puts its largest value in [2^14, 2^15), so nothing overflows and every value above 2^-29 of the
  largest keeps fp16's relative precision; the values below move by at most 2^-39 of the largest);
- the exact ring: a value passes N - 1 casts of partial sums and one cast of the complete sum (by its
  owner, which keeps what it sends, so every rank holds the same bits), each partial sum at most
  sum_j |g_j| in size: |result - sum| <= (N u16 + (N - 1) u32) sum_j |g_j| per value, to first order;
  the two-tier hierarchy: (G - 1) + (n - 1) + 2 casts, N of them on 2 x 2;
- CERAR: each of the messages a worker decodes carries at most N - 1 casts (of its partial sums) and
  its float32 products sqrt(c + L) roundings; the decode amplifies both by at most kappa:
  ||result_i - spec_i|| <= kappa (N u16 + sqrt(c + L) u32) ||G||_F against the spec's protocol in
  float64 (``tests/spec_reference.py``). The code is chosen with a truncation error (0.55) twenty
  times that bound on fp16 (2.7 times on bf16), so a result that were the exact sum would fail it.

Bytes on the wire are counted by the transport log (what was handed to ``batch_isend_irecv``) and
held to the formula: element size x (values + one scale value per message).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import cerar
from cerar.formats.wire import Wire
from cerar.hierarchical import (
    HierarchicalHookState,
    NodeLayout,
    hierarchical_all_reduce,
    hierarchical_ring_all_reduce,
)
from cerar.ring.precision import admissible_kappa, check_admissible
from tests.distributed import run_workers
from tests.nccl_emulation import transport_log
from tests.spec_reference import spec_all_reduce, spec_matrices
from tests.test_hierarchical import node_sums_of_shards, spec_hierarchical

U = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
U32 = 2.0**-24
SIZES = {"float16": 2, "bfloat16": 2}
N, D = 4, 3001
SCALES = (1.0, 1e-7, 1e6)  # below fp16's normal range (6.1e-5) and above its largest value (65504)


def gradients(N: int, d: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Every rank's tensor, identical in every process: row r belongs to rank r."""
    G = torch.randn(N, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (G * scale).to(torch.float32)


def coded() -> cerar.Code:
    """A code whose truncation error (0.55) is far above its rounding on either 16-bit wire."""
    return cerar.make_code(N, 8, "perturbation", eps=0.9)


def sent(log_before: dict) -> int:
    return transport_log()["bytes_isend"] - log_before["bytes_isend"]


# --- the workers ---------------------------------------------------------------------------------


def _flat_worker(rank, world_size, transports):
    code = coded()
    out = {}
    for transport in transports:
        for k, scale in enumerate(SCALES):
            X = gradients(world_size, D, seed=k, scale=scale)
            x, before = X[rank].clone(), dict(transport_log())
            stats = cerar.ring_all_reduce(x, transport=transport, timeout=60)
            out[("ring", transport, scale)] = (x, stats.bytes_sent, sent(before))
        X = gradients(world_size, D, seed=7)
        x, before = X[rank].clone(), dict(transport_log())
        stats = cerar.all_reduce(x, code, transport=transport, timeout=60)
        out[("cerar", transport)] = (x, stats.bytes_sent, sent(before))
        x = X[rank].clone()
        x[rank * 100] = math.inf if rank == 1 else x[rank * 100]  # an overflowed fp16 step stays non-finite
        cerar.ring_all_reduce(x, transport=transport, timeout=60)
        out[("inf", transport)] = bool(torch.isfinite(x).all())
    return out


def _hierarchy_worker(rank, world_size, transport):
    from cerar.ddp import CerarHookState

    layout = NodeLayout(2, 2)
    rail_code = cerar.make_code(2, 4, "perturbation", eps=0.9)
    X = gradients(world_size, D, seed=11)
    out = {}
    x, before = X[rank].clone(), dict(transport_log())
    stats = hierarchical_ring_all_reduce(x, layout, transport=transport, timeout=60)
    out["hier_ring"] = (x, stats.intra_node.bytes_sent, stats.inter_node.bytes_sent, sent(before), stats.exact)
    x = X[rank].clone()
    stats = hierarchical_all_reduce(x, rail_code, layout, transport=transport, timeout=60, coded_on_two_nodes=True)
    out["hier_cerar"] = (x, stats.intra_node.bytes_sent, stats.inter_node.bytes_sent)
    # the DDP hooks' path: the states' own groups and thread, a bucket submitted as DDP submits it
    flat_hook = CerarHookState(construction="perturbation", c=8, eps=0.9, timeout=60, transport_dtype=transport)
    x = X[rank].clone()
    flat_hook.submit(x).wait()
    out["hook"] = (x, flat_hook.last_stats[0].bytes_sent)
    hier_hook = HierarchicalHookState(exact_ring=True, timeout=60, layout=layout, transport_dtype=transport)
    x = X[rank].clone()
    hier_hook.submit(x).wait()
    out["hier_hook"] = (x, hier_hook.last_stats[0].bytes_sent)
    return out


def _disagreeing_worker(rank, world_size):
    """Rank 2 asks for float16 messages, the others for float32: every rank must refuse, naming it."""
    errors = []
    for call in (
        lambda x, t: cerar.ring_all_reduce(x, transport=t, timeout=30),
        lambda x, t: cerar.all_reduce(
            x, cerar.make_code(world_size, 4, "perturbation", eps=0.5), transport=t, timeout=30
        ),
    ):
        try:
            call(torch.ones(64), "float16" if rank == 2 else "float32")
            errors.append(None)
        except cerar.CollectiveError as error:
            errors.append(str(error))
    return errors


# --- what the results are held to ------------------------------------------------------------------


def assert_within_casts(result: torch.Tensor, X: torch.Tensor, casts: int, transport: str, label) -> None:
    """|result - sum| <= (casts u16 + (N - 1) u32) sum_j |x_j| per value (first order; 1 % slack), plus
    the scale floor: casts x 2^-38 of the largest partial sum."""
    exact, absolute = X.double().sum(0), X.double().abs().sum(0)
    allowed = 1.01 * (casts * U[transport] + (X.shape[0] - 1) * U32) * absolute + casts * 2.0**-38 * absolute.max()
    excess = (result.double() - exact).abs() - allowed
    assert excess.max() <= 0, (label, float(excess.max()), float(allowed.max()))


def cerar_bound(code: cerar.Code, transport: str) -> float:
    """kappa (N u16 + sqrt(c + L) u32), relative to ||G||_F (module docstring)."""
    return max(code.kappa, 1.0) * (code.N * U[transport] + math.sqrt(code.c + code.L) * U32)


def check_flat(results, transports) -> None:
    code = coded()
    A, Dm = spec_matrices(code.points, N)
    m = -(-D // code.c)
    for transport in transports:
        for k, scale in enumerate(SCALES):
            X = gradients(N, D, seed=k, scale=scale)
            label = ("ring", transport, scale)
            first = results[0][label][0]
            for r in range(N):
                x, reported, counted = results[r][label]
                assert torch.equal(x, first), label  # the owner keeps what it sends: the same bits everywhere
                assert_within_casts(x, X, N, transport, label)
                assert reported == counted == 2 * (N - 1) * (-(-D // N) + 1) * SIZES[transport], label
        X = gradients(N, D, seed=7)
        G = X.double().numpy()
        reference, truth = spec_all_reduce(G, A, Dm), G.sum(0)
        allowed = cerar_bound(code, transport) * np.linalg.norm(G)
        for r in range(N):
            x, reported, counted = results[r][("cerar", transport)]
            gap = np.linalg.norm(x.double().numpy() - reference[r])
            assert gap <= allowed, (transport, r, gap, allowed)
            assert reported == counted == code.L * (m + 1) * SIZES[transport], (transport, r)
        worst = max(np.linalg.norm(results[r][("cerar", transport)][0].double().numpy() - truth) for r in range(N))
        assert worst > 2 * allowed, (transport, worst, allowed)  # the exact sum would fail this test
        assert not any(results[r][("inf", transport)] for r in range(N)), transport


@pytest.mark.parametrize("contract", ["gloo", "nccl"])
def test_flat_16bit_messages_against_the_spec_and_the_format(contract):
    """ring_all_reduce and all_reduce on float16 and bfloat16 messages, under gloo's contract and NCCL's
    (emulated): the spec's protocol in float64 within kappa (N u16 + sqrt(c+L) u32) ||G||, the exact ring
    within N casts per value at gradients of size 1, 1e-7 and 1e6, every rank the same bits, bytes equal
    to the formula, an inf carried through. bfloat16 under gloo's contract only: the contracts differ in how
    rounds are waited for, not in what travels."""
    transports = ("float16", "bfloat16") if contract == "gloo" else ("float16",)
    check_flat(run_workers(_flat_worker, N, args=(transports,), contract=contract), transports)


@pytest.mark.parametrize("contract", ["gloo", "nccl"])
def test_16bit_hierarchy_both_tiers_and_the_ddp_hooks(contract):
    """hierarchical_ring_all_reduce (the 16-bit exact hierarchy) and hierarchical_all_reduce (CERAR on the
    rail) with float16 on both tiers of 2 x 2, and the flat and hierarchical DDP hooks' path: results
    held to the float64 sum / the spec on the node sums with bounds from the format, bytes per tier
    equal to the formula."""
    transport = "float16"
    results = run_workers(_hierarchy_worker, N, args=(transport,), contract=contract)
    X = gradients(N, D, seed=11)
    size, s = SIZES[transport], -(-D // 2)
    intra, rail = 2 * (s + 1) * size, 2 * (-(-s // 2) + 1) * size  # G = n = 2: one step each way per tier
    for r in range(N):
        x, intra_sent, rail_sent, counted, exact = results[r]["hier_ring"]
        assert torch.equal(x, results[0]["hier_ring"][0]) and not exact
        assert_within_casts(x, X, N, transport, "hier_ring")  # (G-1) + (n-1) + 2 = 4 casts
        assert (intra_sent, rail_sent, counted) == (intra, rail, intra + rail)
        x, hook_sent = results[r]["hier_hook"]  # the hook averages: the same casts, divisions in float32
        assert torch.equal(x, results[0]["hier_hook"][0]) and hook_sent == intra + rail
        assert_within_casts(x, X.double() / N, N, transport, "hier_hook")
    # CERAR on the rail: node i holds the spec's worker i on the node sums, within the rail's rounding
    # (kappa (n u16 + sqrt(c+L) u32) ||node sums||), the node sums' (G - 1) casts (amplified by |a^n| < 2)
    # and the all-gather's cast of the result
    rail_code = cerar.make_code(2, 4, "perturbation", eps=0.9)
    G = X.double().numpy()
    reference = spec_hierarchical(G, 2, 2, rail_code)
    node_sums, absolute = node_sums_of_shards(G, 2, 2), node_sums_of_shards(np.abs(G), 2, 2)
    for r in range(N):
        x, intra_sent, rail_sent = results[r]["hier_cerar"]
        assert torch.equal(x, results[r // 2 * 2]["hier_cerar"][0])  # the all-gather's owner keeps what it sends
        allowed = (
            cerar_bound(rail_code, transport) * np.linalg.norm(node_sums)
            + 2 * (U[transport] + U32) * np.linalg.norm(absolute, axis=(0, 2)).sum()
            + U[transport] * np.linalg.norm(reference[r // 2])
        )
        gap = np.linalg.norm(x.double().numpy() - reference[r // 2])
        assert gap <= allowed, (r, gap, allowed)
        if r // 2 == 0:  # node 0 carries the code's error (node n-1 decodes exactly): the exact sum would fail
            assert np.linalg.norm(x.double().numpy() - G.sum(0)) > 2 * allowed
        assert intra_sent == intra and rail_sent == rail_code.L * (-(-s // rail_code.c) + 1) * size
    code = coded()
    A, Dm = spec_matrices(code.points, N)
    reference = spec_all_reduce(G, A, Dm) / N  # the hook averages
    for r in range(N):
        x, hook_sent = results[r]["hook"]
        gap = np.linalg.norm(x.double().numpy() - reference[r])
        assert gap <= cerar_bound(code, transport) * np.linalg.norm(G) / N + 2 * U32 * np.linalg.norm(reference[r])
        assert hook_sent == code.L * (-(-D // code.c) + 1) * size


def test_ranks_that_disagree_on_the_transport_are_refused_on_every_rank():
    errors = run_workers(_disagreeing_worker, 3, timeout_s=60)
    for rank_errors in errors:
        assert all(e is not None and "ranks disagree on transport" in e for e in rank_errors), rank_errors


# --- in one process --------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("transport", ["float16", "bfloat16"])
def test_the_scale_keeps_tiny_and_huge_blocks_within_the_format(transport):
    """Blocks of size ~1e-7 (below fp16's normal range) and ~1e6 (above its largest value, 65504) come
    back within u16 of every value; the same blocks cast without the scale do not (fp16)."""
    wire = Wire(transport)
    base = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    for scale in (1e-7, 1e6, 1.0):
        block = base * scale
        message = wire.empty(block.numel(), block)
        wire.encode(block, message)
        back = torch.empty_like(block)
        wire.decode(message, back)
        allowed = U[transport] * block.abs() + 2.0**-39 * block.abs().max()
        assert ((back - block).abs() <= allowed).all(), (transport, scale)
        assert message.numel() == block.numel() + 1 and message.dtype == wire.dtype  # one scale value per message
        unscaled = block.to(wire.dtype).float()
        if transport == "float16" and scale != 1.0:
            assert not ((unscaled - block).abs() <= allowed).all(), scale  # what the scale is for


@pytest.mark.quick
def test_the_admissible_kappa_follows_from_the_rounding_and_the_code_error():
    """The rule: a code is admitted on a 16-bit wire iff it is exact (c <= N) or the rounding its messages add
    on Gaussian gradients, kappa r, is at most max(its predicted error, the exact ring's rounding on that wire
    on the same gradients). Both roundings are measured here with a 16-bit wire written in the test, not taken
    from the package: the code's on the spec's protocol in float64 (tests/test_wire_rounding.py), the ring's on
    float64 sums (tests/test_precision.py, which pins the package's model of it); a refusal names N, c, kappa,
    the dtype and the largest admissible kappa."""
    from tests.test_precision import spec_ring_rounding
    from tests.test_wire_rounding import spec_rounding

    cases = [
        cerar.make_code(4, 5, "optimized", kappa_max=20.0),
        cerar.make_code(4, 8, "optimized", kappa_max=20.0),
        cerar.make_code(4, 8, "optimized", kappa_max=200.0),
        cerar.make_code(4, 5, "perturbation", kappa_max=1e4),
        cerar.make_code(4, 4, "perturbation"),
        cerar.make_code(8, 8, "exact"),
    ]
    verdicts = set()
    for code in cases:
        for name, wire in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
            ring = spec_ring_rounding(code.N, wire)
            rounding = 0.0 if code.is_exact else spec_rounding(code, wire)
            allowed = max(code.predicted_error(), ring)
            assert code.is_exact or not 0.8 < rounding / allowed < 1.25, "too close to the edge to judge"
            admitted = code.is_exact or rounding <= allowed
            verdicts.add(admitted)
            if admitted:
                check_admissible(code, torch.float32, wire)
                assert admissible_kappa(code, torch.float32, wire) >= code.kappa
            else:
                with pytest.raises(ValueError) as refusal:
                    check_admissible(code, torch.float32, wire)
                text = str(refusal.value)
                assert f"N={code.N}, c={code.c}" in text and name in text and f"kappa={code.kappa:.3g}" in text
                limit = admissible_kappa(code, torch.float32, wire)
                assert f"largest admissible kappa for this code is {limit:.3g}" in text
                assert 0.75 <= limit / (allowed / (rounding / max(code.kappa, 1.0))) <= 1.33
    assert verdicts == {True, False}
    # the default 16-bit budget is admitted at the trainer's shapes (N = 4, c = 5 and 8) on fp16
    for c in (5, 8):
        check_admissible(
            cerar.make_code(4, c, "optimized", kappa_max=cerar.default_kappa_max("float16")),
            torch.float32,
            torch.float16,
        )


@pytest.mark.quick
def test_a_16bit_transport_needs_a_float32_tensor_and_a_known_dtype():
    with pytest.raises(ValueError, match="transport must be one of"):
        cerar.ring_all_reduce(torch.ones(4), transport="float8")
    with pytest.raises(ValueError, match="carries float32 tensors"):
        cerar.ring_all_reduce(torch.ones(4, dtype=torch.float64), transport="float16")


def test_the_trainer_takes_a_16bit_transport_and_refuses_a_bad_one_before_any_group():
    """aggregator.transport is validated with the config: a typo, a kind that does not take it, c=auto, and a
    code the rule refuses each stop the run naming the field; the presets are hier_ring on 16 bits."""
    from tests.runs import composed
    from train.config import ConfigError, validate

    for overrides, named in [
        (("aggregator=cerar", "aggregator.transport=float8", "c=5"), "aggregator.transport"),
        (("aggregator=nccl", "aggregator.transport=float16"), "aggregator.transport=float16 is for"),
        (("aggregator=cerar", "aggregator.transport=float16", "c=auto"), "c=auto"),
        (("aggregator=cerar", "aggregator.transport=float16", "c=5", "aggregator.kappa_max=1e4"), "not admissible"),
    ]:
        with pytest.raises(ConfigError, match=named):
            validate(composed(*overrides), world_size=4)
    validate(composed("aggregator=cerar", "aggregator.transport=float16", "c=5"), world_size=4)
    # float32, the default, stays out of a run's identity, so runs from before the field resume unchanged
    from train.config import training_identity

    assert "aggregator.transport" not in training_identity(composed("aggregator=cerar", "c=5"), 4)
    sixteen = training_identity(composed("aggregator=cerar", "aggregator.transport=float16", "c=5"), 4)
    assert sixteen["aggregator.transport"] == "float16"
    for preset, transport in (("hier_fp16", "float16"), ("hier_bf16", "bfloat16")):
        a = composed(f"aggregator={preset}").aggregator
        assert (a.kind, a.transport) == ("hier_ring", transport)
