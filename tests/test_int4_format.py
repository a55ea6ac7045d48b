"""The 4-bit block format (cerar.formats.int4_blocks) against a reference written here from its description, byte for
byte: two values per byte, one float32 scale absmax/7 per block, an optional rotation of each full block (random
signs, then the fast Walsh-Hadamard transform in the stated order of stages), rounding to nearest or stochastically
with a dither that no two positions of a message share.

The reference works in numpy: float32 where the format computes in float32 (numpy's float32 additions, products and
divisions are IEEE single operations, each correctly rounded, so the rotation's stages, the scale, the ratio and
r + u give the format's float32 results exactly), float64 and Python integers elsewhere. The hashes (the dither's
table, its per-chunk keys, the rotation's signs) are re-derived here from the words of the module docstring, not
imported.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cerar.formats import int4_blocks as q4

M32 = 0xFFFFFFFF
P = 2**16
U = 2.0**-24
TINY = 2.0**-126


def hash32(h):
    """The docstring's hash on 32-bit words (numpy uint64 arrays or Python ints)."""
    h = h & M32
    h = ((h ^ (h >> 16)) * 0x21F0AAAD) & M32
    h = ((h ^ (h >> 15)) * 0x735A2D97) & M32
    return h ^ (h >> 15)


def key_of(*keys: int) -> int:
    h = 0x6A09E667
    for k in keys:
        h = hash32(h ^ hash32(k & M32))
    return h


def signs(seed: int, B: int) -> np.ndarray:
    K = key_of(seed, 0x524F54)
    return 1.0 - 2.0 * (hash32(np.arange(B, dtype=np.uint64) ^ np.uint64(K)) & np.uint64(1)).astype(np.float64)


def dither(key: int, s: int) -> np.ndarray:
    """u of positions 0 .. s-1 (float64, exact multiples of 2^-16)."""
    A = (hash32(np.arange(P, dtype=np.uint64)) & np.uint64(0xFFFF)).astype(np.int64)
    p = np.arange(s)
    chunk, within = p // P, p % P
    u = np.empty(s)
    for c in np.unique(chunk):
        k = key_of(key, int(c))
        at = chunk == c
        u[at] = ((A[(within[at] + (k >> 16)) % P] + (k & 0xFFFF)) & 0xFFFF) / 2**16
    return u


