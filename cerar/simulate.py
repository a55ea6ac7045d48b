"""The single-process oracle: all N workers of the CERAR ring in one process."""

from __future__ import annotations

import torch

from cerar.codes import Code
from cerar.matrices import check_transport_dtype, device_matrices
from cerar.precision import full_fp32_products
from cerar.rounds import DEFAULT_STORAGE, CodedRingRank, check_storage


def simulate(
    G: torch.Tensor,
    code: Code,
    *,
    return_values_sent: bool = False,
    storage: str = DEFAULT_STORAGE,
    transport=None,
    _check=True,
):
    """Run the protocol for all N workers in one process and return each worker's result [N, d].

    G is [N, d]: row i is worker i's gradient, float32 or float64, on any device. The rounds,
    their order and the dtype of every block are those of the distributed ``cerar.all_reduce``,
    so this is the oracle it is tested against. With ``return_values_sent`` also returns the
    number of values each worker sent (L * ceil(d / c)). ``storage``: as for ``cerar.all_reduce``.
    ``transport``: the wire dtype (``cerar.wire``): with float16/bfloat16 every block a worker receives
    is what the wire delivers (scaled, cast, cast back and unscaled), float32 arithmetic otherwise, as
    in ``cerar.all_reduce(..., transport=)``; the admissibility rule measures its rounding this way
    (``cerar.precision.expected_rounding``). G must then be float32.
    """
    from cerar.wire import transport_dtype, wire_for

    wire = wire_for(transport)
    if not isinstance(G, torch.Tensor):
        raise ValueError(f"G must be a torch.Tensor of shape [N, d], got {type(G).__name__}")
    if wire is not None and G.dtype != torch.float32:
        raise ValueError(f"simulate: transport={transport!r} carries float32 gradients, got G of dtype {G.dtype}")
    if _check:  # (expected_rounding measures codes the rule has not judged yet: it is the rule's input)
        check_transport_dtype(G.dtype, code, "G", None if wire is None else transport_dtype(transport))
    check_storage(storage)
    if G.dim() != 2 or G.shape[0] != code.N:
        raise ValueError(f"G must have shape [N, d] with N={code.N} (the code's N), got {tuple(G.shape)}")
    N, d = G.shape
    c, m = code.c, code.m_for(d)
    result = G.clone()
    with torch.no_grad(), full_fp32_products(G.device):  # the same products as all_reduce, TF32 or not
        ranks = [
            CodedRingRank(device_matrices(code, i, G.dtype, G.device), result[i], c, m, N, storage=storage)
            for i in range(N)
        ]
        for t in range(1, code.L + 1):
            sent = [[worker.message().clone() for worker in rank.workers] for rank in ranks]
            for rank in ranks:
                for worker in rank.workers:
                    worker.while_in_flight(t)
            for i, rank in enumerate(ranks):
                for p, worker in enumerate(rank.workers):
                    y = worker.receive_buffer(t)
                    y.copy_(sent[i - 1][p])  # worker i receives what worker i-1 sent
                    if wire is not None:  # ... as the wire delivers it
                        wire.round_trip(y, wire.empty(y.numel(), y))
                    worker.receive(t, y)
        for i, rank in enumerate(ranks):
            rank.write_result(result[i])
    return (result, code.L * m) if return_values_sent else result
