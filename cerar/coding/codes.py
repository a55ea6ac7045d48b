"""Code constructions for CERAR, in the notation of the specification.

An N-worker ring, gradients of length d split into c components (G_i is c x m, m = ceil(d/c)).
A code is the set of encoding matrices A_j (c x c, one per worker) and decoding matrices D_i
(c x L, L = c + N - 2), built from c distinct non-zero complex points a_1..a_c closed under
conjugation:

    A_j = V^-1 diag(a^j) F            D_i = F^-1 diag(a^-(i-1)) V_L

Worker i's result is S_hat_i = G_i + D_i Yhat_i. It is exact on the components carried by points
with a^N = 1; elsewhere worker i errs by (a^N - 1) times the partial sum of the workers j > i.

Constructions (all with rates L = c + N - 2 rounds, (1 + (N-2)/c) d values sent per worker):

- ``exact``        c <= N: c of the N-th roots of unity, the best-conditioned conjugate-closed subset.
- ``vandermonde``  all c points real and clustered at 1: a^N = 1 + eps*b_k. Error O(eps), kappa O(eps^-(c-1)).
- ``perturbation`` q = ceil(c/N) levels of N-th roots scaled by rho_s, rho_s^N = 1 + eps*b_s.
                   Error O(eps), kappa O(eps^-(q-1)).
- ``optimized``    the condition-number-constrained design (see ``cerar.coding.optimize``), read from the
                   table shipped with the package where it holds the shape (``cerar.coding.stored_codes``).

``eps`` is normalised so that it is the largest |a^N - 1| over the points: the worst factor by which
any component's wrapped partial sum is mis-weighted. It must lie in (0, 1). When it is omitted it is
the smallest eps whose code satisfies kappa <= kappa_max (default ``DEFAULT_KAPPA_MAX``).
"""

from __future__ import annotations

import functools

import numpy as np

from cerar.coding.closed_forms import (
    CONSTRUCTIONS,
    DEFAULT_KAPPA_MAX,
    Code,
    closed_form_code,
    code_from_matrices,
    decoders,
    encoders,
    exact_points,
    max_condition,
    ordered_points,
    perturbation_levels,
    perturbation_points,
    real_to_points,
    ring_rounds,
    roots_of_unity,
    smallest_feasible,
    vandermonde_points,
)
from cerar.coding.stored_codes import optimized_code

__all__ = [
    "CONSTRUCTIONS",
    "DEFAULT_KAPPA_MAX",
    "Code",
    "code_from_matrices",
    "decoders",
    "encoders",
    "exact_points",
    "make_code",
    "max_condition",
    "ordered_points",
    "perturbation_levels",
    "perturbation_points",
    "real_to_points",
    "ring_rounds",
    "roots_of_unity",
    "smallest_feasible",
    "vandermonde_points",
]


def make_code(
    N: int,
    c: int,
    construction: str = "perturbation",
    eps: float | None = None,
    kappa_max: float | None = None,
) -> Code:
    """Build (or fetch from the cache) the CERAR code for N workers and c components.

    The same arguments give bit-identical matrices in every process. Raises ValueError naming the
    argument for invalid input, and when no code of the construction meets ``kappa_max``: for
    ``optimized`` a ``cerar.coding.optimize.UnreachableBudgetError`` naming the least kappa the search
    reached, at once where the shipped table or the host's cache records that the search fails
    (``cerar.coding.stored_codes``), so that a failed search is paid once per host, not on every call.
    """
    N, c, construction, eps, kappa_max = _validated(N, c, construction, eps, kappa_max)
    return _make_code_cached(N, c, construction, eps, kappa_max)


def _validated(N, c, construction, eps, kappa_max):
    if isinstance(N, bool) or not isinstance(N, (int, np.integer)) or N < 1:
        raise ValueError(f"N (number of workers) must be an integer >= 1, got {N!r}")
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
        raise ValueError(f"c (number of components) must be an integer >= 1, got {c!r}")
    if construction not in CONSTRUCTIONS:
        raise ValueError(f"construction must be one of {CONSTRUCTIONS}, got {construction!r}")
    if eps is not None and not (isinstance(eps, (int, float)) and 0 < eps < 1):
        raise ValueError(f"eps must lie in (0, 1), got {eps!r}")
    if kappa_max is not None and not (isinstance(kappa_max, (int, float)) and kappa_max >= 1):
        raise ValueError(f"kappa_max must be a number >= 1, got {kappa_max!r}")
    if construction == "exact" and c > N:
        raise ValueError(f"construction 'exact' needs c <= N (only N N-th roots of unity exist), got c={c}, N={N}")
    eps = None if eps is None else float(eps)
    kappa_max = None if kappa_max is None else float(kappa_max)
    return int(N), int(c), construction, eps, kappa_max


@functools.lru_cache(maxsize=256)
def _make_code_cached(N, c, construction, eps, kappa_max) -> Code:
    if construction == "optimized" and N > 1 and c > N:
        return optimized_code(N, c, eps=eps, kappa_max=kappa_max)
    return closed_form_code(N, c, construction, eps, kappa_max)
