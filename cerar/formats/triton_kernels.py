"""Hand-written Triton kernels for the formats' per-call arithmetic on a GPU: each operation in one pass over the data.

Why by hand: ``torch.compile`` wrote the 8-bit quantizer as two kernels (the blocks' absmax, then the values, which
read the float32 values a second time) that ran at 5.4x a device copy at 256 MiB on the H200 of 2026-12-04, and
eager torch's one-pass forms (``cerar.formats.devices``) at 2.3-3.9x for the decoders and 3.4-6.7x for the 16-bit
encode (``reports/gpu_bench.md``); issue 52 asks for at most 2x. A copy reads 4 bytes a value and writes 4. Here:

- ``quantize``: one kernel, a tile of whole blocks per program: each block's absmax, scale and inverse in
  registers, then the values: 4 bytes read and 1 + 4/B written a value (0.63 of a copy's traffic at B = 128).
  The stochastic dither is computed from its hashes in the kernel (``int8_blocks``' tables are those hashes
  written out), so it reads nothing more.
- ``dequantize`` (and ``dequantize_add``): 1 + 4/B bytes read and 4 written (5 and 9 with the add).
- ``wire_encode``: the message's least and largest value in one read (``torch.aminmax``, as eager: a NaN
  propagates), then one pass that finds k from their bits and writes the 16-bit values: 4 + 4 + 2 bytes, two
  launches (a first form, an atomic maximum of the bits after a zeroed accumulator, took three: 2.8x a copy at 64
  MiB on the H200, where the host's launches outlast the GPU's work).
- ``wire_decode``: 2 bytes read and 4 written.

Exact: every kernel writes the bytes of its eager reference (``int8_blocks.quantize_eager``, ``dequantize``,
``wire.Wire.encode_eager`` and ``decode``), which ``cerar.formats.fused.enable`` checks on each device before it
may be switched on. Each rounding is one IEEE rounding of the same operands:
- divisions in float64, rounded to float32 (Triton lowers float32 ``/`` to an approximate division; float64's is
  ``div.rn``): the float32 quotient (``cerar.formats.fused``'s docstring has the argument);
- round to nearest even by adding and subtracting 1.5 x 2^23 in float32 (|r| <= 127.5 here), so no library call;
- no library call at all (``libdevice`` is compiled with flush-to-zero by Triton's default, ``enable_reflect_ftz``,
  triton backends/nvidia/compiler.py ``CUDAOptions``; inductor's frexp is ``libdevice.ilogb`` and ``ldexp``: a
  probable cause of the compiled 16-bit encode's differences on the H200, whose check sample holds a message of
  subnormals), and kernels launch with ``enable_fp_fusion=False`` (no contraction into multiply-adds) and
  ``enable_reflect_ftz=False``;
- the dequantize-and-add is written both ways, as a product then a sum, and as one fused multiply-add (which is
  what CUDA's ``addcmul`` kernel, ``a + alpha * b * c`` compiled with contraction, computes at alpha = 1), and
  ``fused.enable`` keeps the form whose bytes are eager's on that device.

Where: CUDA tensors with Triton importable; and, asked for (``enable(triton=True)``), CPU tensors under
``TRITON_INTERPRET=1``: Triton's interpreter, which the tests use to hold these kernels to the eager bytes on a
machine without a GPU (far slower than eager). Block sizes up to ``MAX_BLOCK`` (a tile of whole blocks per program).
"""

from __future__ import annotations

import os

import torch

from cerar.formats import int4_blocks as q4
from cerar.formats import int8_blocks as q8
from cerar.formats import wire

TILE = 4096
"""Values per program: 16 KiB of float32, 32 blocks of 128."""

MAX_BLOCK = 4096
"""The largest block size B these kernels take (one tile holds at least one whole block)."""

LAUNCH = {"enable_fp_fusion": False, "enable_reflect_ftz": False}
"""Triton's compile options for every launch (module docstring): no contraction, no flush-to-zero in libdevice."""

