"""The Triton source of ``cerar.formats.triton_kernels`` (which says what each kernel computes and why it is exact).

Imported only by ``triton_kernels._kernels``, at the first call: importing it jits the kernels, and Triton decides
then whether they run compiled or in its interpreter (``TRITON_INTERPRET=1``). The constants are the formats':
127 (``int8_blocks.QMAX``), 2^-126 and 2^64 (``TINY_SCALE``, ``PRESCALE``), 2^16 (the dither's levels, chunks and
period), 1.5 x 2^23 (round to nearest even by a sum), 15 and 126 (``wire.TARGET_EXPONENT``, ``K_LIMIT``).
"""

import triton
import triton.language as tl


@triton.jit
def mix32(h):
    """``int8_blocks._mix32`` on uint32 (the multiplications wrap mod 2^32 as its masks do)."""
    h = (h ^ (h >> 16)) * 0x45D9F3B
    h = (h ^ (h >> 16)) * 0x45D9F3B
    return h ^ (h >> 16)


@triton.jit
def quantize(x_ptr, scale_ptr, q_ptr, s, nb, offset, shift, chunk_shift,
             B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
             STOCHASTIC: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BP)
    pos = rows[:, None].to(tl.int64) * B + cols[None, :]
    mask = (cols[None, :] < B) & (pos < s)
    x = tl.load(x_ptr + pos, mask=mask, other=0.0)
    absmax = tl.max(tl.abs(x), axis=1)
    nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    scale = (absmax.to(tl.float64) / 127.0).to(tl.float32)
    scale = tl.where(nan, float("nan"), scale)
    p = tl.where((scale < 1.1754943508222875e-38) & (scale > 0), 18446744073709551616.0, 1.0)
    inverse = tl.where(scale > 0, (1.0 / (scale * p).to(tl.float64)).to(tl.float32), 0.0)
    r = (x * p[:, None]) * inverse[:, None]
    if STOCHASTIC:
        chunk = (rows // K + chunk_shift) % 65536
        shifts = (shift + (mix32((chunk + 65536).to(tl.uint32)) & 0xFFFF).to(tl.int32)) % P
        entry = (((rows % K) * B)[:, None] + cols[None, :] + shifts[:, None]) % P
        level = ((mix32(entry.to(tl.uint32)) & 0xFFFF).to(tl.int32) + offset) & 0xFFFF
        u = level.to(tl.float32) * 0.0000152587890625
        q = tl.floor((r.to(tl.float64) + u.to(tl.float64)).to(tl.float32))
    else:
        q = (r + 12582912.0) - 12582912.0
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(q_ptr + pos, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < nb)


@triton.jit
def dequantize(q_ptr, scale_ptr, out_ptr, s, nb,
               B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
               ADD: tl.constexpr, FMA: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BP)
    pos = rows[:, None].to(tl.int64) * B + cols[None, :]
    mask = (cols[None, :] < B) & (pos < s)
    q = tl.load(q_ptr + pos, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=rows < nb, other=0.0)[:, None]
    if ADD:
        out = tl.load(out_ptr + pos, mask=mask, other=0.0)
        if FMA:  # noqa: SIM108 (Triton's if on a constexpr: one form compiled)
            y = tl.fma(q, scale, out)
        else:
            y = out + q * scale
    else:
        y = q * scale
    tl.store(out_ptr + pos, y, mask=mask)


@triton.jit
def to_bfloat16_bits(y):
    """float32 -> bfloat16's bits (int16), rounded to nearest even on the integer bits as c10::BFloat16 does for
    every non-NaN value (Triton's interpreter truncates its own conversion; CUDA's cvt.rn gives the same bits)."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(y != y, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def encode(x_ptr, least_ptr, largest_ptr, out_ptr, n, TILE: tl.constexpr, BF16: tl.constexpr):
    # the larger magnitude of the message's least and largest value (torch.aminmax: a NaN propagates), as bits
    a = tl.maximum(tl.load(largest_ptr), -tl.load(least_ptr), propagate_nan=tl.PropagateNan.ALL)
    a = a.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    e = ((a.to(tl.float32, bitcast=True).to(tl.float64).to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1022
    e = tl.where((a == 0) | (a >= 0x7F800000), 0, e.to(tl.int32))
    k = tl.minimum(tl.maximum(15 - e, -126), 126)
    power = ((k + 127) << 23).to(tl.float32, bitcast=True)
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    y = tl.load(x_ptr + offs, mask=offs < n, other=0.0) * power
    if BF16:  # out_ptr: the message's bits as int16
        tl.store(out_ptr + 1 + offs, to_bfloat16_bits(y), mask=offs < n)
        if tl.program_id(0) == 0:
            tl.store(out_ptr, to_bfloat16_bits(k.to(tl.float32)))
    else:
        tl.store(out_ptr + 1 + offs, y.to(tl.float16), mask=offs < n)
        if tl.program_id(0) == 0:
            tl.store(out_ptr, k.to(tl.float32).to(tl.float16))


@triton.jit
def decode(message_ptr, out_ptr, n, TILE: tl.constexpr, BF16: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    if BF16:  # message_ptr: its bits as int16; a bfloat16 is the top half of a float32
        head = tl.load(message_ptr).to(tl.uint16, bitcast=True).to(tl.uint32)
        k = (head << 16).to(tl.float32, bitcast=True).to(tl.int32)
        bits = tl.load(message_ptr + 1 + offs, mask=offs < n, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        v = (bits << 16).to(tl.float32, bitcast=True)
    else:
        k = tl.load(message_ptr).to(tl.float32).to(tl.int32)
        v = tl.load(message_ptr + 1 + offs, mask=offs < n, other=0.0).to(tl.float32)
    power = ((127 - k) << 23).to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs, v * power, mask=offs < n)


# ------------------------------------------------------------------------------------------------
# The 4-bit format (cerar.formats.int4_blocks): rotation, rounding, packing in one kernel; the decoder likewise
# ------------------------------------------------------------------------------------------------


@triton.jit
def hash32(h):
    """``int4_blocks._hash32`` on uint32 (the products wrap mod 2^32 as its masks do)."""
    h = (h ^ (h >> 16)) * 0x21F0AAAD
    h = (h ^ (h >> 15)) * 0x735A2D97
    return h ^ (h >> 15)


@triton.jit
def fwht(y, ROWS: tl.constexpr, B: tl.constexpr, LOG2B: tl.constexpr):
    """``int4_blocks.fwht_`` on each row of y [ROWS, B]: stage h = 1, 2, ..., B/2 takes each pair (a, b) = (v[i],
    v[i + h]) of a group of 2h values to (a + b, a - b), in that order (the format's)."""
    for i in tl.static_range(LOG2B):
        v = tl.permute(tl.reshape(y, (ROWS, B // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
        a, b = tl.split(v)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, B))
    return y


@triton.jit
def quantize4(x_ptr, signs_ptr, scale_ptr, packed_ptr, s, nb, full_rows, chain,
              B: tl.constexpr, ROWS: tl.constexpr, LOG2B: tl.constexpr, ROTATE: tl.constexpr,
              STOCHASTIC: tl.constexpr, RECIPROCAL: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, B)
    pos = rows[:, None].to(tl.int64) * B + cols[None, :]
    x = tl.load(x_ptr + pos, mask=pos < s, other=0.0)
    if ROTATE:  # full blocks only: the short last block is sent as it is
        y = fwht(x * tl.load(signs_ptr + cols)[None, :], ROWS, B, LOG2B)
        x = tl.where((rows < full_rows)[:, None], y, x)
    absmax = tl.max(tl.abs(x), axis=1)
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1) > 0
    if RECIPROCAL:  # noqa: SIM108  CUDA eager x / 7: times float32 1/7 (div_true_kernel_cuda, CPU scalar)
        scale = absmax * 0.14285714285714285
    else:  # the IEEE quotient (the CPU's), from float64
        scale = (absmax.to(tl.float64) / 7.0).to(tl.float32)
    scale = tl.where(bad, float("nan"), scale)
    p = tl.where((scale < 1.1754943508222875e-38) & (scale > 0), 18446744073709551616.0, 1.0)
    inverse = tl.where(scale * p > 0, (1.0 / (scale * p).to(tl.float64)).to(tl.float32), 0.0)
    r = (x * p[:, None]) * inverse[:, None]
    if STOCHASTIC:  # u of position pos: its chunk's key (offset, shift) from the message's chain, then the table
        chunk = (pos >> 16).to(tl.uint32)
        key = hash32(chain.to(tl.uint32) ^ hash32(chunk))
        entry = ((pos & 0xFFFF).to(tl.uint32) + (key >> 16)) & 0xFFFF
        u = ((hash32(entry) + key) & 0xFFFF).to(tl.float32) * 0.0000152587890625
        q = tl.floor(r + u)
    else:
        q = (r + 12582912.0) - 12582912.0
    nibble = tl.minimum(tl.maximum(q, -7.0), 7.0) + 8.0
    low, high = tl.split(tl.reshape(nibble, (ROWS, B // 2, 2)))
    pair = rows[:, None].to(tl.int64) * (B // 2) + tl.arange(0, B // 2)[None, :]
    high = tl.where(2 * pair + 1 < s, high, 0.0)  # an odd s: the last byte's high nibble is 0
    tl.store(packed_ptr + pair, (low + 16.0 * high).to(tl.uint8), mask=2 * pair < s)
    tl.store(scale_ptr + rows, scale, mask=rows < nb)


@triton.jit
def dequantize4(packed_ptr, signs_ptr, scale_ptr, out_ptr, s, nb, full_rows,
                B: tl.constexpr, ROWS: tl.constexpr, LOG2B: tl.constexpr, ROTATE: tl.constexpr,
                ADD: tl.constexpr, FMA: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pair = rows[:, None].to(tl.int64) * (B // 2) + tl.arange(0, B // 2)[None, :]
    byte = tl.load(packed_ptr + pair, mask=2 * pair < s, other=0x88).to(tl.int32)
    q = tl.reshape(tl.join(byte & 15, byte >> 4), (ROWS, B)).to(tl.float32) - 8.0
    if ROTATE:  # (sigma / B) (H q): exact (integers, then +-2^-m)
        y = fwht(q, ROWS, B, LOG2B) * (tl.load(signs_ptr + tl.arange(0, B)) * (1.0 / B))[None, :]
        q = tl.where((rows < full_rows)[:, None], y, q)
    scale = tl.load(scale_ptr + rows, mask=rows < nb, other=0.0)[:, None]
    pos = rows[:, None].to(tl.int64) * B + tl.arange(0, B)[None, :]
    if ADD:
        out = tl.load(out_ptr + pos, mask=pos < s, other=0.0)
        if FMA:  # noqa: SIM108 (Triton's if on a constexpr: one form compiled)
            y = tl.fma(q, scale, out)
        else:
            y = out + q * scale
    else:
        y = q * scale
    tl.store(out_ptr + pos, y, mask=pos < s)
