"""16-bit messages, float32 arithmetic: how a block of float32 values travels as float16 or bfloat16.

``transport`` (the wire dtype) is an argument of every collective in the package. With float32 (the
default) the blocks travel as they are. With float16 or bfloat16 the caller's tensor, the encoding,
the decoding and every sum stay float32; each message block is cast to the wire dtype just before it
is sent and back to float32 on arrival (into a 16-bit receive buffer). Only the messages are rounded.

The scale before the cast (``Wire.encode``): fp16 overflows above 65504 and keeps full relative
precision only down to its normal range, 2^-14 (6.1e-5); below it the spacing is fixed at 2^-24 and
values under 2^-25 (3e-8) become zero. Gradients can sit anywhere in float32's range (1e-7 is
common late in training without loss scaling; a spike or an unscaled sum can exceed 65504) and coded
messages are mixtures of several workers' rows, larger than any one gradient. So every message block
carries its own power-of-two scale 2^k, chosen from the block's largest magnitude a so that
a 2^k lies in [2^14, 2^15): the block is multiplied by 2^k (exact in float32: only the exponent
changes), cast, and k travels as the block's first value (an integer |k| <= 126, exact in both
16-bit formats); the receiver multiplies by 2^-k (exact again). Then no finite value overflows, and
each value x of the block is rounded to within u |x| (u = 2^-11 for fp16, 2^-8 for bf16) unless
|x| < a 2^-29 (fp16; 2^-140 for bf16), where the absolute error is at most a 2^-39: below u's
share of the block's norm by a factor 2^28. Cost: one wire value (2 bytes) per message, i.e. L per
CERAR chunk and 2 (N - 1) per exact ring, and one extra pass over the block to find a. Non-finite
values (an overflowed fp16 step) stay non-finite, so a loss scaler still sees them.

bfloat16 has float32's exponent range, so the scale is not needed to avoid overflow or underflow
there; it is applied anyway (one code path, 2 bytes per message), and changes nothing but which
bf16 values of the same relative precision carry the block.

Bytes on the wire per message: element size of the wire dtype x (values + ``HEADER``).
"""

from __future__ import annotations

import math

import torch

from cerar.coding.closed_forms import DEFAULT_KAPPA_MAX
from cerar.formats import devices

FUSED_ENCODE = None
"""The fused encoder's dispatch, put here by ``cerar.formats.fused`` when it is imported (the kernel depends on this
wire, never the other way): (block, out) -> True when a kernel enabled for the block's device wrote the message;
None, or False, and ``Wire.encode`` writes it."""

FUSED_DECODE = None
"""The decoder's dispatch, put there by ``cerar.formats.fused`` as ``FUSED_ENCODE``: (message, out) -> True when a
kernel enabled for out's device wrote ``out``."""

TRANSPORTS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The wire dtypes, by the names the trainer's config and the agreement check use."""

HEADER = 1
"""Wire values a 16-bit message carries besides its block: the scale's exponent k."""

TARGET_EXPONENT = 15
"""Blocks are scaled so that their largest magnitude lies in [2^(T-1), 2^T): below fp16's 65504 with
room for the rounding up, and 2^29 above fp16's smallest normal."""

K_LIMIT = 126
"""|k| <= 126: 2^k and 2^-k are both normal float32 numbers, so scaling and unscaling are exact."""


def transport_dtype(transport) -> torch.dtype:
    """The wire dtype named by ``transport`` (a name in ``TRANSPORTS``, a torch dtype, or None for
    float32); a ValueError naming the choices otherwise."""
    if transport is None:
        return torch.float32
    if isinstance(transport, torch.dtype) and transport in TRANSPORTS.values():
        return transport
    if isinstance(transport, str) and transport in TRANSPORTS:
        return TRANSPORTS[transport]
    raise ValueError(f"transport must be one of {tuple(TRANSPORTS)} (the dtype on the wire), got {transport!r}")


