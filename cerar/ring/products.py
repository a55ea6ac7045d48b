"""The products of CERAR's rounds: torch's GEMMs, or one hand-written Triton kernel where it is faster on the device.

Every product of a call (``cerar.ring.rounds``) has the same shape: a small matrix of coefficients W (M x K: rows of
A_i, W_i's or D_i's columns, the injection's [-1, 1]; M, K <= c + L) times K long rows of the gradient X (K x w,
w = m or a chunk of it; rows contiguous, any stride between them), written into or added to M long rows:

    out = beta out + alpha (W X)        (``addmm``; ``mm`` is beta = 0, alpha = 1)

With M and K a few tens and w a million, each value of X is read once and used M times: the product is bound by
memory, and its ideal is one read of X and one write (and read, for beta != 0) of out. On the H200 of 2026-12-04
cuBLAS ran them as CUTLASS SIMT GEMMs with 128 x 32 tiles (M <= 32: most of each tile idle) and the injection's
1 x 2 ones as ``gemv2N``; one rank's arithmetic came to 2.1x its memory-traffic bound at 64 MiB (issue 52, target 2x;
``docs/gpus.md``). ``small_mm`` (``triton_products_source``) is that ideal written out: a program per tile of
``block_columns(M)`` columns holds all M rows of its tile in registers, reads each of the K rows of X once and
accumulates in float32, one multiply-add per term in the order k = 0..K-1, then writes beta out + alpha acc.

Accuracy, not bytes: a product's rounding depends on its order of sums, which cuBLAS picks per shape and device,
so neither path is the other's reference. Both are held to the error bound of a float32 inner product of K terms,
|fl(W X) - W X| <= K u |W| |X| (u = 2^-24; Higham, Accuracy and Stability, 3.1), which the spec's decoding error
already takes for every product (``cerar.ring.precision``); ``enable`` checks the kernel against a float64 product
on each shape class before it times it, and keeps it only where it is faster than torch's. No TF32 here: the kernel
multiplies in float32 FMA units (no ``tl.dot``), whatever ``torch.backends`` says (``cerar.ring.fp32_products``).

Where: CUDA tensors with Triton importable; in tests, CPU tensors under ``TRITON_INTERPRET=1`` (Triton's
interpreter, as ``cerar.formats.triton_kernels``). Until ``enable`` switches it on for a device, and on every other
device, ``mm`` and ``addmm_`` are torch's own operations (the operation counts of ``tests/test_op_count.py``).
"""

from __future__ import annotations

import torch

from cerar.formats.devices import side_by_side_seconds

MAX_ROWS = 128
"""The most rows M (and terms K) the kernel takes: its M x block tile lives in registers; larger products (never
made by a code of c <= 64) stay torch's."""

TILE = 4096
"""Values of out per program (M x block_columns(M))."""

_ENABLED: dict[str, str] = {}
"""device -> a line saying what ``enable`` found (present: the kernel runs there)."""

_KERNELS: dict[str, object] = {}


def padded_rows(M: int) -> int:
    """M rounded up to a power of two: the kernel's register tile has that many rows (the rest masked)."""
    return 1 << max(0, (M - 1).bit_length())


