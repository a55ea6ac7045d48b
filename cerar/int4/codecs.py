"""The block formats as the two-shot all-reduce (``cerar.int4.two_shot``) sees them: a message's size, how a shard is
written into one and read back, and what the ranks must agree on.

``Int4Codec``: ``cerar.formats.int4_blocks`` (4 bits, optionally rotated); ``Int8Codec``: ``cerar.formats.int8_blocks``
(8 bits), for the 8-bit reduce-scatter inside a node of the two-tier 8/4 call. The two-shot skeleton takes either,
so a format is one class here, not another copy of the rounds.
"""

from __future__ import annotations

import torch

from cerar.formats import int4_blocks as q4
from cerar.formats import int8_blocks as q8
from cerar.int4.two_shot import message_key


class Int4Codec:
    """4-bit messages: ``block`` values per float32 scale, ``rounding``, ``rotate`` (the rotation's signs from
    ``seed``)."""

    bits = 4

    def __init__(self, block: int, rounding: str, rotate: bool, seed: int, operation: str = "Int4Codec"):
        self.block, self.rounding, self.rotate = q4.check_format(block, rounding, rotate, operation)
        self.seed = int(seed)
        self.name = q4.format_name(rounding, rotate)

    def message_bytes(self, s: int) -> int:
        return q4.message_bytes(s, self.block)

    @staticmethod
    def key(seed: int, call: int, sender: int, shard: int, phase: int) -> int:
        """A message's dither key: the 4-bit format's hash (``cerar.int4.two_shot.message_key``)."""
        return message_key(seed, call, sender, shard, phase)

    def new_message(self, s: int, device) -> torch.Tensor:
        return q4.new_message(s, self.block, device)

    def encode(self, message: torch.Tensor, x: torch.Tensor, key: int) -> None:
        q4.quantize_into(message, x, self.block, self.rounding, key, self.rotate, self.seed)

    def decode(self, message: torch.Tensor, s: int, out: torch.Tensor, add: bool = False) -> None:
        q4.dequantize(message, s, self.block, out, add=add, rotate=self.rotate, seed=self.seed)

    def agreement(self) -> dict:
        """What every rank must hold alike (the rotation's seed only where it rotates: it sets the signs)."""
        fields = {"format": self.name, "block size B": self.block}
        if self.rotate:
            fields["rotation seed"] = self.seed
        return fields


class Int8Codec:
    """8-bit messages (``cerar.formats.int8_blocks``): ``block`` values per float32 scale, ``rounding``; the message's
    32-bit key is the 8-bit format's dither key (its offset and shift)."""

    bits = 8

    def __init__(self, block: int, rounding: str, operation: str = "Int8Codec"):
        self.block = q8.check_block(block, operation)
        self.rounding = q8.check_rounding(rounding, operation)
        self.name = q8.format_name(rounding)

    def message_bytes(self, s: int) -> int:
        return q8.message_bytes(s, self.block)

    @staticmethod
    def key(seed: int, call: int, sender: int, shard: int, phase: int) -> int:
        """A message's dither key: the 8-bit format's hash (``cerar.formats.int8_blocks.dither_key``) of the same
        words, phase 0 a contribution and 1 a reduced shard, as ``cerar.int8.all_reduce`` has always keyed them."""
        return q8.dither_key(seed, call, sender, shard, phase)

    def new_message(self, s: int, device) -> torch.Tensor:
        return q8.new_message(s, self.block, device)

    def encode(self, message: torch.Tensor, x: torch.Tensor, key: int) -> None:
        q8.quantize_into(message, x, self.block, self.rounding, key if self.rounding == "stochastic" else 0)

    def decode(self, message: torch.Tensor, s: int, out: torch.Tensor, add: bool = False) -> None:
        q8.dequantize(message, s, self.block, out, add=add)

    def agreement(self) -> dict:
        return {"format": self.name, "block size B": self.block}


__all__ = ["Int4Codec", "Int8Codec"]