def transport_name(transport) -> str:
    """``transport``'s name in ``TRANSPORTS`` ("float32", "float16", "bfloat16")."""
    dtype = transport_dtype(transport)
    return next(name for name, value in TRANSPORTS.items() if value == dtype)


DEFAULT_TRANSPORT_KAPPA_MAX = {"float32": DEFAULT_KAPPA_MAX, "float16": 64.0, "bfloat16": 20.0}
"""The kappa_max a code gets when none is given, per wire dtype. float32: the spec's 1e4. 16 bits: where
the code's error and the rounding its messages add (``cerar.ring.precision.expected_rounding``, both on Gaussian
gradients) meet, which is also where their total is least, as the design tool finds it (``python -m
cerar.planning.design --transport-sweep``; ``reports/code_design.md``): code error falls about as 1 / kappa, the
rounding grows as kappa u_wire, so they meet near kappa 64-100 on fp16 (u = 2^-11) and 20-32 on bf16
(u = 2^-8, 8x fp16's). The defaults are the largest budgets of the sweep that the rule admits at every
N = 3..8 with c = N+1, 2N and 3N (fp16 64: N=4, c=5 totals 0.015 where kappa_max 20 totalled 0.045; bf16
20); at N = 2 the codes have no truncation error, only rounding, and 16-bit messages are refused there."""


def default_kappa_max(transport) -> float:
    """The default kappa_max for codes whose messages travel in ``transport`` (``DEFAULT_TRANSPORT_KAPPA_MAX``)."""
    return DEFAULT_TRANSPORT_KAPPA_MAX[transport_name(transport)]


