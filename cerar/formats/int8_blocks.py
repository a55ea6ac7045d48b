"""The 8-bit block format of ``cerar.int8.all_reduce``: int8 values with one float32 scale per block of B values.

A vector x of s values is cut into nb = ceil(s/B) blocks of B values (the last one shorter). Block b
keeps its scale and B integers:

    scale_b = absmax_b / 127,   q = round(x / scale_b) in [-127, 127],   x~ = q scale_b

rounding either to nearest (ties to even; ``rounding="nearest"``), so every value errs by at most
scale_b / 2 = absmax_b / 254 (plus float32's rounding of x / scale_b and of q scale_b, a relative 2^-24
each: ``error_bound``), or stochastically (``rounding="stochastic"``, ``DEFAULT_ROUNDING``): q =
floor(x / scale_b + u) with a dither u in [0, 1), so that q scale_b is x on average over calls (to 2^-16
of the scale), at most one scale_b from it, and about 1.4x nearest's error in one call. Nearest rounding
is a bias where contributions repeat: a value beside one 127x larger in its block rounds the same way on
every rank at every step (0.003 beside 1.0 decodes to 0, always), and averaging over ranks or steps does
not remove it; stochastic rounding's error averages out over steps, which is why it is the default of the
all-reduce (docs/int8.md has the measurements).

The dither is counter-based, so no random numbers are drawn on the device and a call is reproducible: u at
position p of a message is ((base[(p + shift) mod P] + offset) mod 2^16) / 2^16, base a fixed hash of the
position (``dither_base``, P = 2^16 values, rounded down to whole blocks) and (offset, shift) a hash of the
message's keys (the seed, the call's count, the sender, the shard: ``dither_key``), computed on the host.
The offset makes every position's u uniform over calls; the shift gives each block new base values at each
call, so that the dithers of one block are not the same pattern moved at every call (with a fixed pattern,
a block's mean error over 40 calls reached 6.2 standard deviations of an independent dither's in a 2-rank
test). The table of a call is built from them on the device (``dither_table``, at most P values) and read
by the values' loop. Every rank decodes the bytes the sender wrote, so ranks need not agree on the dither,
only on the format (``format_name``).

Where absmax_b is below 127 x 2^-126 (1.5e-36) the scale is subnormal and 1 / scale would overflow, so
such a block's values and scale are multiplied by 2^64 first (exact: a power of two), and q is held to
[-127, 127]: the block is kept to within its bound plus 127 x 2^-150 (the subnormal scale's own rounding),
where it used to decode to zero. A block of zeros has scale 0 and decodes to zeros; a block holding a NaN
or an infinity decodes to NaN throughout (its scale is not finite; its integers are unspecified), so a
non-finite gradient stays non-finite after aggregation and the trainer's check still sees it.

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

ROUNDINGS = ("nearest", "stochastic")
DEFAULT_ROUNDING = "stochastic"

_FORMAT_STEM = "int8 absmax/127, one float32 scale per block, scales first, 2^64 prescale below 2^-126"
_DITHER = " (dither: 16-bit mix32 table per position, shifted and offset per message)"

TINY_SCALE = 2.0**-126
"""Below this scale (float32's least normal; absmax < 1.5e-36) 1 / scale may overflow (above 2^128 once the
scale is subnormal), so such a block is multiplied by ``PRESCALE`` first and its inverse taken of scale x 2^64."""
PRESCALE = 2.0**64

DITHER_LEVELS = 2**16
"""Stochastic rounding's dither takes the values k / 2^16, k = 0 .. 2^16 - 1."""
DITHER_PERIOD = 2**16
"""Positions of a message with distinct fixed dither parts (``dither_base``); the pattern repeats after them."""


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


def check_rounding(rounding, operation: str) -> str:
    """``rounding`` as one of ``ROUNDINGS``, else ValueError naming it."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"{operation}: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    return rounding


def format_name(rounding: str = DEFAULT_ROUNDING) -> str:
    """The format's description that ranks compare before the first round (``FORMAT`` for the default rounding)."""
    dither = _DITHER if check_rounding(rounding, "format_name") == "stochastic" else ""
    return f"{_FORMAT_STEM}, {rounding} rounding{dither}"


FORMAT = format_name(DEFAULT_ROUNDING)
"""What ranks compare before the first round (with the block size): a rank that decodes another format
refuses. ``format_name(rounding)`` for the other rounding."""


