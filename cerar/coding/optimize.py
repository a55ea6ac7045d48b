"""The condition-number-constrained design (construction ``"optimized"``): the search.

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
It is therefore never worse than the closed form it starts from. Everything is deterministic, and a
result is fully described by its points and its kind of decoder (``matrices_from_points``): that is
what the table shipped with the package (``cerar.coding.stored_codes``) keeps. When no candidate meets
kappa_max the search raises ``UnreachableBudgetError`` with the least kappa of every design it
evaluated (the closed form's eps grid, every pattern size Nelder-Mead tried): how far out of reach
the budget is. The table and the host's cache keep such refusals too, so that they are paid once.

``SEARCH_CODE_VERSION`` digests this module and the closed forms it starts from, so that codes
searched by other code (the host cache, the shipped table) are recognised as such.
"""

from __future__ import annotations

import hashlib
import io
import math
import tokenize
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cerar.coding import closed_forms
from cerar.coding.closed_forms import (
    DEFAULT_KAPPA_MAX,
    _real_part,
    closed_form_code,
    code_from_matrices,
    decoders,
    encoders,
    max_condition,
    ordered_points,
    perturbation_points,
    roots_of_unity,
    smallest_feasible,
)

SEARCH_PARAMETERS = {
    "pattern_iterations": 120,
    "pattern_xatol": 1e-4,
    "pattern_fatol": 1e-6,
    "pattern_start_signs": (1.0, -1.0),
    "pattern_round_decimals": 8,
    "pinv_rcond": 1e-13,
}
"""The knobs of the search (Nelder-Mead's budget and tolerances for the pattern's shape, its two
mirrored starts, the rounding of its result, the pseudo-inverse's cut-off). The shipped table records
them beside each code."""

DECODER_KINDS = ("polynomial", "least_squares")
"""D_i = F^-1 diag(a^-(i-1)) V_L (the specification's), or the least-squares fit to the encoders."""


class Found(NamedTuple):
    """One candidate of the search: its worst worker's predicted error and how to rebuild it."""

    error: float
    points: np.ndarray
    A: np.ndarray
    D: np.ndarray
    decoders: str
    origin: str  # "perturbation", "perturbation+least_squares" or "pattern"


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
        D[i] = target @ np.linalg.pinv(M, rcond=SEARCH_PARAMETERS["pinv_rcond"])
    return D


