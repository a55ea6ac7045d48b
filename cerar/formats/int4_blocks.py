"""The 4-bit block format of ``cerar.int4.all_reduce``: two values per byte, one float32 scale per block of B values,
optionally a shared random rotation of each block before it is rounded.

A vector x of s values is cut into nb = ceil(s/B) blocks of B values (the last one shorter). Block b keeps its
scale and B integers in [-7, 7]:

    scale_b = absmax_b(y) / 7,   q = round(y / scale_b) in [-7, 7],   y~ = q scale_b

where y is the block itself (``rotate=False``) or its rotation (``rotate=True``, full blocks only; the short last
block of a message is never rotated): y = H (sigma * x), sigma a vector of B random signs and H the B x B
Walsh-Hadamard matrix (B a power of two), computed by the fast transform in log2 B stages (``fwht_``; stage h = 1,
2, 4, ..., B/2 replaces each pair (a, b) = (v[i], v[i + h]), i in the first half of a group of 2h, by (a + b, a -
b), one float32 addition each: the order is part of the format, so the bytes are reproducible). It is undone after
dequantizing: x~ = ((sigma / B) * (H q)) scale_b (H q is computed on the integers, and its product by sigma / B =
+-2^-m, exactly: one rounding, the product by the scale); with H H = B I the decoded block is x plus the rounding
error rotated back, whose norm is the rotated error's / sqrt(B). The signs are a hash of the seed and the position
in the block (``rotation_signs``): every rank derives them the same way from the seed the ranks agree on, so
nothing about the rotation travels. Why rotate: the error of a block is set by its absmax, and gradients are
heavy-tailed; the rotation spreads one large value over the whole block (the rotated values are near-Gaussian with
the block's root mean square), so the step relative to the block's norm, absmax(y) / (7 sqrt(B) ||x||_2), falls
from up to 1 / 7 (one spike) to about sqrt(2 ln 2B / B) / 7, and the small values stop rounding to zero
(docs/int4.md has the measurements).

Rounding: to nearest, ties to even (``rounding="nearest"``): at most scale_b / 2 per rotated value; or
stochastically (``rounding="stochastic"``, ``DEFAULT_ROUNDING``): q = floor(y / scale_b + u) with a dither u in
[0, 1), so that q scale_b is y on average over calls (to 2^-16 of the scale), at most one scale_b from it. The
rotation is linear, so the decoded x~ is then x on average too. Per decoded value, with k = 1/2 (nearest) or 1
(stochastic), m = log2 B:

    |x~ - x| <= scale_b (k + 2 u (40 + 8 m sqrt(B)))  +  8 x 2^-149,   u = 2^-24

scale_b the exact scale of the block (of its exact rotation where rotated); the second term is float32's
rounding of the transform, the ratio, the dither's sum and the decoding (the transform's 2 m sqrt(B) u is the
largest), the third a subnormal scale's own rounding (``error_bound``). Rotated, a value's worst case is the
same k steps (every value of H e / B is a mean of the B rotated errors e), and its root mean square is
k / sqrt(3) steps of the rotated block, whose step is ~sqrt(2 ln 2B / B) ||x||_2 / 7.

The dither is counter-based and independent across positions, messages and calls: position p of a message
takes u = ((A[(p mod P + shift_c) mod P] + offset_c) mod 2^16) / 2^16, with A a fixed hash of the P = 2^16
positions of a chunk (``dither_base``) and (offset_c, shift_c) the low and high 16 bits of a hash of the message's
key and the chunk's index c = p div P (``chunk_key``): positions p and p + 2^16 take independent offsets and
shifts, so no two positions of a message share their dither (the 8-bit format's table repeats every 2^16
positions). The message's key is a hash of integers the sender knows and its receivers need not
(``dither_key``: the seed, the call's count, the sender's global rank, the shard, the phase): every rank decodes
the bytes their sender wrote. Over calls whose keys are uniform, every position's u is uniform on the 2^16 levels.
The hash, on 32-bit words (``_hash32``): h ^= h >> 16, h *= 0x21F0AAAD, h ^= h >> 15, h *= 0x735A2D97, h ^= h >> 15
(products mod 2^32); A[i] = hash(i) mod 2^16; a key of integers k_1 .. k_n is h_n, h_0 = 0x6A09E667, h_j =
hash(h_{j-1} ^ hash(k_j mod 2^32)); the chunk's key is the key of (message key, c); the rotation's signs are
sigma_i = 1 - 2 (hash(i ^ K) mod 2), K the key of (seed, 0x524F54).

Why B = 128 and float32 scales (docs/int4.md): the message costs 1/2 + 4/B bytes per value (0.133 of float32's at
B = 128; 0.141 at 64, 0.129 at 256); rotated, a block's error grows only as sqrt(ln 2B) with B, so halving B
buys 5-7 % less error for 6 % more bytes, and doubling it saves 3 % of the bytes for 5-6 % more error: 128 is
the knee. Float32 scales: a bfloat16 one would add 2^-9 to the step, harmless at 4 bits, but a float16 one would
flush gradients below ~4e-7 to zero, and 2 bytes per block would save only 1.6 % of the payload at B = 128.

Non-finite inputs stay non-finite: a block holding a NaN or an infinity (or, rotated, whose sums overflow:
values above 2^128 / B) gets a NaN scale, so it decodes to NaN throughout.

On the wire one message is one uint8 buffer: the nb float32 scales first (aligned for any s), then ceil(s/2)
bytes of values, value 2k in the low nibble of byte k and value 2k + 1 in its high nibble, each stored as q + 8
(1 .. 15; an odd s leaves the last high nibble 0): ``message_bytes(s, B) = 4 ceil(s/B) + ceil(s/2)``.
"""

