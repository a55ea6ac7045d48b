"""The single-process oracle, checked: all N workers of the CERAR ring in one process (``cerar.ring.oracle``), after
the checks ``cerar.all_reduce`` makes of its inputs and of the code's dtypes."""

from __future__ import annotations

import torch

from cerar.coding.codes import Code
from cerar.ring.oracle import run
from cerar.ring.precision import check_transport_dtype
from cerar.ring.rounds import DEFAULT_STORAGE, check_storage


def simulate(
    G: torch.Tensor,
    code: Code,
    *,
    return_values_sent: bool = False,
    storage: str = DEFAULT_STORAGE,
    transport=None,
):
    """Run the protocol for all N workers in one process and return each worker's result [N, d].

    G is [N, d]: row i is worker i's gradient, float32 or float64, on any device. The rounds,
    their order and the dtype of every block are those of the distributed ``cerar.all_reduce``,
    so this is the oracle it is tested against. With ``return_values_sent`` also returns the
    number of values each worker sent (L * ceil(d / c)). ``storage``: as for ``cerar.all_reduce``.
    ``transport``: the wire dtype (``cerar.formats.wire``): with float16/bfloat16 every block a worker receives
    is what the wire delivers (scaled, cast, cast back and unscaled), float32 arithmetic otherwise, as
    in ``cerar.all_reduce(..., transport=)`` (the admission rule measures its rounding the same way, by
    ``cerar.ring.oracle.run``, before the code is judged). G must then be float32.
    """
    from cerar.formats.wire import transport_dtype, wire_for

    wire = wire_for(transport)
    if not isinstance(G, torch.Tensor):
        raise ValueError(f"G must be a torch.Tensor of shape [N, d], got {type(G).__name__}")
    if wire is not None and G.dtype != torch.float32:
        raise ValueError(f"simulate: transport={transport!r} carries float32 gradients, got G of dtype {G.dtype}")
    check_transport_dtype(G.dtype, code, "G", None if wire is None else transport_dtype(transport))
    check_storage(storage)
    if G.dim() != 2 or G.shape[0] != code.N:
        raise ValueError(f"G must have shape [N, d] with N={code.N} (the code's N), got {tuple(G.shape)}")
    result, sent = run(G, code, wire, storage)
    return (result, sent) if return_values_sent else result
