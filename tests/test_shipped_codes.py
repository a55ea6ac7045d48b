"""The optimized codes shipped in cerar/coding/data/optimized_codes.json, held to the search and to the spec.

A sample (the cheapest shapes) is searched again and must come out as shipped; every shipped code is
rebuilt by make_code's path and checked for what the specification requires, against
``tests/spec_reference.py``: the matrices A_j and D_i from its points as the spec builds them, kappa
within the budget, each worker's error on Gaussian gradients, run through the spec's protocol in
float64, as the code predicts, and the last worker exact. ``make_code`` must read a shipped shape
without searching, and refuse a shape the table records as unreachable without searching. A search
that fails outside the table is paid once: its refusal is cached under the search's identity.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import cerar
from cerar.coding import optimize, stored_codes
from scripts.codes import build_shipped_codes
from tests.spec_reference import spec_all_reduce, spec_least_squares_decoders, spec_matrices

FLOAT64_UNIT_ROUNDOFF = 2.0**-53
DEFAULT_KAPPA = float(cerar.DEFAULT_KAPPA_MAX)
TABLE = stored_codes.read_table()
ENTRIES = [] if TABLE is None else TABLE["codes"]
UNREACHABLE = [] if TABLE is None else TABLE["unreachable"]
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
    cerar.coding.codes._make_code_cached.cache_clear()
    yield
    cerar.coding.codes._make_code_cached.cache_clear()


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


@pytest.mark.quick
def test_the_table_was_searched_by_the_current_search_code():
    """The package uses the table only while this holds; a changed search must be rebuilt into it
    before it ships (comments and docstrings do not count, see the next test)."""
    assert TABLE is not None, f"{stored_codes.SHIPPED_TABLE} is missing; {REBUILD}"
    assert TABLE["search_code_version"] == optimize.SEARCH_CODE_VERSION, f"the search code changed; {REBUILD}"
    assert TABLE["search_parameters"] == json.loads(json.dumps(optimize.SEARCH_PARAMETERS)), REBUILD
    assert stored_codes.shipped_entries() and stored_codes.shipped_unreachable()  # so the package uses it


@pytest.mark.quick
def test_the_search_codes_version_ignores_comments_docstrings_and_imports_only():
    sources = [path.read_text(encoding="utf-8") for path in optimize.SEARCH_CODE_MODULES]
    search, closed_forms = sources
    assert optimize.search_code_digest(sources) == optimize.SEARCH_CODE_VERSION
    cosmetic = [
        ('"""The condition-number-constrained', '"""Reworded. The condition-number-constrained'),
        ("    return min(candidates, key", "    # a new comment\n\n    return min(candidates, key"),
        ('DECODER_KINDS = ("polynomial", "least_squares")', 'DECODER_KINDS = (\n    "polynomial",  "least_squares"\n)'),
        ("from cerar.coding import closed_forms\n", "from cerar import closed_forms\n"),  # a module moved (issue 37)
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
    for entry in ENTRIES + UNREACHABLE:
        assert entry["search_cpu_seconds"] >= 0 and entry["search_seconds"] >= 0, _id(entry)


def test_every_shape_the_builder_plans_is_in_the_table_as_a_code_or_as_unreachable():
    """So that make_code neither searches nor fails slowly for any of them: a shape whose budget the
    search cannot meet is recorded as such, never left out."""
    refused = [_shape(e) for e in UNREACHABLE]
    assert len(refused) == len(set(refused)) and not set(refused) & {_shape(e) for e in ENTRIES}
    planned = {(N, c, kappa_max) for _, N, c, kappa_max in build_shipped_codes.plan(list(build_shipped_codes.TIERS))}
    missing = sorted(planned - {_shape(e) for e in ENTRIES} - set(refused))
    assert not missing, f"planned but neither shipped nor recorded as unreachable: {missing}; {REBUILD}"


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


UNREACHABLE_SAMPLE = [(3, 16, DEFAULT_KAPPA), (4, 16, 1e2)]
"""The cheapest recorded failures of each kind: (3, 16) tries the perturbation family only (c is not a
multiple of N, 0.1 s), (4, 16) at kappa_max 1e2 the patterns too (c = 4N, 2 CPU seconds)."""


@pytest.mark.parametrize("N, c, kappa_max", UNREACHABLE_SAMPLE)
def test_a_sample_of_the_recorded_failures_is_what_the_search_reaches(N, c, kappa_max):
    """The search, run here, fails as recorded, reaching the recorded least kappa: a minimum over the
    condition numbers of the designs it tried, which are the same on every machine (the closed form's
    fixed eps grid; Nelder-Mead's path over patterns that are all infeasible, whose objective is one
    constant), so equal up to the rounding of the condition numbers themselves."""
    entry = stored_codes.shipped_unreachable()[(N, c, kappa_max)]
    with pytest.raises(optimize.UnreachableBudgetError) as refusal:
        optimize.search(N, c, kappa_max)
    assert refusal.value.best_kappa == pytest.approx(entry["best_kappa"], rel=1e-6)


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
    # the shipped table's figure, as rebuilt here: float64 arithmetic through matrices of condition kappa, which
    # another machine's BLAS rounds differently by up to ~kappa u (c + L) (1.8e-12 seen on a kappa 1e6 code whose
    # error is 1.7e-6)
    rounding64 = code.kappa * FLOAT64_UNIT_ROUNDOFF * (c + L)
    assert code.predicted_error() == pytest.approx(entry["predicted_error"], rel=1e-6, abs=rounding64)
    # the last worker, whose sum never wraps round the ring, is exact (every worker at N = 2)
    assert errors[N - 1] <= rounding, errors
    if N == 2:
        assert errors.max() <= rounding, errors


# --- make_code reads the table first -------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("entry", UNREACHABLE, ids=_id)
def test_a_shape_recorded_as_unreachable_is_refused_at_once_naming_what_the_search_reached(
    entry, no_stored_codes, counted_searches
):
    N, c, kappa_max = _shape(entry)
    with pytest.raises(ValueError) as refusal:
        cerar.make_code(N, c, "optimized", kappa_max=kappa_max)
    assert isinstance(refusal.value, optimize.UnreachableBudgetError)
    message = str(refusal.value)
    for named in (f"N={N}, c={c}", f"kappa_max={kappa_max:g}", f"reached is {entry['best_kappa']:.4g}"):
        assert named in message, (named, message)
    assert refusal.value.best_kappa == entry["best_kappa"] > kappa_max
    assert counted_searches == []
    assert not stored_codes.cache_dir().exists()  # nothing searched, nothing cached


def test_no_shape_is_recorded_as_out_of_reach_at_a_budget_above_one_it_met():
    """Every design that meets a budget meets every larger one, so a code shipped at (N, c, k) and a
    failure recorded at (N, c, k') with k' >= k contradict each other: one of them is stale."""
    for failure in UNREACHABLE:
        N, c, kappa_max = _shape(failure)
        met = [entry["kappa_max"] for entry in ENTRIES if (entry["N"], entry["c"]) == (N, c)]
        assert all(budget > kappa_max for budget in met), (_id(failure), met)


@pytest.mark.quick
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
    cerar.coding.codes._make_code_cached.cache_clear()
    again = cerar.make_code(3, 5, "optimized", kappa_max=2e3)
    assert counted_searches == [shape]
    assert np.array_equal(first.A, again.A) and np.array_equal(first.D, again.D)
    key = f"{optimize.SEARCH_CODE_VERSION}-p{stored_codes.search_parameters_digest()}"
    assert len(list(stored_codes.cache_dir().glob(f"optimized-{key}-N3-c5-*.npz"))) == 1


FAILING = (2, 4, 1.5)
"""A shape outside the table whose budget no code meets: c = 2N has no pattern to search, so the
search fails at once (0.1 s) and the test can run it several times."""


def _refusal(N, c, kappa_max) -> optimize.UnreachableBudgetError:
    cerar.coding.codes._make_code_cached.cache_clear()
    with pytest.raises(optimize.UnreachableBudgetError) as refusal:
        cerar.make_code(N, c, "optimized", kappa_max=kappa_max)
    return refusal.value


@pytest.mark.quick
def test_a_failed_search_is_recorded_in_the_cache_and_refused_at_once_the_next_time(no_stored_codes, counted_searches):
    assert FAILING not in stored_codes.shipped_entries() and FAILING not in stored_codes.shipped_unreachable()
    first = _refusal(*FAILING)
    assert counted_searches == [FAILING]
    assert "kappa_max=1.5 is unreachable for construction 'optimized' at N=2, c=4" in str(first)
    # the least kappa the search reached: no more than the perturbation design's at the largest eps the
    # search tries (0.999), whose kappa the closed form reports independently, and beyond the budget
    widest = cerar.make_code(2, 4, "perturbation", eps=0.999)
    assert FAILING[2] < first.best_kappa <= widest.kappa * (1 + 1e-9)

    records = list(stored_codes.cache_dir().glob("*.unreachable.json"))
    assert len(records) == 1
    record = json.loads(records[0].read_text(encoding="utf-8"))
    identity = stored_codes.search_identity()
    assert record == {"N": 2, "c": 4, "kappa_max": 1.5, "best_kappa": first.best_kappa, **identity}

    again = _refusal(*FAILING)  # a fresh memo, as in another process: read from the cache
    assert counted_searches == [FAILING]  # not searched again
    assert str(again) == str(first) and again.best_kappa == first.best_kappa


@pytest.mark.quick
def test_a_recorded_failure_is_searched_again_by_another_search_code_or_parameters(
    no_stored_codes, counted_searches, monkeypatch
):
    _refusal(*FAILING)
    assert len(counted_searches) == 1
    with monkeypatch.context() as edited:
        edited.setattr(optimize, "SEARCH_CODE_VERSION", "edited-search")
        _refusal(*FAILING)
        assert len(counted_searches) == 2
    with monkeypatch.context() as edited:
        edited.setitem(optimize.SEARCH_PARAMETERS, "pattern_iterations", 7)
        _refusal(*FAILING)
        assert len(counted_searches) == 3
        _refusal(*FAILING)  # each search's refusal is its own record
        assert len(counted_searches) == 3
    _refusal(*FAILING)  # the original search's record is still there
    assert len(counted_searches) == 3
    assert len(list(stored_codes.cache_dir().glob("*.unreachable.json"))) == 3

    # a record whose contents name another search (say, a file copied between hosts) is not believed
    for record_path in stored_codes.cache_dir().glob("*.unreachable.json"):
        record = json.loads(record_path.read_text(encoding="utf-8"))
        record["search_code_version"] = "another-search"
        record_path.write_text(json.dumps(record), encoding="utf-8")
    _refusal(*FAILING)
    assert len(counted_searches) == 4


def test_a_table_from_other_search_code_is_not_used(no_stored_codes, counted_searches, monkeypatch):
    """After an edit of the search, its own results count: the shape is searched like any other."""
    monkeypatch.setattr(optimize, "SEARCH_CODE_VERSION", "edited-search")
    code = cerar.make_code(3, 7, "optimized")
    assert counted_searches == [(3, 7, DEFAULT_KAPPA)]
    assert code.kappa <= DEFAULT_KAPPA * (1 + 1e-9)


@pytest.mark.quick
def test_a_shipped_code_that_does_not_rebuild_as_recorded_is_refused(tmp_path, monkeypatch):
    table = json.loads(stored_codes.SHIPPED_TABLE.read_text(encoding="utf-8"))
    entry = next(e for e in table["codes"] if _shape(e) == (4, 16, DEFAULT_KAPPA))
    entry["points"] = [[re * 1.001, im * 1.001] for re, im in entry["points"]]  # another code, as valid
    forged = tmp_path / "optimized_codes.json"
    forged.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.setattr(stored_codes, "SHIPPED_TABLE", forged)
    with pytest.raises(stored_codes.ShippedTableError, match="N=4, c=16"):
        stored_codes.shipped_code(4, 16, DEFAULT_KAPPA)


def test_a_table_from_other_search_parameters_is_not_used(no_stored_codes, counted_searches, monkeypatch):
    monkeypatch.setitem(optimize.SEARCH_PARAMETERS, "pattern_iterations", 7)
    assert stored_codes.shipped_entries() == {} and stored_codes.shipped_unreachable() == {}
    cerar.make_code(3, 7, "optimized")
    assert counted_searches == [(3, 7, DEFAULT_KAPPA)]


@pytest.mark.quick
def test_a_failure_recorded_within_its_budget_is_refused_as_malformed(tmp_path, monkeypatch):
    table = json.loads(stored_codes.SHIPPED_TABLE.read_text(encoding="utf-8"))
    table["unreachable"][0]["best_kappa"] = table["unreachable"][0]["kappa_max"] / 2
    forged = tmp_path / "optimized_codes.json"
    forged.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.setattr(stored_codes, "SHIPPED_TABLE", forged)
    with pytest.raises(stored_codes.ShippedTableError, match="within the budget"):
        stored_codes.shipped_unreachable()


@pytest.mark.quick
def test_a_malformed_table_is_named(tmp_path, monkeypatch):
    broken = tmp_path / "optimized_codes.json"
    broken.write_text('{"format": 1, "codes": [', encoding="utf-8")
    monkeypatch.setattr(stored_codes, "SHIPPED_TABLE", broken)
    with pytest.raises(stored_codes.ShippedTableError, match="optimized_codes.json"):
        stored_codes.shipped_entries()
