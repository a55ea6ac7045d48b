"""The checks a collective makes before its first round: its arguments on this rank (a ValueError naming the
call and the argument), and the agreement of every rank of the group on the call (an all-gather of a digest of
what each rank is about to run, cached per group and length: a rank that disagrees fails every rank with
``CollectiveError`` before any round)."""

from __future__ import annotations

import hashlib
import struct

import torch
import torch.distributed as dist

from cerar.coding.codes import Code
from cerar.formats.wire import transport_dtype, transport_name
from cerar.ring.precision import check_transport_dtype
from cerar.ring.rounds import check_storage
from cerar.ring.transport import CollectiveError, _Ring

OPS = ("sum", "avg")


def _check_tensor(tensor, operation: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{operation}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"{operation}: tensor must be floating point (float32 or float64), got dtype {tensor.dtype}")


def _check_op(op: str, operation: str) -> None:
    if op not in OPS:
        raise ValueError(f"{operation}: op must be one of {OPS}, got {op!r}")


def check_coded_call(tensor: torch.Tensor, code, op: str, storage: str, operation: str, transport=None) -> None:
    """The arguments of a coded all-reduce (flat or hierarchical), checked on this rank before any
    collective: a ValueError naming the call and the bad argument. A 16-bit ``transport`` needs a
    float32 tensor (the arithmetic stays float32) and a code admissible on it (``cerar.ring.precision``)."""
    _check_tensor(tensor, operation)
    _check_op(op, operation)
    if not isinstance(code, Code):
        raise ValueError(f"{operation}: code must be a cerar.Code from cerar.make_code, got {type(code).__name__}")
    wire = check_transport(tensor, transport, operation)
    check_transport_dtype(tensor.dtype, code, operation, wire)
    check_storage(storage)


def check_transport(tensor: torch.Tensor, transport, operation: str) -> torch.dtype:
    """The wire dtype ``transport`` names (``cerar.formats.wire``); 16-bit messages need a float32 tensor."""
    try:
        wire = transport_dtype(transport)
    except ValueError as error:
        raise ValueError(f"{operation}: {error}") from None
    if wire != torch.float32 and tensor.dtype != torch.float32:
        raise ValueError(
            f"{operation}: transport={transport_name(wire)} carries float32 tensors (16-bit messages, float32 "
            f"arithmetic), got a tensor of dtype {tensor.dtype}"
        )
    return wire


# ------------------------------------------------------------------------------------------------
# Agreement before the first round
# ------------------------------------------------------------------------------------------------

_agreed: set[tuple] = set()


def _agreement_key(ring: _Ring, fields: tuple) -> tuple:
    return (id(ring.group), ring.size, fields)


def check_agreement(ring: _Ring, fields: dict[str, object]) -> None:
    """Check once per (group, fields) that every rank holds the same ``fields``; a disagreement
    raises on every rank, naming the field and the ranks, instead of hanging in the rounds."""
    key = _agreement_key(ring, tuple(fields.items()))
    if key in _agreed:
        return
    digests = [_digest(value) for value in fields.values()]
    mine = torch.tensor(digests, dtype=torch.int64)
    device = _group_device(ring.group)
    gathered = [torch.empty_like(mine, device=device) for _ in range(ring.size)]
    try:
        work = dist.all_gather(gathered, mine.to(device), group=ring.group, async_op=True)
    except Exception as error:
        raise ring._failure("checking that all ranks agree on the call", "(all ranks of the group)", error) from error
    ring.await_works([work], "checking that all ranks agree on the call", "(all ranks of the group)")
    table = torch.stack([g.cpu() for g in gathered])
    for column, name in enumerate(fields):
        values = table[:, column]
        if not torch.all(values == values[0]):
            disagreeing = [r for r in range(ring.size) if values[r] != values[ring.rank]]
            raise CollectiveError(
                f"{ring.operation}: ranks disagree on {name} (this rank, {ring.rank}, has "
                f"{fields[name]!r}; ranks {disagreeing} differ): every rank must pass the same {name}"
            )
    _agreed.add(key)


def _digest(value) -> int:
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, float):
        data = struct.pack("<d", value)
    else:
        data = repr(value).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:7], "little")


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
