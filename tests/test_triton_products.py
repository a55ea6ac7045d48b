"""CERAR's products by the hand-written Triton kernel (cerar.ring.products) on the CPU, in Triton's interpreter.

The story: every product of a call is a small matrix of coefficients times long rows of the gradient; the kernel
streams the rows once and accumulates in float32. Its rounding is not cuBLAS's (neither is a reference for the
other), so it is held to what any float32 product must meet, K u |W| |X| from a float64 product, and a product that
drops one term fails that by orders of magnitude. Then the protocol: with the kernel switched on, every product of
the rounds runs through it, and each worker's result stays within the spec's rounding bound of the same protocol in
float64 (cerar.ring.precision.rounding_bound), while a kernel that drops a term does not. What the interpreter
cannot show is the kernel's speed: ``enable`` times it against torch's on the device and keeps the faster (the GPU
benchmark's arithmetic section measures both).
"""

from __future__ import annotations

import pytest
import torch

import cerar
from cerar.ring import products
from cerar.ring.precision import rounding_bound

pytest.importorskip("triton", reason="Triton is not installed: pip install -r requirements-kernels.txt runs the "
                    "kernel in its interpreter (a CUDA build of torch brings it)")


@pytest.fixture(autouse=True)
def interpreter():
    assert products.usable("cpu", interpreter=True) == (True, ""), "TRITON_INTERPRET=1 must be set before Triton"
    products.disable()
    yield
    products.disable()


@pytest.mark.parametrize(("M", "K"), [(1, 2), (16, 34)])
def test_the_product_errs_within_K_u_of_the_exact_one_and_one_dropped_term_does_not(M, K):
    """beta 0 (out holding NaN, never read) and beta 1 with alpha 1/4, on rows of X two apart (as the injection's are
    N apart), over two programs' columns and a masked tail."""
    g = torch.Generator().manual_seed(M)
    w = products.block_columns(M) + 37
    W = torch.randn(M, K, generator=g)
    X = torch.randn(2 * K, w, generator=g)[::2]
    out0 = torch.randn(M, w, generator=g)
    for alpha, beta in ((1.0, 0.0), (0.25, 1.0)):
        got = out0.clone() if beta else torch.full((M, w), float("nan"))
        products.small_mm(got, W, X, alpha, beta)
        exact = (beta * out0.double() if beta else 0) + alpha * (W.double() @ X.double())
        # a float32 inner product of K terms errs by at most K u |W||X| (Higham 3.1); alpha, beta and their sum
        # one rounding each
        magnitude = abs(alpha) * (W.double().abs() @ X.double().abs()) + (beta * out0.double().abs() if beta else 0)
        bound = (K + 2) * 2.0**-24 * magnitude
        assert torch.equal(bound, products.error_bound(W, X, out0, alpha, beta))  # enable's check uses the same
        assert bool(((got.double() - exact).abs() <= bound).all()), (M, K, beta)
        dropped = exact - alpha * (W[:, -1:].double() @ X[-1:].double())
        assert float(((dropped - exact).abs() - bound).max()) > 1e3 * float(bound.max())


def test_the_rounds_run_every_product_through_the_kernel_within_the_spec_rounding(monkeypatch):
    """N=4, c=8 (L = 10, N message rows: batches of 3; rows of 300 values, the last short): with the kernel on,
    each worker's float32 result is within rounding_bound of the same protocol in float64 (torch's products: the
    kernel takes float32 only), relative to ||G||_F; every product of the rounds went through it, the injection's
    1 x 2 in the 4 rounds where both of its rows exist (t = N..c-1) for each of the 4 workers; a kernel that drops
    its last term is caught."""
    code = cerar.make_code(4, 8, "optimized")
    G = torch.randn(4, code.c * 300 - 5, generator=torch.Generator().manual_seed(3))
    exact = cerar.simulate(G.double(), code)
    calls = []
    real = products.small_mm

    def counted(out, W, X, alpha=1.0, beta=0.0):
        calls.append(tuple(W.shape))
        real(out, W, X, alpha, beta)

    monkeypatch.setattr(products, "small_mm", counted)
    monkeypatch.setitem(products._ENABLED, "cpu", "on for the test")
    got = cerar.simulate(G, code)
    scale = float(G.double().norm())
    assert float((got.double() - exact).abs().max()) <= rounding_bound(code, torch.float32) * scale
    k = code.c - 1  # G's rows held whole (head); the last, short one is the tail's
    assert calls.count((1, 2)) == 4 * 4, calls  # the injections
    assert calls.count((k, k)) == 4  # the encoding's U_i rows after x(1), one product per worker
    assert calls.count((k, code.c + 3)) == 4  # the first decoding product: W_i's U-columns and a batch of 3 messages

    def dropping(out, W, X, alpha=1.0, beta=0.0):
        real(out, W[:, :-1], X[:-1], alpha, beta)

    monkeypatch.setattr(products, "small_mm", dropping)
    wrong = cerar.simulate(G, code)
    assert float((wrong.double() - exact).abs().max()) > 1e3 * rounding_bound(code, torch.float32) * scale


def test_enable_checks_times_and_says_why_it_stays_off():
    """Off wherever Triton cannot run (a CPU without the interpreter asked for), saying so in its one line."""
    lines: list[str] = []
    assert products.enable("cpu", say=lines.append) is False
    assert lines == ["cerar.ring.products: torch's products on cpu (no Triton kernels for cpu)"]
    assert products.enabled() == {}
