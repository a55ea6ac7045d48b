"""The condition-number-constrained design (construction ``"optimized"``).

The specification poses it as

    minimise   max_i || D_i [E_1(A_{i-1}), ..., E_{N-1}(A_{i-N+1})] - [I, ..., I] ||
    subject to kappa(A_j) <= kappa_max for all j

with E_h(A) the L x c matrix holding A in rows h..h+c-1. We solve it in two nested steps:

1. Decoders. For fixed encoders the objective separates over workers, and each worker's best
   decoder is a least-squares fit: D_i = [I, ..., I] M_i^+ with M_i the block matrix above. This
   is the minimum of the (Frobenius) objective over all decoders, so it never errs more than the
   polynomial decoder F^-1 diag(a^-(i-1)) V_L; worker N-1, exact under that decoder, stays exact.
   For N = 2 it makes every worker exact: worker 0 receives all of A_1 G_1, and A_1 is invertible.
2. Encoders. They stay in the polynomial family A_j = V^-1 diag(a^j) F, with points
   a = w^r z_k: every N-th root of unity w^r times one conjugate-closed pattern z_0 = 1,
   z_1..z_{q-1} (q = c/N). The pattern's shape is searched by Nelder-Mead. Its size is the
   smallest that meets kappa_max: kappa falls as the pattern grows from zero, and the error grows
   with it. The radial pattern of the perturbation construction is one such shape; angular
   offsets (pairs 1 + s(x +- iy)) condition better at the same size.

The result is the best of: the perturbation code tuned to kappa_max with its own decoders, the
same encoders with least-squares decoders, and the searched patterns with least-squares decoders.
It is therefore never worse than the closed form it starts from. Everything is deterministic.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from cerar import closed_forms
from cerar.closed_forms import (
    DEFAULT_KAPPA_MAX,
    Code,
    closed_form_code,
    code_from_matrices,
    encoders,
    max_condition,
    ordered_points,
    roots_of_unity,
    smallest_feasible,
)

_PATTERN_SEARCH_ITERATIONS = 120


def least_squares_decoders(A: np.ndarray, N: int) -> np.ndarray:
    """D_i = [I, ..., I] M_i^+ for each worker i: the decoders that minimise each worker's error."""
    c = A.shape[-1]
    L = c + N - 2
    target = np.tile(np.eye(c), (1, N - 1))
    D = np.empty((N, c, L))
    for i in range(N):
        M = np.zeros((L, (N - 1) * c))
        for h in range(1, N):
            M[h - 1 : h - 1 + c, (h - 1) * c : h * c] = A[(i - h) % N]
        D[i] = target @ np.linalg.pinv(M, rcond=1e-13)
    return D


