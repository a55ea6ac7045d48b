"""The codes' building blocks: ``Code``, the evaluation points of the closed-form constructions and
the matrices A_j and D_i they give (the specification's "The code"). ``cerar.coding.codes.make_code``
chooses among them and ``cerar.coding.optimize`` searches beyond them; neither is imported here.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

CONSTRUCTIONS = ("exact", "vandermonde", "perturbation", "optimized")

DEFAULT_KAPPA_MAX = 1e4
"""Default condition-number budget: float32 transport then errs by about 1e-3 from rounding (spec)."""

LOW_PRECISION_KAPPA_LIMIT = 4.0
"""Retired: nothing reads it. 16-bit transport is decided by the derived rule instead
(``cerar.ring.precision.check_admissible``: a code's rounding bound on the wire against its own error).
It stays only because this module's tokens version the search of the shipped optimized codes
(``cerar.coding.optimize.SEARCH_CODE_VERSION``): removing it would make the shipped table stale."""

_IMAG_TOLERANCE = 1e-9
"""Relative size of the imaginary parts that construction rounding may leave in A_j and D_i."""


@dataclass(frozen=True, eq=False)
class Code:
    """A CERAR code for an N-worker ring with c components.

    ``A[j]`` encodes worker j's c x m gradient matrix, ``D[i]`` decodes what worker i received.
    Arrays are read-only float64; ``points`` are the complex evaluation points a_1..a_c.
    """

    N: int
    c: int
    construction: str
    eps: float | None
    kappa_max: float | None
    points: np.ndarray = field(repr=False)
    A: np.ndarray = field(repr=False)
    D: np.ndarray = field(repr=False)
    kappa: float = 0.0

    @property
    def L(self) -> int:
        """Communication rounds: c + N - 2 (no rounds on a ring of one)."""
        return ring_rounds(self.N, self.c)

    def m_for(self, d: int) -> int:
        """Block length for a gradient of length d: m = ceil(d / c)."""
        if d < 0:
            raise ValueError(f"d must be >= 0, got {d}")
        return -(-d // self.c)

    @property
    def comm_rate(self) -> float:
        """Values sent per worker as a multiple of d: L / c = 1 + (N - 2) / c."""
        return self.L / self.c

    @property
    def ring_rate(self) -> float:
        """The exact ring all-reduce's rate, 2 (N - 1) / N, for comparison."""
        return 2 * (self.N - 1) / self.N

    @property
    def storage_rate(self) -> float:
        """Working storage beyond the input as a multiple of d: 1 + N / c."""
        return 1 + self.N / self.c

    @property
    def is_exact(self) -> bool:
        """Whether every worker obtains the exact sum (all points satisfy a^N = 1)."""
        return self.N == 1 or bool(np.all(np.abs(self.points**self.N - 1) < 1e-12))

    def residuals(self) -> np.ndarray:
        """R[i, h-1] = D_i E_h(A_{i-h}) - I, for h = 1..N-1: worker i's error operator on G_{i-h}.

        Worker i's error is sum_h R[i, h-1] G_{i-h}. Shape [N, N-1, c, c].
        """
        N, c = self.N, self.c
        R = np.zeros((N, max(N - 1, 0), c, c))
        for i in range(N):
            for h in range(1, N):
                R[i, h - 1] = self.D[i][:, h - 1 : h - 1 + c] @ self.A[(i - h) % N] - np.eye(c)
        return R

    def worker_errors(self) -> np.ndarray:
        """Each worker's expected relative error on i.i.d. Gaussian gradients (no rounding).

        E||S_hat_i - S||^2 = m sum_h ||R_ih||_F^2 and E||S||^2 = N c m.
        """
        if self.N == 1:
            return np.zeros(1)
        R = self.residuals()
        return np.sqrt((R**2).sum(axis=(1, 2, 3)) / (self.N * self.c))

    def predicted_error(self) -> float:
        """The worst worker's expected relative error on Gaussian gradients, from the code alone.

        Analytic: it covers the code's truncation error, not transport rounding (which grows with
        kappa times the dtype's unit roundoff).
        """
        return float(self.worker_errors().max())


def ring_rounds(N: int, c: int) -> int:
    """L = c + N - 2 rounds for N >= 2; a ring of one worker needs none."""
    return c + N - 2 if N > 1 else 0


def closed_form_code(N: int, c: int, construction: str, eps: float | None, kappa_max: float | None) -> Code:
    """The exact, Vandermonde or perturbation code (arguments already validated): with ``eps``
    omitted, the smallest eps whose code meets kappa_max (default ``DEFAULT_KAPPA_MAX``)."""
    if N == 1:
        # A ring of one: no rounds, S_hat = G. The points are never used; any valid set will do.
        return _freeze(N, c, construction, None, kappa_max, roots_of_unity(c))
    if c <= N and construction != "vandermonde":
        # Every construction but the clustered one degenerates to the exact code when c <= N.
        return _freeze(N, c, construction, None, kappa_max, exact_points(N, c))
    if construction not in ("vandermonde", "perturbation"):
        raise ValueError(f"{construction!r} is not a closed-form construction for c={c} > N={N}")
    points_for = {"vandermonde": vandermonde_points, "perturbation": perturbation_points}[construction]
    if eps is None:
        eps = _eps_for_kappa(lambda e: points_for(N, c, e), N, kappa_max or DEFAULT_KAPPA_MAX, construction)
    code = _freeze(N, c, construction, eps, kappa_max, points_for(N, c, eps))
    if kappa_max is not None and code.kappa > kappa_max * (1 + 1e-9):
        raise ValueError(
            f"kappa_max={kappa_max:g} is not met by construction {construction!r} at eps={eps:g} "
            f"(kappa={code.kappa:.3g}); raise eps or kappa_max"
        )
    return code


# ---------------------------------------------------------------------------------------------
# Points
# ---------------------------------------------------------------------------------------------


def roots_of_unity(N: int) -> np.ndarray:
    """w^r for r = 0..N-1, w = exp(2 pi i / N), with exact real parts at r = 0 and r = N/2."""
    r = np.arange(N)
    w = np.exp(2j * np.pi * r / N)
    w[0] = 1.0
    if N % 2 == 0:
        w[N // 2] = -1.0
    w[N - r[1 : (N + 1) // 2]] = np.conj(w[r[1 : (N + 1) // 2]])  # exactly conjugate-closed
    return w


def _conjugate_closed_subsets(N: int, k: int, limit: int = 512):
    """Index sets of k N-th roots of unity closed under conjugation (all of them, or a spread
    sample when there are more than ``limit``)."""
    reals = [0] + ([N // 2] if N % 2 == 0 else [])
    pairs = list(range(1, (N + 1) // 2))  # r and N - r
    options = []
    for n_real in range(len(reals) + 1):
        n_pairs, rest = divmod(k - n_real, 2)
        if rest or n_pairs < 0 or n_pairs > len(pairs):
            continue
        for real_set in itertools.combinations(reals, n_real):
            if math.comb(len(pairs), n_pairs) <= limit:
                pair_sets = itertools.combinations(pairs, n_pairs)
            else:  # evenly spread pairs: a well-conditioned choice when enumeration is too costly
                spread = np.linspace(1, len(pairs), n_pairs).round().astype(int).tolist()
                pair_sets = [tuple(sorted(set(spread)))] if len(set(spread)) == n_pairs else []
            for pair_set in pair_sets:
                options.append(list(real_set) + [x for r in pair_set for x in (r, N - r)])
    return options


def _best_conditioned(N: int, candidates: list[np.ndarray]) -> np.ndarray:
    """The candidate point set whose code has the smallest kappa (first one on ties)."""
    best, best_kappa = None, np.inf
    for points in candidates:
        kappa = max_condition(encoders(ordered_points(points), N))
        if kappa < best_kappa - 1e-9:
            best, best_kappa = points, kappa
    if best is None:
        raise ValueError(f"no conjugate-closed point set found for N={N}")
    return best


def exact_points(N: int, c: int) -> np.ndarray:
    """c distinct N-th roots of unity, conjugate-closed, with the smallest kappa (c <= N)."""
    w = roots_of_unity(N)
    return _best_conditioned(N, [w[idx] for idx in _conjugate_closed_subsets(N, c)])


def perturbation_levels(count: int) -> np.ndarray:
    """b = 0, 1, -1, 2, -2, ... normalised to max |b| = 1 (so eps is the largest |a^N - 1|)."""
    b = np.array([0] + [s * k for k in range(1, count) for s in (1, -1)][: count - 1], dtype=float)
    top = np.abs(b).max()
    return b / top if top > 0 else b


def perturbation_points(N: int, c: int, eps: float) -> np.ndarray:
    """q = ceil(c/N) levels rho_s w^r with rho_s^N = 1 + eps b_s; the last level is the
    best-conditioned conjugate-closed subset of the roots."""
    q = -(-c // N)
    rho = (1 + eps * perturbation_levels(q)) ** (1 / N)
    w = roots_of_unity(N)
    full = np.concatenate([rho[s] * w for s in range(q - 1)])
    last = c - N * (q - 1)
    candidates = [np.concatenate([full, rho[q - 1] * w[idx]]) for idx in _conjugate_closed_subsets(N, last)]
    return _best_conditioned(N, candidates)


def vandermonde_points(N: int, c: int, eps: float) -> np.ndarray:
    """c real points clustered at 1: a_k^N = 1 + eps b_k with b = 0, 1, -1, ... normalised."""
    return (1 + eps * perturbation_levels(c)) ** (1 / N) + 0j


def ordered_points(points: np.ndarray) -> np.ndarray:
    """Points in the canonical order: real points first (ascending), then conjugate pairs
    (a, conj a) with Im a > 0, by angle then modulus. Raises if not conjugate-closed."""
    points = np.asarray(points, dtype=complex)
    tol = 1e-12 * max(1.0, np.abs(points).max())
    real = np.sort(points[np.abs(points.imag) <= tol].real).astype(complex)
    upper = points[points.imag > tol]
    upper = upper[np.lexsort((np.abs(upper), np.angle(upper)))]
    lower = points[points.imag < -tol]
    if len(upper) != len(lower) or not np.allclose(_canonical_sort(np.conj(upper)), _canonical_sort(lower)):
        raise ValueError("points must be closed under conjugation")
    pairs = np.stack([upper, np.conj(upper)], axis=1).reshape(-1)
    ordered = np.concatenate([real, pairs])
    if len(np.unique(ordered.round(14))) != len(ordered) or np.any(ordered == 0):
        raise ValueError("points must be distinct and non-zero")
    return ordered


# ---------------------------------------------------------------------------------------------
# Matrices
# ---------------------------------------------------------------------------------------------


def _canonical_sort(z: np.ndarray) -> np.ndarray:
    return z[np.lexsort((z.imag.round(10), z.real.round(10)))]


def real_to_points(points: np.ndarray) -> np.ndarray:
    """F (c x c complex): a real point carries one component; a pair (a, conj a) carries two
    components (p, q) as (p + iq, p - iq). ``points`` must be in canonical order."""
    c = len(points)
    F = np.zeros((c, c), dtype=complex)
    r = 0
    while r < c:
        if abs(points[r].imag) == 0:
            F[r, r] = 1
            r += 1
        else:
            F[r, r], F[r, r + 1] = 1, 1j
            F[r + 1, r], F[r + 1, r + 1] = 1, -1j
            r += 2
    return F


def encoders(points: np.ndarray, N: int) -> np.ndarray:
    """A_j = V^-1 diag(a^j) F for j = 0..N-1 (complex, before the reality check)."""
    c = len(points)
    V = np.vander(points, c, increasing=True)
    F = real_to_points(points)
    powers = points[None, :] ** np.arange(N)[:, None]  # [N, c]: a^j
    return np.linalg.solve(V[None], powers[:, :, None] * F[None])


def decoders(points: np.ndarray, N: int) -> np.ndarray:
    """D_i = F^-1 diag(a^-(i-1)) V_L for i = 0..N-1 (complex, before the reality check)."""
    c = len(points)
    V_L = np.vander(points, ring_rounds(N, c), increasing=True)
    F_inv = np.linalg.inv(real_to_points(points))
    powers = points[None, :] ** (-(np.arange(N)[:, None] - 1.0))  # [N, c]: a^-(i-1)
    return F_inv[None] @ (powers[:, :, None] * V_L[None])


def max_condition(A: np.ndarray) -> float:
    """kappa = max_j cond_2(A_j)."""
    return float(np.max(np.linalg.cond(A)))


def _real_part(M: np.ndarray, name: str, kappa_V: float) -> np.ndarray:
    """The real part of M, after checking that its imaginary part is construction rounding
    (about the unit roundoff times kappa(V)) and not a sign of points that are not
    conjugate-closed."""
    scale = max(np.abs(M).max(), 1.0)
    tolerance = max(_IMAG_TOLERANCE, 1e-14 * kappa_V)
    if np.abs(M.imag).max() > tolerance * scale:
        raise ValueError(
            f"{name} is not real to rounding (imaginary part {np.abs(M.imag).max():.2e} of {scale:.2e}, "
            f"kappa(V) = {kappa_V:.2e}): the points are too ill-conditioned to build in float64; "
            "choose a larger eps"
        )
    return np.ascontiguousarray(M.real)


def _freeze(N, c, construction, eps, kappa_max, points) -> Code:
    """Build the real float64 matrices of a point set into an immutable Code."""
    points = ordered_points(points)
    if N == 1:
        A = np.eye(c)[None].copy()
        D = np.zeros((1, c, 0))
    else:
        kappa_V = np.linalg.cond(np.vander(points, c, increasing=True))
        A = _real_part(encoders(points, N), "A_j", kappa_V)
        D = _real_part(decoders(points, N), "D_i", kappa_V)
    return code_from_matrices(N, c, construction, eps, kappa_max, points, A, D)


def code_from_matrices(N, c, construction, eps, kappa_max, points, A, D) -> Code:
    """An immutable Code from given real matrices (used by the optimiser for free-form decoders)."""
    for array in (points, A, D):
        array.setflags(write=False)
    return Code(N, c, construction, eps, kappa_max, points, A, D, kappa=max_condition(A))


def smallest_feasible(kappa, kappa_max: float, lo: float = 1e-9, hi: float = 0.999, steps: int = 30):
    """Smallest x in [lo, hi] with kappa(x) <= kappa_max, or None.

    kappa falls as the points spread from their cluster centres (x grows from 0) but can rise
    again once clusters meet, so the first feasible point of a geometric grid is bracketed and then
    refined by bisection on log x.
    """
    grid = np.geomspace(lo, hi, 32)
    feasible = [k for k, x in enumerate(grid) if kappa(x) <= kappa_max]
    if not feasible:
        return None
    k = feasible[0]
    if k == 0:
        return float(grid[0])
    below, above = grid[k - 1], grid[k]
    for _ in range(steps):
        mid = math.sqrt(below * above)
        if kappa(mid) <= kappa_max:
            above = mid
        else:
            below = mid
    return float(above)


def _eps_for_kappa(points_for, N: int, kappa_max: float, construction: str) -> float:
    """Smallest eps in (0, 1) whose code has kappa <= kappa_max: the least error within budget."""

    def kappa(eps):
        try:
            return max_condition(encoders(ordered_points(points_for(eps)), N))
        except (ValueError, np.linalg.LinAlgError):
            return np.inf

    eps = smallest_feasible(kappa, kappa_max)
    if eps is None:
        raise ValueError(
            f"kappa_max={kappa_max:g} is unreachable for construction {construction!r} "
            f"(kappa={kappa(0.999):.3g} even at eps=0.999); raise kappa_max or lower c"
        )
    return eps