from __future__ import annotations

import math
from contextlib import ExitStack

import torch

from cerar.formats.int8_blocks import PRESCALE, ROUNDINGS, TINY_SCALE, blocks, check_block, check_rounding
from cerar.ring.workspace import POOL

QMAX = 7
"""The largest magnitude of a quantized value: the symmetric range [-7, 7] (the nibble 0, -8, unused)."""

DEFAULT_BLOCK = 128
"""Values per scale (module docstring: why 128)."""

DEFAULT_ROUNDING = "stochastic"
DEFAULT_ROTATE = True

SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
NIBBLE_OFFSET = 8
"""A value q is stored as the nibble q + 8."""

DITHER_LEVELS = 2**16
DITHER_PERIOD = 2**16
"""Positions of a chunk: each chunk of a message takes its own offset and shift (``chunk_key``)."""

ROTATION_TAG = 0x524F54
"""Mixed into the rotation's key, so that the signs and the dithers of one seed are different hashes."""

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_ROTATE",
    "DEFAULT_ROUNDING",
    "FORMAT",
    "QMAX",
    "ROUNDINGS",
    "check_format",
    "dequantize",
    "dequantize_eager",
    "dither",
    "dither_key",
    "error_bound",
    "format_name",
    "fwht_",
    "message_bytes",
    "new_message",
    "parts",
    "quantize_eager",
    "quantize_into",
    "rotation_signs",
]


# ------------------------------------------------------------------------------------------------
# Sizes and layout
# ------------------------------------------------------------------------------------------------


def check_format(block, rounding, rotate, operation: str) -> tuple[int, str, bool]:
    """(B, rounding, rotate) checked: B an integer >= 1, a power of two when rotated (the fast transform), rounding
    one of ``ROUNDINGS``, rotate a bool; else ValueError naming the argument."""
    check_block(block, operation)
    check_rounding(rounding, operation)
    if not isinstance(rotate, bool):
        raise ValueError(f"{operation}: rotate must be true or false, got {rotate!r}")
    if rotate and block & (block - 1):
        raise ValueError(
            f"{operation}: block must be a power of two to be rotated (the fast Walsh-Hadamard transform), got "
            f"{block}; pass rotate=False for another size"
        )
    return block, rounding, rotate