def _search_code_version() -> str:
    """A digest of the source that decides a search's result (this module and the closed forms it
    starts from): a changed search never reads an older one's cached codes."""
    digest = hashlib.sha256()
    for module in (__file__, closed_forms.__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()[:12]


SEARCH_CODE_VERSION = _search_code_version()


def cache_dir() -> Path:
    """Where searched codes are kept: ``$CERAR_CACHE_DIR``, default ``~/.cache/cerar``."""
    return Path(os.environ.get("CERAR_CACHE_DIR", Path.home() / ".cache" / "cerar"))


def _cache_path(N: int, c: int, kappa_max: float) -> Path:
    return cache_dir() / f"optimized-{SEARCH_CODE_VERSION}-N{N}-c{c}-k{kappa_max!r}.npz"


def optimized_code(N: int, c: int, eps: float | None = None, kappa_max: float | None = None) -> Code:
    """The best code found with kappa <= kappa_max (see module docstring).

    Without kappa_max the budget is the kappa of the perturbation code at ``eps`` when eps is
    given, else DEFAULT_KAPPA_MAX. The search takes seconds, so its result is kept on disk
    (``cache_dir()``) under a key that carries ``SEARCH_CODE_VERSION``, and shared by every process
    of a host.
    """
    if kappa_max is None:
        kappa_max = closed_form_code(N, c, "perturbation", eps, None).kappa if eps is not None else DEFAULT_KAPPA_MAX
    path = _cache_path(N, c, kappa_max)
    try:
        with np.load(path) as saved:
            points, A, D = saved["points"], saved["A"], saved["D"]
    except (OSError, KeyError, ValueError):
        points, A, D = _search(N, c, kappa_max)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(tmp, points=points, A=A, D=D)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home only costs the search again
    eps_reached = float(np.abs(points**N - 1).max())
    return code_from_matrices(N, c, "optimized", eps_reached, kappa_max, points, A.copy(), D.copy())


def _search(N: int, c: int, kappa_max: float):
    """(points, A, D) of the best candidate."""
    candidates = []
    try:
        start = closed_form_code(N, c, "perturbation", None, kappa_max)
        candidates += [
            (start.predicted_error(), start.points, start.A, start.D),
            _with_least_squares_decoders(start.points, start.A, N),
        ]
    except ValueError:
        pass  # the closed form cannot meet this budget; the pattern search may
    if c % N == 0:
        candidates += _pattern_search(N, c, kappa_max)
    if not candidates:
        raise ValueError(
            f"kappa_max={kappa_max:g} is unreachable for construction 'optimized' at N={N}, c={c}; "
            "raise kappa_max or lower c"
        )
    _, points, A, D = min(candidates, key=lambda cand: cand[0])
    return points, A, D


def _with_least_squares_decoders(points, A, N):
    D = least_squares_decoders(A, N)
    return _worst_error(A, D, N), points, A, D


def _worst_error(A, D, N) -> float:
    c = A.shape[-1]
    probe = code_from_matrices(N, c, "probe", None, None, np.zeros(1), A.copy(), D.copy())
    return probe.predicted_error()


def _pattern_points(N: int, params: np.ndarray, n_real: int, size: float) -> np.ndarray:
    """w^r z_k: z_0 = 1, n_real real offsets 1 + size*x, then pairs 1 + size*(x +- iy)."""
    reals = 1 + size * params[:n_real]
    xy = params[n_real:].reshape(-1, 2)
    pairs = 1 + size * (xy[:, 0] + 1j * xy[:, 1])
    pattern = np.concatenate([[1.0 + 0j], reals, pairs, np.conj(pairs)])
    return (roots_of_unity(N)[:, None] * pattern[None, :]).reshape(-1)


def _smallest_feasible_size(N, params, n_real, kappa_max) -> float | None:
    """The smallest pattern size (the smallest error) whose encoders meet kappa_max, or None."""

    def kappa(size):
        try:
            points = ordered_points(_pattern_points(N, params, n_real, size))
            return max_condition(encoders(points, N))
        except (ValueError, np.linalg.LinAlgError):
            return math.inf

    return smallest_feasible(kappa, kappa_max)


def _pattern_search(N: int, c: int, kappa_max: float):
    q = c // N
    n_pairs = (q - 1) // 2
    n_real = (q - 1) - 2 * n_pairs
    if n_pairs == 0:
        return []  # a single real offset: the perturbation shape is the only one

    def evaluate(params):
        size = _smallest_feasible_size(N, params, n_real, kappa_max)
        if size is None:
            return None
        points = ordered_points(_pattern_points(N, params, n_real, size))
        A = np.ascontiguousarray(encoders(points, N).real)
        return _with_least_squares_decoders(points, A, N)

    def objective(params):
        found = evaluate(params)
        return 10.0 if found is None else found[0]

    results = []
    for sign in (1.0, -1.0):
        pairs = np.column_stack([sign * np.linspace(0.8, 0.3, n_pairs), np.full(n_pairs, 0.8)])
        start = np.concatenate([np.ones(n_real), pairs.ravel()])
        fit = minimize(
            objective,
            start,
            method="Nelder-Mead",
            options={"maxiter": _PATTERN_SEARCH_ITERATIONS, "xatol": 1e-4, "fatol": 1e-6},
        )
        found = evaluate(np.round(fit.x, 8))
        if found is not None:
            results.append(found)
    return results
