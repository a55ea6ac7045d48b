"""The hand-written Triton kernels (cerar.formats.triton_kernels) against the eager formats, byte for byte, on the CPU.

No GPU here: the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``: numpy executes each program's block
operations), which holds their arithmetic, indexing, masks and the dither's hashes to the eager references written
from the format's spec. What the interpreter cannot show is how CUDA rounds: the kernels use only operations that
round once, as IEEE does, whatever the backend (the module docstring), and ``enable`` checks each against eager on
the device before switching it on (the GPU check and the GPU benchmark run that). One exception is tested here for
what it is: the interpreter's ``tl.fma`` rounds twice, so the dequantize-and-add's fused multiply-add form is
checked only on a GPU, and its product-then-sum form here.
"""

from __future__ import annotations

import pytest
import torch

from cerar.formats import fused
from cerar.formats import int4_blocks as q4
from cerar.formats import int8_blocks as q8
from cerar.formats import triton_kernels as tk
from cerar.formats.wire import Wire

pytest.importorskip("triton", reason="Triton is not installed: pip install -r requirements-kernels.txt runs these "
                    "kernels in its interpreter (a CUDA build of torch brings it)")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` before Triton is imported); the formats'
    kernels switched off around each test."""
    assert tk.usable("cpu", interpreter=True) == (True, ""), "TRITON_INTERPRET=1 must be set before Triton loads"
    monkeypatch.delenv("CERAR_FUSED", raising=False)
    fused.disable()
    yield
    fused.disable()


N = 2**16 + 5 * 128 + 37
"""Two dither chunks at B = 128 and a short last block: the chunk shift, the tail mask and a partial tile."""
SHORT = 5 * 4096 + 37
"""Five tiles and a partial one, for the kernels with no chunks."""


@pytest.mark.parametrize("block", [128, 100])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_quantizer_writes_the_eager_bytes_in_one_kernel(rounding, block):
    """Scales, integers and the dither (hashed in the kernel, read from tables by eager) byte for byte, on blocks
    built to sit at rounding boundaries (``fused._sample``: ties, subnormal and huge scales, decades apart). B = 100
    pads each block's columns to 128 and makes the dither's period 65,500, not a power of two (its entries wrap
    within a chunk at every shift)."""
    n = N if (rounding, block) == ("stochastic", 128) else SHORT
    x = fused._sample(block, rounding, n)
    want, got = q8.new_message(n, block, "cpu"), q8.new_message(n, block, "cpu")
    q8.quantize_eager(want, x, block, rounding, 12345)
    tk.quantize(got, x, block, rounding, 12345)
    assert torch.equal(want, got), f"{int((want != got).sum())} of {want.numel()} bytes differ"
    if rounding == "stochastic":  # another key moves the dither: the kernel reads it, bytes change
        other = q8.new_message(n, block, "cpu")
        tk.quantize(other, x, block, rounding, 777)
        q8.quantize_eager(want, x, block, rounding, 777)
        assert torch.equal(want, other) and not torch.equal(got, other)


def test_the_decoders_write_the_eager_bytes_and_the_add_rounds_the_product_then_the_sum():
    """q scale into float32 as eager writes it; added, as fl(out + fl(q scale)) (a reference in two torch operations:
    the interpreter's fused multiply-add rounds twice too; the one-rounding form is checked on a GPU by enable)."""
    x = fused._sample(128, "stochastic", SHORT)
    message = q8.new_message(SHORT, 128, "cpu")
    q8.quantize_eager(message, x, 128, "stochastic", 5)
    want, got = torch.empty(SHORT), torch.full((SHORT,), 7.0)
    q8.dequantize_eager(message, SHORT, 128, want)
    tk.dequantize(message, SHORT, 128, got)
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    scales, values = q8.parts(message, SHORT, 128)
    base = torch.randn(SHORT, generator=torch.Generator().manual_seed(1))
    product = values.float() * scales.repeat_interleave(128)[:SHORT]
    added = base.clone()
    tk.dequantize(message, SHORT, 128, added, add=True, fma=False)
    assert torch.equal((base + product).view(torch.int32), added.view(torch.int32))
    assert not torch.equal(added, base + 1.0001 * product)  # the check sees a product off by 1e-4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_wire_kernels_write_the_eager_bytes_for_normal_subnormal_huge_and_zero_blocks(dtype):
    """k from the bits of the message's larger magnitude (``aminmax``), the values scaled and rounded to 16 bits
    (bfloat16 rounded to nearest even on its bits, as c10 does), and back: byte for byte with ``Wire``'s eager
    encode and decode, for a block of subnormals (k clamped at 126), one with infinities (k of a non-finite
    maximum: 15), one of zeros."""
    w = Wire(dtype)
    x = fused._sample(128, None, SHORT)
    for values in (x, x * 1e-42, x * 1e30, torch.zeros(SHORT), -x * 2.0**-60):
        want, got = w.empty(SHORT, values), w.empty(SHORT, values)
        w.encode_eager(values, want)
        tk.wire_encode(values, got)
        assert torch.equal(want.view(torch.int16), got.view(torch.int16)), (dtype, float(want[0]), float(got[0]))
        out_want, out_got = torch.empty(SHORT), torch.empty(SHORT)
        w.decode_eager(want, out_want)
        tk.wire_decode(want, out_got)
        assert torch.equal(out_want.view(torch.int32), out_got.view(torch.int32))
    with_nan = x.clone()
    with_nan[7] = float("nan")  # k of a NaN maximum: eager's frexp gives exponent 0, so k = 15; the rest finite
    want, got = w.empty(SHORT, x), w.empty(SHORT, x)
    w.encode_eager(with_nan, want)
    tk.wire_encode(with_nan, got)
    finite = torch.ones(SHORT + 1, dtype=torch.bool)
    finite[8] = False
    assert float(got[0]) == float(want[0]) == 15.0
    assert torch.equal(want.view(torch.int16)[finite], got.view(torch.int16)[finite])


def test_enable_times_triton_beside_eager_and_the_formats_dispatch_to_the_kernel_it_chose(monkeypatch):
    """Every Triton kernel is checked against eager on enable's sample, then timed; given timings where Triton is
    the fastest, the formats' public functions (quantize_into, dequantize, Wire.encode and decode) run it (seen by
    counting its calls) and write the eager bytes. The dequantize-and-add's forms both round twice in the
    interpreter while the CPU's eager addcmul rounds once: it stays eager, saying why."""
    timings = {"copy": 1.0, "triton": 1.0}
    monkeypatch.setattr(fused, "_seconds", lambda calls, device: {k: timings.get(k, 3.0) for k in calls})
    calls = []
    for name in ("quantize", "dequantize", "wire_encode", "wire_decode"):
        real = getattr(tk, name)
        monkeypatch.setattr(tk, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    lines: list[str] = []
    fused.enable("cpu", 128, kernels=("quantize_stochastic", "dequantize", "dequantize_add", "wire_encode",
                                      "wire_decode"), backend="eager", say=lines.append,
                 sample_values=2 * fused.MIN_VALUES, triton=True)  # fmt: skip
    chosen = {k[0]: v["chosen"] for k, v in fused.choices().items()}
    assert chosen == {"quantize_stochastic": "triton", "dequantize": "triton", "dequantize_add": "eager",
                      "wire_encode": "triton", "wire_decode": "triton"}, lines  # fmt: skip
    assert "dequantize_add eager (triton failed: the dequantize_add kernel differs" in lines[-1], lines
    assert "wire_decode triton 1.00 (eager 3.00;" in lines[-1], lines
    calls.clear()
    x = fused._sample(128, None, N)
    message, want = q8.new_message(N, 128, "cpu"), q8.new_message(N, 128, "cpu")
    q8.quantize_into(message, x, 128, "stochastic", 3)
    q8.quantize_eager(want, x, 128, "stochastic", 3)
    out = torch.empty(N)
    q8.dequantize(message, N, 128, out)
    w = Wire("float16")
    wire_message, wire_out = w.empty(N, x), torch.empty(N)
    w.encode(x, wire_message)
    w.decode(wire_message, wire_out)
    assert calls == ["quantize", "dequantize", "wire_encode", "wire_decode"]
    assert torch.equal(message, want)
    small = torch.empty(fused.MIN_VALUES - 1)
    w.decode(w.empty(small.numel(), small).zero_(), small)  # below MIN_VALUES: eager, no kernel call
    assert calls == ["quantize", "dequantize", "wire_encode", "wire_decode"]


def test_a_kernel_that_misrounds_stays_off_and_the_next_form_is_tried():
    """``enable``'s check refuses a kernel one unit off in one value of the sample, naming it; of a list of forms
    (the dequantize-and-add's) the first that writes the eager bytes is kept, else the first failure is raised."""

    def off_by_one_unit(message, s, block, out):
        tk.dequantize(message, s, block, out)
        out.view(torch.int32)[s // 2] += 1

    with pytest.raises(AssertionError, match="the dequantize kernel differs from the eager reference in 1 of"):
        fused._check("dequantize", off_by_one_unit, 128, "cpu", 2 * fused.MIN_VALUES)
    kept = fused._checked_runner("dequantize", [off_by_one_unit, tk.dequantize], 128, "cpu", 2 * fused.MIN_VALUES)
    assert kept is tk.dequantize
    with pytest.raises(AssertionError, match="in 1 of"):
        fused._checked_runner("dequantize", [off_by_one_unit, off_by_one_unit], 128, "cpu", 2 * fused.MIN_VALUES)


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_4_bit_kernel_rotates_rounds_and_packs_the_eager_bytes(rounding, rotate):
    """The 4-bit format in one kernel: random signs and the Walsh-Hadamard stages in the format's order on the full
    blocks (the short last one as it is), the scale as the CPU's quotient absmax / 7, the dither hashed per chunk and
    position, two nibbles a byte (an odd length: the last high nibble 0); byte for byte with ``quantize_eager`` over
    two dither chunks. CUDA's eager scale is a product by float32's 1/7 (a CPU scalar divisor): that form writes
    other bytes here, and ``enable`` keeps whichever is eager's on the device."""
    n = N  # odd: the last byte has one value
    x = fused._sample(128, None, n)
    want, got = q4.new_message(n, 128, "cpu"), q4.new_message(n, 128, "cpu")
    q4.quantize_eager(want, x, 128, rounding, 12345, rotate, 7)
    tk.quantize4(got, x, 128, rounding, 12345, rotate, 7, reciprocal=False)
    assert torch.equal(want, got), f"{int((want != got).sum())} of {want.numel()} bytes differ"
    tk.quantize4(got, x, 128, rounding, 12345, rotate, 7, reciprocal=True)
    assert not torch.equal(want, got)  # the other form is another rounding of the scale, seen here
    tk.quantize4(got, x, 128, rounding, 12345, rotate, 8, reciprocal=False)
    assert torch.equal(want, got) != rotate  # the rotation's seed moves the bytes only where blocks are rotated


@pytest.mark.parametrize("rotate", [True, False])
def test_the_4_bit_decoder_unrotates_and_scales_as_eager_and_adds_the_product_then_the_sum(rotate):
    """Unpacked, un-rotated ((sigma / B) (H q): exact) and scaled: eager's float32 bytes; added, fl(out + fl(x~))
    against torch's two operations (the one-rounding add is CUDA's and the CPU's addcmul: checked by enable on the
    device, as for the 8-bit decoder)."""
    x = fused._sample(128, None, SHORT)
    message = q4.new_message(SHORT, 128, "cpu")
    q4.quantize_eager(message, x, 128, "stochastic", 3, rotate, 7)
    want, got = torch.empty(SHORT), torch.full((SHORT,), 7.0)
    q4.dequantize_eager(message, SHORT, 128, want, rotate=rotate, seed=7)
    tk.dequantize4(message, SHORT, 128, got, False, rotate, 7)
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    base = torch.randn(SHORT, generator=torch.Generator().manual_seed(2))
    added = base.clone()
    tk.dequantize4(message, SHORT, 128, added, True, rotate, 7, fma=False)
    assert torch.equal((base + want).view(torch.int32), added.view(torch.int32))
    tk.dequantize4(message, SHORT, 128, got, False, rotate, 8)  # another seed: another rotation back
    assert torch.equal(want, got) != rotate


def test_the_4_bit_formats_dispatch_to_the_kernels_enable_chose(monkeypatch):
    """``enable`` checks the 4-bit kernels (each form) against eager, rotated and not, and switches on the one whose
    bytes are eager's where it is the fastest; ``int4_blocks.quantize_into`` and ``dequantize`` then run it."""
    monkeypatch.setattr(fused, "_seconds", lambda calls, device: {k: 1.0 if k in ("copy", "triton") else 3.0
                                                                  for k in calls})  # fmt: skip
    lines: list[str] = []
    fused.enable("cpu", 128, kernels=("int4_quantize_stochastic", "int4_dequantize"), backend="eager",
                 say=lines.append, sample_values=2 * fused.MIN_VALUES, triton=True)  # fmt: skip
    assert [k for k, _, _ in fused.enabled()] == ["int4_dequantize", "int4_quantize_stochastic"], lines
    calls = []
    for name in ("quantize4", "dequantize4"):
        real = getattr(tk, name)
        monkeypatch.setattr(tk, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    fused.disable()
    fused.enable("cpu", 128, kernels=("int4_quantize_stochastic", "int4_dequantize"), backend="eager",
                 say=lines.append, sample_values=2 * fused.MIN_VALUES, triton=True)  # fmt: skip
    calls.clear()
    x = fused._sample(128, None, N)
    message, want = q4.new_message(N, 128, "cpu"), q4.new_message(N, 128, "cpu")
    q4.quantize_into(message, x, 128, "stochastic", 5, True, 7)
    q4.quantize_eager(want, x, 128, "stochastic", 5, True, 7)
    out = torch.empty(N)
    q4.dequantize(message, N, 128, out, rotate=True, seed=7)
    assert calls == ["quantize4", "dequantize4"] and torch.equal(message, want)


def test_blocks_above_a_tile_are_refused_by_name():
    with pytest.raises(ValueError, match="block 8192 is above MAX_BLOCK=4096"):
        tk.quantize(q8.new_message(9000, 8192, "cpu"), torch.ones(9000), 8192, "nearest", 0)
    with pytest.raises(ValueError, match="the 4-bit kernels take a power of two 2..4096 as block, got 100"):
        tk.quantize4(q4.new_message(900, 100, "cpu"), torch.ones(900), 100, "nearest", 0, False, 0, reciprocal=False)