def message_bytes(s: int, block: int) -> int:
    """Bytes of one message carrying s values: 4 per block's scale, one per two values."""
    return SCALE_BYTES * blocks(s, block) + (s + 1) // 2


def new_message(s: int, block: int, device) -> torch.Tensor:
    """An empty message buffer for s values (uint8, ``message_bytes(s, block)`` long)."""
    return torch.empty(message_bytes(s, block), dtype=torch.uint8, device=device)


def parts(message: torch.Tensor, s: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scales, packed values) views of a message: float32 [nb] and uint8 [ceil(s/2)]."""
    nb = blocks(s, block)
    return message[: SCALE_BYTES * nb].view(SCALE_DTYPE), message[SCALE_BYTES * nb :]


def format_name(rounding: str = DEFAULT_ROUNDING, rotate: bool = DEFAULT_ROTATE) -> str:
    """The format's description, which ranks compare before the first round (with B and the seed)."""
    check_rounding(rounding, "format_name")
    rotation = "full blocks rotated (random signs, then Walsh-Hadamard, stages h=1..B/2)" if rotate else "not rotated"
    dither = " (dither: 16-bit table per position, offset and shift per 2^16-value chunk)" * (rounding == "stochastic")
    return (
        f"int4 absmax/7, q+8 in nibbles low first, one float32 scale per block, scales first, 2^64 prescale below "
        f"2^-126, {rotation}, {rounding} rounding{dither}"
    )


FORMAT = format_name()


# ------------------------------------------------------------------------------------------------
# Hashes: the dither and the rotation's signs, counter-based (no random numbers drawn on a device)
# ------------------------------------------------------------------------------------------------


def _hash32(h):
    """A 32-bit integer hash (xor-shift-multiply, three rounds; constants below 2^31, so int64 never overflows).
    Works on Python ints and int64 tensors alike."""
    h = h & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x21F0AAAD) & 0xFFFFFFFF
    h = ((h ^ (h >> 15)) * 0x735A2D97) & 0xFFFFFFFF
    return h ^ (h >> 15)


def dither_key(*keys: int) -> int:
    """A message's key in [0, 2^32): a hash of integer keys (the seed, the call's count, the sender's global rank,
    the shard, the phase), computed on the host."""
    h = 0x6A09E667
    for key in keys:
        h = _hash32(h ^ _hash32(int(key) & 0xFFFFFFFF))
    return int(h)


def chunk_key(key: int, chunk: int) -> int:
    """The key of chunk ``chunk`` (positions chunk P .. chunk P + P - 1) of a message of key ``key``: its low 16 bits
    are the chunk's dither offset, its high 16 its shift."""
    return dither_key(key, chunk)


_BASE: dict[str, torch.Tensor] = {}


def dither_base(device) -> torch.Tensor:
    """A / 2^16: the fixed per-position part of the dither, float32 [P], a hash of the position in [0, 2^16) over
    2^16 (exact: 16 bits); cached per device."""
    device = torch.device(device)
    base = _BASE.get(str(device))
    if base is None:
        table = _hash32(torch.arange(DITHER_PERIOD, dtype=torch.int64)) & (DITHER_LEVELS - 1)
        base = _BASE[str(device)] = (table.to(torch.float32) / DITHER_LEVELS).to(device)
    return base


