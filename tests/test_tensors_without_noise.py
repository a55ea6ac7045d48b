"""A parameter tensor with no noise (issue 51): an unused parameter's gradient is zero on every rank, so its
noise sigma_t is 0, and a tensor identical on every rank has none either.

The story: the coded aggregators (CERAR mixes a column's components) leaked their column-mates' values into an
unused parameter's zero gradient, 3e-4 to 6e-4 at N=4, c=5, a step Adam takes in full; now every aggregator returns
a tensor that is zero on every rank as zeros, equilibrated or not, flat or on two tiers. Both autos measured such
a tensor as error/noise = inf, read inf as "evidence not finite", kept the exact choice and measured every
candidate again at every step, for ever; now they measure it as the aggregators return it (no error: rho 0) and
decide at their first check. A tensor identical on every rank but not zero is still mixed: its rho is inf, a
measurement, so no candidate that errs on it fits and the autos decide on the ones that leave it exact. Real gloo
ranks, a real model's gradients (backward through a module with an unused layer).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import run_workers

N = 4
DECLARED = ("aggregator.auto_links.intra_alpha_s=1e-4", "aggregator.auto_links.intra_gbit_s=1.0",
            "aggregator.auto_links.inter_alpha_s=1e-4", "aggregator.auto_links.inter_gbit_s=1.0",
            "aggregator.auto_links.memory_gbyte_s=5.0")  # fmt: skip
CODE = ("aggregator.construction=perturbation", "aggregator.kappa_max=50")  # errs ~0.05: far above rounding


class Net(torch.nn.Module):
    """Two used layers and one that the forward pass never calls."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(24, 48)
        self.head = torch.nn.Linear(48, 8)
        self.unused = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.tanh(self.used(x)))


def _gradients(rank: int):
    """(flat gradient, layout) of this rank: the same model on every rank, its own batch; the unused layer's
    gradient is zero (the flat buffer's, as the trainer's FlatGradients leaves it)."""
    from train.aggregation.tensor_errors import TensorLayout

    torch.manual_seed(0)
    net = Net()
    generator = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(64, 24, generator=generator), torch.randn(64, 8, generator=generator)
    torch.nn.functional.mse_loss(net(x), y).backward()
    params = [p for p in net.parameters() if p.requires_grad]
    flat = torch.cat([torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1) for p in params])
    return flat, TensorLayout.of(net.named_parameters())


def _worker(rank, world_size):
    from tests.runs import composed
    from train.aggregation.auto_aggregator import AutoAggregator
    from train.aggregation.auto_c import build_auto_c
    from train.aggregation.build import build_aggregator
    from train.loop import measure_auto_c

    torch.set_num_threads(1)
    flat, layout = _gradients(rank)
    sizes = list(layout.sizes)
    out = {"names": layout.names, "sizes": sizes, "local": flat.clone()}
    # fixed coded aggregators: flat CERAR and the two tiers (4 nodes of 1 rank: a code between the nodes)
    fixed = {}
    for kind in ("aggregator=cerar", "aggregator=hier_cerar"):
        for equilibrate in ("true", "false"):
            cfg = composed(kind, "c=5", "model=tiny", "aggregator.local_size=1",
                           f"aggregator.equilibrate={equilibrate}", *CODE)  # fmt: skip
            aggregator = build_aggregator(cfg, world_size)
            aggregator.use_tensors(sizes)
            x = flat.clone()
            aggregator.aggregate(x)
            fixed[kind, equilibrate] = x
    out["fixed"] = fixed
    for case in ("unused", "identical"):
        g = flat.clone()
        if case == "identical":  # head.bias: the same nonzero gradient on every rank (no noise, not zero)
            start = sum(sizes[: layout.names.index("head.bias")])
            g[start : start + 8] = torch.linspace(-1.0, 1.0, 8)
        cfg = composed("aggregator=auto", "model=tiny", "aggregator.auto_warmup_steps=1", "aggregator.auto_trials=0",
                       "aggregator.local_size=2", *DECLARED,
                       "aggregator.auto_aggregators=[ring16,int8,cerar,hier_ring16,hier_int8]")  # fmt: skip
        auto = AutoAggregator(cfg, world_size)
        auto.use_tensors(sizes)
        auto.prepare(g.numel(), torch.device("cpu"))
        auto.check(g.clone(), 1, seed=3, layout=layout)
        whole = {}
        for name, aggregator in auto.aggregators.items():  # every candidate's real call on the whole gradient
            x = g.clone()
            aggregator.aggregate(x)
            whole[name] = x
        cfg = composed("aggregator=cerar", "c=auto", "model=tiny", "aggregator.auto_warmup_steps=1")
        auto_c = build_auto_c(world_size, g.numel(), cfg.aggregator)
        cerar = build_aggregator(cfg, world_size)
        cerar.use_tensors(sizes)
        measure_auto_c(auto_c, g.clone(), 1, 3, 512, layout, cerar.tensor_scales(g))  # as the trainer's check
        out[case] = {"auto": auto.choice.decisions, "auto_retry": auto.choice.retry_at, "whole": whole,
                     "auto_c": auto_c.decisions, "auto_c_retry": auto_c.retry_at, "gradient": g}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, N, timeout_s=280)


