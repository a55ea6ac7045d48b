"""The fast CERAR, oracle and distributed, held to the specification written out independently.

``tests/spec_reference.py`` rebuilds the matrices from a code's points and runs the spec's rounds
literally in float64. In float64 the fast code must agree with it to rounding (kappa times a few
hundred ulps); in float32 to kappa times float32's unit roundoff times sqrt(c + L) + N: every block of the
protocol is a sum of O(c + L) products whose rounding the code's conditioning amplifies.
The sizes take the chunked path (two column chunks, m >= 2 * 2^16) that every real gradient takes.
"""

import numpy as np
import pytest
import torch

import cerar
from cerar.ring.precision import rounding_bound
from cerar.ring.rounds import STORAGE_CHOICES, pipeline_chunks
from tests.distributed import run_workers
from tests.spec_reference import spec_all_reduce, spec_least_squares_decoders, spec_matrices


def tolerance(code: cerar.Code, dtype: torch.dtype) -> float:
    """Relative error allowed between the fast code and the float64 reference: the transport's
    rounding bound, kappa times its unit roundoff times sqrt(c + L) + N
    (``cerar.ring.precision.rounding_bound``, which says why; measured: 0.1 to 0.3 of it on long
    gradients). Relative to the reference worker's result, which for these independent Gaussian
    gradients is about ||G||_F."""
    return rounding_bound(code, dtype)


