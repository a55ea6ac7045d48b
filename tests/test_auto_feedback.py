"""aggregator=auto with error feedback (aggregator.error_feedback=true): its quantized candidates fed back, judged
over a window of calls as the trainer judges a fed run.

The story, on the gradients of tests/test_auto_int4.py (three tensors decades apart, noise known per tensor): one
4-bit call errs some 0.3 of each tensor's noise, so at a budget of 0.25 auto without feedback refuses `int4` and
takes `int8`. Fed back, a call's error is E_t - E_{t+1} (docs/int4.md): the sum of W consecutive calls errs by two
residuals whatever W, and against the summed noise of W steps, sqrt(W) sigma_t, that is some sqrt(2 / W) of one
unfed call's figure. auto measures exactly that on its sample (one call to fill residuals of its own, then the sum
of the next W), and its figure is the real one: set beside the same window computed here, in float64 from every
rank's results of a fed 4-bit all-reduce of its own on the whole gradient, W + 1 calls. So fed, `int4_ef` fits the
same budget and auto takes it (the cheapest by the model, on a slow link with free arithmetic, declared).

The run's own residuals are the run's: a check's sample and a trial's timing round with residuals of their own, so
they leave the chosen candidate's untouched; the chosen candidate's residuals are what a checkpoint keeps of each
rank, restored after the choice, so a restored auto aggregates the uninterrupted one's bytes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.distributed import run_workers
from tests.test_auto_int4 import SLOW, TENSORS, gradient

N = 4
W = 10  # aggregator.feedback_window's default under feedback: 1 / (1 - beta1)
BUDGET = 0.25  # between one 4-bit call's figure (0.30-0.35) and a fed window's (about sqrt(2 / W) of it)


def _auto(base, fed: bool, world_size: int):
    from train.aggregation.auto_aggregator import AutoAggregator

    cfg = base.copy()
    cfg.aggregator.error_feedback = fed
    for key, value in SLOW.items():
        cfg.aggregator.auto_links[key] = value
    auto = AutoAggregator(cfg, world_size)
    auto.use_tensors([size for _, size, _ in TENSORS])
    auto.prepare(sum(size for _, size, _ in TENSORS), torch.device("cpu"))
    return auto


def _residuals(auto) -> dict:
    state = auto.rank_state()
    return {name: value.numpy().copy() for name, value in state["error_feedback"].items()}


def _fed_worker(rank, world_size, base):
    """Both autos' checks at step 1; the fed one's choice aggregating a step, checked again and timed (its residuals
    before and after); a restored copy against it; and the window of a fed 4-bit all-reduce on the whole gradient."""
    from cerar.int4.two_shot import dither_calls, set_dither_calls
    from train.aggregation.aggregators import Int4Aggregator
    from train.aggregation.tensor_errors import TensorLayout

    layout = TensorLayout(tuple(name for name, _, _ in TENSORS), tuple(size for _, size, _ in TENSORS))
    g = torch.from_numpy(gradient(rank))
    out = {}
    for fed in (False, True):
        auto = _auto(base, fed, world_size)
        auto.check(g.clone(), 1, seed=11, layout=layout)
        out[fed] = {"decision": auto.choice.decisions[-1], "seconds": auto.choice.seconds,
                    "windows": {name: cand.window for name, cand in auto.choice.candidates.items()}}  # fmt: skip
    out["before"] = _residuals(auto) if auto.feedback is not None else None  # none yet: the choice has not run
    auto.aggregate(g.clone())  # the run's step: its residuals now hold what it dropped
    out["filled"] = _residuals(auto)
    auto.check(g.clone(), 2, seed=11, layout=layout)  # the choice and the more accurate int8_ef, on samples
    auto.time_calls(["int4_ef", "int8_ef"], g)  # trials on the whole gradient
    out["after"] = _residuals(auto)

    calls = dither_calls()
    restored = _auto(base, True, world_size)
    restored.load_state_dict(auto.state_dict())  # as Trainer.restore: the choice first, then this rank's residuals
    restored.load_rank_state(auto.rank_state())
    fresh = _auto(base, True, world_size)
    fresh.load_state_dict(auto.state_dict())  # the choice without the residuals
    step = {}
    for name, aggregator in (("uninterrupted", auto), ("restored", restored), ("fresh", fresh)):
        set_dither_calls(calls)
        x = 0.5 * g
        aggregator.aggregate(x)
        step[name] = x.numpy().copy()
    out["step"] = step

    reference = Int4Aggregator(world_size, 60.0, 128, True, error_feedback=True)
    windows = []
    for call in range(1 + W):
        x = g.clone()
        reference.aggregate(x)
        if call:
            windows.append(x.double().numpy())
    out["reference"] = np.sum(windows, axis=0)  # the sum of W fed calls' aggregates, the first call's left out
    return out


@pytest.fixture(scope="module")
def checked():
    from tests.runs import composed

    base = composed("aggregator=auto", "model=tiny", "aggregator.auto_warmup_steps=1", "aggregator.auto_trials=0",
                    "aggregator.auto_sample_values=8192", f"aggregator.error_budget={BUDGET}",
                    "aggregator.auto_aggregators=[int8,int4]")  # fmt: skip
    return run_workers(_fed_worker, N, args=(base,), timeout_s=240)


def window_figure(results) -> float:
    """The worst rank's worst tensor of || sum over W calls (g_hat - g_bar) || / (sqrt(W) sigma_t), in float64 from
    every rank's gradient and results (train/aggregation/feedback_window.py's rho_t(W), every step's noise this
    gradient's)."""
    G = np.stack([gradient(r) for r in range(N)]).astype(np.float64)
    mean = G.mean(0)
    worst, start = 0.0, 0
    for _, size, _ in TENSORS:
        t = slice(start, start + size)
        sigma = math.sqrt(((G[:, t] - mean[t]) ** 2).sum() / (N * (N - 1)))
        for r in results:
            worst = max(worst, np.linalg.norm(r["reference"][t] - W * mean[t]) / (math.sqrt(W) * sigma))
        start += size
    return worst


