"""The CERAR codes and the single-process oracle, checked against the specification's figures.

Where a result should be exact, the bound is the rounding the code itself predicts (``rounding_bound``:
the transport's unit roundoff times kappa), not a fixed number that holds only while two paths round
alike.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

import cerar
from cerar.coding.codes import real_to_points, ring_rounds
from tests.spec_reference import spec_all_reduce

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def rounding_bound(code, dtype: torch.dtype) -> float:
    """The relative error the transport's rounding may add to a worker's result: the dtype's unit
    roundoff amplified by kappa (the spec's "Numerics") and by sqrt(c + L) + N, the sums of c + L
    coded terms and of the N workers' values in every block (as tests/test_spec_reference.py)."""
    return max(code.kappa, 1.0) * UNIT_ROUNDOFF[dtype] * (np.sqrt(code.c + code.L) + code.N)


def relative_errors(G: torch.Tensor, code) -> torch.Tensor:
    """Each worker's ||S_hat_i - S|| / ||S||, with S computed in float64."""
    S = G.double().sum(0)
    return (cerar.simulate(G, code).double() - S).norm(dim=1) / S.norm()


def gaussian(N, d, dtype=torch.float32, seed=0):
    return torch.randn(N, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# --- exact codes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("N", [*(pytest.param(N, marks=pytest.mark.quick) for N in (1, 2, 3, 4)), 5, 6, 8])
def test_exact_codes_are_exact_in_float32_for_every_c_up_to_N(N):
    for c in range(1, N + 1):
        code = cerar.make_code(N, c, "exact")
        assert code.is_exact
        assert relative_errors(gaussian(N, 1000 + c), code).max() <= rounding_bound(code, torch.float32), (N, c)


@pytest.mark.quick
def test_exact_code_at_c_equal_N_is_perfectly_conditioned_up_to_F():
    # V is sqrt(N) times a unitary matrix at c = N; what is left of kappa is F's sqrt(2).
    for N in (3, 4, 8):
        assert cerar.make_code(N, N, "exact").kappa == pytest.approx(np.sqrt(2))


@pytest.mark.quick
def test_exact_points_are_conjugate_closed_roots_of_unity():
    code = cerar.make_code(4, 3, "exact")  # the spec's example: 1, i, -i
    assert np.allclose(np.sort_complex(code.points), np.sort_complex(np.array([1, 1j, -1j])))


# --- the analytic error of the closed forms ------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(
    "N, c, construction, eps",
    [
        (4, 8, "perturbation", 0.01),
        (3, 7, "perturbation", 0.05),
        (4, 6, "vandermonde", 0.3),
        (2, 5, "perturbation", 0.1),
    ],
)
def test_each_worker_errs_by_a_N_minus_one_times_the_wrapped_partial_sum(N, c, construction, eps):
    code = cerar.make_code(N, c, construction, eps=eps)
    d = c * 300
    G = gaussian(N, d, torch.float64)
    result = cerar.simulate(G, code)
    S = G.sum(0)
    F = real_to_points(code.points)
    wrap = np.real(np.linalg.inv(F) @ np.diag(code.points**N - 1) @ F)  # F^-1 diag(a^N - 1) F
    for i in range(N):
        wrapped = G[i + 1 :].sum(0).reshape(c, -1).numpy()
        predicted = (wrap @ wrapped).reshape(-1)
        measured = (result[i] - S).numpy()
        rounding = 1e-14 * code.kappa * np.abs(S.numpy()).max()  # float64 rounding, amplified by kappa
        assert np.abs(measured - predicted).max() <= rounding, i
    assert (result[N - 1] - S).abs().max() <= 1e-14 * code.kappa * S.abs().max()  # worker N-1 never wraps


@pytest.mark.quick
def test_level_zero_components_are_exact_on_every_worker():
    N, c = 4, 8
    code = cerar.make_code(N, c, "perturbation", eps=0.05)
    G = gaussian(N, c * 200, torch.float64)
    error = (cerar.simulate(G, code) - G.sum(0)).reshape(N, c, -1)
    level0 = np.abs(np.abs(code.points) - 1) < 1e-12  # the points on the unit circle
    assert level0.sum() == N
    assert error[:, level0].abs().max() <= rounding_bound(code, torch.float64) * G.sum(0).abs().max()
    assert error[0, ~level0].abs().max() > 1e-4  # the other level does err


@pytest.mark.quick
def test_predicted_error_matches_the_measured_gaussian_error():
    for construction in ("perturbation", "optimized"):
        code = cerar.make_code(4, 16, construction, kappa_max=1e3)
        measured = relative_errors(gaussian(4, 16 * 4000, torch.float64), code)
        assert measured.max().item() == pytest.approx(code.predicted_error(), rel=0.05)


@pytest.mark.quick
def test_spec_reference_figures_for_the_perturbation_construction():
    # (N, c, delta) -> the spec's worst relative error, float32 transport, Gaussian gradients
    for N, c, delta, expected in [(8, 16, 0.01, 6.6e-3), (4, 8, 0.01, 6.1e-3)]:
        code = cerar.make_code(N, c, "perturbation", eps=delta)
        assert relative_errors(gaussian(N, c * 4096), code).max().item() == pytest.approx(expected, rel=0.05)


@pytest.mark.quick
def test_error_shrinks_with_eps_while_kappa_grows():
    codes = [cerar.make_code(4, 12, "perturbation", eps=eps) for eps in (0.3, 0.1, 0.03)]
    assert [c.predicted_error() for c in codes] == sorted([c.predicted_error() for c in codes], reverse=True)
    assert [c.kappa for c in codes] == sorted(c.kappa for c in codes)


# --- rates ---------------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("N, c, d", [(4, 16, 1000), (8, 16, 33), (3, 7, 7), (5, 2, 1), (2, 9, 4), (1, 4, 10)])
def test_rounds_and_values_sent_match_the_rate_table(N, c, d):
    code = cerar.make_code(N, c)
    assert (c + N - 2 if N > 1 else 0) == code.L
    assert code.m_for(d) == -(-d // c)
    _, sent = cerar.simulate(gaussian(N, d), code, return_values_sent=True)
    assert sent == code.L * code.m_for(d)
    if N > 1:
        assert code.comm_rate == pytest.approx(1 + (N - 2) / c)
        assert code.ring_rate == pytest.approx(2 * (N - 1) / N)
    assert code.storage_rate == pytest.approx(1 + N / c)
    assert ring_rounds(N, c) == code.L


@pytest.mark.quick
def test_cerar_sends_less_than_the_ring_only_when_c_exceeds_N():
    assert cerar.make_code(4, 4).comm_rate == pytest.approx(cerar.make_code(4, 4).ring_rate)
    assert cerar.make_code(4, 16).comm_rate < cerar.make_code(4, 16).ring_rate
    assert cerar.make_code(4, 2).comm_rate > cerar.make_code(4, 2).ring_rate


# --- edge cases ----------------------------------------------------------------------------------


@pytest.mark.quick
def test_a_ring_of_one_is_the_identity():
    G = gaussian(1, 37)
    assert torch.equal(cerar.simulate(G, cerar.make_code(1, 5)), G)


@pytest.mark.quick
def test_two_workers_and_a_single_component():
    for N, c in [(2, 1), (2, 2), (5, 1)]:
        code = cerar.make_code(N, c)
        assert relative_errors(gaussian(N, 101), code).max() <= rounding_bound(code, torch.float32)


@pytest.mark.quick
def test_gradients_shorter_than_c_and_not_a_multiple_of_c():
    for N, c, d in [(4, 16, 5), (3, 3, 1), (4, 4, 1001)]:
        code = cerar.make_code(N, c, "exact" if c <= N else "perturbation", eps=0.2)
        G = gaussian(N, d)
        result = cerar.simulate(G, code)
        assert result.shape == (N, d)
        bound = rounding_bound(code, torch.float32) if code.is_exact else 0.2
        assert relative_errors(G, code).max() <= bound


@pytest.mark.quick
def test_simulate_works_in_float64_and_keeps_the_dtype():
    G = gaussian(4, 200, torch.float64)
    code = cerar.make_code(4, 4)
    result = cerar.simulate(G, code)
    assert result.dtype == torch.float64
    assert (result - G.sum(0)).abs().max() <= rounding_bound(code, torch.float64) * G.sum(0).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_simulate_on_cuda_matches_the_cpu():
    """Both devices within float32 rounding of the spec's protocol run in float64: the two may round
    differently (kappa ~ 1e5 here amplifies every difference), so neither is the other's reference."""
    G = gaussian(4, 4096)
    code = cerar.make_code(4, 16, "perturbation", eps=0.05)
    reference = torch.from_numpy(spec_all_reduce(G.double().numpy(), code.A, code.D))
    for result in (cerar.simulate(G.cuda(), code).cpu(), cerar.simulate(G, code)):
        errors = (result.double() - reference).norm(dim=1) / reference.norm(dim=1)
        assert errors.max() <= rounding_bound(code, torch.float32), errors


# --- determinism ---------------------------------------------------------------------------------


@pytest.mark.quick
def test_codes_are_cached_and_bit_identical_when_rebuilt():
    first = cerar.make_code(4, 12, "perturbation", kappa_max=1e3)
    assert cerar.make_code(4, 12, "perturbation", kappa_max=1e3) is first
    cerar.coding.codes._make_code_cached.cache_clear()
    again = cerar.make_code(4, 12, "perturbation", kappa_max=1e3)
    assert again is not first
    assert np.array_equal(again.A, first.A) and np.array_equal(again.D, first.D)
    assert not first.A.flags.writeable


def test_codes_are_bit_identical_in_another_process():
    import subprocess
    import sys

    script = (
        "import cerar,hashlib;k=cerar.make_code(8,16,'perturbation',eps=0.01);"
        "print(hashlib.sha256(k.A.tobytes()+k.D.tobytes()).hexdigest())"
    )
    here = cerar.make_code(8, 16, "perturbation", eps=0.01)
    import hashlib

    expected = hashlib.sha256(here.A.tobytes() + here.D.tobytes()).hexdigest()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == expected


# --- the optimiser -------------------------------------------------------------------------------


def test_searched_codes_are_kept_in_the_suites_cache_under_the_search_codes_version(cerar_code_cache):
    """tests/conftest.py points $CERAR_CACHE_DIR at the pytest cache; the file name carries the search
    code's version and its parameters' digest (tests/test_shipped_codes.py checks what changes them),
    so an edited search never reads its predecessor's codes. (3, 5) at kappa_max 2e3 is outside the
    shipped table: searched."""
    from cerar.coding import optimize, stored_codes

    assert (3, 5, 2e3) not in stored_codes.shipped_entries()
    cerar.make_code(3, 5, "optimized", kappa_max=2e3)
    assert stored_codes.cache_dir() == Path(cerar_code_cache)
    key = f"{optimize.SEARCH_CODE_VERSION}-p{stored_codes.search_parameters_digest()}"
    assert (Path(cerar_code_cache) / f"optimized-{key}-N3-c5-k2000.0.npz").is_file()


def test_the_optimiser_and_the_closed_forms_do_not_import_each_other_in_a_circle():
    import subprocess
    import sys

    script = (
        "import sys, cerar.coding.closed_forms; "
        "assert 'cerar.coding.optimize' not in sys.modules and 'cerar.coding.codes' not in sys.modules, "
        "sorted(sys.modules); "
        "import cerar.coding.optimize; assert 'cerar.coding.codes' not in sys.modules; print('ok')"
    )
    # cerar/__init__ imports the package's public API (which includes cerar.coding.codes); load the modules
    # as files under a stub package so that only what they import themselves gets loaded.
    stub = (
        "import importlib.util, sys, types, pathlib; root = pathlib.Path(cerar_path); "
        "pkg = types.ModuleType('cerar'); pkg.__path__ = [str(root)]; sys.modules['cerar'] = pkg; "
    )
    out = subprocess.run(
        [sys.executable, "-c", f"cerar_path = {str(Path(cerar.__file__).parent)!r}; " + stub + script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.quick
def test_optimized_halves_the_perturbation_error_at_kappa_max_1e4():
    """The bar: N = 4, c = 16, float32, kappa_max = 1e4."""
    perturbation = cerar.make_code(4, 16, "perturbation", kappa_max=1e4)
    optimized = cerar.make_code(4, 16, "optimized", kappa_max=1e4)
    assert optimized.kappa <= 1e4 * (1 + 1e-9)
    G = gaussian(4, 16 * 4096)
    assert relative_errors(G, optimized).max() <= 0.5 * relative_errors(G, perturbation).max()


@pytest.mark.quick
@pytest.mark.parametrize("N, c, kappa_max", [(3, 7, 1e4), (4, 8, 1e3), (2, 8, 1e4), (4, 12, 1e4)])
def test_optimized_is_never_worse_than_its_closed_form_start(N, c, kappa_max):
    start = cerar.make_code(N, c, "perturbation", kappa_max=kappa_max)
    optimized = cerar.make_code(N, c, "optimized", kappa_max=kappa_max)
    assert optimized.kappa <= kappa_max * (1 + 1e-9)
    assert optimized.predicted_error() <= start.predicted_error() + 1e-12
    assert optimized.worker_errors()[N - 1] <= rounding_bound(optimized, torch.float64)  # the last worker: exact


@pytest.mark.quick
def test_optimized_makes_two_workers_exact():
    code = cerar.make_code(2, 8, "optimized")
    assert relative_errors(gaussian(2, 800, torch.float64), code).max() <= rounding_bound(code, torch.float64)


# --- bad arguments -------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(N=0, c=4), "N"),
        (dict(N=4, c=0), "c"),
        (dict(N=4.5, c=4), "N"),
        (dict(N=4, c=16, kappa_max=0.5), "kappa_max"),
        (dict(N=4, c=16, eps=0.0), "eps"),
        (dict(N=4, c=16, eps=1.0), "eps"),
        (dict(N=4, c=16, eps=-0.1), "eps"),
        (dict(N=4, c=5, construction="exact"), "exact"),
        (dict(N=4, c=8, construction="polar"), "construction"),
        (dict(N=4, c=32, construction="perturbation", kappa_max=1e4), "kappa_max"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, named):
    with pytest.raises(ValueError, match=named):
        cerar.make_code(**kwargs)


@pytest.mark.quick
@pytest.mark.parametrize(
    "G, named",
    [
        (torch.ones(4, 10, dtype=torch.int64), "dtype"),
        (torch.ones(3, 10), "shape"),
        (torch.ones(40), "shape"),
        (np.ones((4, 10)), "torch.Tensor"),
        (torch.ones(4, 10, dtype=torch.bfloat16), "kappa"),
    ],
)
def test_simulate_rejects_bad_gradients_with_a_clear_message(G, named):
    code = cerar.make_code(4, 16, "perturbation", eps=0.01)
    with pytest.raises(ValueError, match=named):
        cerar.simulate(G, code)


@pytest.mark.quick
def test_sixteen_bit_transport_is_allowed_for_exact_codes():
    G = gaussian(4, 100, torch.bfloat16)
    result = cerar.simulate(G, cerar.make_code(4, 4))
    assert result.dtype == torch.bfloat16
    S = G.double().sum(0)
    assert ((result.double() - S).norm() / S.norm()).item() <= rounding_bound(cerar.make_code(4, 4), torch.bfloat16)
