"""How far rounding moves CERAR's results, and which dtypes may carry a code.

``rounding_bound(code, dtype)`` and ``sum_rounding_bound(N, dtype)`` say how far rounding in the
transport dtype may move a result from its exact-arithmetic value: the one place where tests and the
GPU check get their numerical bounds, so that no bound depends on which BLAS kernel (AVX2 or
AVX-512, MKL or OpenBLAS, cuBLAS) summed the products in which order.


The admission rule for 16-bit messages and 16-bit arithmetic (``admissible_kappa``, ``check_admissible``,
``check_transport_dtype``) measures a code's expected rounding with the oracle (``cerar.ring.oracle``). The TF32
guard every CERAR product runs under is ``cerar.ring.fp32_products``.
"""

from __future__ import annotations

import math
import weakref

import torch

from cerar.coding.matrices import TRANSPORT_DTYPES
from cerar.ring.oracle import run

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
"""Half the spacing of the dtype's floats at 1 (u): one rounding moves a value by at most u of itself."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a floating-point dtype (``UNIT_ROUNDOFF``)."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff for dtype {dtype}; one of {sorted(map(str, UNIT_ROUNDOFF))}")
    return UNIT_ROUNDOFF[dtype]


def rounding_bound(code, dtype: torch.dtype, wire: torch.dtype | None = None) -> float:
    """How far rounding in ``dtype`` may move any worker's CERAR result from its exact-arithmetic
    value, relative to the size of the gradients, ||G||_F = sqrt(sum_j ||G_j||^2):

        max(kappa, 1) * u * (sqrt(c + L) + N)

    Why: every value a worker decodes is a sum of c + L coded terms (the encoding's c products, the
    decoding's L messages), each carrying one rounding of relative size u; independent roundings
    add in quadrature, sqrt(c + L) u, and the blocks on the ring are sums of the N workers'
    contributions, one rounding each (N u at worst). The decode then amplifies what rounding did to
    the coded blocks by up to the code's condition number kappa (the spec's "Numerics"). (A hop's x(t+1) =
    y(t) + u(t+1) - u(t-N+1) is one operation, a product with [-1, 1] where both rows exist,
    ``cerar.ring.rounds``, and still two roundings, as when the injection was formed apart: its terms times
    +-1 are exact.) Different
    kernels (AVX2, AVX-512, cuBLAS) sum in different orders, which changes the rounding but not its
    size, so two correct implementations differ by at most twice this. Measured: 0.1 to 0.3 of it on
    Gaussian gradients of 10^3 to 10^6 values (``tests/test_spec_reference.py``), so the constant 1
    leaves a margin of 3 or more without making the bound vacuous (kappa ~ 1e2: 1e-5 relative).

    ``wire``: the dtype the messages travel in where it differs from the arithmetic's (``cerar.formats.wire``:
    16-bit messages, float32 arithmetic). The two terms then part: the products' sqrt(c + L) roundings
    are the arithmetic's, the N roundings of the blocks on the ring the wire's (each message is cast
    once per hop, and its power-of-two scale keeps every value within the format's relative rounding):

        max(kappa, 1) * (u_arithmetic sqrt(c + L) + u_wire N)"""
    if wire is None or wire == dtype:
        return max(float(code.kappa), 1.0) * unit_roundoff(dtype) * (math.sqrt(code.c + code.L) + code.N)
    return max(float(code.kappa), 1.0) * _per_kappa(code, dtype, wire)


def _per_kappa(code, dtype: torch.dtype, wire: torch.dtype) -> float:
    return unit_roundoff(dtype) * math.sqrt(code.c + code.L) + unit_roundoff(wire) * code.N


LOW_PRECISION = (torch.float16, torch.bfloat16)


ROUNDING_SAMPLE_COLUMNS = 256
"""Columns (values per component and worker) of the Gaussian gradients ``expected_rounding`` runs the protocol
on: c x 256 values per worker estimate the ratio to a few percent (seeded, so every process gets the same)."""

_expected: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def expected_rounding(code, wire: torch.dtype) -> float:
    """The worst worker's expected relative error that 16-bit messages add to ``code``'s result, on i.i.d.
    Gaussian gradients: the model under which ``code.predicted_error()`` gives the code's own error, so the
    two compare like for like.

    Measured from the code alone, not bounded: the protocol runs twice in one process (``cerar.ring.oracle``),
    with float32 messages and with ``wire``'s (scaled, cast and back, as ``cerar.all_reduce`` sends them), on
    a seeded Gaussian G of c x ``ROUNDING_SAMPLE_COLUMNS`` values per worker; the estimate is
    max_i ||S_hat_i(wire) - S_hat_i(float32)|| / ||S||. Why not ``rounding_bound``: the bound takes every
    rounding amplified by the full kappa and adding in phase, and on the decoders' real structure the
    measured rounding is 1/15 to 1/20 of it (N = 4, 8; c = N+1 .. 2N; fp16 and bf16). A rule on the bound
    refused the codes with the least total error: at N=4, c=5 on fp16 it admitted kappa <= 20 (total error
    0.045) and refused kappa 64-100 (total 0.014-0.016). The rounding grows in proportion to kappa
    (0.9-1.2e-4 kappa at N=4, c=5 on fp16; about 8x that on bf16, whose u is 8x fp16's) while the code's
    error falls as 1/kappa, so their sum is least where the two meet: the rule below admits a code up to
    that point. Cached per code and wire."""
    if wire not in LOW_PRECISION:
        raise ValueError(f"expected_rounding is for 16-bit wires ({LOW_PRECISION}), got {wire}")
    per_code = _expected.setdefault(code, {})
    if wire not in per_code:
        from cerar.formats.wire import wire_for

        generator = torch.Generator().manual_seed(0)
        G = torch.randn(code.N, code.c * ROUNDING_SAMPLE_COLUMNS, generator=generator)
        exact_messages = run(G, code)[0].double()
        wire_messages = run(G, code, wire_for(wire))[0].double()
        S = G.double().sum(0)
        per_code[wire] = float(((wire_messages - exact_messages).norm(dim=1) / S.norm()).max())
    return per_code[wire]


ROUNDING_RMS_PER_UNIT = math.sqrt(1 / (8 * math.log(2)))
"""The root mean square of one rounding to nearest, relative to the value rounded, in units of u: 0.4247. A value x
in [2^e, 2^(e+1)) is rounded with an error uniform over a spacing of 2u 2^e, so E[err^2] = (2u 2^e)^2 / 12, and
with x's mantissa y = x / 2^e log-uniform on [1, 2) (Benford's law: Gaussian gradients' magnitudes, spread over
decades, are close to it) E[(err / x)^2] = (u^2 / 3) E[1 / y^2] = (u^2 / 3) (3 / (8 ln 2)) = u^2 / (8 ln 2)."""


def expected_ring_rounding(N: int, wire: torch.dtype) -> float:
    """The exact ring's expected relative rounding on a 16-bit ``wire`` (float32 sums), on i.i.d. Gaussian
    gradients, ||S_hat - S|| / ||S||: ``ROUNDING_RMS_PER_UNIT`` u_wire sqrt((N + 1) / 2).

    Why: each value is cast N times on its way (``cerar.formats.wire``: each message relative to its own scale): the
    N - 1 partial sums of h = 1..N-1 gradients the reduce-scatter sends, and the complete sum its owner sends round,
    each rounding independent, of variance (0.4247 u)^2 times the square of what it rounds. On i.i.d. gradients of
    variance sigma^2 a partial sum of h has variance h sigma^2 and the sum N sigma^2, so the squared error is
    (0.4247 u)^2 (sum_{h<N} h + N) sigma^2 = (0.4247 u)^2 N (N + 1) / 2 sigma^2 per value, against ||S||^2's
    N sigma^2. ``tests/test_precision.py`` pins it: the rounding of a 16-bit ring written in the test, measured on
    the spec's float64 sums, lands within 25 % of it (fp16, bf16; N = 3, 4, 8). The worst-case
    ``sum_rounding_bound`` is (N + 1) sqrt(N) u_wire: 15x this at N=4 on bf16 (3.9e-2 against 2.6e-3)."""
    return ROUNDING_RMS_PER_UNIT * unit_roundoff(wire) * math.sqrt((N + 1) / 2)


def admissible_kappa(code, dtype: torch.dtype, wire: torch.dtype | None = None) -> float:
    """The largest kappa a code with ``code``'s truncation error may have on a 16-bit wire (or in
    16-bit arithmetic): max(E, R) / r, with E = ``code.predicted_error()``, r the rounding per unit of
    kappa and R the rounding of the exact ring on the same wire.

    The rule (the condition-number-constrained design applied to the precision on the wire): a code
    is admissible when what the wire adds, kappa r, does not exceed the larger of its own predicted
    error and what the exact ring on the same wire rounds: the wire then at most doubles the error
    the code was chosen for (in quadrature: 1.41x), and a code without truncation error (the optimized
    codes at N = 2) may round as much as the 16-bit exact ring does, no more. An exact code (c <= N,
    kappa <= sqrt(2)) is always admissible (infinite here): its rounding is then all its error, as for
    any exact collective, in 16-bit arithmetic as on a 16-bit wire. Since E falls about as 1 / kappa
    along a construction while kappa r grows as kappa, E = kappa r is also where their sum is least
    (``cerar.formats.wire.default_kappa_max`` is chosen there). On a 16-bit wire with float32 arithmetic,
    kappa r is the expected rounding on Gaussian gradients (``expected_rounding``: the model of E too)
    and R the exact ring's expected rounding on them (``expected_ring_rounding``), like for like; in
    16-bit arithmetic (a 16-bit tensor), the bounds ``rounding_bound`` and ``sum_rounding_bound``.
    (The first version compared the expected rounding with the ring's worst-case bound, 15x its real
    rounding: on bf16 at N=8, c=9 it admitted a user's kappa_max 64, whose total error is 3.7x the code's.)"""
    wire = dtype if wire is None else wire
    if code.is_exact:  # c <= N, kappa <= sqrt(2): rounding is all its error, as for any exact collective
        return math.inf
    if dtype == torch.float32 and wire in LOW_PRECISION:
        per_kappa = expected_rounding(code, wire) / max(float(code.kappa), 1.0)
        ring = expected_ring_rounding(code.N, wire)
    else:
        per_kappa = rounding_bound(code, dtype, wire) / max(float(code.kappa), 1.0)
        ring = sum_rounding_bound(code.N, dtype, wire)
    allowed = max(float(code.predicted_error()), ring)
    return allowed / per_kappa if per_kappa > 0 else math.inf


def ring_rounding(N: int, dtype: torch.dtype, wire: torch.dtype | None = None) -> float:
    """The exact ring's rounding the rule compares with (``admissible_kappa``): expected on a 16-bit wire with
    float32 arithmetic, the worst-case bound otherwise."""
    wire = dtype if wire is None else wire
    if dtype == torch.float32 and wire in LOW_PRECISION:
        return expected_ring_rounding(N, wire)
    return sum_rounding_bound(N, dtype, wire)


def check_admissible(code, dtype: torch.dtype, wire: torch.dtype | None = None, what: str = "cerar") -> None:
    """Refuse, in one line naming N, c, kappa, the dtype and the largest admissible kappa, a code whose
    rounding on a 16-bit wire (or in 16-bit arithmetic) would exceed its own error or the exact
    ring's on that wire (``admissible_kappa``). float32 and float64 are not judged here (their
    rounding at the default kappa_max is the spec's, about 1e-3 at worst)."""
    wire = dtype if wire is None else wire
    low = wire if wire in LOW_PRECISION else dtype if dtype in LOW_PRECISION else None
    if low is None:
        return
    limit = admissible_kappa(code, dtype, wire)
    kappa = max(float(code.kappa), 1.0)
    if kappa > limit * (1 + 1e-9):
        E, ring = float(code.predicted_error()), ring_rounding(code.N, dtype, wire)
        rounding = kappa * (max(E, ring) / limit)
        balance = math.sqrt(E * kappa / (rounding / kappa))  # where E ~ 1/kappa meets kappa r, along this construction
        hint = f", and codes of this shape balance near kappa_max ~ {balance:.3g}" if balance > limit else ""
        raise ValueError(
            f"{what}: N={code.N}, c={code.c} ({code.construction}) with kappa={kappa:.3g} is not admissible on "
            f"{str(low).replace('torch.', '')} (16-bit): the rounding it adds, {rounding:.3g}, exceeds its own error "
            f"{E:.3g} "
            f"(and the exact ring's {ring:.3g}); the largest admissible kappa for this code is {limit:.3g}{hint} "
            "(set kappa_max, or use float32 transport)"
        )


