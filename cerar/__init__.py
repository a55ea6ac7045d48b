"""CERAR: ring-based coded approximate all-reduce.

Public API:
    make_code(N, c, construction, eps, kappa_max) -> Code
    simulate(G, code) -> each simulated worker's result
"""

from cerar.codes import CONSTRUCTIONS, DEFAULT_KAPPA_MAX, LOW_PRECISION_KAPPA_LIMIT, Code, make_code
from cerar.simulate import simulate

__all__ = [
    "CONSTRUCTIONS",
    "DEFAULT_KAPPA_MAX",
    "LOW_PRECISION_KAPPA_LIMIT",
    "Code",
    "make_code",
    "simulate",
]