def test_fed_back_the_quantized_candidates_are_judged_over_a_window_at_their_real_figure(checked):
    """Fed, the candidates are int8_ef and int4_ef, each judged over W = 10 calls; int4_ef's figure (estimate and 2
    standard errors) covers the window computed here from a fed 4-bit all-reduce on the whole gradient and is not
    above 1.5x it; that is under 0.6 of the unfed int4's one-call figure at the same check (sqrt(2 / W) = 0.45).
    Every rank decided from the same numbers."""
    fed, unfed = checked[0][True]["decision"], checked[0][False]["decision"]
    assert all(r[True]["decision"] == fed and r[False]["decision"] == unfed for r in checked)
    assert {name: w for name, w in checked[0][True]["windows"].items() if w} == {"int8_ef": W, "int4_ef": W}
    assert sorted(fed["errors"]) == ["int4_ef", "int8_ef"] and sorted(unfed["errors"]) == ["int4", "int8"]
    truth = window_figure(checked)
    error, se = fed["errors"]["int4_ef"], fed["standard_errors"]["int4_ef"]
    assert truth / 1.5 < error + 2 * se and error < 1.5 * truth, (error, se, truth)
    assert error < 0.6 * unfed["errors"]["int4"], (error, unfed["errors"]["int4"])


def test_at_a_budget_one_4_bit_call_exceeds_the_fed_window_fits_and_auto_takes_it(checked):
    """Budget 0.25: unfed, int4 is refused (its one call errs 0.3 of the noise) and auto takes int8; fed, int4_ef's
    window fits, the model prices it below int8_ef (half the bytes) and auto takes it."""
    unfed, fed = checked[0][False], checked[0][True]
    assert unfed["decision"]["choice"] == "int8" and "int4" in unfed["decision"]["refused"], unfed["decision"]
    assert fed["seconds"]["int4_ef"] < 0.6 * fed["seconds"]["int8_ef"]
    assert fed["decision"]["choice"] == "int4_ef" and fed["decision"]["refused"] == {}, fed["decision"]


def test_checks_and_trials_leave_the_runs_residuals_and_a_restored_auto_continues_them(checked):
    """The choice's residuals exist once it has aggregated; a check on samples and trials on the whole gradient
    after it leave them bit for bit; an auto restored from the state and this rank's residuals aggregates the next
    step to the uninterrupted one's bytes, and one restored without the residuals does not."""
    for r in checked:
        assert r["before"] == {}
        assert r["filled"] and any(np.abs(v).max() > 0 for v in r["filled"].values())
        assert r["filled"].keys() == r["after"].keys()
        assert all(np.array_equal(r["filled"][k], r["after"][k]) for k in r["filled"])
        assert np.array_equal(r["step"]["uninterrupted"], r["step"]["restored"])
        assert not np.array_equal(r["step"]["uninterrupted"], r["step"]["fresh"])


@pytest.mark.quick
def test_error_feedback_feeds_back_autos_quantized_candidates_only_and_is_refused_where_none_is_kept():
    """Under aggregator.error_feedback=true every int8/int4 candidate, flat and two-tier, is fed back (named _ef, its
    window aggregator.feedback_window, 10 when null) in place of the unfed one; the casts and CERAR are not; a
    family list that keeps none of the fed kinds is refused before any process group, naming both fields; feedback
    enters auto's identity (a fed auto run never resumes an unfed one's checkpoints)."""
    from tests.runs import composed
    from train.aggregation.auto_choice import candidates
    from train.config import ConfigError, training_identity, validate

    fed = candidates(4, 2, 2, composed("aggregator=auto", "aggregator.error_feedback=true").aggregator)
    windows = {name: cand.window for name, cand in fed.items() if cand.window}
    assert windows == {"int8_ef": 10, "int4_ef": 10, "hier_int8_ef": 10, "hier_int4_ef": 10}
    assert not {"int8", "int4", "hier_int8", "hier_int4"} & set(fed) and {"fp16", "bf16", "hier_fp16"} <= set(fed)
    six = candidates(4, 1, 4, composed("aggregator=auto", "aggregator.error_feedback=true",
                                       "aggregator.feedback_window=6").aggregator)  # fmt: skip
    assert {name: cand.window for name, cand in six.items() if cand.window} == {"int8_ef": 6, "int4_ef": 6}
    with pytest.raises(ConfigError, match=r"aggregator=auto aggregator.error_feedback=true feeds back its int8, "
                                          r"hier_int8, int4, hier_int4 candidates; aggregator.auto_aggregators="
                                          r"\['cerar', 'ring16'\] keeps none of them"):  # fmt: skip
        validate(composed("aggregator=auto", "aggregator.error_feedback=true",
                          "aggregator.auto_aggregators=[cerar,ring16]"), 4)  # fmt: skip
    validate(composed("aggregator=auto", "aggregator.error_feedback=true", "aggregator.auto_aggregators=[int4]"), 4)
    assert training_identity(composed("aggregator=auto", "aggregator.error_feedback=true"), 4)[
        "aggregator.error_feedback"] is True  # fmt: skip
    assert "aggregator.error_feedback" not in training_identity(composed("aggregator=auto"), 4)