def dither(key: int, first: int, n: int, device, out: torch.Tensor | None = None) -> torch.Tensor:
    """u for positions first .. first + n - 1 of the message of key ``key``, float32 [n] in [0, 1) (module
    docstring): position p takes ((A[(p mod P + shift_c) mod P] + offset_c) mod 2^16) / 2^16, c = p div P.

    Computed as frac(A / 2^16 + offset_c / 2^16), every step exact (two multiples of 2^-16 below 1 sum to one below
    2, 17 significant bits; frac of it takes 1 off where it reaches 1): one sum per chunk written in place, one
    frac over the whole range, where the integer form took four passes per chunk. Written into ``out[:n]`` when
    given (float32, on ``device``)."""
    base = dither_base(device)
    u = torch.empty(n, dtype=torch.float32, device=device) if out is None else out[:n]
    p = first
    while p < first + n:
        c, start = divmod(p, DITHER_PERIOD)
        take = min(DITHER_PERIOD - start, first + n - p)
        k = chunk_key(key, c)
        offset, shift = (k & (DITHER_LEVELS - 1)) / DITHER_LEVELS, k >> 16
        begin = (start + shift) % DITHER_PERIOD
        wrap = max(0, begin + take - DITHER_PERIOD)  # positions read from the table's start again
        at = p - first
        torch.add(base[begin : begin + take - wrap], offset, out=u[at : at + take - wrap])
        if wrap:
            torch.add(base[:wrap], offset, out=u[at + take - wrap : at + take])
        p += take
    return u.frac_()


_SIGNS: dict[tuple[int, int, str], torch.Tensor] = {}


def rotation_signs(seed: int, block: int, device) -> torch.Tensor:
    """sigma: float32 [B] of +-1, sigma_i = 1 - 2 (hash(key ^ i) mod 2), key = ``dither_key(seed, ROTATION_TAG)``;
    cached per (seed, B, device). The same on every rank that passes the same seed."""
    cached = (int(seed), block, str(torch.device(device)))
    signs = _SIGNS.get(cached)
    if signs is None:
        key = dither_key(seed, ROTATION_TAG)
        bits = _hash32(torch.arange(block, dtype=torch.int64) ^ key) & 1
        signs = _SIGNS[cached] = (1 - 2 * bits).to(torch.float32).to(device)
    return signs


# ------------------------------------------------------------------------------------------------
# The rotation
# ------------------------------------------------------------------------------------------------