_KERNELS: dict[str, object] = {}


def usable(device, interpreter: bool = False) -> tuple[bool, str]:
    """(True, "") where these kernels can run on ``device``: CUDA with Triton importable, or, when ``interpreter``
    is asked for, the CPU under ``TRITON_INTERPRET=1`` (set before Triton is first imported: tests/conftest.py);
    else (False, why)."""
    device = torch.device(device)
    if device.type == "cpu" and interpreter and os.environ.get("TRITON_INTERPRET") != "1":
        return False, "Triton's interpreter needs TRITON_INTERPRET=1 before Triton is imported"
    if device.type != "cuda" and not (device.type == "cpu" and interpreter):
        return False, f"no Triton kernels for {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return False, f"Triton is not importable ({error})"
    return True, ""


def _kernels() -> dict[str, object]:
    """The jitted kernels (``cerar.formats.triton_source``), imported at the first call, so that ``TRITON_INTERPRET``,
    read when a function is jitted, is the caller's."""
    if not _KERNELS:
        from cerar.formats import triton_source as src

        _KERNELS.update(quantize=src.quantize, dequantize=src.dequantize, encode=src.encode, decode=src.decode,
                        quantize4=src.quantize4, dequantize4=src.dequantize4)  # fmt: skip
    return _KERNELS