def _power_of_two(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32, built from its bits ((k + 127) << 23): exact for integer |k| <= 126."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def exponent(block: torch.Tensor) -> torch.Tensor:
    """k (int32, 0-dim, on the block's device; no host synchronisation) for a non-empty block: T - e where the
    block's largest magnitude lies in [2^(e-1), 2^e), clamped to +-126. The largest and the least value in one
    read (``aminmax``), their larger magnitude; a NaN propagates (NaN's exponent: the k of 0)."""
    least, largest = torch.aminmax(block)
    _, e = torch.frexp(torch.maximum(largest, least.neg()).abs())
    return (TARGET_EXPONENT - e).clamp_(-K_LIMIT, K_LIMIT)


def host_exponent(block: torch.Tensor) -> int:
    """``exponent`` found on the host (CPU tensors only: reading the largest value back is free there, and it
    replaces eight tensor operations on one value, about 40 us a message, with Python's frexp): the same k
    (math.frexp and torch.frexp agree on every float32, subnormals, zero, inf and NaN included)."""
    if not block.numel():
        return TARGET_EXPONENT
    least, largest = torch.aminmax(block)
    largest = max(largest.item(), -least.item())
    k = min(K_LIMIT, max(-K_LIMIT, TARGET_EXPONENT - math.frexp(largest)[1]))
    return k


def cast_into(block: torch.Tensor, scale: torch.Tensor, values: torch.Tensor) -> None:
    """values (16 bits) = block x scale (float32; a power of two, so the product is exact and the cast is the one
    rounding): one pass where ``cerar.formats.devices.one_pass``, else the product, then the cast (a
    product written straight into 16 bits runs a CPU's unvectorized casting loop)."""
    if devices.one_pass(block.device):
        torch.mul(block, scale, out=values)
    else:
        values.copy_(block * scale)


class Wire:
    """How blocks travel in ``dtype`` (float16 or bfloat16): ``numel(m)`` wire values per block of
    m, ``encode`` a float32 block into a wire message, ``decode`` one back into float32."""

    def __init__(self, transport):
        self.dtype = transport_dtype(transport)
        if self.dtype == torch.float32:
            raise ValueError("Wire is for 16-bit transport; float32 blocks travel as they are")
        self.name = transport_name(self.dtype)
        self.element_size = torch.tensor([], dtype=self.dtype).element_size()

    def numel(self, m: int) -> int:
        return m + HEADER

    def empty(self, m: int, like: torch.Tensor) -> torch.Tensor:
        """A wire message for a block of m values, on ``like``'s device."""
        return torch.empty(self.numel(m), dtype=self.dtype, device=like.device)

    def encode(self, block: torch.Tensor, out: torch.Tensor) -> None:
        """out = [k, block 2^k cast to the wire dtype], k = T - e where the block's largest magnitude
        lies in [2^(e-1), 2^e) (``TARGET_EXPONENT``), clamped to +-126. No host synchronisation on a device.
        Through the fused kernel of ``cerar.formats.fused`` where it is enabled (the same bytes), else on a CPU
        with k found on the host (``_encode_host``), elsewhere ``encode_eager``."""
        if FUSED_ENCODE is not None and FUSED_ENCODE(block, out):
            return
        if block.device.type == "cpu":
            self._encode_host(block, out)
        else:
            self.encode_eager(block, out)

    @staticmethod
    def _encode_host(block: torch.Tensor, out: torch.Tensor) -> None:
        """``encode_eager`` with k found on the host (``host_exponent``): the same k and the same product (2^k as
        a scalar is exact in float32)."""
        k = host_exponent(block)
        out[0] = k
        out[HEADER:].copy_(block * 2.0**k)

    def encode_eager(self, block: torch.Tensor, out: torch.Tensor) -> None:
        """``encode`` with torch's eager operations and k kept on the device: one read for the block's largest
        magnitude (``exponent``), a few operations on one value, then the product and the cast
        (``cast_into``: on a device one pass, 4 bytes read and 2 written a value)."""
        k = exponent(block)
        out[0].copy_(k)
        cast_into(block, _power_of_two(k), out[HEADER:])

    def decode(self, message: torch.Tensor, out: torch.Tensor) -> None:
        """out (float32) = message's block times 2^-k: through the kernel of ``cerar.formats.fused`` where it is
        enabled for out's device (the same bytes), else ``decode_eager``."""
        if FUSED_DECODE is not None and FUSED_DECODE(message, out):
            return
        self.decode_eager(message, out)

    def decode_eager(self, message: torch.Tensor, out: torch.Tensor) -> None:
        """out (float32) = message's block times 2^-k (an exact product of the float32 value). On a device one
        pass, the 16-bit values read and float32 written (2^-k a 1-value float32 tensor, so that the product is
        float32's: a 0-d one would not promote a 16-bit block); on a CPU a cast, then the product (one multiply
        written into float32 from 16 bits runs torch's unvectorized casting loop, 1.6x slower), k read on the
        host, as in ``_encode_host``."""
        if devices.one_pass(message.device):
            torch.mul(message[HEADER:], _power_of_two(-message[:HEADER].to(torch.int32)), out=out)
            return
        out.copy_(message[HEADER:])  # to float32 first: a 0-d float32 scale would not promote a 16-bit block
        out.mul_(2.0 ** -int(message[0].item()))

    def round_trip(self, block: torch.Tensor, message: torch.Tensor) -> None:
        """block = what its receivers get: encode into ``message``, decode back in place. The exact
        collectives apply it to the complete chunks their owner sends round, so that every rank,
        the owner too, holds the same bits."""
        self.encode(block, message)
        self.decode(message, block)


def wire_for(transport) -> Wire | None:
    """A ``Wire`` for 16-bit transport, None for float32 (blocks sent as they are)."""
    return None if transport_dtype(transport) == torch.float32 else Wire(transport)


def message_bytes(values: int, messages: int, transport) -> int:
    """Bytes on the wire for ``messages`` messages carrying ``values`` values in all: element size x
    (values + HEADER per message) for 16-bit transport, 4 x values for float32."""
    wire = wire_for(transport)
    if wire is None:
        return 4 * values
    return wire.element_size * (values + HEADER * messages)