def _mix32(h):
    """A 32-bit integer hash (two multiply-xorshift rounds; constants below 2^31, so int64 never overflows).
    Works on Python ints and int64 tensors alike."""
    h = h & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def dither_key(*keys: int) -> int:
    """A message's dither key in [0, 2^32), a hash of integer keys (the seed, the call's count, the sender's
    rank, the shard), computed on the host: the low 16 bits are the offset, the high 16 the shift
    (``dither_table``). No device work, the same on every device."""
    h = 0x9E3779B9
    for key in keys:
        h = _mix32(h ^ _mix32(int(key) & 0xFFFFFFFF))
    return int(h)


_DITHER_BASE: dict[tuple[str, int], torch.Tensor] = {}


def dither_base(block: int, device) -> torch.Tensor:
    """The fixed per-position part of the dither: int32 [K B] (K = max(1, 2^16 // B) blocks), a hash of the
    index, in [0, 2^16); cached per device and block size."""
    device = torch.device(device)
    cached = (str(device), block)
    base = _DITHER_BASE.get(cached)
    if base is None:
        K = max(1, DITHER_PERIOD // block)
        positions = torch.arange(K * block, dtype=torch.int64)
        base = (_mix32(positions) & (DITHER_LEVELS - 1)).to(torch.int32).to(device)
        _DITHER_BASE[cached] = base
    return base


def dither_table(block: int, key: int, device, first_row: int = 0, rows: int | None = None) -> torch.Tensor:
    """The dither of one message, float32 [R, B]: table entry e is u = ((base[(e + shift) mod KB] + offset) mod
    2^16) / 2^16, in [0, 1), with offset = key mod 2^16 and shift = (key >> 16) mod KB; position p of the message
    takes entry p mod KB (table row (p // B) mod K, column p mod B). Returned: the table rows first_row,
    first_row + 1, ... (mod K), R = min(K, rows) of them (all K when ``rows`` is None), built from a slice of
    ``base`` (at most K B values: a short message pays for its own rows only). Over messages whose keys are
    uniform, every position's u is uniform on the 2^16 levels, so floor(r + u) is r on average (to 2^-16)."""
    key &= 0xFFFFFFFF  # dither_key's 32 bits: the offset below, the shift above
    base = dither_base(block, device)
    KB = base.numel()
    K = KB // block
    n = K * block if rows is None else min(K, rows) * block
    start = ((first_row % K) * block + (key >> 16)) % KB
    end = start + n
    part = base[start:end] if end <= KB else torch.cat([base[start:], base[: end - KB]])
    table = ((part + (key & (DITHER_LEVELS - 1))) & (DITHER_LEVELS - 1)).to(torch.float32).mul_(1.0 / DITHER_LEVELS)
    return table.view(-1, block)


def _scales_into(scale: torch.Tensor, rows: torch.Tensor) -> None:
    """scale = absmax / 127 per row: the largest and the least value (two reads, no |x| written), their larger
    magnitude (abs: +0.0 for a block of zeros, as |x| gives); a NaN propagates, so its block decodes to NaN."""
    torch.amax(rows, dim=1, out=scale)
    scale.copy_(torch.maximum(scale, torch.amin(rows, dim=1).neg_())).abs_()
    scale.div_(QMAX)


def _add_dither(ratio: torch.Tensor, table: torch.Tensor) -> None:
    """ratio [n, w] += the dither: row r takes ``table``'s row r mod R (the table starts at ratio's first row)."""
    R = table.shape[0]
    n, width = ratio.shape
    for r in range(0, n, R):
        take = min(R, n - r)
        ratio[r : r + take].add_(table[:take, :width])


def quantize_eager(
    message: torch.Tensor, x: torch.Tensor, block: int, rounding: str = "nearest", offset: int = 0
) -> None:
    """The format written with torch's eager operations, one pass each: the reference the fused kernel
    (``cerar.formats.fused``) must match byte for byte, and the path taken without it (``quantize_rows`` says how)."""
    s = x.numel()
    scales, values = parts(message, s, block)
    for rows, which in _rows(x, block):
        q = values[which.start * block : which.start * block + rows.numel()].view(rows.shape)
        quantize_rows(rows, scales[which], q, block, which.start, rounding, offset)


def quantize_rows(
    rows: torch.Tensor,
    scale: torch.Tensor,
    values: torch.Tensor,
    block: int,
    first_row: int,
    rounding: str = "nearest",
    offset: int = 0,
) -> None:
    """Rows [n, w] (w <= B) of a message, blocks first_row.., into their scales [n] and int8 values [n, w],
    eagerly.

    Per block: scale = absmax / 127 (float32), then r = (x p) (1 / (scale p)) with p = 2^64 where scale is
    below 2^-126 and 1 elsewhere (multiplying by a power of two is exact, so for every normal scale this is
    x times the scale's inverse, and a subnormal scale's inverse no longer overflows), and
    q = round(r) (to nearest, ties to even) or floor(r + u) (stochastic, u the dither of key ``offset``:
    ``dither_table``), held to [-127, 127].
    Traffic per value at nearest: absmax 8 (the largest and the least), r 8, rounded 8, stored 5: 29 bytes
    (the clamp, 8 more, only where a block's scale is subnormal); stochastic adds the dither, the floor and
    the clamp (24 more)."""
    table = dither_table(block, offset, rows.device, first_row, rows.shape[0]) if rounding == "stochastic" else None
    _scales_into(scale, rows)
    tiny = (scale < TINY_SCALE) & (scale > 0)
    prescale = bool(tiny.any()) if rows.device.type == "cpu" else True  # no host synchronisation on a device
    if prescale:
        p = torch.where(tiny, PRESCALE, 1.0)
        inverse = torch.where(scale > 0, 1 / (scale * p), 0.0)
        ratio = rows * p.unsqueeze(1)
        ratio.mul_(inverse.unsqueeze(1))
    else:  # a zero block: inverse 0 (an infinite scale: 0, and x inf -> NaN)
        ratio = rows * torch.where(scale > 0, 1 / scale, 0.0).unsqueeze(1)
    if table is None:
        ratio.round_()
    else:
        _add_dither(ratio, table)
        ratio.floor_()
    if prescale or table is not None:  # nearest on normal scales stays within 127.5: no clamp needed
        ratio.clamp_(-QMAX, QMAX)
    values.copy_(ratio)


def quantize_into(
    message: torch.Tensor, x: torch.Tensor, block: int, rounding: str = "nearest", offset: int = 0
) -> None:
    """Write x (float32, s values, contiguous) into ``message`` in the block format (``quantize_eager`` says
    how), through the fused kernel of ``cerar.formats.fused`` when it is enabled for x's device and s is large enough
    to pay for a call, else eagerly; the bytes are the same either way. ``offset``: the message's dither
    key (``dither_key``), read only with ``rounding="stochastic"``."""
    if FUSED_QUANTIZE is None or not FUSED_QUANTIZE(message, x, block, rounding, offset):
        quantize_eager(message, x, block, rounding, offset)


FUSED_QUANTIZE = None
"""The fused quantizer's dispatch, put here by ``cerar.formats.fused`` when it is imported (the kernels depend on this
format, never the other way): (message, x, block, rounding, offset) -> True when a fused kernel enabled for x's
device wrote the message; None, or False, and the eager path writes it."""


def dequantize(message: torch.Tensor, s: int, block: int, out: torch.Tensor, *, add: bool = False) -> None:
    """x~ = q scale, written into ``out`` (float32, s values, contiguous), or added to it with ``add=True``:
    13 bytes of traffic per value written (int8 read, float32 written, read and written scaled), 17 added.
    Eager only (``cerar.formats.fused.KERNELS`` says why)."""
    scales, values = parts(message, s, block)
    for rows, which in _rows(out, block):
        q = values[which.start * block : which.start * block + rows.numel()].view(rows.shape)
        dequantize_rows(q, scales[which], rows, add)


dequantize_eager = dequantize


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, add: bool) -> None:
    """rows [n, w] = (or +=) values [n, w] x scale [n], eagerly: q scale rounded once to float32, then added."""
    if add:
        rows.addcmul_(values.to(rows.dtype), scale.unsqueeze(1))
    else:
        rows.copy_(values)
        rows.mul_(scale.unsqueeze(1))


def error_bound(x: torch.Tensor, block: int, rounding: str = "nearest") -> torch.Tensor:
    """The most each value of x can err once quantized and decoded: scale_b / 2 of its block (scale_b with
    ``rounding="stochastic"``: floor(r + u) lies within one step of r), plus float32's rounding of the scale,
    the product and the decoding (each at most 2^-24 of 128 scale_b; counted twice over for margin), plus
    127 x 2^-150 where the scale is subnormal (its own rounding, half the least subnormal, times |q| <= 127).
    Float64."""
    x = x.detach().double().reshape(-1)
    s = x.numel()
    nb = blocks(s, block)
    padded = torch.cat([x, x.new_zeros(nb * block - s)]).view(nb, block)
    scale = padded.abs().amax(dim=1) / QMAX
    step = 0.5 if check_rounding(rounding, "error_bound") == "nearest" else 1.0
    per_value = scale * (step + 4 * (QMAX + 1) * 2.0**-24) + QMAX * 2.0**-150
    return per_value.repeat_interleave(block)[:s]