def sum_rounding_bound(N: int, dtype: torch.dtype, wire: torch.dtype | None = None) -> float:
    """How far rounding may move a sum of N tensors (the exact ring's result, ``dist.all_reduce``'s)
    from the exact sum, relative to ||G||_F: (N - 1) u sqrt(N) + u. Each element's N - 1 additions
    err by at most (N - 1) u sum_j |g_j| (to first order, in any order), and ||sum_j |g_j| || <=
    sqrt(N) ||G||_F; the last u covers a division by N (op="avg").

    ``wire``: 16-bit messages over float32 sums (``cerar.formats.wire``) add (N + 1) sqrt(N) u_wire: every
    cast message is a partial sum of at most N gradients, rounded within u_wire of itself; a value
    passes at most N - 1 hops of partial sums and one cast of the complete sum by its owner in the flat
    ring, and (G - 1) + (n - 1) + 2 <= N + 1 casts in the two-tier hierarchy (N = n G), each at most
    u_wire sum_j |g_j|. The scale's floor (values below 2^-29 of their block's largest, fp16) adds at
    most sqrt(m) 2^-39 per block of m, negligible against u_wire below m = 2^50."""
    bound = ((N - 1) * math.sqrt(N) + 1) * unit_roundoff(dtype)
    if wire is not None and wire != dtype:
        bound += (N + 1) * math.sqrt(N) * unit_roundoff(wire)
    return bound


def check_transport_dtype(dtype: torch.dtype, code, name: str = "tensor", wire=None) -> None:
    """Refuse dtypes the protocol cannot carry: integers always, and a 16-bit tensor (all arithmetic
    16-bit) or 16-bit messages (``wire``) where the code's rounding there would exceed its own error
    (``check_admissible``, the derived rule)."""
    if dtype not in TRANSPORT_DTYPES:
        raise ValueError(f"{name} must be a floating-point tensor (float32 or float64), got dtype {dtype}")
    check_admissible(code, dtype, wire, what=name)