def matrices_from_points(points: np.ndarray, N: int, decoder_kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(points in canonical order, A, D) of the polynomial encoders at ``points`` with the decoders of
    ``decoder_kind``: the one way every candidate of the search is built, so that the points and the
    kind rebuild a searched code bit for bit. Raises ValueError for points that are not distinct,
    non-zero and closed under conjugation."""
    if decoder_kind not in DECODER_KINDS:
        raise ValueError(f"decoder kind must be one of {DECODER_KINDS}, got {decoder_kind!r}")
    points = ordered_points(points)
    if decoder_kind == "polynomial":  # as the closed forms build them, imaginary parts checked
        kappa_V = np.linalg.cond(np.vander(points, len(points), increasing=True))
        A = _real_part(encoders(points, N), "A_j", kappa_V)
        D = _real_part(decoders(points, N), "D_i", kappa_V)
    else:  # the decoders fit whatever real encoders the points give
        A = np.ascontiguousarray(encoders(points, N).real)
        D = least_squares_decoders(A, N)
    return points, A, D


def budget(N: int, c: int, eps: float | None, kappa_max: float | None) -> float:
    """The kappa budget the search meets: ``kappa_max``; without it, the kappa of the perturbation
    code at ``eps`` when eps is given, else DEFAULT_KAPPA_MAX."""
    if kappa_max is not None:
        return kappa_max
    return closed_form_code(N, c, "perturbation", eps, None).kappa if eps is not None else DEFAULT_KAPPA_MAX


class UnreachableBudgetError(ValueError):
    """No candidate of the search meets kappa_max at (N, c). ``best_kappa`` is the smallest kappa of
    every design the search evaluated: how far the budget is out of reach, so that a caller knows what
    to ask for instead. A ValueError, as every refusal of ``make_code``."""

    def __init__(self, N: int, c: int, kappa_max: float, best_kappa: float):
        self.N, self.c, self.kappa_max, self.best_kappa = N, c, float(kappa_max), float(best_kappa)
        super().__init__(
            f"kappa_max={kappa_max:g} is unreachable for construction 'optimized' at N={N}, c={c} "
            f"(the least kappa the search reached is {best_kappa:.4g}); raise kappa_max or lower c"
        )

    def __reduce__(self):  # picklable (a worker process may report it): rebuilt from its fields
        return type(self), (self.N, self.c, self.kappa_max, self.best_kappa)


def search(N: int, c: int, kappa_max: float) -> Found:
    """The best candidate with kappa <= kappa_max (see module docstring), for N >= 2 and c > N.

    Raises UnreachableBudgetError, naming kappa_max and the least kappa reached, when no candidate meets it.
    """
    candidates = []
    least_kappa = _LeastKappa()
    try:
        start = closed_form_code(N, c, "perturbation", None, kappa_max)
    except ValueError:
        # the closed form cannot meet this budget; the pattern search may. Its least kappa, over the
        # eps the closed form tried, counts towards what the search reached.
        smallest_feasible(least_kappa.of(lambda eps: perturbation_points(N, c, eps), N), kappa_max)
    else:
        candidates += [
            _candidate(start.points, N, "polynomial", "perturbation"),
            _candidate(start.points, N, "least_squares", "perturbation+least_squares"),
        ]
    if c % N == 0:
        candidates += _pattern_search(N, c, kappa_max, least_kappa)
    if not candidates:
        raise UnreachableBudgetError(N, c, kappa_max, least_kappa.value)
    return min(candidates, key=lambda cand: cand.error)


class _LeastKappa:
    """The least kappa of the designs evaluated so far (inf before any)."""

    def __init__(self):
        self.value = math.inf

    def of(self, points_for, N: int):
        """kappa(x) of the encoders at ``points_for(x)`` (inf where they do not exist), recorded."""

        def kappa(x):
            try:
                value = max_condition(encoders(ordered_points(points_for(x)), N))
            except (ValueError, np.linalg.LinAlgError):
                value = math.inf
            self.value = min(self.value, value)
            return value

        return kappa


def _candidate(points, N: int, decoder_kind: str, origin: str) -> Found:
    points, A, D = matrices_from_points(points, N, decoder_kind)
    return Found(_worst_error(A, D, N), points, A, D, decoder_kind, origin)


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


def _smallest_feasible_size(N, params, n_real, kappa_max, least_kappa: _LeastKappa) -> float | None:
    """The smallest pattern size (the smallest error) whose encoders meet kappa_max, or None."""
    kappa = least_kappa.of(lambda size: _pattern_points(N, params, n_real, size), N)
    return smallest_feasible(kappa, kappa_max)


def _pattern_search(N: int, c: int, kappa_max: float, least_kappa: _LeastKappa) -> list[Found]:
    q = c // N
    n_pairs = (q - 1) // 2
    n_real = (q - 1) - 2 * n_pairs
    if n_pairs == 0:
        return []  # a single real offset: the perturbation shape is the only one

    def evaluate(params):
        size = _smallest_feasible_size(N, params, n_real, kappa_max, least_kappa)
        if size is None:
            return None
        return _candidate(_pattern_points(N, params, n_real, size), N, "least_squares", "pattern")

    def objective(params):
        found = evaluate(params)
        return 10.0 if found is None else found.error

    from scipy.optimize import minimize  # here, not at the top: every rank imports cerar, few ever search a code

    results = []
    for sign in SEARCH_PARAMETERS["pattern_start_signs"]:
        pairs = np.column_stack([sign * np.linspace(0.8, 0.3, n_pairs), np.full(n_pairs, 0.8)])
        start = np.concatenate([np.ones(n_real), pairs.ravel()])
        fit = minimize(
            objective,
            start,
            method="Nelder-Mead",
            options={
                "maxiter": SEARCH_PARAMETERS["pattern_iterations"],
                "xatol": SEARCH_PARAMETERS["pattern_xatol"],
                "fatol": SEARCH_PARAMETERS["pattern_fatol"],
            },
        )
        found = evaluate(np.round(fit.x, SEARCH_PARAMETERS["pattern_round_decimals"]))
        if found is not None:
            results.append(found)
    return results


# ---------------------------------------------------------------------------------------------
# The search code's version
# ---------------------------------------------------------------------------------------------

_LAYOUT_TOKENS = {tokenize.NEWLINE: "<newline>", tokenize.INDENT: "<indent>", tokenize.DEDENT: "<dedent>"}
_STATEMENT_STARTS = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)


def search_code_digest(sources: list[str]) -> str:
    """A digest of Python sources that ignores what cannot change a result: comments, docstrings
    (and every other statement that is a lone string), blank lines, spacing and line breaks inside
    brackets. Any other edit changes it. Built on tokens, not on the AST, so that every Python
    version gives the same digest for the same source."""
    digest = hashlib.sha256()
    for source in sources:
        for text in _code_tokens(source):
            digest.update(text.encode())
            digest.update(b"\x00")
        digest.update(b"\x01")
    return digest.hexdigest()[:12]


def _code_tokens(source: str) -> list[str]:
    lines = source.splitlines(keepends=True)
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    kept: list[tuple[int, str]] = []  # (token type, text)
    k = 0
    while k < len(tokens):
        tok = tokens[k]
        name = tokenize.tok_name.get(tok.type, "")
        if name.endswith("STRING_START"):  # an f-string split into parts (Python 3.12+): one token
            depth, end = 0, k
            while True:
                kind = tokenize.tok_name.get(tokens[end].type, "")
                depth += kind.endswith("STRING_START") - kind.endswith("STRING_END")
                if depth == 0:
                    break
                end += 1
            text = _source_span(lines, tok.start, tokens[end].end)
            kept.append((tokenize.STRING, text))
            k = end + 1
            continue
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER):
            k += 1
            continue
        kept.append((tok.type, _LAYOUT_TOKENS.get(tok.type, tok.string)))
        k += 1
    # Drop statements that are one string (docstrings): a STRING between two statement boundaries; and import
    # statements: where a module lives is not what it computes (the imported code is digested by its own source).
    out = []
    importing = False
    for index, (kind, text) in enumerate(kept):
        before = kept[index - 1][0] if index else tokenize.NEWLINE
        after = kept[index + 1][0] if index + 1 < len(kept) else tokenize.NEWLINE
        if kind == tokenize.NAME and text in ("import", "from") and before in _STATEMENT_STARTS:
            importing = True
        if importing:
            importing = kind != tokenize.NEWLINE
            continue
        if kind == tokenize.STRING and before in _STATEMENT_STARTS and after == tokenize.NEWLINE:
            continue
        out.append(text)
    return out


def _source_span(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    (row0, col0), (row1, col1) = start, end
    if row0 == row1:
        return lines[row0 - 1][col0:col1]
    return lines[row0 - 1][col0:] + "".join(lines[row0 : row1 - 1]) + lines[row1 - 1][:col1]


SEARCH_CODE_MODULES = (Path(__file__), Path(closed_forms.__file__))
"""The sources that decide a search's result: this module and the closed forms it starts from."""

SEARCH_CODE_VERSION = search_code_digest([path.read_text(encoding="utf-8") for path in SEARCH_CODE_MODULES])
