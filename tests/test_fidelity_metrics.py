"""The diagnostics that tell whether approximate aggregation trains like exact all-reduce.

Under CERAR only rank N-1, the reference replica, receives the exact average; the other replicas
drift. These tests hold the loop's measurements to things computed independently of it: the
noise of a mean of draws from a known distribution, a perturbation of known size, gradients from
plain autograd, and the validation loss of the reference replica's checkpoint evaluated in the test.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.distributed import run_workers
from tests.runs import MATRIX, WORLDS


def _noise_worker(rank, world_size, d, sigma, delta):
    from train.loop import error_and_noise

    generator = torch.Generator().manual_seed(100 + rank)
    mu = torch.linspace(-1.0, 1.0, d, dtype=torch.float64)  # the expected gradient, known to the test
    local = mu + sigma * torch.randn(d, generator=generator, dtype=torch.float64)
    exact = local.clone()
    torch.distributed.all_reduce(exact)
    exact /= world_size
    aggregated = exact.clone()
    if rank == 0:  # a perturbation of known size on one rank only: the worst rank's error
        aggregated[0] += delta
    return error_and_noise(local, aggregated, exact, rank), float(exact.norm())


def test_noise_estimate_matches_the_spread_of_a_known_distribution():
    N, d, sigma, delta = 4, 200_000, 0.5, 3.0
    results = run_workers(_noise_worker, N, args=(d, sigma, delta))
    record, g_bar_norm = results[0]
    # The mean of N draws with per-coordinate std sigma has std sigma/sqrt(N): over d coordinates its norm is
    # sigma sqrt(d/N). The estimate sees only the N draws, not sigma.
    assert record["noise/rel_std_mean"] == pytest.approx(sigma * math.sqrt(d / N) / g_bar_norm, rel=0.01)
    assert record["agg/rel_error_max"] == pytest.approx(delta / g_bar_norm, rel=1e-9)
    assert record["agg/rel_error_rank0"] == record["agg/rel_error_max"]
    assert all(r[0]["agg/rel_error_max"] == record["agg/rel_error_max"] for r in results)  # every rank logs the max
    assert results[1][0]["agg/rel_error_rank0"] is None


def _two_layer_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


@pytest.mark.quick
def test_flat_gradients_accumulate_backward_in_place():
    from train.loop import FlatGradients

    model, reference = _two_layer_model(0), _two_layer_model(0)
    params = list(model.parameters())
    grads = FlatGradients(params)
    inputs = [torch.randn(4, 7, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    for x in inputs:  # two micro-batches accumulate
        model(x).square().sum().backward()
    expected = [torch.zeros_like(p) for p in reference.parameters()]
    for x in inputs:
        autograd = torch.autograd.grad(reference(x).square().sum(), list(reference.parameters()))
        for e, g in zip(expected, autograd, strict=True):
            e += g
    assert torch.equal(grads.flat, torch.cat([e.reshape(-1) for e in expected]))
    grads.flat.mul_(0.5)  # an aggregator averaging the buffer in place is seen by every .grad
    assert all(torch.equal(p.grad, 0.5 * e) for p, e in zip(params, expected, strict=True))
    grads.zero_()
    assert all(p.grad is v and not p.grad.any() for p, v in zip(params, grads.views, strict=True))
    assert grads.flat.numel() == sum(p.numel() for p in params)


@pytest.mark.parametrize(
    ("poison", "expected"), [(float("inf"), True), (float("-inf"), True), (float("nan"), True), (1e30, False)]
)
@pytest.mark.quick
def test_one_fused_finiteness_check_finds_any_bad_gradient(poison, expected):
    from train.loop import local_nonfinite

    model = _two_layer_model(1)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    params[2].grad.view(-1)[3] = poison  # one value of one tensor
    assert bool(local_nonfinite(params, None)) is expected
    assert bool(local_nonfinite(params, torch.cat([p.grad.reshape(-1) for p in params]))) is expected


def _read(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_validation_loss_is_the_reference_replicas_and_drift_is_measured_against_it(sweep, cache_dir, monkeypatch):
    """The N=4 training launch of the suite (tests/runs.py): nccl, CERAR (c=8) and CERAR resynchronised every
    3 steps; drift every 3 steps, the aggregation error every step."""
    N, c = 4, WORLDS[4]["c"]
    runs = sweep(N)
    nccl, _ = _read(runs / "nccl")
    cerar, cerar_summary = _read(runs / "cerar")
    resync, _ = _read(runs / "cerar_resync")
    for r in nccl:  # exact aggregation: one replica, no drift, no aggregation error, but SGD noise
        assert r.get("drift/rel_l2", 0.0) == 0.0 and r.get("agg/rel_error_max", 0.0) < 1e-6
        assert r.get("val_loss_worst_replica") == r.get("val_loss")
    assert all(r["noise/rel_std_mean"] > 0 for r in nccl if "noise/rel_std_mean" in r)
    drifted = [r for r in cerar if "drift/rel_l2" in r]
    assert drifted and all(r["drift/rel_l2"] > 0 and r["drift/max_abs"] > 0 for r in drifted)
    assert all(r["val_loss_worst_replica"] >= r["val_loss"] for r in cerar if "val_loss" in r)
    # With resync the drift is measured before each resync: what the interval built up from identical replicas.
    # Up to the first resync both runs are one trajectory, so their first drift is the same.
    resynced = [r for r in resync if "drift/rel_l2" in r]
    assert [r["step"] for r in resynced] == [r["step"] for r in drifted]
    assert all(r["drift/rel_l2"] > 0 for r in resynced)
    assert resynced[0]["drift/rel_l2"] == pytest.approx(drifted[0]["drift/rel_l2"], rel=1e-6)
    # lr is the one the step used: warmup of 1% of 6 steps rounds to none, so step 1 runs at the peak lr.
    assert nccl[0]["lr"] == pytest.approx(3e-3)

    # The logged validation loss is the reference replica's (rank N-1, whose weights the checkpoint keeps) on
    # the whole validation set: evaluate that checkpoint here, over every rank's share.
    from tests.runs import composed
    from train.data import build_data
    from train.model import build_model

    monkeypatch.setenv("CERAR_PYTHIA_CACHE", str(cache_dir))
    run_cfg = composed(*MATRIX, "aggregator=cerar", f"c={c}")
    state = torch.load(sorted((runs / "cerar" / "checkpoints").glob("*.pt"))[-1], weights_only=False)
    model = build_model(run_cfg.model)
    model.load_state_dict(state["model"])
    model.eval()
    losses, tokens = 0.0, 0
    with torch.no_grad():
        for rank in range(N):
            for batch in build_data(run_cfg, rank, N).val_batches:
                logits = model(input_ids=batch[:, :-1]).logits
                target = batch[:, 1:]
                losses += float(
                    torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
                )
                tokens += target.numel()
    assert cerar_summary["final_val_loss"] == pytest.approx(losses / tokens, rel=1e-5)