def fwht_(rows: torch.Tensor, spare: torch.Tensor | None = None) -> torch.Tensor:
    """The fast Walsh-Hadamard transform of every row of ``rows`` [n, B] (B a power of two), unnormalized (H, whose
    square is B I): log2 B stages, stage h = 1, 2, ..., B/2 taking each pair (a, b) = (v[i], v[i + h]) of a group
    of 2h values to (a + b, a - b). Ping-pongs between ``rows`` and ``spare`` (the same shape; made when not
    given); returns the tensor holding the result (``rows`` after an even number of stages)."""
    n, B = rows.shape
    src, dst = rows, torch.empty_like(rows) if spare is None else spare
    h = 1
    while h < B:
        a = src.view(n, B // (2 * h), 2, h)
        out = dst.view(n, B // (2 * h), 2, h)
        torch.add(a[:, :, 0], a[:, :, 1], out=out[:, :, 0])
        torch.sub(a[:, :, 0], a[:, :, 1], out=out[:, :, 1])
        src, dst = dst, src
        h *= 2
    return src


def _split(s: int, block: int, rotate: bool) -> int:
    """How many leading values are rotated: the full blocks when ``rotate``, else none."""
    return s // block * block if rotate else 0


# ------------------------------------------------------------------------------------------------
# Quantize
# ------------------------------------------------------------------------------------------------


def quantize_into(
    message: torch.Tensor,
    x: torch.Tensor,
    block: int,
    rounding: str = DEFAULT_ROUNDING,
    key: int = 0,
    rotate: bool = DEFAULT_ROTATE,
    seed: int = 0,
) -> None:
    """Write x (float32, s values, contiguous) into ``message`` in the 4-bit format, through the fused kernel of
    ``cerar.formats.fused`` when one is enabled for x's device (``FUSED_QUANTIZE``), else eagerly
    (``quantize_eager``); the bytes are the same either way. ``key``: the message's dither key (``dither_key``),
    read only with stochastic rounding; ``seed``: the rotation's (``rotation_signs``), read only with ``rotate``."""
    if FUSED_QUANTIZE is None or not FUSED_QUANTIZE(message, x, block, rounding, key, rotate, seed):
        quantize_eager(message, x, block, rounding, key, rotate, seed)


FUSED_QUANTIZE = None
"""The fused 4-bit quantizer's dispatch, for ``cerar.formats.fused`` to set when it is imported (the kernels depend
on this format, never the other way): (message, x, block, rounding, key, rotate, seed) -> True when a fused kernel
enabled for x's device wrote the message; None, or False, and the eager path writes it."""


def _scales(rows: torch.Tensor) -> torch.Tensor:
    """scale = absmax / 7 per row (the largest and the least value, as the 8-bit format finds them), NaN where the
    row holds a NaN or an infinity (so that the whole block decodes to NaN)."""
    scale = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()).abs_().div_(QMAX)
    return scale.masked_fill_(~torch.isfinite(scale), float("nan"))


def _to_ratios(rows: torch.Tensor, scale: torch.Tensor) -> None:
    """rows [n, w] <- (rows p) (1 / (scale p)) in place, p = 2^64 where the scale is below 2^-126 (its inverse
    would overflow) and 1 elsewhere; 0 for a zero block (and a NaN one: its scale decodes it to NaN)."""
    tiny = (scale < TINY_SCALE) & (scale > 0)
    if rows.device.type != "cpu" or bool(tiny.any()):  # no host synchronisation on a device
        p = torch.where(tiny, PRESCALE, 1.0)
        rows.mul_(p.unsqueeze(1))
        scale = scale * p
    rows.mul_(torch.where(scale > 0, 1 / scale, 0.0).unsqueeze(1))


def _each_block_set(work: torch.Tensor, block: int):
    """``work``'s full blocks as rows [s // B, B] and its short last block as one row, with the first scale each
    takes."""
    s = work.numel()
    full = s // block * block
    if full:
        yield work[:full].view(-1, block), 0
    if s > full:
        yield work[full:].view(1, -1), full // block


def quantize_eager(
    message: torch.Tensor,
    x: torch.Tensor,
    block: int,
    rounding: str = DEFAULT_ROUNDING,
    key: int = 0,
    rotate: bool = DEFAULT_ROTATE,
    seed: int = 0,
) -> None:
    """The format written with torch's eager operations: the reference a fused kernel must match byte for byte.
    Per block: the rotation (``rotate``: signs, then ``fwht_``), scale = absmax / 7, r = y / scale (``_to_ratios``),
    q = round(r) or floor(r + u), held to [-7, 7], stored as q + 8, two to a byte."""
    s = x.numel()
    scales, packed = parts(message, s, block)
    rotated = _split(s, block, rotate)
    # kept between calls on a CPU (no faults); spare: the stages' other buffer, then the dither, then the pairs
    with POOL.borrowed(s, torch.float32, x.device) as first, POOL.borrowed(s, torch.float32, x.device) as second:
        work, spare = first[:s], second[:s]
        if rotated:
            rows = x.reshape(-1)[:rotated].view(-1, block)
            # the stages ping-pong between two buffers: start in the one that leaves the result in ``work``
            pair = (spare[:rotated].view(-1, block), work[:rotated].view(-1, block))
            begin, other = pair[:: 1 if int(math.log2(block)) % 2 else -1]
            torch.mul(rows, rotation_signs(seed, block, x.device), out=begin)
            fwht_(begin, other)
        work[rotated:].copy_(x.reshape(-1)[rotated:])
        for rows, first in _each_block_set(work, block):
            scale = _scales(rows)
            scales[first : first + scale.numel()].copy_(scale)
            _to_ratios(rows, scale)
        if rounding == "nearest":
            work.round_()
        else:
            work.add_(dither(key, 0, s, x.device, out=spare))
            work.floor_()
        work.clamp_(-QMAX, QMAX).add_(NIBBLE_OFFSET)
        _pack(work, packed, spare)


def _pack(nibbles: torch.Tensor, packed: torch.Tensor, scratch: torch.Tensor) -> None:
    """packed[k] = nibbles[2k] + 16 nibbles[2k + 1] (the last byte's high nibble 0 when s is odd); ``nibbles``
    holds integers in [1, 15] as float32 (any value where its block's scale is NaN); the sums go through
    ``scratch`` (float32, at least s // 2 values)."""
    s = nibbles.numel()
    pairs = s // 2
    if pairs:
        both = nibbles[: 2 * pairs].view(pairs, 2)
        packed[:pairs].copy_(torch.add(both[:, 0], both[:, 1], alpha=16, out=scratch[:pairs]))
    if s % 2:
        packed[pairs:].copy_(nibbles[s - 1 :])


# ------------------------------------------------------------------------------------------------
# Dequantize
# ------------------------------------------------------------------------------------------------


UNROTATE_PRODUCT_MOST = 256
"""The largest B whose decoder takes H q as one product with the B x B matrix H (``hadamard``): 2 B multiply-adds a
value, against log2 B passes of the transform's stages (on this 2-core CPU, 2^22 values at B = 128: 4.5 copies
against 16); above it the stages, whose count grows only as log2 B."""

_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}