def hadamard_rows(rows: np.ndarray, dtype=np.float64) -> np.ndarray:
    """The stages h = 1, 2, ..., B/2 on rows in ``dtype``: (a, b) -> (a + b, a - b). float32: each sum and difference
    rounded as the format's float32 additions are; float64: H rows exactly (Sylvester's H) for the values here."""
    n, B = rows.shape
    v = rows.astype(dtype)
    h = 1
    while h < B:
        g = v.reshape(n, B // (2 * h), 2, h)
        v = np.concatenate([g[:, :, :1] + g[:, :, 1:], g[:, :, :1] - g[:, :, 1:]], axis=2).reshape(n, B)
        h *= 2
    return v


def reference(x: torch.Tensor, B: int, rounding: str, key: int, rotate: bool, seed: int):
    """(scales float32 [nb] with NaN for a non-finite block, q int [s], and the message's bytes)."""
    v = x.numpy().astype(np.float32)
    s = v.size
    nb = -(-s // B)
    rotated = s // B * B if rotate else 0
    y = v.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        if rotated:
            rows = v[:rotated].reshape(-1, B) * signs(seed, B).astype(np.float32)
            y[:rotated] = hadamard_rows(rows, np.float32).reshape(-1)
        scales = np.zeros(nb, np.float32)
        r = np.zeros(s, np.float32)
        for b in range(nb):
            block = y[b * B : (b + 1) * B]
            absmax = np.abs(block).max()
            if not np.isfinite(absmax):
                scales[b] = np.nan
                continue
            scale = np.float32(np.float64(absmax) / 7)
            scales[b] = scale
            if scale == 0:
                continue
            p = np.float32(2.0**64) if scale < TINY else np.float32(1.0)
            inverse = np.float32(1.0 / np.float64(scale * p))
            r[b * B : b * B + block.size] = (block * p) * inverse
    if rounding == "nearest":
        q = np.rint(r.astype(np.float64))
    else:
        q = np.floor((r.astype(np.float64) + dither(key, s)).astype(np.float32).astype(np.float64))
    q = np.clip(q, -7, 7).astype(np.int64)
    nibbles = q + 8
    if s % 2:
        nibbles = np.append(nibbles, 0)
    packed = (nibbles[0::2] + 16 * nibbles[1::2]).astype(np.uint8)
    return scales, q, np.concatenate([scales.view(np.uint8), packed])


def adversarial(B: int, s: int, seed: int = 0) -> torch.Tensor:
    """Blocks spanning decades, exact ties (absmax 7: scale 1, values k + 1/2), zeros, subnormal and huge scales,
    one NaN block, one infinite block, a spike beside small values, and a short last block of odd length."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-s // B)
    x = torch.randn(s, generator=g) * torch.exp(3 * torch.randn(nb, generator=g)).repeat_interleave(B)[:s]
    blocks = [x[b * B : (b + 1) * B] for b in range(nb)]
    blocks[0].zero_()
    ties = (torch.arange(B, dtype=torch.float32) % 14 - 6.5).clamp(-6.5, 6.5)
    ties[0] = 7.0
    blocks[1].copy_(ties)
    for b, a in ((2, 1e-37), (3, 1e-40), (4, 1e-44), (5, 2.0**-149), (6, 3e38)):
        blocks[b].mul_(a / blocks[b].abs().max())
    blocks[7][3] = float("nan")
    blocks[8][5] = float("-inf")
    blocks[9].uniform_(0.02, 0.06, generator=g)
    blocks[9][B // 2 + 1] = 1.0
    return x


CASES = [(128, 128 * 20 + 37, True), (128, 128 * 20 + 37, False), (16, 16 * 12 + 5, True), (12, 12 * 11 + 1, False),
         (512, 512 * 11 + 3, True)]  # fmt: skip
"""Above ``UNROTATE_PRODUCT_MOST`` (256) the decoder undoes the rotation by its stages, not by one product."""


@pytest.mark.quick
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(("B", "s", "rotate"), CASES)
def test_quantizer_writes_the_format_byte_for_byte(rounding, B, s, rotate):
    """Every byte of the message as the reference writes it (a non-finite block: its scale NaN, its nibbles
    unspecified); the message is 4 ceil(s/B) + ceil(s/2) bytes long; the decoding of each finite block is
    (sigma H q / B) scale (rotated) or q scale, rounded once to float32; a non-finite block decodes to NaN."""
    x = adversarial(B, s)
    key, seed = q4.dither_key(3, 4), 11
    message = q4.new_message(s, B, "cpu")
    assert message.numel() == 4 * math.ceil(s / B) + math.ceil(s / 2)
    q4.quantize_into(message, x, B, rounding, key, rotate, seed)
    scales, q, want = reference(x, B, rounding, key, rotate, seed)
    got = message.numpy()
    finite = np.isfinite(scales)
    nb = scales.size
    assert np.array_equal(np.isnan(q4.parts(message, s, B)[0].numpy()), ~finite)
    byte_ok = np.ones(got.size, bool)
    for b in np.flatnonzero(~finite):
        byte_ok[4 * b : 4 * b + 4] = False  # NaN's bits may differ; checked as NaN above
        lo, hi = 4 * nb + (b * B) // 2, 4 * nb + -(-min(s, (b + 1) * B) // 2)
        byte_ok[lo:hi] = False
    bad = np.flatnonzero((got != want) & byte_ok)
    assert bad.size == 0, (rounding, rotate, bad[:8], got[bad[:8]], want[bad[:8]])
    out = torch.empty(s)
    q4.dequantize(message, s, B, out, rotate=rotate, seed=seed)
    rotated = s // B * B if rotate else 0
    decoded = q.astype(np.float64)
    if rotated:
        decoded[:rotated] = (hadamard_rows(q[:rotated].reshape(-1, B)) * signs(seed, B) / B).reshape(-1)
    expected = torch.from_numpy((decoded * np.repeat(scales.astype(np.float64), B)[:s]).astype(np.float32))
    per_value = torch.from_numpy(np.repeat(finite, B)[:s])
    assert torch.equal(out[per_value], expected[per_value])
    assert torch.isnan(out[~per_value]).all()


def spec_bound(x: torch.Tensor, B: int, rounding: str, rotate: bool, seed: int) -> torch.Tensor:
    """The docstring's bound, written here: per value of block b, scale_b (k + 2 u (40 + 8 m sqrt(B))) + 8 x
    2^-149, scale_b = absmax / 7 of the block's exact rotation (float64) where rotated."""
    v = x.double().numpy()
    s = v.size
    rotated = s // B * B if rotate else 0
    y = v.copy()
    if rotated:
        y[:rotated] = hadamard_rows(v[:rotated].reshape(-1, B) * signs(seed, B)).reshape(-1)
    nb = -(-s // B)
    absmax = np.array([np.abs(y[b * B : (b + 1) * B]).max() for b in range(nb)])
    m = math.log2(B) if rotate else 0
    step = 0.5 if rounding == "nearest" else 1.0
    per_block = absmax / 7 * (step + 2 * U * (40 + 8 * m * math.sqrt(B))) + 8 * 2.0**-149
    return torch.from_numpy(np.repeat(per_block, B)[:s])


@pytest.mark.quick
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(("B", "s", "rotate"), CASES)
def test_decoded_values_are_within_the_stated_bound_and_err_as_a_4_bit_quantizer_does(rounding, B, s, rotate):
    """Every finite value within the docstring's bound (written here, and equal to q4.error_bound's), and the squared
    error at least a quarter of what uniform rounding predicts, sum over blocks of (B, or 1 rotated) x step^2 / 12
    (nearest) or / 6 (stochastic): the exact values, or a format rounding in 8 bits, would fail that."""
    x = adversarial(B, s, seed=2)
    finite = torch.isfinite(x.view(-1)).clone()
    for b in range(-(-s // B)):
        if not bool(finite[b * B : (b + 1) * B].all()) or (rotate and b == 6 and (b + 1) * B <= s):
            finite[b * B : (b + 1) * B] = False  # the NaN and infinite blocks; rotated, the 3e38 block overflows
    message, out = q4.new_message(s, B, "cpu"), torch.empty(s)
    q4.quantize_into(message, x, B, rounding, q4.dither_key(9), rotate, 5)
    q4.dequantize(message, s, B, out, rotate=rotate, seed=5)
    assert torch.isnan(out[~finite]).all()
    xs = torch.where(finite, x, 0.0)
    bound = spec_bound(xs, B, rounding, rotate, 5)
    assert torch.equal(bound, q4.error_bound(xs, B, rounding, rotate, 5))
    error = (out.double() - x.double()).abs()[finite]
    worst = int(torch.argmax(error - bound[finite]))
    assert torch.all(error <= bound[finite]), (worst, float(error[worst]), float(bound[finite][worst]))
    typical_step = 1 / 12 if rounding == "nearest" else 1 / 6
    steps = (bound[finite] - 8 * 2.0**-149) / (0.5 if rounding == "nearest" else 1.0)
    per_value_share = torch.where(
        torch.arange(s)[finite] < (s // B * B if rotate else 0), torch.tensor(1.0 / B), torch.tensor(1.0)
    ).double()
    typical = float((steps.square() * per_value_share).sum()) * typical_step
    assert float(error.square().sum()) >= 0.25 * typical, (float(error.square().sum()), typical)


# ------------------------------------------------------------------------------------------------
# Stochastic rounding: unbiased over calls, a dither no two positions share
# ------------------------------------------------------------------------------------------------


def small_beside_large(B: int = 128, nb: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of one 1.0 and B - 1 values in [0.02, 0.06], below half a step (1/14): nearest rounding of the plain
    format decodes each of them to 0, at every call."""
    g = torch.Generator().manual_seed(21)
    x = 0.02 + 0.04 * torch.rand(nb * B, generator=g)
    x[::B] = 1.0
    small = torch.ones(nb * B, dtype=torch.bool)
    small[::B] = False
    return x, small


@pytest.mark.quick
@pytest.mark.parametrize("rotate", [False, True])
def test_stochastic_rounding_is_unbiased_over_calls_where_nearest_is_not(rotate):
    """Over T calls with keys (seed, call), the mean decoded value converges to x. Per rotated (or plain) value,
    one call's rounding errs by e in [-step, step) with E[e] within b = step (2^-16 + 2 u (40 + 8 m sqrt(B))) (the
    dither's levels and float32's rounding, as in the bound) and variance at most step^2 / 4; rotated back, a
    decoded value's error is a mean of B such errors with random signs (variance step^2 / 4B), plain it is one of
    them. Held: every value's mean over T calls within b + 6 sigma / sqrt(T) (sigma = step / 2, or step / 2 sqrt(B)
    rotated; 6 sigma: a chance below 2e-9 per value), step the block's scale (of its exact rotation). Nearest fails:
    plain, it sends every small value to 0 (0.14-0.42 of a step off); rotated, its fixed error is far outside the
    stochastic mean's band for some values."""
    B, T = 128, 200
    x, small = small_beside_large(B)
    s = x.numel()
    steps = spec_bound(x, B, "stochastic", rotate, 0).numpy() - 8 * 2.0**-149  # one step (+ float32's slack)
    m = math.log2(B) if rotate else 0
    bias = steps * (2.0**-16 + 2 * U * (40 + 8 * m * math.sqrt(B)))
    sigma = steps / 2 / (math.sqrt(B) if rotate else 1)
    band = torch.from_numpy(bias + 6 * sigma / math.sqrt(T))
    for rounding in ("stochastic", "nearest"):
        message, out, total = q4.new_message(s, B, "cpu"), torch.empty(s), torch.zeros(s, dtype=torch.float64)
        for t in range(T):
            q4.quantize_into(message, x, B, rounding, q4.dither_key(0, t), rotate, 0)
            q4.dequantize(message, s, B, out, rotate=rotate, seed=0)
            total += out.double()
        error = (total / T - x.double()).abs()
        if rounding == "stochastic":
            worst = int(torch.argmax(error - band))
            assert torch.all(error <= band), (rotate, worst, float(error[worst]), float(band[worst]))
        else:
            assert int((error > band).sum()) > s // 20, (rotate, int((error > band).sum()))
            if not rotate:
                assert torch.all(out[small] == 0)


@pytest.mark.quick
def test_the_dither_is_the_docstrings_and_no_two_positions_of_a_message_share_it():
    """q4.dither equals the reference's for positions spanning three chunks, from any first position; and over
    K = 400 message keys, the dithers at positions p and p + 2^16 (the 8-bit table's period, where its positions
    share their dither) are uncorrelated: the sample correlation of a pair of independent uniforms has standard
    deviation 1/sqrt(K - 1), held within 5 of it, where a shared dither gives 1; they coincide on about 2^-16 of
    the keys (held: at most 3 of the 400 over the 64 pairs checked, where sharing gives all)."""
    key = q4.dither_key(7, 8)
    s = 2 * P + 1000
    want = torch.from_numpy(dither(key, s)).float()
    assert torch.equal(q4.dither(key, 0, s, "cpu"), want)
    assert torch.equal(q4.dither(key, P - 5, 5000, "cpu"), want[P - 5 : P + 4995])
    K = 400
    pairs = torch.arange(0, P, P // 64)
    a = torch.stack([q4.dither(q4.dither_key(1, k), 0, 2 * P, "cpu") for k in range(K)])
    first, second = a[:, pairs], a[:, pairs + P]
    first, second = first - first.mean(dim=0), second - second.mean(dim=0)
    corr = (first * second).sum(dim=0) / (first.norm(dim=0) * second.norm(dim=0))
    assert corr.abs().max() <= 5 / math.sqrt(K - 1), corr.abs().max()
    assert int((a[:, pairs] == a[:, pairs + P]).sum()) <= 3
    assert a.min() >= 0 and a.max() < 1 and abs(float(a.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / a.numel())


@pytest.mark.quick
def test_the_errors_of_the_two_chunks_of_a_message_are_independent_over_calls():
    """A message whose second 2^16 values repeat its first: the summed rounding error of each half, over T calls,
    is uncorrelated (|corr| within 5 / sqrt(T - 1)); with a shared dither the halves would err identically
    (correlation 1)."""
    B, T = 128, 120
    g = torch.Generator().manual_seed(4)
    half = torch.rand(P, generator=g)
    half[::B] = 1.0
    x = torch.cat([half, half])
    message, out = q4.new_message(2 * P, B, "cpu"), torch.empty(2 * P)
    sums = torch.empty(T, 2, dtype=torch.float64)
    for t in range(T):
        q4.quantize_into(message, x, B, "stochastic", q4.dither_key(2, t), False, 0)
        q4.dequantize(message, 2 * P, B, out, rotate=False)
        sums[t] = (out.double() - x.double()).view(2, P).sum(dim=1)
    centred = sums - sums.mean(dim=0)
    corr = float((centred[:, 0] * centred[:, 1]).sum() / (centred[:, 0].norm() * centred[:, 1].norm()))
    assert abs(corr) <= 5 / math.sqrt(T - 1), corr


# ------------------------------------------------------------------------------------------------
# The rotation
# ------------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_the_rotation_is_derived_from_the_seed_alone_and_undone_exactly():
    """The signs are the reference's, the same for the same seed, other for another; H H = B I exactly on integers
    (the decoder's transform), and fwht_ ping-pongs whatever its stage count."""
    for seed in (0, 1, 2**40 + 3):
        assert torch.equal(q4.rotation_signs(seed, 64, "cpu"), torch.from_numpy(signs(seed, 64)).float())
    assert not torch.equal(q4.rotation_signs(0, 64, "cpu"), q4.rotation_signs(1, 64, "cpu"))
    for B in (1, 2, 8, 128):
        z = torch.randint(-7, 8, (5, B)).float()
        once = q4.fwht_(z.clone()).clone()
        assert torch.equal(once.double(), torch.from_numpy(hadamard_rows(z.numpy())))
        assert torch.equal(q4.fwht_(once), z * B)


@pytest.mark.quick
def test_the_rotation_keeps_small_values_beside_a_spike():
    """A block of one spike (100) and small Gaussian values: plain, every small value is below half a step
    (100/14) and decodes to 0 (nearest rounding), an error of the small values' whole norm; rotated, the spike is
    spread over the block and the small values' relative error falls below 0.5 (measured 0.2-0.3)."""
    B = 128
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64 * B, generator=g)
    x[::B] = 100.0
    small = torch.ones_like(x, dtype=torch.bool)
    small[::B] = False
    errors = {}
    for rotate in (False, True):
        message, out = q4.new_message(x.numel(), B, "cpu"), torch.empty(x.numel())
        q4.quantize_into(message, x, B, "nearest", 0, rotate, 3)
        q4.dequantize(message, x.numel(), B, out, rotate=rotate, seed=3)
        errors[rotate] = float((out - x)[small].norm() / x[small].norm())
    assert errors[False] == 1.0 and errors[True] < 0.5, errors


ROTATION_QUANTIZE_OPERATIONS = 1 + 2 * 7
"""The operations the rotation adds to a quantization at B = 128: the product by the signs, and each of the log2 B
stages' sums and differences (one operation each, over every block at once)."""
ROTATION_DEQUANTIZE_OPERATIONS = 3
"""...and to a dequantization: H q as one product (B <= 256: ``UNROTATE_PRODUCT_MOST``), the signs times 1/B (B
values), their product."""
QUANTIZE_OPERATIONS_MOST = 68
"""A rotated quantization with nearest rounding at B = 128, a short last block included (44 without it), counted:
at most this many operations whatever the message's length."""
DEQUANTIZE_OPERATIONS_MOST = 10
"""...and a rotated dequantization, the short last block included (23 when the rotation was undone by its stages)."""


@pytest.mark.quick
def test_the_rotation_is_a_fixed_number_of_operations_at_any_length():
    """Counted on the dispatched operations (tests/test_op_count.py's counter: views and allocations are not
    operations): rotated less not rotated, at 2^17 + 37 and 2^19 + 37 values, the rotation is 1 + 2 log2 B
    operations per quantization and 3 per dequantization (B <= 256), none of them per block or per chunk of the
    message; nearest rounding's whole count does not grow with the message. (The stochastic dither still adds a
    few operations per 2^16 values, a loop the 8-bit format's device form removed: not the rotation's.)"""
    from tests.test_op_count import OperationCounter

    B = 128
    counts = {}
    for s in (2**17 + 37, 2**19 + 37):
        x, out, message = torch.randn(s), torch.empty(s), q4.new_message(s, B, "cpu")
        for rotate in (False, True):
            q4.quantize_eager(message, x, B, "nearest", 0, rotate, 3)  # the signs, built once per seed
            q4.dequantize(message, s, B, out, rotate=rotate, seed=3)  # and H, once per B
            with OperationCounter() as quantize:
                q4.quantize_eager(message, x, B, "nearest", 0, rotate, 3)
            with OperationCounter() as dequantize:
                q4.dequantize(message, s, B, out, rotate=rotate, seed=3)
            counts[s, rotate] = (quantize.total, dequantize.total)
        plain, rotated = counts[s, False], counts[s, True]
        assert rotated[0] - plain[0] == ROTATION_QUANTIZE_OPERATIONS, counts
        assert rotated[1] - plain[1] == ROTATION_DEQUANTIZE_OPERATIONS, counts
        assert rotated[0] <= QUANTIZE_OPERATIONS_MOST and rotated[1] <= DEQUANTIZE_OPERATIONS_MOST, counts
    assert counts[2**17 + 37, True] == counts[2**19 + 37, True], counts


# ------------------------------------------------------------------------------------------------
# Arguments and the fused path's hook
# ------------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_bad_formats_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="block must be a power of two to be rotated"):
        q4.check_format(96, "nearest", True, "test")
    assert q4.check_format(96, "nearest", False, "test") == (96, "nearest", False)
    with pytest.raises(ValueError, match="rounding must be one of"):
        q4.check_format(64, "up", True, "test")
    with pytest.raises(ValueError, match="block must be an integer >= 1"):
        q4.check_format(0, "nearest", False, "test")
    with pytest.raises(ValueError, match="rotate must be true or false"):
        q4.check_format(64, "nearest", 1, "test")
    names = {q4.format_name(r, rot) for r in q4.ROUNDINGS for rot in (False, True)}
    assert len(names) == 4 and q4.format_name(q4.DEFAULT_ROUNDING, q4.DEFAULT_ROTATE) == q4.FORMAT


@pytest.mark.quick
def test_the_fused_hook_is_asked_first_and_the_eager_path_writes_otherwise(monkeypatch):
    """quantize_into asks FUSED_QUANTIZE (cerar.formats.fused's to set) with every argument of the format; where it
    answers False, or is None, the eager reference writes the message; where True, nothing else touches it."""
    x = adversarial(64, 64 * 12 + 3)
    s = x.numel()
    want = q4.new_message(s, 64, "cpu")
    q4.quantize_eager(want, x, 64, "stochastic", 5, True, 9)
    asked = []

    def declines(*args):
        asked.append(args[2:])
        return False

    monkeypatch.setattr(q4, "FUSED_QUANTIZE", declines)
    got = q4.new_message(s, 64, "cpu")
    q4.quantize_into(got, x, 64, "stochastic", 5, True, 9)
    assert asked == [(64, "stochastic", 5, True, 9)]
    assert torch.equal(got, want)
    monkeypatch.setattr(q4, "FUSED_QUANTIZE", lambda *args: True)
    untouched = torch.zeros_like(want)
    q4.quantize_into(untouched, x, 64, "stochastic", 5, True, 9)
    assert not untouched.any()
