"""The 8-bit block format of ``cerar.int8.all_reduce``: int8 values with one float32 scale per block of B values.

A vector x of s values is cut into nb = ceil(s/B) blocks of B values (the last one shorter). Block b
keeps its scale and B integers:

    scale_b = absmax_b / 127,   q = round(x / scale_b) in [-127, 127],   x~ = q scale_b

(scale_b and 1 / scale_b are float32's correctly rounded quotients on every device: ``block_scales``),
rounding either to nearest (ties to even; ``rounding="nearest"``), so every value errs by at most
scale_b / 2 = absmax_b / 254 (plus float32's rounding of x / scale_b and of q scale_b, a relative 2^-24
each: ``error_bound``), or stochastically (``rounding="stochastic"``, ``DEFAULT_ROUNDING``): q =
floor(x / scale_b + u) with a dither u in [0, 1), so that q scale_b is x on average over calls (to 2^-16
of the scale), at most one scale_b from it, and about 1.4x nearest's error in one call. Nearest rounding
is a bias where contributions repeat: a value beside one 127x larger in its block rounds the same way on
every rank at every step (0.003 beside 1.0 decodes to 0, always), and averaging over ranks or steps does
not remove it; stochastic rounding's error averages out over steps, which is why it is the default of the
all-reduce (docs/int8.md has the measurements).

The dither is counter-based, so no random numbers are drawn on the device and a call is reproducible. The
message's positions are cut into chunks of P values (P = K B, K = max(1, 2^16 // B) blocks: 2^16 at B = 128):
position p lies in chunk c = p // P at entry e = p mod P, and

    u_p = ((A[(e + s_c) mod P] + offset) mod 2^16) / 2^16,   s_c = (shift + C[(c + chunk_shift) mod Q]) mod P

with A[i] = mix32(i) mod 2^16 (i < P) and C[j] = mix32(2^16 + j) mod 2^16 (j < Q = 2^16) fixed hashes of the
index (``dither_tables``), and offset = key mod 2^16, shift = (key >> 16) mod P, chunk_shift = mix32(key xor
``CHUNK_SALT``) mod Q, all from the message's key (a hash of the seed, the call's count, the sender's global rank,
the shard: ``dither_key``), computed on the host. Over messages whose keys are uniform:
- every u_p is uniform on the 2^16 levels (the offset), so floor(r + u) is r on average (to 2^-16 of a step);
- two positions of one chunk take A at two entries, moved by the chunk's shift at each call, so the dithers of
  a block are not the same pattern moved at every call (with a fixed pattern, a block's mean error over 40
  calls reached 6.2 standard deviations of an independent dither's in a 2-rank test);
- positions p and p + P (the same entry of two chunks) take A at entries s_c apart, and s_c - s_c' = C[c +
  chunk_shift] - C[c' + chunk_shift] changes at each call: their dithers are as independent as two entries of
  one chunk (before, every chunk repeated the first one's dither: u_p = u_(p + 2^16) at every call, issue 51).
  The whole message's pattern repeats only after Q P = 2^32 values (16 GiB of float32).
A (as A / 2^16, float32) and C are kept on each device, each twice over so that a shifted table is a slice: per
message the work is the table plus the offset (P values; exact: a sum of multiples of 2^-16 and its fraction)
and one shift per chunk; each position then reads its chunk's window of that table (``dither``, ``add_dither``).
Every rank decodes the bytes the sender wrote, so ranks need not agree on the dither, only on the format
(``format_name``).

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

from cerar.formats import devices
from cerar.ring.workspace import POOL

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
_DITHER = " (dither: 16-bit mix32 table per entry, shifted per 2^16-value chunk by a mix32 table, offset per message)"

TINY_SCALE = 2.0**-126
"""Below this scale (float32's least normal; absmax < 1.5e-36) 1 / scale may overflow (above 2^128 once the
scale is subnormal), so such a block is multiplied by ``PRESCALE`` first and its inverse taken of scale x 2^64."""
PRESCALE = 2.0**64

DITHER_LEVELS = 2**16
"""Stochastic rounding's dither takes the values k / 2^16, k = 0 .. 2^16 - 1."""
DITHER_PERIOD = 2**16
"""Positions per chunk of a message (rounded down to whole blocks: K B, K = max(1, 2^16 // B)); each chunk reads
the entry table from its own shift (module docstring)."""
DITHER_CHUNKS = 2**16
"""Q: chunks with distinct shift parts; a message's dither repeats after Q chunks (2^32 values at B = 128)."""
CHUNK_SALT = 0x27D4EB2F
"""Hashed with the message's key for the chunk shift, so that it is not a function of the offset or the shift."""


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
    rank, the shard), computed on the host: the low 16 bits are the offset, the high 16 the shift,
    and a hash of all 32 the chunk shift (``chunk_shifts``). No device work, the same on every device."""
    h = 0x9E3779B9
    for key in keys:
        h = _mix32(h ^ _mix32(int(key) & 0xFFFFFFFF))
    return int(h)


_DITHER_TABLES: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
_CHUNK_TABLE: list[int] = []
_QMAX_DIVISOR: dict[str, torch.Tensor] = {}


def _chunk_table() -> list[int]:
    """C[j] = mix32(2^16 + j) mod 2^16, j < Q, as Python integers (built once)."""
    if not _CHUNK_TABLE:
        j = torch.arange(DITHER_CHUNKS, dtype=torch.int64)
        _CHUNK_TABLE.extend((_mix32(DITHER_PERIOD + j) & (DITHER_LEVELS - 1)).tolist())
    return _CHUNK_TABLE


def dither_tables(block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(A / 2^16: float32 [2 P], C: int64 [2 Q]) on ``device``, the fixed parts of the dither (module docstring),
    each twice over so that a shifted table is a slice; built once per device and block size and cached."""
    device = torch.device(device)
    cached = (str(device), block)
    tables = _DITHER_TABLES.get(cached)
    if tables is None:
        P = max(1, DITHER_PERIOD // block) * block
        entries = (_mix32(torch.arange(P, dtype=torch.int64)) & (DITHER_LEVELS - 1)).to(torch.float32) / DITHER_LEVELS
        chunks = torch.tensor(_chunk_table(), dtype=torch.int64)
        tables = (torch.cat([entries, entries]).to(device), torch.cat([chunks, chunks]).to(device))
        _DITHER_TABLES[cached] = tables
    return tables


def _key_parts(key: int, P: int) -> tuple[float, int, int]:
    """(offset / 2^16, shift, chunk shift) of a message's key (module docstring)."""
    key &= 0xFFFFFFFF  # dither_key's 32 bits: the offset below, the shift above
    return (key & (DITHER_LEVELS - 1)) / DITHER_LEVELS, (key >> 16) % P, _mix32(key ^ CHUNK_SALT) % DITHER_CHUNKS


def message_dither(block: int, key: int, device) -> torch.Tensor:
    """The message's entry table twice over, float32 [2 P]: frac(A[i mod P] / 2^16 + offset / 2^16), the u of entry
    i of a chunk whose shift is 0 (exact: a sum of multiples of 2^-16 below 2, and its fraction)."""
    entries, _ = dither_tables(block, device)
    offset, _, _ = _key_parts(key, entries.numel() // 2)
    return torch.add(entries, offset).frac_()


def chunk_shifts(block: int, key: int, device, first_chunk: int, chunks: int) -> torch.Tensor:
    """The shifts s_c = (shift + C[(c + chunk shift) mod Q]) mod P of the chunks first_chunk .. first_chunk +
    chunks - 1, int64 on ``device`` (a slice of the cached C and two operations: no host synchronisation)."""
    entries, table = dither_tables(block, device)
    P = entries.numel() // 2
    _, shift, chunk_shift = _key_parts(key, P)
    start = (first_chunk + chunk_shift) % DITHER_CHUNKS
    if chunks <= DITHER_CHUNKS:
        part = table[start : start + chunks]
    else:  # a message of more than 2^32 values: its chunks' shifts repeat
        part = table[start : start + DITHER_CHUNKS].repeat(-(-chunks // DITHER_CHUNKS))[:chunks]
    return (part + shift) % P


def dither(block: int, key: int, device, first_row: int, rows: int, width: int | None = None) -> torch.Tensor:
    """The dither u of rows first_row .. first_row + rows - 1 of a message (blocks of B values; ``width`` < B for
    a short last block), float32 [rows, width], from the message's table (``message_dither``) by one gather of
    each chunk's window (``chunk_shifts``): the same few operations at any number of rows. Over messages whose
    keys are uniform, every u is uniform on the 2^16 levels, so floor(r + u) is r on average (to 2^-16)."""
    K = max(1, DITHER_PERIOD // block)
    first_chunk = first_row // K
    shifts = chunk_shifts(block, key, device, first_chunk, (first_row + rows - 1) // K - first_chunk + 1)
    windows = message_dither(block, key, device).unfold(0, K * block, 1)  # windows[s] = the table from entry s
    start = first_row - first_chunk * K
    return windows.index_select(0, shifts).view(-1, block)[start : start + rows, : block if width is None else width]


def add_dither(ratio: torch.Tensor, block: int, key: int, first_row: int) -> None:
    """ratio [n, w] += u, the dither of rows first_row.. of the message of key ``key`` (``dither``). On a device
    (``cerar.formats.devices.one_pass``) u is gathered (``dither``) and added: the same few operations at any n.
    On a CPU without writing u: each chunk's rows take a slice of the message's table (the shifts read on the
    host, which is free there), one addition per 2^16 values."""
    if devices.one_pass(ratio.device):
        ratio.add_(dither(block, key, ratio.device, first_row, ratio.shape[0], ratio.shape[1]))
        return
    K = max(1, DITHER_PERIOD // block)
    P = K * block
    offset, shift, chunk_shift = _key_parts(key, P)
    entries, _ = dither_tables(block, "cpu")
    n, width = ratio.shape
    single = first_row // K == (first_row + n - 1) // K
    table = None if single else message_dither(block, key, "cpu")
    row = first_row
    while row < first_row + n:
        c, k = divmod(row, K)
        take = min(K - k, first_row + n - row)
        s = (shift + _chunk_table()[(c + chunk_shift) % DITHER_CHUNKS]) % P + k * block
        # one chunk: only its rows' part of the table; more: slices of the message's table
        u = torch.add(entries[s : s + take * block], offset).frac_() if table is None else table[s : s + take * block]
        ratio[row - first_row : row - first_row + take].add_(u.view(take, block)[:, :width])
        row += take


def block_scales(rows: torch.Tensor, scale: torch.Tensor, *, always_prescale: bool | None = None):
    """Per row (block): scale = absmax / 127 into ``scale``, and returns (p, inverse): the prescale p (2^64 where
    the scale is below ``TINY_SCALE``, else 1; None where no block needs it and ``always_prescale`` is false)
    and the inverse 1 / (scale p) (0 for a zero block), all float32 [n], eagerly.

    Both divisions are torch's IEEE division on every device: scale by a 1-value tensor of 127 on the rows'
    device (a Python number would be a CPU scalar, which CUDA's ``div_true_kernel_cuda``,
    aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu, turns into a product by its reciprocal: the CPU's bytes
    would differ), the inverse by ``reciprocal`` (``1 / a`` in UnaryFractionKernels.cu). The fused kernels take
    p and the inverse from here and only multiply (Triton's ``/`` is an approximate division,
    torch._inductor.config.eager_numerics.division_rounding: 6 of 16,777,216 values differed on an H200).
    The absmax: the largest and the least value (``cerar.formats.devices.one_pass``: on a device ``aminmax``,
    one read; on a CPU ``amax`` and ``amin``), their larger magnitude (abs: +0.0 for a block of zeros); a NaN
    propagates, so its block decodes to NaN. ``always_prescale`` None: p may be None only where the host may be
    read (on a CPU; on a device that would synchronise)."""
    one_pass = devices.one_pass(rows.device)
    if one_pass:
        least, largest = torch.aminmax(rows, dim=1)
        torch.maximum(largest, least.neg_(), out=scale).abs_()
    else:
        torch.amax(rows, dim=1, out=scale)
        scale.copy_(torch.maximum(scale, torch.amin(rows, dim=1).neg_())).abs_()
    divisor = _QMAX_DIVISOR.get(str(rows.device))
    if divisor is None:
        divisor = _QMAX_DIVISOR.setdefault(str(rows.device), torch.full((1,), float(QMAX), device=rows.device))
    scale.div_(divisor)
    tiny = (scale < TINY_SCALE) & (scale > 0)
    if always_prescale is None:
        always_prescale = one_pass
    if not always_prescale and not bool(tiny.any()):  # a zero block: inverse 0 (an infinite scale: 0, x inf: NaN)
        return None, torch.where(scale > 0, 1 / scale, 0.0)
    p = torch.where(tiny, PRESCALE, 1.0)
    return p, torch.where(scale > 0, 1 / (scale * p), 0.0)


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
    below 2^-126 and 1 elsewhere (``block_scales``: multiplying by a power of two is exact, so for every normal
    scale this is x times the scale's inverse, and a subnormal scale's inverse no longer overflows), and
    q = round(r) (to nearest, ties to even) or floor(r + u) (stochastic, r + u rounded once to float32, u the
    dither of key ``offset``: ``dither``), held to [-127, 127].
    Traffic per value at nearest, on a CPU: absmax 8 (the largest and the least), r 8, rounded 8, stored 5: 29
    bytes (the clamp, 8 more, only where a block's scale is subnormal); stochastic adds the dither (12: added from
    the message's table, one addition per 2^16 values), the floor and the clamp (16): 57. On a device
    (``cerar.formats.devices.one_pass``): absmax 4, p always applied (8 more) with its clamp (8), and the dither
    gathered before it is added (4 more): the same few operations at any n."""
    prescale, inverse = block_scales(rows, scale)
    with POOL.borrowed(rows.numel(), torch.float32, rows.device) as scratch:  # kept between calls on a CPU (no faults)
        ratio = torch.mul(rows, (inverse if prescale is None else prescale).unsqueeze(1),
                          out=scratch[: rows.numel()].view(rows.shape))  # fmt: skip
        if prescale is not None:
            ratio.mul_(inverse.unsqueeze(1))
        if rounding == "stochastic":
            add_dither(ratio, block, offset, first_row)
            ratio.floor_()
        else:
            ratio.round_()
        if prescale is not None or rounding == "stochastic":  # nearest on normal scales stays within 127.5: no clamp
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
    """x~ = q scale, written into ``out`` (float32, s values, contiguous), or added to it with ``add=True``
    (``dequantize_eager`` says how), through the kernel ``cerar.formats.fused`` enabled for out's device where there
    is one (the same bytes), else eagerly."""
    if FUSED_DEQUANTIZE is None or not FUSED_DEQUANTIZE(message, s, block, out, add):
        dequantize_eager(message, s, block, out, add=add)


FUSED_DEQUANTIZE = None
"""The decoder's dispatch, put here by ``cerar.formats.fused`` (as ``FUSED_QUANTIZE``): (message, s, block, out, add)
-> True when a kernel enabled for out's device wrote ``out``."""


def dequantize_eager(message: torch.Tensor, s: int, block: int, out: torch.Tensor, *, add: bool = False) -> None:
    """``dequantize`` with torch's eager operations, the reference its kernels must match: 13 bytes of traffic per
    value written on a CPU (int8 read, float32 written, read and written scaled), 17 added."""
    scales, values = parts(message, s, block)
    for rows, which in _rows(out, block):
        q = values[which.start * block : which.start * block + rows.numel()].view(rows.shape)
        dequantize_rows(q, scales[which], rows, add)


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, add: bool) -> None:
    """rows [n, w] = (or +=) values [n, w] x scale [n], eagerly: q scale rounded once to float32, then added
    (``addcmul``, whose rounding is its kernel's: every rank decodes the same bytes with the same operation on
    the same kind of device, so the ranks agree)."""
    if devices.one_pass(rows.device):  # one pass each (``cerar.formats.devices``): 5 and 9 bytes a value
        if add:
            rows.addcmul_(values, scale.unsqueeze(1))
        else:
            torch.mul(values, scale.unsqueeze(1), out=rows)
    elif add:
        with POOL.borrowed(values.numel(), rows.dtype, rows.device) as scratch:  # kept between calls (no page faults)
            rows.addcmul_(scratch[: values.numel()].view(values.shape).copy_(values), scale.unsqueeze(1))
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