def block_columns(M: int) -> int:
    """Columns per program: ``TILE`` values of out over ``padded_rows(M)`` rows, at least 64."""
    return max(64, TILE // padded_rows(M))


def usable(device, interpreter: bool = False) -> tuple[bool, str]:
    """(True, "") where the kernel can run on ``device``, else (False, why): where the formats' Triton kernels can
    (``cerar.formats.triton_kernels.usable``: CUDA with Triton, or the CPU in Triton's interpreter when asked for)."""
    from cerar.formats.triton_kernels import usable as triton_usable

    return triton_usable(device, interpreter)


def small_mm(out: torch.Tensor, W: torch.Tensor, X: torch.Tensor, alpha: float = 1.0, beta: float = 0.0) -> None:
    """out = beta out + alpha (W X) by the Triton kernel (module docstring): float32, W [M, K], X [K, w] and out
    [M, w] with unit stride along w; beta = 0 never reads out."""
    M, K = W.shape
    w = X.shape[1]
    if not _KERNELS:
        from cerar.ring import triton_products_source as src

        _KERNELS["small_mm"] = src.small_mm
    columns = block_columns(M)
    _KERNELS["small_mm"][(-(-w // columns),)](
        W, X, out, w, W.stride(0), W.stride(1), X.stride(0), out.stride(0), float(alpha), float(beta),
        M=M, K=K, MP=padded_rows(M), BLOCK=columns, BETA=beta != 0,
    )  # fmt: skip


def _fits(out: torch.Tensor, W: torch.Tensor, X: torch.Tensor) -> bool:
    """Whether the kernel takes this product: an enabled device, float32, unit stride along the rows, M and K within
    ``MAX_ROWS``."""
    return (
        str(out.device) in _ENABLED
        and out.dtype == W.dtype == X.dtype == torch.float32
        and out.stride(1) == 1
        and X.stride(1) == 1
        and W.shape[0] <= MAX_ROWS
        and W.shape[1] <= MAX_ROWS
    )


def mm(W: torch.Tensor, X: torch.Tensor, out: torch.Tensor) -> None:
    """out = W X: the kernel where ``enable`` switched it on for out's device, else ``torch.mm``."""
    if _fits(out, W, X):
        small_mm(out, W, X)
    else:
        torch.mm(W, X, out=out)


def addmm_(out: torch.Tensor, W: torch.Tensor, X: torch.Tensor, beta: float = 1.0, alpha: float = 1.0) -> None:
    """out = beta out + alpha W X: the kernel where ``enable`` switched it on for out's device, else ``addmm_``."""
    if _fits(out, W, X):
        small_mm(out, W, X, alpha, beta)
    else:
        out.addmm_(W, X, beta=beta, alpha=alpha)


def error_bound(W: torch.Tensor, X: torch.Tensor, out0: torch.Tensor | None, alpha: float, beta: float):
    """The most |result - exact| may be per value of beta out0 + alpha W X in float32 (float64 [M, w]): K + 2 units
    of roundoff of |beta out0| + |alpha| |W| |X| (K for the inner product, one for each scaling and the sum)."""
    W64, X64 = W.double(), X.double()
    magnitude = abs(alpha) * (W64.abs() @ X64.abs())
    if out0 is not None and beta != 0:
        magnitude = magnitude + abs(beta) * out0.double().abs()
    return (W.shape[1] + 2) * 2.0**-24 * magnitude


SHAPES = ((1, 2), (15, 15), (16, 34), (31, 31), (32, 70))
"""(M, K) classes ``enable`` checks and times: the injection, the encoding's A_i rows, the decoding's first product
at N=4 c=16 (c x (c + L)) and N=8 c=32, and a code's k x k block."""


def _check(device: torch.device, w: int) -> None:
    """The kernel against a float64 product on each of ``SHAPES`` (beta 0 and 1, strided rows of X), within
    ``error_bound``; AssertionError naming the shape where it is not."""
    g = torch.Generator().manual_seed(52)
    for M, K in SHAPES:
        W = torch.randn(M, K, generator=g).to(device)
        X = torch.randn(2 * K, w, generator=g).to(device)[::2]  # rows two apart, as the injection's are N apart
        out0 = torch.randn(M, w, generator=g).to(device)
        for alpha, beta in ((1.0, 0.0), (0.25, 1.0)):
            got = out0.clone()
            small_mm(got, W, X, alpha, beta)
            exact = (beta * out0.double() if beta else 0) + alpha * (W.double() @ X.double())
            err = (got.double() - exact).abs()
            bound = error_bound(W, X, out0, alpha, beta)
            if not bool((err <= bound).all()):
                raise AssertionError(f"the Triton product errs beyond K u |W||X| at M={M} K={K} beta={beta}: "
                                     f"{float((err - bound).max()):.3g} over")  # fmt: skip


def enable(device="cuda", *, columns: int = 2**20, interpreter: bool = False, pick: str = "faster",
           say=print) -> bool:  # fmt: skip
    """Check the Triton product on ``device`` (``_check``), time it against torch's on the decoding's shape (16 x 34
    over ``columns`` columns) and switch it on where it is faster (``pick="faster"``) or wherever it passes its check
    (``pick="checked"``: the benchmark, to measure it); one line (``say``) either way. Returns whether it is on.
    Call before the first collective (its first launches compile)."""
    if pick not in ("faster", "checked"):
        raise ValueError(f"cerar.ring.products.enable: pick must be 'faster' or 'checked', got {pick!r}")
    device = torch.device(device)
    ok, why = usable(device, interpreter)
    if not ok:
        say(f"cerar.ring.products: torch's products on {device} ({why})")
        return False
    _ENABLED.pop(str(device), None)
    try:
        _check(device, block_columns(1) + 37 if interpreter else columns + 37)  # two programs, a masked tail
        W = torch.randn(16, 34, device=device)
        X, out = torch.randn(34, columns, device=device), torch.empty(16, columns, device=device)
        seconds = side_by_side_seconds(
            {"triton": lambda: small_mm(out, W, X, 1.0, 1.0), "torch": lambda: out.addmm_(W, X)}, device
        )
        kernel, torch_s = seconds["triton"], seconds["torch"]
    except Exception as error:  # a kernel that fails to build or errs stays off, and says why
        say(f"cerar.ring.products: torch's products on {device} (the Triton product failed: "
            f"{type(error).__name__}: {str(error)[:200]})")  # fmt: skip
        return False
    faster = kernel < torch_s or pick == "checked"
    line = (f"cerar.ring.products: {'Triton' if faster else 'torch'}'s products on {device} (16 x 34 over "
            f"{columns} columns: Triton {kernel * 1e3:.3f} ms, torch {torch_s * 1e3:.3f} ms; "
            "checked within K u)")  # fmt: skip
    if faster:
        _ENABLED[str(device)] = line
    say(line)
    return faster


def disable() -> None:
    """Back to torch's products everywhere."""
    _ENABLED.clear()


def enabled() -> dict[str, str]:
    """{device: enable's line} where the Triton product runs."""
    return dict(_ENABLED)