def _span(result, name: str) -> slice:
    start = sum(result["sizes"][: result["names"].index(name)])
    return slice(start, start + result["sizes"][result["names"].index(name)])


@pytest.mark.timeout(300)
def test_a_tensor_zero_on_every_rank_stays_zero_through_the_coded_aggregators(results):
    unused = [_span(results[0], name) for name in ("unused.weight", "unused.bias")]
    for r in results:
        for (kind, equilibrate), x in r["fixed"].items():
            for span in unused:
                assert torch.count_nonzero(x[span]) == 0, (kind, equilibrate, x[span].abs().max())
            # the others are CERAR's approximation of the mean, not zeroed: some rank errs far above rounding
        assert {"hier_fp16", "hier_int8", "int8", "fp16", "cerar-c5"} <= set(r["unused"]["whole"])
        for name, x in r["unused"]["whole"].items():  # every candidate of aggregator=auto, flat or on two tiers
            for span in unused:
                assert torch.count_nonzero(x[span]) == 0, (name, x[span].abs().max())
    mean = torch.stack([r["local"] for r in results]).double().mean(0)
    worst = max((r["fixed"]["aggregator=cerar", "true"].double() - mean).norm() / mean.norm() for r in results)
    assert worst > 1e-3, worst  # the code errs far above float32 rounding: the kept zeros are not an exact call


def _decided_at_once(case: dict) -> tuple[dict, dict]:
    """(aggregator=auto's decision, c=auto's) of a case: one each, a choice, and no check scheduled again (a
    refusal, "evidence not finite", would check again at the next step)."""
    [decision], [choice] = case["auto"], case["auto_c"]
    assert decision["reason"] == "first choice" and case["auto_retry"] is None, decision["reason"]
    assert choice["reason"] == "first choice" and case["auto_c_retry"] is None, choice["reason"]
    return decision, choice


@pytest.mark.timeout(300)
def test_both_autos_decide_at_their_first_check_on_a_gradient_with_an_unused_parameter(results):
    for r in results:
        decision, choice = _decided_at_once(r["unused"])
        # every candidate measured, as its call returns the unused layer (zeros): a finite number each
        assert all(math.isfinite(e) for e in decision["errors"].values()), decision["errors"]
        assert "unused" not in "".join(decision["worst_tensors"].values())
        assert all(math.isfinite(e) for e in choice["errors"].values()), choice["errors"]


@pytest.mark.timeout(300)
def test_a_tensor_identical_on_every_rank_fits_only_the_candidates_that_leave_it_exact(results):
    for r in results:
        identical = r["identical"]
        decision, choice = _decided_at_once(identical)
        head = _span(r, "head.bias")
        exact = identical["gradient"][head]  # the same on every rank: its exact mean
        for name, error in decision["errors"].items():
            # no noise: a candidate whose call moves the tensor at all has error/noise inf; one that leaves it
            # exact is judged on the other tensors
            erred = not torch.equal(identical["whole"][name][head], exact)
            assert (error == math.inf) == erred, (name, error)
            if name.startswith("cerar"):  # CERAR mixes it with its column-mates: it errs
                assert error == math.inf and decision["worst_tensors"][name] == "head.bias", (name, error)
        chosen, errors = decision["choice"], decision["errors"]
        if chosen in errors:  # an inexact candidate (the exact ones are not measured): it fits
            assert errors[chosen] + 2 * decision["standard_errors"][chosen] <= 0.01, (chosen, errors)
        assert all(e == math.inf for e in choice["errors"].values()) and choice["c"] == N, choice
