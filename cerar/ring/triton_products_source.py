"""The Triton source of ``cerar.ring.products`` (which says what the kernel computes and why): imported at its first
call, so that ``TRITON_INTERPRET``, read when a function is jitted, is the caller's."""

import triton
import triton.language as tl


@triton.jit
def small_mm(w_ptr, x_ptr, out_ptr, n, stride_wm, stride_wk, stride_x, stride_out, alpha, beta,
             M: tl.constexpr, K: tl.constexpr, MP: tl.constexpr, BLOCK: tl.constexpr, BETA: tl.constexpr):  # fmt: skip
    """out[:, tile] = beta out[:, tile] + alpha (W X[:, tile]): the program's BLOCK columns, all M rows in
    registers, each of the K rows of X read once, one float32 multiply-add per term in the order k = 0..K-1."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_cols = cols < n
    rows = tl.arange(0, MP)
    in_rows = rows < M
    acc = tl.zeros((MP, BLOCK), dtype=tl.float32)
    for k in tl.static_range(K):
        w = tl.load(w_ptr + rows * stride_wm + k * stride_wk, mask=in_rows, other=0.0)
        x = tl.load(x_ptr + k * stride_x + cols, mask=in_cols, other=0.0)
        acc += w[:, None] * x[None, :]
    where = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    mask = in_rows[:, None] & in_cols[None, :]
    if BETA:  # noqa: SIM108 (a constexpr branch: beta = 0 never reads out)
        acc = beta * tl.load(where, mask=mask, other=0.0) + alpha * acc
    else:
        acc = alpha * acc
    tl.store(where, acc, mask=mask)