def _tiling(block: int) -> tuple[int, int]:
    """(BP, ROWS): the block's columns padded to a power of two, and whole blocks per program (BP ROWS = TILE)."""
    if block > MAX_BLOCK:
        raise ValueError(f"cerar.formats.triton_kernels: block {block} is above MAX_BLOCK={MAX_BLOCK}")
    bp = 1 << (block - 1).bit_length()
    return bp, max(1, TILE // bp)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize(message: torch.Tensor, x: torch.Tensor, block: int, rounding: str, offset: int) -> None:
    """``message`` = x (float32, contiguous) in the 8-bit block format (``int8_blocks.quantize_eager``'s bytes), one
    kernel; the dither's key parts (offset, shift, chunk shift) are read on the host from the key, as eager does."""
    s = x.numel()
    nb = q8.blocks(s, block)
    scales, values = q8.parts(message, s, block)
    bp, rows = _tiling(block)
    K = max(1, q8.DITHER_PERIOD // block)
    P = K * block
    stochastic = rounding == "stochastic"
    _, shift, chunk_shift = q8._key_parts(offset, P) if stochastic else (0.0, 0, 0)
    _kernels()["quantize"][(_cdiv(nb, rows),)](
        x, scales, values, s, nb, offset & (q8.DITHER_LEVELS - 1) if stochastic else 0, shift, chunk_shift,
        B=block, BP=bp, ROWS=rows, K=K, P=P, STOCHASTIC=stochastic, **LAUNCH,
    )  # fmt: skip


def dequantize(message: torch.Tensor, s: int, block: int, out: torch.Tensor, add: bool = False, fma: bool = True):
    """out (float32, s values) = (or +=, ``add``) q scale from ``message`` (``int8_blocks.dequantize``'s bytes), one
    kernel; ``fma``: the add as one fused multiply-add (else a product, then a sum)."""
    nb = q8.blocks(s, block)
    scales, values = q8.parts(message, s, block)
    bp, rows = _tiling(block)
    _kernels()["dequantize"][(_cdiv(nb, rows),)](
        values, scales, out, s, nb, B=block, BP=bp, ROWS=rows, ADD=add, FMA=fma, **LAUNCH
    )


def wire_encode(x: torch.Tensor, out: torch.Tensor) -> None:
    """out (16 bits) = [k, x 2^k] (``wire.Wire.encode_eager``'s bytes): the least and largest value in one read
    (``torch.aminmax``, as eager), then one pass that finds k from their bits and writes the values: two launches."""
    n = x.numel()
    least, largest = torch.aminmax(x)
    bf16 = out.dtype == torch.bfloat16
    _kernels()["encode"][(_cdiv(n, TILE),)](
        x, least, largest, out.view(torch.int16) if bf16 else out, n, TILE=TILE, BF16=bf16, **LAUNCH
    )


def wire_decode(message: torch.Tensor, out: torch.Tensor) -> None:
    """out (float32) = the message's values 2^-k (``wire.Wire.decode``'s bytes), one pass."""
    n = out.numel()
    bf16 = message.dtype == torch.bfloat16
    message = message.view(torch.int16) if bf16 else message
    _kernels()["decode"][(_cdiv(n, TILE),)](message, out, n, TILE=TILE, BF16=bf16, **LAUNCH)


def _tiling4(block: int) -> tuple[int, int]:
    """(ROWS, log2 B) for the 4-bit kernels: B a power of two from 2 to ``MAX_BLOCK`` (rotated or not: whole pairs
    and whole blocks per tile), else ValueError naming it."""
    if block < 2 or block > MAX_BLOCK or block & (block - 1):
        raise ValueError(f"cerar.formats.triton_kernels: the 4-bit kernels take a power of two 2..{MAX_BLOCK} as "
                         f"block, got {block}")  # fmt: skip
    return max(1, TILE // block), block.bit_length() - 1


def quantize4(message, x, block: int, rounding: str, key: int, rotate: bool, seed: int, *, reciprocal: bool):
    """``message`` = x in the 4-bit format (``int4_blocks.quantize_eager``'s bytes), one kernel: the rotation of the
    full blocks, the scale, the rounding (the dither hashed in the kernel from the message's key) and the packing.
    ``reciprocal``: the scale as absmax times float32's 1/7 (CUDA's eager ``x / 7``), else the IEEE quotient (the
    CPU's); ``enable`` keeps the form whose bytes are eager's on the device."""
    s = x.numel()
    nb = q8.blocks(s, block)
    scales, packed = q4.parts(message, s, block)
    rows, log2b = _tiling4(block)
    signs = q4.rotation_signs(seed, block, x.device)
    chain = q4._hash32(0x6A09E667 ^ q4._hash32(int(key) & 0xFFFFFFFF))  # dither_key's first link: chunk_key's base
    _kernels()["quantize4"][(_cdiv(nb, rows),)](
        x, signs, scales, packed, s, nb, s // block if rotate else 0, chain,
        B=block, ROWS=rows, LOG2B=log2b, ROTATE=rotate, STOCHASTIC=rounding == "stochastic", RECIPROCAL=reciprocal,
        **LAUNCH,
    )  # fmt: skip


def dequantize4(message, s: int, block: int, out, add: bool, rotate: bool, seed: int, *, fma: bool = True):
    """out (float32, s values) = (or +=, ``add``) the decoded 4-bit message (``int4_blocks.dequantize``'s bytes),
    one kernel; ``fma``: the add as one fused multiply-add (else a product, then a sum)."""
    nb = q8.blocks(s, block)
    scales, packed = q4.parts(message, s, block)
    rows, log2b = _tiling4(block)
    signs = q4.rotation_signs(seed, block, out.device)
    _kernels()["dequantize4"][(_cdiv(nb, rows),)](
        packed, signs, scales, out, s, nb, s // block if rotate else 0,
        B=block, ROWS=rows, LOG2B=log2b, ROTATE=rotate, ADD=add, FMA=fma, **LAUNCH,
    )  # fmt: skip


assert q4.QMAX == 7 and q4.NIBBLE_OFFSET == 8 and q4.DITHER_PERIOD == 2**16  # the 4-bit constants the kernels hold
assert wire.HEADER == 1 and wire.TARGET_EXPONENT == 15 and wire.K_LIMIT == 126  # the constants the kernels hold
assert q8.QMAX == 127 and q8.TINY_SCALE == 2.0**-126 and q8.PRESCALE == 2.0**64 and q8.DITHER_LEVELS == 2**16
assert q8.DITHER_CHUNKS == 2**16 and q8.DITHER_PERIOD == 2**16
