"""The optimized codes shipped in cerar/data/optimized_codes.json, held to the search and to the spec.

A sample (the cheapest shapes) is searched again and must come out as shipped; every shipped code is
rebuilt by make_code's path and checked for what the specification requires, against
``tests/spec_reference.py``: the matrices A_j and D_i from its points as the spec builds them, kappa
within the budget, each worker's error on Gaussian gradients, run through the spec's protocol in
float64, as the code predicts, and the last worker exact. ``make_code`` must read a shipped shape
without searching.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import cerar
from cerar import optimize, stored_codes
from tests.spec_reference import spec_all_reduce, spec_least_squares_decoders, spec_matrices

FLOAT64_UNIT_ROUNDOFF = 2.0**-53
DEFAULT_KAPPA = float(cerar.DEFAULT_KAPPA_MAX)
TABLE = stored_codes.read_table()
ENTRIES = [] if TABLE is None else TABLE["codes"]
REBUILD = "rebuild it: python scripts/codes/build_shipped_codes.py"


def _id(entry: dict) -> str:
    return f"N{entry['N']}-c{entry['c']}-k{entry['kappa_max']:g}"


def _shape(entry: dict) -> tuple[int, int, float]:
    return entry["N"], entry["c"], float(entry["kappa_max"])


@pytest.fixture
def no_stored_codes(monkeypatch, tmp_path):
    """An empty host cache and make_code's in-process memo cleared, so only the table or a search
    can answer."""
    monkeypatch.setenv("CERAR_CACHE_DIR", str(tmp_path / "empty-cache"))
    cerar.codes._make_code_cached.cache_clear()
    yield
    cerar.codes._make_code_cached.cache_clear()


@pytest.fixture
def counted_searches(monkeypatch):
    """Every call of the search, recorded as (N, c, kappa_max); the search still runs."""
    calls = []
    real_search = optimize.search

    def search(N, c, kappa_max):
        calls.append((N, c, kappa_max))
        return real_search(N, c, kappa_max)

    monkeypatch.setattr(optimize, "search", search)
    return calls


# --- the table and what it covers ----------------------------------------------------------------


def test_the_table_was_searched_by_the_current_search_code():
    """The package uses the table only while this holds; a changed search must be rebuilt into it
    before it ships (comments and docstrings do not count, see the next test)."""
    assert TABLE is not None, f"{stored_codes.SHIPPED_TABLE} is missing; {REBUILD}"
    assert TABLE["search_code_version"] == optimize.SEARCH_CODE_VERSION, f"the search code changed; {REBUILD}"
    assert TABLE["search_parameters"] == json.loads(json.dumps(optimize.SEARCH_PARAMETERS)), REBUILD


def test_the_search_codes_version_ignores_comments_and_docstrings_only():
    sources = [path.read_text(encoding="utf-8") for path in optimize.SEARCH_CODE_MODULES]
    search, closed_forms = sources
    assert optimize.search_code_digest(sources) == optimize.SEARCH_CODE_VERSION
    cosmetic = [
        ('"""The condition-number-constrained', '"""Reworded. The condition-number-constrained'),
        ("    return min(candidates, key", "    # a new comment\n\n    return min(candidates, key"),
        ('DECODER_KINDS = ("polynomial", "least_squares")', 'DECODER_KINDS = (\n    "polynomial",  "least_squares"\n)'),
    ]
    meaningful = [
        ('"pattern_iterations": 120', '"pattern_iterations": 121'),
        ("return min(candidates, key=lambda cand: cand.error)", "return max(candidates, key=lambda cand: cand.error)"),
        ("unreachable for construction 'optimized'", "out of reach for construction 'optimized'"),  # an f-string
    ]
    for old, _ in cosmetic + meaningful:
        assert old in search, old
    for old, new in cosmetic:
        assert optimize.search_code_digest([search.replace(old, new), closed_forms]) == optimize.SEARCH_CODE_VERSION
    for old, new in meaningful:
        assert optimize.search_code_digest([search.replace(old, new), closed_forms]) != optimize.SEARCH_CODE_VERSION
    edited = closed_forms.replace("DEFAULT_KAPPA_MAX = 1e4", "DEFAULT_KAPPA_MAX = 1e5")
    assert optimize.search_code_digest([search, edited]) != optimize.SEARCH_CODE_VERSION


def test_the_table_holds_the_grid_and_the_presets_shapes():
    """N = 2..8 with c = N+1..4N (c <= N is the exact code, never searched) at the default budget,
    N = 4 and 8 at c = 16 and 32 (the presets and README), and every code once."""
    shipped = [_shape(e) for e in ENTRIES]
    assert len(shipped) == len(set(shipped)), "a shape is in the table twice"
    wanted = {(N, c, DEFAULT_KAPPA) for N in range(2, 9) for c in range(N + 1, 4 * N + 1)}
    wanted |= {(4, 16, DEFAULT_KAPPA), (8, 16, DEFAULT_KAPPA), (8, 32, DEFAULT_KAPPA)}
    missing = sorted(wanted - set(shipped))
    assert not missing, f"not in the table: {missing}; {REBUILD}"
    for entry in ENTRIES:
        assert entry["search_cpu_seconds"] >= 0 and entry["search_seconds"] >= 0, _id(entry)


# --- a sample searched again ---------------------------------------------------------------------

SAMPLE = [(3, 7), (6, 10), (3, 9)]
"""The cheapest shapes of each kind: (3, 7) and (6, 10) search no pattern (the perturbation start and
its least-squares decoders, 0.1 s), (3, 9) a pattern (c = 3N, 5 CPU seconds). Not N = 2, whose
patterns all err 0 to rounding: Nelder-Mead's path there follows rounding noise, whichever code it
ends at is as good, and another machine may end at another."""


@pytest.mark.parametrize("N, c", SAMPLE)
def test_a_sample_of_the_table_is_what_the_search_finds(N, c):
    """The search, run here, finds the shipped code: bit for bit where this machine's linear algebra
    rounds as the builder's did (measured: it does here); elsewhere Nelder-Mead may take another path
    through ties of a few ulps, so the points may move within the search's own tolerance on the
    pattern's shape (xatol, relative to the pattern's size) and the error within its fatol."""
    entry = stored_codes.shipped_entries()[(N, c, DEFAULT_KAPPA)]
    found = optimize.search(N, c, DEFAULT_KAPPA)
    assert (found.decoders, found.origin) == (entry["decoders"], entry["origin"])
    shipped_points = stored_codes.entry_points(entry)
    size = np.abs(shipped_points).max()
    assert np.abs(found.points - shipped_points).max() <= 10 * optimize.SEARCH_PARAMETERS["pattern_xatol"] * size
    assert abs(found.error - entry["predicted_error"]) <= 10 * optimize.SEARCH_PARAMETERS["pattern_fatol"]
    assert optimize.matrices_from_points(shipped_points, N, entry["decoders"])[1].shape == found.A.shape


# --- every shipped code, against the spec --------------------------------------------------------


def _rounding_bound(kappa: float, c: int, L: int, N: int) -> float:
    """Relative float64 rounding of one run of the protocol: the unit roundoff amplified by kappa and
    by sqrt(c + L) + N (the sums of c + L coded terms and of N workers in each block), as in
    tests/test_spec_reference.py."""
    return max(kappa, 1.0) * FLOAT64_UNIT_ROUNDOFF * (np.sqrt(c + L) + N)


def _least_squares_conditioning(A: np.ndarray, N: int) -> float:
    """cond(M) + cond(M)^2 over the workers' block matrices M_i = [E_1(A_{i-1}), ..., E_{N-1}(A_{i-N+1})]:
    how much a least-squares solution moves per unit roundoff (Wedin's bound; the square term is
    the residual's share)."""
    c, L = A.shape[-1], A.shape[-1] + N - 2
    worst = 0.0
    for i in range(N):
        M = np.zeros((L, (N - 1) * c))
        for h in range(1, N):
            M[h - 1 : h - 1 + c, (h - 1) * c : h * c] = A[(i - h) % N]
        worst = max(worst, np.linalg.cond(M))
    return worst + worst**2


def _sampling_spread(code: cerar.Code, m: int) -> np.ndarray:
    """Each worker's relative standard deviation of its measured error ||E_i|| / ||S|| on m Gaussian
    columns around the predicted value: E_i's columns are i.i.d. N(0, Sigma_i) with
    Sigma_i = sum_h R_ih R_ih^T, so ||E_i||^2 has relative spread sqrt(2 tr Sigma_i^2 / m) / tr Sigma_i
    (half that for ||E_i||), and ||S|| sqrt(1 / (2 c m))."""
    R = code.residuals()
    spread = np.zeros(code.N)
    for i in range(code.N):
        Sigma = sum(R[i, h] @ R[i, h].T for h in range(code.N - 1))
        trace = np.trace(Sigma)
        spread[i] = 0.5 * np.sqrt(2 * np.trace(Sigma @ Sigma) / m) / trace if trace > 0 else 0.0
    return spread + np.sqrt(1 / (2 * code.c * m))


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_every_shipped_code_has_the_properties_the_spec_requires(entry, no_stored_codes, monkeypatch):
    N, c, kappa_max = _shape(entry)

    def no_search(*args):
        raise AssertionError(f"make_code searched for the shipped shape N={N}, c={c}, kappa_max={kappa_max:g}")

    monkeypatch.setattr(optimize, "search", no_search)
    code = cerar.make_code(N, c, "optimized", kappa_max=kappa_max)
    L = c + N - 2
    assert (code.A.shape, code.D.shape, code.points.shape) == ((N, c, c), (N, c, L), (c,))
    assert code.kappa_max == kappa_max

    # A_j as the spec builds it from the points, D_i the spec's polynomial or least-squares decoder,
    # each within the rounding of building it (A_j: kappa; least squares: cond(M_i) and its square)
    A, D_polynomial = spec_matrices(code.points, N)
    assert np.abs(code.A - A).max() <= code.kappa * FLOAT64_UNIT_ROUNDOFF * c * max(1.0, np.abs(A).max())
    if entry["decoders"] == "polynomial":
        D, conditioning = D_polynomial, code.kappa
    else:
        D, conditioning = spec_least_squares_decoders(A, N), _least_squares_conditioning(A, N)
    assert np.abs(code.D - D).max() <= conditioning * FLOAT64_UNIT_ROUNDOFF * (c + L) * max(1.0, np.abs(D).max())

    # kappa within the budget, measured on the spec's matrices
    kappa = max(np.linalg.cond(A[j]) for j in range(N))
    assert kappa <= kappa_max * (1 + 1e-6), kappa
    assert code.kappa == pytest.approx(entry["kappa"], rel=1e-9)

    # each worker errs as predicted, through the spec's protocol in float64
    m = 2048
    G = np.random.default_rng(N * 1000 + c).standard_normal((N, c * m))
    S = G.sum(0)
    errors = np.linalg.norm(spec_all_reduce(G, code.A, code.D) - S, axis=1) / np.linalg.norm(S)
    predicted = code.worker_errors()
    rounding = _rounding_bound(code.kappa, c, L, N)
    allowed = 6 * _sampling_spread(code, m) * predicted + rounding
    assert np.all(np.abs(errors - predicted) <= allowed), (errors, predicted, allowed)
    assert abs(errors.max() - code.predicted_error()) <= allowed.max()
    assert code.predicted_error() == pytest.approx(entry["predicted_error"], rel=1e-6, abs=1e-12)
    # the last worker, whose sum never wraps round the ring, is exact (every worker at N = 2)
    assert errors[N - 1] <= rounding, errors
    if N == 2:
        assert errors.max() <= rounding, errors


# --- make_code reads the table first -------------------------------------------------------------


def test_make_code_reads_a_shipped_shape_without_searching(no_stored_codes, counted_searches):
    for N, c in [(4, 16), (8, 16), (8, 32)]:
        code = cerar.make_code(N, c, "optimized")
        entry = stored_codes.shipped_entries()[(N, c, DEFAULT_KAPPA)]
        assert np.array_equal(code.points, stored_codes.entry_points(entry))
    assert counted_searches == []
    assert not (stored_codes.cache_dir()).exists()  # nothing was searched, so nothing was cached


def test_a_shape_outside_the_table_is_searched_once_then_read_from_the_cache(no_stored_codes, counted_searches):
    shape = (3, 5, 2e3)
    assert shape not in stored_codes.shipped_entries()
    first = cerar.make_code(3, 5, "optimized", kappa_max=2e3)
    cerar.codes._make_code_cached.cache_clear()
    again = cerar.make_code(3, 5, "optimized", kappa_max=2e3)
    assert counted_searches == [shape]
    assert np.array_equal(first.A, again.A) and np.array_equal(first.D, again.D)
    assert len(list(stored_codes.cache_dir().glob(f"optimized-{optimize.SEARCH_CODE_VERSION}-N3-c5-*.npz"))) == 1


def test_a_table_from_other_search_code_is_not_used(no_stored_codes, counted_searches, monkeypatch):
    """After an edit of the search, its own results count: the shape is searched like any other."""
    monkeypatch.setattr(optimize, "SEARCH_CODE_VERSION", "edited-search")
    code = cerar.make_code(3, 7, "optimized")
    assert counted_searches == [(3, 7, DEFAULT_KAPPA)]
    assert code.kappa <= DEFAULT_KAPPA * (1 + 1e-9)


def test_a_shipped_code_that_does_not_rebuild_as_recorded_is_refused(tmp_path, monkeypatch):
    table = json.loads(stored_codes.SHIPPED_TABLE.read_text(encoding="utf-8"))
    entry = next(e for e in table["codes"] if _shape(e) == (4, 16, DEFAULT_KAPPA))
    entry["points"] = [[re * 1.001, im * 1.001] for re, im in entry["points"]]  # another code, as valid
    forged = tmp_path / "optimized_codes.json"
    forged.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.setattr(stored_codes, "SHIPPED_TABLE", forged)
    with pytest.raises(stored_codes.ShippedTableError, match="N=4, c=16"):
        stored_codes.shipped_code(4, 16, DEFAULT_KAPPA)


def test_a_malformed_table_is_named(tmp_path, monkeypatch):
    broken = tmp_path / "optimized_codes.json"
    broken.write_text('{"format": 1, "codes": [', encoding="utf-8")
    monkeypatch.setattr(stored_codes, "SHIPPED_TABLE", broken)
    with pytest.raises(stored_codes.ShippedTableError, match="optimized_codes.json"):
        stored_codes.shipped_entries()