def hadamard(block: int, device) -> torch.Tensor:
    """H, float32 [B, B] of +-1 (Sylvester's order, the transform's: ``fwht_`` of the identity), cached per (B,
    device). For a row q of integers q H = H q (H symmetric) exactly, whatever the order of the product's sums:
    each partial sum is an integer below 8 B in magnitude, so none rounds (nor a TF32 product on a GPU: the
    integers and +-1 are exact in its 10 bits); a zero sum is +0, as the stages' sums and differences of integers
    give."""
    cached = (block, str(torch.device(device)))
    matrix = _HADAMARD.get(cached)
    if matrix is None:
        matrix = _HADAMARD[cached] = fwht_(torch.eye(block, dtype=torch.float32)).to(device)
    return matrix


def _unrotate(rows: torch.Tensor, seed: int, block: int, spare: torch.Tensor) -> torch.Tensor:
    """(sigma / B) (H q) for every row q of ``rows`` [n, B] (integers, float32), exactly: H q as one product with
    ``hadamard`` (into ``spare``, rows' shape) up to ``UNROTATE_PRODUCT_MOST``, else by the transform's stages
    (``rows`` and ``spare`` overwritten); then times the signs over B (integers times +-2^-m: exact, -0 where sigma
    is -1 and H q is 0)."""
    if block <= UNROTATE_PRODUCT_MOST:
        result = torch.mm(rows, hadamard(block, rows.device), out=spare)
    else:
        result = fwht_(rows, spare)
    return result.mul_(rotation_signs(seed, block, rows.device) * (1.0 / block))


