"""c=auto (train/aggregation/auto_c.py and its measurement in train/loop.py): the c with the fewest bytes whose
worst-rank
error stays within error_budget x the SGD noise of the averaged gradient, tensor by tensor (here the gradient is
one tensor; tests/test_tensor_errors.py holds the per-tensor estimate to a model of several).

The decisions are held to things the test knows without the code under test: per-rank gradients built as a
mean plus noise of a chosen relative size (so the noise is known), each code's worst-rank error on them
computed by the specification's protocol with the specification's matrices (tests/spec_reference.py, float64,
rebuilt from the code's points, not the package's A_j and D_i), and the bytes a code
sends counted from the specification's figures (L = c + N - 2 blocks of ceil(d/c) values). Real gloo
process groups measure; real training runs resume.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.distributed import run_workers
from tests.spec_reference import spec_all_reduce
from tests.test_spec_reference import spec_code_matrices

N = 4
D = 48_000  # a multiple of every candidate c, so no padding
KAPPA_MAX = 1e3  # float32 rounding then adds at most ~kappa 2^-24 = 6e-5, far below every error that decides
CANDIDATES = [8, 12, 16]
ROUNDING = 4 * KAPPA_MAX * 2.0**-24  # the float32 transport's share of a measured error (kappa times rounding)


def codes():
    from train.aggregation.auto_c import candidate_codes

    return candidate_codes(N, "perturbation", None, KAPPA_MAX, CANDIDATES)


def spec_bytes(c: int, d: int = D) -> int:
    """The specification's count: L = c + N - 2 rounds of one block of ceil(d/c) float32 values."""
    return (c + N - 2) * -(-d // c) * 4


def gradients(rho: float, step: int) -> tuple[np.ndarray, float]:
    """N per-rank gradients g_r = mu + sigma z_r (rounded to float32, as the trainer's are), sigma chosen so that
    the mean's deviation from mu is rho ||mu|| in norm, and the noise the trainer reports for them: that
    deviation, sigma sqrt(d/N), relative to the norm of the mean g_bar (known from sigma, not estimated)."""
    mu = np.random.default_rng(0).standard_normal(D)
    z = np.random.default_rng(1000 + step).standard_normal((N, D))
    sigma = rho * np.linalg.norm(mu) / math.sqrt(D / N)
    G = (mu + sigma * z).astype(np.float32)
    return G, sigma * math.sqrt(D / N) / np.linalg.norm(G.astype(np.float64).mean(0))


def spec_worst_error(G: np.ndarray, code) -> float:
    G = G.astype(np.float64)
    S = G.sum(0)
    return max(np.linalg.norm(r - S) for r in spec_all_reduce(G, *spec_code_matrices(code))) / np.linalg.norm(S)


def right_c(allowed: float, errors: dict[int, float]) -> int:
    """Fewest bytes among the codes whose error is within `allowed`; the exact code c = N always is."""
    fits = [c for c, e in errors.items() if e <= allowed] + [N]
    return min(fits, key=spec_bytes)


# ------------------------------------------------------------------ the pure decision


def test_choose_c_takes_the_fewest_bytes_that_fit():
    from train.aggregation.auto_c import choose_c

    bytes_by_c = {4: 600, 8: 500, 12: 466, 16: 450}
    errors = {4: 0.0, 8: 0.0005, 12: 0.01, 16: 0.04}
    assert choose_c(1.0, errors, bytes_by_c, 0.05) == 16
    assert choose_c(1.0, errors, bytes_by_c, 0.02) == 12
    assert choose_c(1.0, errors, bytes_by_c, 0.01) == 12  # at the budget fits
    assert choose_c(0.5, errors, bytes_by_c, 0.01) == 8
    assert choose_c(0.01, errors, bytes_by_c, 0.01) == 4
    # Nothing fits: the smallest error. A non-finite error never fits; a non-finite noise fits nothing.
    assert choose_c(0.01, {8: 0.0005, 16: 0.04}, bytes_by_c, 0.01) == 8
    assert choose_c(1.0, {12: math.nan, 16: 0.001}, bytes_by_c, 0.01) == 16
    assert choose_c(1.0, {12: math.nan, 8: 0.02}, bytes_by_c, 0.01) == 8
    assert choose_c(math.nan, errors, bytes_by_c, 0.01) == 4
    with pytest.raises(ValueError, match="no byte count for c=\\[32\\]"):
        choose_c(1.0, {32: 0.1}, bytes_by_c, 0.01)
    with pytest.raises(ValueError, match="budget must be > 0"):
        choose_c(1.0, errors, bytes_by_c, 0.0)


@pytest.mark.quick
def test_choose_c_takes_the_fewest_bytes_where_padding_makes_them_rise_with_c():
    """At small d the padding to a multiple of c breaks "more c, fewer bytes": N=4, d=100, c=15 sends 17 blocks
    of 7 values (119), c=16 18 of 7 (126). Every code fits: the fewest bytes is c=15, not the largest c."""
    import cerar
    from train.aggregation.auto_c import bytes_per_call, choose_c

    d = 100
    values = {c: (c + N - 2) * -(-d // c) for c in range(N + 1, 4 * N + 1)}
    assert (values[15], values[16]) == (119, 126) and min(values, key=values.get) == 15
    bytes_by_c = {c: 4 * v for c, v in values.items()}
    assert {c: bytes_per_call(cerar.make_code(N, c, "perturbation"), d) for c in (10, 15, 16)} == {
        c: bytes_by_c[c] for c in (10, 15, 16)
    }
    assert choose_c(1.0, {c: 0.001 for c in values}, bytes_by_c, 0.01) == 15
    assert choose_c(1.0, {c: 0.001 * (c != 15) + 0.5 * (c == 15) for c in values}, bytes_by_c, 0.01) == 10  # 120


def test_the_default_error_budget_is_0_01_everywhere_it_is_set():
    """The README's and reports/fidelity.md's budget: the library's default, the config schema's and the composed
    configuration's, and what a c=auto run is built with."""
    from tests.runs import composed
    from train.aggregation.auto_c import DEFAULT_ERROR_BUDGET, AutoC, build_auto_c
    from train.config import AggregatorConfig

    assert DEFAULT_ERROR_BUDGET == 0.01
    assert AggregatorConfig().error_budget == 0.01
    cfg = composed("aggregator=cerar", "c=auto", "aggregator.auto_candidates=[8]")
    assert cfg.aggregator.error_budget == 0.01
    assert build_auto_c(N, D, cfg.aggregator).budget == 0.01
    assert AutoC(N=N, codes=codes(), bytes_by_c={c: spec_bytes(c) for c in codes()}).budget == 0.01


@pytest.mark.quick
def test_the_default_candidates_at_n4_are_5_6_8_12_16():
    """The README's list: at N=4 (optimized, the default construction and kappa_max) c=auto weighs the exact
    code and c = 5, 6, 8, 12, 16."""
    from train.aggregation.auto_c import candidate_codes

    assert sorted(candidate_codes(N, "optimized", None, None)) == [N, 5, 6, 8, 12, 16]


def test_candidates_bytes_and_the_schedule():
    from train.aggregation.auto_c import AutoC, bytes_per_call, candidate_codes

    by_c = codes()
    assert sorted(by_c) == [N, *CANDIDATES] and by_c[N].is_exact
    assert all(bytes_per_call(code, D) == spec_bytes(c) for c, code in by_c.items())
    assert bytes_per_call(by_c[N], D) == 2 * (N - 1) * D // N * 4  # the exact code sends the ring's bytes
    # The default candidates at N=4 (optimized): byte-saving codes in (N, 4N] that no other beats on both bytes
    # and predicted error; each kept one is unbeaten, each left out beaten, checked against every built code.
    default = candidate_codes(N, "perturbation", None, KAPPA_MAX)
    import cerar

    every = {}
    for c in range(N + 1, 4 * N + 1):
        try:
            every[c] = cerar.make_code(N, c, construction="perturbation", kappa_max=KAPPA_MAX)
        except ValueError:
            continue  # not buildable within kappa_max: never a candidate
    error = {c: code.predicted_error() for c, code in every.items()}
    for c in every:
        beaten = any(
            spec_bytes(o) <= spec_bytes(c)
            and error[o] <= error[c]
            and (spec_bytes(o), error[o]) != (spec_bytes(c), error[c])
            for o in every
        )
        assert (c in default) == (not beaten), c
    assert set(default) - set(every) == {N}
    # N=2: no c sends fewer bytes than the ring (1 + 0/c = 2(N-1)/N): only the exact code.
    assert sorted(candidate_codes(2, "optimized", None, None)) == [2]

    auto = AutoC(N=N, codes=by_c, bytes_by_c={c: spec_bytes(c) for c in by_c}, warmup_steps=5, check_every=10)
    assert auto.c == N and [s for s in range(1, 40) if auto.due(s)] == [5, 15, 25, 35]
    assert auto.to_measure() == CANDIDATES  # the exact code is never measured
    # the numbers are each code's worst tensor's error against that tensor's noise: budget 0.01 is what fits
    assert auto.decide(5, 0.2, {8: (math.nan, 0.0), 12: (0.004, 0.0)})["c"] == N  # nan: refused, not "exceeds"
    assert auto.decisions[-1]["reason"].startswith("evidence not finite") and auto.due(6) and not auto.due(7)
    assert auto.to_measure() == CANDIDATES  # a refused check chose nothing: the next one is a first choice
    auto.decide(6, 0.2, {8: (0.00015, 0.0), 12: (0.004, 0.0), 16: (0.0215, 0.0)}, {8: "a", 12: "b", 16: "b"})
    assert auto.c == 12 and auto.to_measure() == [8, 12]  # afterwards: the code in use and the larger ones
    assert auto.decisions[-1]["reason"] == "first choice" and auto.decisions[-1]["worst_tensors"][12] == "b"
    # A sampled error counts with two standard errors: 0.0095 + 2 x 0.0005 > 0.01, so c=12 no longer fits.
    auto.decide(15, 0.2, {8: (0.00015, 0.0), 12: (0.0095, 0.0005)})
    assert auto.c == 8 and auto.decisions[-1]["reason"] == "c=12 exceeds the budget"
    auto.decide(25, 0.2, {8: (3e-9, 0.0)})  # however small its error grows, c never moves up
    assert auto.c == 8 and auto.decisions[-1]["reason"] == "still fits"
    auto.decide(35, 0.2, {8: (0.3, 0.0)})
    assert auto.c == N and not auto.due(45)  # the exact code: nothing left to measure
    restored = AutoC(N=N, codes=by_c, bytes_by_c=auto.bytes_by_c, warmup_steps=5, check_every=10)
    restored.load_state_dict(auto.state_dict())
    assert restored.c == N and len(restored.decisions) == 5


def test_training_identity_keeps_c_auto_whatever_it_chose():
    """A resumed c=auto run is the same training whichever c it has moved to; fixed-c runs do not carry the
    c=auto settings (so their checkpoints' identity is unchanged by them)."""
    from tests.runs import composed
    from train.config import ConfigError, training_identity, validate

    auto = composed("aggregator=cerar", "c=auto", "aggregator.error_budget=0.02")
    fixed = composed("aggregator=cerar", "c=16")
    wrong = [
        (["aggregator=nccl", "c=auto"], "c=auto chooses a CERAR code: it needs aggregator=cerar"),
        (["aggregator=cerar", "c=abc"], "c='abc' must be an integer >= 1 or auto"),
        (["aggregator=cerar", "c=auto", "trainer.overlap=true"], "c=auto needs trainer.overlap=false"),
        (["aggregator=cerar", "c=auto", "aggregator.error_budget=0"], "error_budget=0.0 must be > 0"),
        (["aggregator=cerar_vandermonde", "c=auto"], "no c in (4, 16] of construction 'vandermonde'"),
    ]
    for overrides, message in wrong:
        with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace("]", "\\]")):
            validate(composed(*overrides), world_size=N)
    identity = training_identity(auto, N)
    assert identity["c"] == "auto" and identity["aggregator.error_budget"] == 0.02
    assert not any(
        key.startswith("aggregator.auto_") or key.endswith("error_budget") for key in training_identity(fixed, N)
    )


# ------------------------------------------------------------------ measured in a process group


def _decide_worker(rank, world_size, plan, sample_values):
    """For each (step, rho, budget, fresh) of the plan: this rank's gradient, one check, the decision (with a
    fresh AutoC where asked: a first choice; else with the running one: a re-check)."""
    from train.aggregation.auto_c import AutoC, bytes_per_call
    from train.loop import measure_auto_c

    by_c = codes()
    bytes_by_c = {c: bytes_per_call(code, D) for c, code in by_c.items()}
    auto, out = None, []
    for step, rho, budget, fresh in plan:
        if fresh:
            auto = AutoC(N=world_size, codes=by_c, bytes_by_c=bytes_by_c, warmup_steps=step, check_every=1)
        auto.budget = budget
        if not auto.due(step):
            out.append(None)
            continue
        local = torch.from_numpy(gradients(rho, step)[0][rank].copy())
        record = measure_auto_c(auto, local, step, seed=1, sample_values=sample_values)
        out.append({"c": auto.c, "decision": auto.decisions[-1], "record": record})
    return out


# (rho, budget): the noise (about rho / sqrt(1 + rho^2) relative to ||g_bar||) and the budget both decide; chosen
# so that c = 16, 12, 8, 4 (exact) and, at a small noise, 8 again are right.
FIRST_CHOICES = [(3.0, 1.0), (3.0, 0.25), (3.0, 0.01), (3.0, 0.0005), (0.1, 0.1)]


def spec_decision_inputs(rho: float, step: int) -> tuple[float, dict[int, float]]:
    G, noise = gradients(rho, step)
    return noise, {c: spec_worst_error(G, code) for c, code in codes().items() if c != N}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sample_values", [0, 2048])
def test_first_choice_on_gradients_of_known_noise(sample_values):
    """Each first choice is the c the test derives from the spec's errors, the known noise and the budget; the
    measured noise and errors match them (sampled: within four of their own standard errors)."""
    plan = [(1, rho, budget, True) for rho, budget in FIRST_CHOICES]
    results = run_workers(_decide_worker, N, args=(plan, sample_values))
    assert all(r == results[0] for r in results)  # every rank: the same numbers, the same decisions
    expected = []
    for (step, rho, budget, _), got in zip(plan, results[0], strict=True):
        noise, errors = spec_decision_inputs(rho, step)
        allowed = budget * noise
        for c, e in errors.items():  # the case is meaningful: no error lies near what is allowed
            assert not allowed / 1.5 < e < allowed * 1.5, (rho, budget, c, e)
        expected.append(right_c(allowed, errors))
        decision = got["decision"]
        assert decision["noise"] == pytest.approx(noise, rel=0.02)  # estimated from the N draws
        for c, e in errors.items():  # one tensor: rho is the relative error over the (measured) relative noise
            se = decision["standard_errors"][c]
            assert se == 0.0 if sample_values == 0 else se > 0
            rho_c = e / decision["noise"]
            assert abs(decision["errors"][c] - rho_c) <= 4 * se + ROUNDING * max(rho_c, 1.0), (rho, c, decision, e)
        assert got["record"]["auto_c/error_c16"] == decision["errors"][16]
    assert [r["c"] for r in results[0]] == expected == [16, 12, 8, N, 8]


@pytest.mark.timeout(300)
def test_recheck_moves_to_a_smaller_c_on_every_rank_at_the_same_step():
    """Budget 0.7: at rho 10 (noise ~1) c=16 fits and stays until a check at rho 0.3 (noise ~0.29): c=12 from
    that step on every rank; rho 10 again does not move it back up; rho 0.002 then takes it to the exact code,
    after which nothing is left to measure. Then a fresh run at rho 3 and budget 1 takes c=16, and a re-check
    at budget 0.25 whose c=16 error lies between 0.25 x noise and the noise itself leaves it: the budget
    decides, not the noise."""
    rhos = [10.0, 10.0, 0.3, 10.0, 0.002, 10.0]
    plan = [(step, rho, 0.7, step == 1) for step, rho in enumerate(rhos, start=1)]
    plan += [(7, 3.0, 1.0, True), (8, 3.0, 0.25, False)]
    results = run_workers(_decide_worker, N, args=(plan, 0))
    assert all(r == results[0] for r in results)
    got = results[0]
    assert [g["c"] if g else None for g in got] == [16, 16, 12, 12, N, None, 16, 12]
    noise, errors = spec_decision_inputs(3.0, 8)
    assert 0.25 * noise * 1.5 < errors[16] < noise / 1.5, (noise, errors)  # between budget x noise and noise
    assert got[7]["decision"]["reason"] == "c=16 exceeds the budget"
    assert got[7]["c"] == right_c(0.25 * noise, {c: e for c, e in errors.items() if c != 16})
    for (step, rho, budget, _), g in zip(plan[:5], got[:5], strict=True):  # each move as the spec's errors say
        noise, errors = spec_decision_inputs(rho, step)
        current = g["decision"]["c_before"]
        if current != N and errors.get(current, 0.0) > budget * noise:
            smaller = {c: e for c, e in errors.items() if spec_bytes(c) > spec_bytes(current)}
            assert g["c"] == right_c(budget * noise, smaller)
        elif step > 1:
            assert g["c"] == current
    assert [g["decision"]["reason"] for g in got[:5]] == [
        "first choice",
        "still fits",
        "c=16 exceeds the budget",
        "still fits",
        "c=12 exceeds the budget",
    ]
    assert sorted(got[3]["decision"]["errors"]) == [8, 12]  # after moving down only c <= 12 is measured


# ------------------------------------------------------------------ real training runs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_auto_runs_switch_resume_and_say_what_they_were(tmp_path, cache_dir):
    """Real 4-process runs of model=tiny: c=auto aggregates exactly until its first check, then with the code it
    chose (bytes per step as the specification counts them); a run resumed before its first choice is the same
    run bit for bit, one resumed after it keeps its decision; every summary says what the run was."""
    from tests.test_train_runs import SMALL, read_run, torchrun

    auto = "aggregator=cerar c=auto aggregator.auto_candidates=[6,8] aggregator.auto_warmup_steps=2"
    auto += " aggregator.auto_check_every=2 checkpoint.every=1"
    torchrun(
        N,
        "sweep.py",
        [
            str(tmp_path),
            f"full: {auto}",
            f"early: {auto} trainer.stop_after_step=1",
            f"early: {auto} resume=true",
            f"late: {auto} trainer.stop_after_step=3",
            f"late: {auto} resume=true",
            "resync: aggregator=cerar_perturbation c=8 trainer.resync_every=2 aggregator.kappa_max=1000",
            "--",
            *SMALL,
            "trainer.micro_batch_size=2",
            "trainer.global_batch_size=16",
        ],
        cache_dir,
        timeout=850,
    )
    from tests.runs import composed
    from train.model import build_model

    full_records, full = read_run(tmp_path / "full")
    d = full["parameters"]
    used = {r["step"]: r["auto_c/c"] for r in full_records}
    first = full["auto_c"]["decisions"][0]
    chosen = first["c"]
    assert used[1] == N and chosen in (6, 8) and all(used[s] == chosen for s in range(2, 7))
    # the choice its own evidence calls for, at the default budget 0.01: the fewest bytes (the spec's count) among
    # the codes whose worst tensor's error plus two standard errors is within 0.01 x that tensor's noise, else the
    # exact code; each names the tensor that set its figure
    assert first["allowed"] == 0.01 and set(first["worst_tensors"]) == set(first["errors"])
    fits = [int(c) for c, e in first["errors"].items() if e + 2 * first["standard_errors"][c] <= first["allowed"]]
    assert chosen == min([*fits, N], key=lambda c: spec_bytes(c, d)), first
    ring_bytes = {r["step"]: r["bytes_sent"] for r in full_records}
    assert ring_bytes[1] == pytest.approx(2 * (N - 1) / N * d * 4, rel=1e-4)  # the exact ring
    # the code's blocks, and at most an all-reduce of one float64 per parameter tensor (CERAR's equilibration)
    tensors = len([p for p in build_model(composed("model=tiny").model).parameters() if p.requires_grad])
    coded = (chosen + N - 2) * -(-d // chosen) * 4
    assert all(coded <= ring_bytes[s] <= coded + 2 * (N - 1) * tensors * 8 for s in range(2, 7)), (coded, ring_bytes)
    assert [x["step"] for x in full["auto_c"]["decisions"]] == [2, 4, 6]
    assert "auto_c/noise" in next(r for r in full_records if r["step"] == 2)
    assert "time/auto_c" in next(r for r in full_records if r["step"] == 2)

    _, early = read_run(tmp_path / "early")
    assert early["resumed_from_step"] == 1
    assert early["auto_c"]["decisions"] == full["auto_c"]["decisions"]  # every number, bit for bit
    assert early["param_sha256_per_rank"] == full["param_sha256_per_rank"]

    late_records, late = read_run(tmp_path / "late")
    assert late["resumed_from_step"] == 3  # the identity check took the resumed c=auto run
    assert late["auto_c"]["decisions"][0] == full["auto_c"]["decisions"][0]  # restored, not chosen again
    assert [x["reason"] for x in late["auto_c"]["decisions"]][1:] == ["still fits", "still fits"]
    assert [r["auto_c/c"] for r in late_records] == [used[s] for s in range(1, 7)]

    for summary in (full, late):
        assert (summary["c"], summary["c_chosen"], summary["construction"]) == ("auto", chosen, "optimized")
        assert summary["training_identity"]["c"] == "auto"
    _, resync = read_run(tmp_path / "resync")
    expected = {
        "aggregator": "cerar_perturbation", "construction": "perturbation", "c": 8, "c_chosen": 8,
        "kappa_max": 1000.0, "resync_every": 2, "global_batch_size": 16, "micro_batch_size": 2, "grad_accum": 2,
        "seq_len": 32, "tokens_per_step": 16 * 32, "world_size": N, "max_steps": 6, "corpus": "embedded-v2",
    }  # fmt: skip
    assert {k: resync[k] for k in expected} == expected
    assert resync["kappa"] <= 1000.0 * (1 + 1e-9) and 0 < resync["eps"] < 1
    assert resync["training_identity"]["trainer.resync_every"] == 2
    assert full["resync_every"] == 0
