"""The 4-bit format's rows of scripts/bench/bench_arithmetic.py (issue 54): what the rotation costs, beside a copy.

The eager format (``cerar.formats.int4_blocks``; its fused kernels are Triton, for GPUs) on the bench's tensor of
heavy-tailed values: quantize with stochastic rounding (the all-reduce's default) with and without the rotation, the
rotation alone (the product by the signs and the log2 B stages of the fast Walsh-Hadamard transform), and dequantize
(into place, and added, as the two shots decode) with and without undoing it. The bytes per value are counted on the
dispatched operations as for the 8-bit rows (``Traffic``, on 64 blocks: the decoder's B x B Hadamard matrix, read
once a call, adds 8 bytes a value at that size).
"""

from __future__ import annotations

import torch

from cerar.formats import int4_blocks as q4


def int4_cases(n: int, block: int, case) -> list:
    """The rows as ``case(family, operation, variant, run, count)`` builds them (bench_arithmetic's ``Case``), on n
    values in blocks of ``block`` (a power of two: it is rotated)."""
    x = torch.randn(n) * torch.exp(2 * torch.randn(n // block)).repeat_interleave(block)
    out, message = torch.empty(n), q4.new_message(n, block, "cpu")
    small = 64 * block
    xs, outs, messages = x[:small].clone(), torch.empty(small), q4.new_message(small, block, "cpu")
    signs = q4.rotation_signs(1, block, "cpu")
    rows, spare = torch.empty(n // block, block), torch.empty(n // block, block)
    rows_s, spare_s = torch.empty(small // block, block), torch.empty(small // block, block)

    def rotate(v, into, other):
        torch.mul(v.view(-1, block), signs, out=into)
        q4.fwht_(into, other)

    cases = []
    for rotated, variant in ((False, "eager, not rotated"), (True, "eager, rotated")):
        cases += [
            case("int4", "quantize, stochastic", variant,
                 lambda r=rotated: q4.quantize_eager(message, x, block, "stochastic", 9, r, 1),
                 lambda r=rotated: q4.quantize_eager(messages, xs, block, "stochastic", 9, r, 1)),
            case("int4", "dequantize", variant,
                 lambda r=rotated: q4.dequantize(message, n, block, out, rotate=r, seed=1),
                 lambda r=rotated: q4.dequantize(messages, small, block, outs, rotate=r, seed=1)),
            case("int4", "dequantize and add", variant,
                 lambda r=rotated: q4.dequantize(message, n, block, out, add=True, rotate=r, seed=1),
                 lambda r=rotated: q4.dequantize(messages, small, block, outs, add=True, rotate=r, seed=1)),
        ]  # fmt: skip
    cases.append(case("int4", f"rotation alone (signs, {block.bit_length() - 1} stages)", "eager",
                      lambda: rotate(x, rows, spare), lambda: rotate(xs, rows_s, spare_s)))  # fmt: skip
    return cases


def rotation_line(table: list[dict]) -> list[str]:
    """The report's lines on the rotation: its cost in copies, rotated less not rotated, per operation (from the
    table's rows; none where the 4-bit rows are absent)."""
    ratio = {(r["operation"], r["variant"]): r["ratio_to_copy"] for r in table if r["family"] == "int4"}
    pairs = [(op, ratio.get((op, "eager, rotated")), ratio.get((op, "eager, not rotated")))
             for op in ("quantize, stochastic", "dequantize", "dequantize and add")]  # fmt: skip
    said = [f"{op} {rotated:.2f} against {plain:.2f} (+{rotated - plain:.2f})" for op, rotated, plain in pairs
            if rotated is not None and plain is not None]  # fmt: skip
    if not said:
        return []
    return [
        "4-bit rows (issue 54): the eager format (`cerar.formats.int4_blocks`; its fused kernels are Triton, for "
        "GPUs), x a copy, rotated against not rotated: " + "; ".join(said) + ". The two shots of N ranks quantize N "
        "times and dequantize 2N - 1 times a shard of d/N per call.",
        "",
    ]