def chunked_length(c: int) -> int:
    """A d whose blocks travel as two chunks, and that c does not divide."""
    d = c * 2 * 2**16 + 5
    assert len(pipeline_chunks(-(-d // c))) == 2
    return d


def gradients(N: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((N, d))


CODES = [
    (3, 7, "perturbation", {"eps": 0.05}),
    (4, 16, "optimized", {}),
    (4, 3, "exact", {}),
    (5, 7, "vandermonde", {"eps": 0.3}),
]


@pytest.mark.quick
@pytest.mark.parametrize("N, c, construction, kwargs", CODES)
def test_the_code_matrices_are_the_specs(N, c, construction, kwargs):
    """A_j from the points as the spec builds them; D_i the spec's polynomial decoder or, for the
    optimized construction, possibly its least-squares decoder (the spec's constrained design)."""
    code = cerar.make_code(N, c, construction, **kwargs)
    A, D = spec_matrices(code.points, N)
    scale = max(1.0, np.abs(A).max())
    assert np.abs(code.A - A).max() <= 1e-8 * scale * max(code.kappa, 1)
    if construction == "optimized":
        candidates = [D, spec_least_squares_decoders(A, N)]
        gaps = [np.abs(code.D - Dc).max() / max(1.0, np.abs(Dc).max()) for Dc in candidates]
        assert min(gaps) <= 1e-6, gaps
    else:
        assert np.abs(code.D - D).max() <= 1e-8 * max(1.0, np.abs(D).max()) * max(code.kappa, 1)


def spec_code_matrices(code: cerar.Code) -> tuple[np.ndarray, np.ndarray]:
    """A_j and D_i rebuilt from the code's points by the spec; for the optimized construction the
    decoder is whichever of the spec's two (polynomial, least-squares) the code chose."""
    A, D = spec_matrices(code.points, code.N)
    if code.construction == "optimized":
        D = min([D, spec_least_squares_decoders(A, code.N)], key=lambda Dc: np.abs(code.D - Dc).max())
    return A, D


def reference_for(code: cerar.Code, G: np.ndarray) -> np.ndarray:
    """The spec's protocol on G with the spec's matrices."""
    return spec_all_reduce(G, *spec_code_matrices(code))


def _scaled_errors(result, reference) -> np.ndarray:
    """||result_i - reference_i|| / ||reference_i|| for every worker i."""
    diff = result.double().numpy() - reference
    return np.linalg.norm(diff, axis=1) / np.linalg.norm(reference, axis=1)


ORACLE_CASES = [
    (*case, dtype)
    for case in CODES
    for dtype in (torch.float64, torch.float32)
    if not (case[2] == "vandermonde" and dtype == torch.float32)  # kappa ~ 1e11: float32 carries nothing
]


@pytest.mark.parametrize("storage", STORAGE_CHOICES)
@pytest.mark.parametrize("N, c, construction, kwargs, dtype", ORACLE_CASES)
def test_the_oracle_computes_the_specs_protocol_on_the_chunked_path(N, c, construction, kwargs, dtype, storage):
    code = cerar.make_code(N, c, construction, **kwargs)
    d = chunked_length(c)
    G = gradients(N, d, seed=c)
    G_t = torch.from_numpy(G).to(dtype)
    reference = reference_for(code, G_t.double().numpy())
    errors = _scaled_errors(cerar.simulate(G_t, code, storage=storage), reference)
    assert errors.max() <= tolerance(code, dtype), (errors, tolerance(code, dtype))
    # and the reference is the approximate sum the code promises, not something else
    truth = G_t.double().numpy().sum(0)
    worst = (np.linalg.norm(reference - truth, axis=1) / np.linalg.norm(truth)).max()
    assert worst <= 2 * code.predicted_error() + 1e-12


SMALL_CASES = [(N, c) for N in (2, 3, 4, 5) for c in (1, 2, N - 1, N, N + 1, 2 * N + 1, 4 * N) if c >= 1]


@pytest.mark.parametrize("storage", STORAGE_CHOICES)
@pytest.mark.parametrize(
    "d", [pytest.param(1, marks=pytest.mark.quick), pytest.param(29, marks=pytest.mark.quick), 1000]
)
def test_every_ring_size_and_c_on_small_gradients(d, storage):
    """Every batch layout of the message rows (N, c, d and the storage choice decide it) decodes
    what the spec's protocol computes, in float64."""
    for N, c in SMALL_CASES:
        code = cerar.make_code(N, c, "exact") if c <= N else cerar.make_code(N, c, "perturbation", eps=0.3)
        G = gradients(N, d, seed=N * 100 + c)
        reference = reference_for(code, G)
        errors = _scaled_errors(cerar.simulate(torch.from_numpy(G), code, storage=storage), reference)
        assert errors.max() <= tolerance(code, torch.float64), (N, c, errors)


@pytest.mark.quick
def test_an_unknown_storage_choice_is_refused_by_name():
    with pytest.raises(ValueError, match="storage must be one of"):
        cerar.simulate(torch.zeros(3, 10), cerar.make_code(3, 3), storage="disk")


def _distributed_worker(rank, N, c, construction, kwargs, d, seed, dtype, op, storage):
    G = torch.from_numpy(gradients(N, d, seed)).to(dtype)
    mine = G[rank].clone()
    cerar.all_reduce(mine, cerar.make_code(N, c, construction, **kwargs), op=op, timeout=120, storage=storage)
    return mine


@pytest.mark.parametrize(
    "N, c, construction, kwargs, dtype, op, storage",
    [
        (4, 16, "optimized", {}, torch.float32, "sum", "messages"),
        (4, 16, "optimized", {}, torch.float64, "avg", "spec"),
        (3, 7, "perturbation", {"eps": 0.05}, torch.float64, "avg", "messages"),
    ],
)
def test_distributed_all_reduce_computes_the_specs_protocol(N, c, construction, kwargs, dtype, op, storage):
    """Real gloo processes, the optimized code built in each of them, the chunked path."""
    code = cerar.make_code(N, c, construction, **kwargs)  # fills the test cache before the workers read it
    d = chunked_length(c)
    results = torch.stack(
        run_workers(_distributed_worker, N, args=(c, construction, kwargs, d, 11, dtype, op, storage))
    )
    G = torch.from_numpy(gradients(N, d, 11)).to(dtype).double().numpy()
    reference = reference_for(code, G) / (N if op == "avg" else 1)
    errors = _scaled_errors(results, reference)
    assert errors.max() <= tolerance(code, dtype), (errors, tolerance(code, dtype))
