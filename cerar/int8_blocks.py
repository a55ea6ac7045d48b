"""The 8-bit block format of ``cerar.quantized``: int8 values with one float32 scale per block of B values.

A vector x of s values is cut into nb = ceil(s/B) blocks of B values (the last one shorter). Block b
keeps its scale and B integers:

    scale_b = absmax_b / 127,   q = round(x / scale_b) in [-127, 127],   x~ = q scale_b

rounding to nearest (ties to even), so every value errs by at most scale_b / 2 = absmax_b / 254 (plus
float32's rounding of x / scale_b and of q scale_b, a relative 2^-24 each: ``error_bound``). A block
of zeros has scale 0 and decodes to zeros; a block holding a NaN or an infinity decodes to NaN
throughout (its scale is not finite), so a non-finite gradient stays non-finite after aggregation and
the trainer's check still sees it.

Why float32 scales: gradients span many decades (1e-10 .. 1e2): a float16 scale would flush the
smallest blocks' absmax/127 to zero (its least subnormal is 6e-8) and a bfloat16 one would add a
relative 2^-9 to every value of the block, the same order as the int8 rounding itself. Float32 costs
4 bytes per block: 4/B of the int8 payload (``DEFAULT_BLOCK`` = 128: 3.1%).

Why B = 128 by default: the error of a block is set by its absmax, so the smaller the block the less one
large gradient inflates its neighbours' error (gradients are heavy-tailed: a block of a layer norm's
gains or an embedding's rare rows spans decades); at B = 128 the scales cost 3.1% of the payload and the
whole message (1 + 4/B)/4 = 0.258 of float32's bytes. (DeepSpeed ZeRO++ quantizes its gradients in
groups too; the group size is the same trade.)

On the wire one message is one uint8 buffer, the nb float32 scales first (so that their view is aligned
for any s), then the s int8 values: ``message_bytes(s, B) = 4 ceil(s/B) + s``.
"""

from __future__ import annotations

import torch

QMAX = 127
"""The largest magnitude of a quantized value: the symmetric int8 range [-127, 127] (-128 unused, so
that x and -x quantize to opposite integers)."""

DEFAULT_BLOCK = 128
"""Values per scale (module docstring: why 128)."""

SCALE_DTYPE = torch.float32
SCALE_BYTES = 4

FORMAT = "int8 absmax/127 round-to-nearest, one float32 scale per block, scales first"
"""What ranks compare before the first round (with the block size): a rank that decodes another format refuses."""


def check_block(block, operation: str) -> int:
    """``block`` as the number of values per scale: an integer >= 1, else ValueError naming it."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{operation}: block must be an integer >= 1 (values per scale), got {block!r}")
    return block


def blocks(s: int, block: int) -> int:
    """nb = ceil(s / B): the number of scales of a vector of s values."""
    return -(-s // block)


def message_bytes(s: int, block: int) -> int:
    """Bytes of one message carrying s values: 4 per block's scale, 1 per value."""
    return SCALE_BYTES * blocks(s, block) + s


def new_message(s: int, block: int, device) -> torch.Tensor:
    """An empty message buffer for s values (uint8, ``message_bytes(s, block)`` long)."""
    return torch.empty(message_bytes(s, block), dtype=torch.uint8, device=device)


def parts(message: torch.Tensor, s: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scales, values) views of a message: float32 [nb] and int8 [s]."""
    nb = blocks(s, block)
    return message[: SCALE_BYTES * nb].view(SCALE_DTYPE), message[SCALE_BYTES * nb :].view(torch.int8)


def _rows(v: torch.Tensor, block: int):
    """v's full blocks as rows [s // B, B] and its short last block as one row, with the slices of the scales
    they take: the arithmetic runs on views, with no padded copy."""
    s = v.numel()
    full = s // block * block
    if full:
        yield v[:full].view(-1, block), slice(0, full // block)
    if s > full:
        yield v[full:].view(1, -1), slice(full // block, full // block + 1)


def quantize_into(message: torch.Tensor, x: torch.Tensor, block: int) -> None:
    """Write x (float32, s values, contiguous) into ``message`` in the block format.

    Per block: the absmax (one read of x), x times the scale's inverse (read, write), rounded in place
    (read, write), stored as int8 (read, write a byte): 25 bytes of memory traffic per value. Multiplying by
    the inverse instead of dividing by the scale moves x / scale by at most 2 ulps of 127 (within
    ``error_bound``'s margin) and keeps it within 127 (1 + 3 2^-24) < 127.5, so no clamp is needed."""
    s = x.numel()
    scales, values = parts(message, s, block)
    for rows, which in _rows(x, block):
        scale = scales[which]
        torch.linalg.vector_norm(rows, ord=float("inf"), dim=1, out=scale)  # NaN propagates: the block decodes to NaN
        scale.div_(QMAX)
        inverse = torch.where(scale > 0, 1 / scale, 0.0)  # a zero block: 0 (and an infinite scale: 0, x inf -> NaN)
        ratio = rows * inverse.unsqueeze(1)
        ratio.round_()
        values[which.start * block : which.start * block + ratio.numel()].view(ratio.shape).copy_(ratio)


def dequantize(message: torch.Tensor, s: int, block: int, out: torch.Tensor, *, add: bool = False) -> None:
    """x~ = q scale, written into ``out`` (float32, s values, contiguous), or added to it with ``add=True``:
    13 bytes of traffic per value written (int8 read, float32 written, read and written scaled), 17 added."""
    scales, values = parts(message, s, block)
    for rows, which in _rows(out, block):
        q = values[which.start * block : which.start * block + rows.numel()].view(rows.shape)
        scale = scales[which].unsqueeze(1)
        if add:
            rows.addcmul_(q.to(rows.dtype), scale)
        else:
            rows.copy_(q)
            rows.mul_(scale)


def error_bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """The most each value of x can err once quantized and decoded: scale_b / 2 of its block, plus
    float32's rounding of the scale, the division and the product (each at most 2^-24 of 128 scale_b;
    counted twice over for margin). Float64."""
    x = x.detach().double().reshape(-1)
    s = x.numel()
    nb = blocks(s, block)
    padded = torch.cat([x, x.new_zeros(nb * block - s)]).view(nb, block)
    scale = padded.abs().amax(dim=1) / QMAX
    per_value = scale * (0.5 + 4 * (QMAX + 1) * 2.0**-24)
    return per_value.repeat_interleave(block)[:s]
