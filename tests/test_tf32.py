"""The claim behind ``cerar.full_fp32_products`` (README, ``cerar/ring/fp32_products.py``), measured: "TF32 would
take N=8, c=16 from about 7e-4 to about 1 relative error".

TensorFloat-32 rounds the inputs of a float32 matrix product to 10 mantissa bits and accumulates in
float32. On the CPU that is emulated exactly where it happens: every matrix product CERAR's rounds make
(``torch.mm`` and ``Tensor.addmm_``, intercepted by a TorchFunctionMode) gets its two factors rounded
to TF32 first; the accumulator stays float32. The expected size follows from the code's kappa: the
decode amplifies the products' input rounding, unit roundoff 2^-11 under TF32 against 2^-24 in
float32, by up to kappa.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

import cerar

FLOAT32_UNIT_ROUNDOFF = 2.0**-24
TF32_UNIT_ROUNDOFF = 2.0**-11  # 10 explicit mantissa bits, round to nearest


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """x with its float32 mantissa rounded to TF32's 10 bits (to nearest, ties away from zero)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).view(x.shape)


class TF32Products(TorchFunctionMode):
    """Float32 matrix products as TF32 tensor cores compute them: factors rounded, float32 accumulation."""

    PRODUCTS = (torch.mm, torch.matmul, torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__)
    ACCUMULATING = (torch.addmm, torch.Tensor.addmm, torch.Tensor.addmm_)

    def __init__(self, only_where_allowed: bool = False):
        super().__init__()
        self.products = 0
        self.only_where_allowed = only_where_allowed  # round only while torch's settings allow TF32, as a GPU does

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.only_where_allowed and torch.get_float32_matmul_precision() == "highest":
            return func(*args, **kwargs)
        if func in self.PRODUCTS:
            args, self.products = (round_to_tf32(args[0]), round_to_tf32(args[1]), *args[2:]), self.products + 1
        elif func in self.ACCUMULATING:
            args, self.products = (
                (args[0], round_to_tf32(args[1]), round_to_tf32(args[2]), *args[3:]),
                self.products + 1,
            )
        elif func in (torch.bmm, torch.baddbmm, torch.Tensor.baddbmm_, torch.einsum):
            raise AssertionError(f"{func} is a product this emulation does not round: teach it")
        return func(*args, **kwargs)


@pytest.mark.quick
def test_round_to_tf32_keeps_ten_mantissa_bits():
    x = torch.tensor([1 + 2**-10, 1 + 2**-11 + 2**-13, 1 + 2**-12, -3.0 * (1 + 2**-11 + 2**-20)])
    assert round_to_tf32(x).tolist() == [1 + 2**-10, 1 + 2**-10, 1.0, -(3 + 2**-9)]
    y = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    assert ((round_to_tf32(y) - y).abs() / y.abs()).max() <= TF32_UNIT_ROUNDOFF


@pytest.mark.quick
def test_tf32_would_take_n8_c16_from_about_7e_4_to_about_1():
    code = cerar.make_code(8, 16)  # the specification's construction at the default kappa_max
    G = torch.randn(8, 16 * 4096 + 3, generator=torch.Generator().manual_seed(0))
    exact = G.double().sum(0)

    def worst_error(result: torch.Tensor) -> float:
        return float(((result.double() - exact).norm(dim=1) / exact.norm()).max())

    fp32 = worst_error(cerar.simulate(G, code))
    emulation = TF32Products()
    with emulation:
        tf32 = worst_error(cerar.simulate(G, code))
    assert emulation.products > 0

    amplification = code.kappa * (math.sqrt(code.c + code.L) + code.N)  # the suite's rounding bound, per unit
    assert fp32 <= code.predicted_error() + amplification * FLOAT32_UNIT_ROUNDOFF
    assert code.kappa * TF32_UNIT_ROUNDOFF / 10 <= tf32 <= amplification * TF32_UNIT_ROUNDOFF  # kappa x TF32's unit
    # the stated figures, "about" read as within a factor of two
    assert 7e-4 / 2 <= fp32 <= 7e-4 * 2, fp32
    assert 1 / 2 <= tf32 <= 2, tf32


@pytest.mark.quick
def test_the_guard_keeps_tf32_out_of_cerars_products_when_the_process_allows_it():
    """The guard itself, on the CPU: with TF32 allowed process-wide (set_float32_matmul_precision("high")) and
    products rounded to TF32 wherever torch's setting allows it, as a GPU's would be, CERAR's result stays at
    float32's error (the guard switches the products to full precision inside the call), and the caller's
    setting is back afterwards. Without the guard the same call errs by about kappa x 2^-11."""
    code = cerar.make_code(8, 16)
    G = torch.randn(8, 16 * 1024 + 3, generator=torch.Generator().manual_seed(1))
    exact = G.double().sum(0)
    amplification = code.kappa * (math.sqrt(code.c + code.L) + code.N)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with TF32Products(only_where_allowed=True):
            result = cerar.simulate(G, code)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(previous)
    error = float(((result.double() - exact).norm(dim=1) / exact.norm()).max())
    float32_bound = code.predicted_error() + amplification * FLOAT32_UNIT_ROUNDOFF
    assert error <= float32_bound < code.kappa * TF32_UNIT_ROUNDOFF / 10  # the bound tells TF32 from float32