def unpack(packed: torch.Tensor, s: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The s integers q of a message's values, float32 (written into ``out``, at least s + 1 values, when given)."""
    pairs = (s + 1) // 2
    q = (torch.empty(2 * pairs, dtype=torch.float32, device=packed.device) if out is None else out[: 2 * pairs])
    q = q.view(pairs, 2)
    q[:, 0].copy_(packed[:pairs] & 15)
    q[:, 1].copy_(packed[:pairs] >> 4)
    return q.view(-1)[:s].sub_(NIBBLE_OFFSET)


def dequantize(
    message: torch.Tensor,
    s: int,
    block: int,
    out: torch.Tensor,
    *,
    add: bool = False,
    rotate: bool = DEFAULT_ROTATE,
    seed: int = 0,
) -> None:
    """x~ written into ``out`` (float32, s values, contiguous), or added to it with ``add=True``
    (``dequantize_eager`` says how), through the kernel ``cerar.formats.fused`` enabled for out's device where there
    is one (the same bytes), else eagerly."""
    if FUSED_DEQUANTIZE is None or not FUSED_DEQUANTIZE(message, s, block, out, add, rotate, seed):
        dequantize_eager(message, s, block, out, add=add, rotate=rotate, seed=seed)


FUSED_DEQUANTIZE = None
"""The 4-bit decoder's dispatch, for ``cerar.formats.fused`` to set (as ``FUSED_QUANTIZE``): (message, s, block,
out, add, rotate, seed) -> True when a kernel enabled for out's device wrote ``out``."""


def dequantize_eager(
    message: torch.Tensor,
    s: int,
    block: int,
    out: torch.Tensor,
    *,
    add: bool = False,
    rotate: bool = DEFAULT_ROTATE,
    seed: int = 0,
) -> None:
    """``dequantize`` with torch's eager operations, the reference its kernels must match: q scale per block, or,
    for a rotated block, ((sigma / B) (H q)) scale (exact but for the product by the scale)."""
    scales, packed = parts(message, s, block)
    rotated = _split(s, block, rotate)
    with ExitStack() as borrowed:  # one pooled buffer for q, a second for the rotation's product
        count = 2 if rotated else 1
        buffers = [borrowed.enter_context(POOL.borrowed(s + 1, torch.float32, out.device)) for _ in range(count)]
        q = unpack(packed, s, buffers[0])
        if rotated:
            result = _unrotate(q[:rotated].view(-1, block), seed, block, buffers[1][:rotated].view(-1, block))
            factor = scales[: rotated // block].unsqueeze(1)
            target = out[:rotated].view(-1, block)
            if add:
                target.addcmul_(result, factor)
            else:
                torch.mul(result, factor, out=target)
        for rows, first in _each_block_set(q[rotated:], block):
            at = rotated + first * block
            target = out[at : at + rows.numel()].view(rows.shape)
            scale = scales[rotated // block + first : rotated // block + first + rows.shape[0]].unsqueeze(1)
            if add:
                target.addcmul_(rows, scale)
            else:
                torch.mul(rows, scale, out=target)


# ------------------------------------------------------------------------------------------------
# The bound
# ------------------------------------------------------------------------------------------------


def error_bound(x: torch.Tensor, block: int, rounding: str = DEFAULT_ROUNDING, rotate: bool = DEFAULT_ROTATE,
                seed: int = 0) -> torch.Tensor:  # fmt: skip
    """The most each value of x can err once quantized and decoded (module docstring), float64: scale_b (k + 2 u
    (40 + 8 m sqrt(B))) + 8 x 2^-149 per value of block b, scale_b from the block's exact rotation (float64) where
    it is rotated, k = 1/2 (nearest) or 1 (stochastic), m = log2 B (0 where not rotated)."""
    check_format(block, rounding, rotate, "error_bound")
    v = x.detach().double().reshape(-1)
    s = v.numel()
    rotated = _split(s, block, rotate)
    absmax = torch.zeros(blocks(s, block), dtype=torch.float64)
    if rotated:
        y = v[:rotated].view(-1, block) * rotation_signs(seed, block, "cpu").double()
        y = fwht_(y.clone())
        absmax[: rotated // block] = y.abs().amax(dim=1)
    tail = v[rotated:]
    nb_tail = blocks(tail.numel(), block)
    if nb_tail:
        padded = torch.cat([tail.abs(), tail.new_zeros(nb_tail * block - tail.numel())]).view(nb_tail, block)
        absmax[rotated // block :] = padded.amax(dim=1)
    k = 0.5 if rounding == "nearest" else 1.0
    m = math.log2(block) if rotate else 0.0
    u = 2.0**-24
    per_block = absmax / QMAX * (k + 2 * u * (40 + 8 * m * math.sqrt(block))) + 8 * 2.0**-149
    return per_block.repeat_interleave(block)[:s]
