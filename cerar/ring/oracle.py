"""The single-process oracle: all N workers of the CERAR ring in one process, the protocol's arithmetic alone.

``run`` carries no admission check: the admission rule (``cerar.ring.precision``) measures a code's rounding with it
before the code is judged. Callers take ``cerar.simulate``, which checks the inputs and the code's dtypes first.
"""

from __future__ import annotations

import torch

from cerar.coding.codes import Code
from cerar.coding.matrices import device_matrices
from cerar.ring.fp32_products import full_fp32_products
from cerar.ring.rounds import DEFAULT_STORAGE, CodedRingRank


def run(G: torch.Tensor, code: Code, wire=None, storage: str = DEFAULT_STORAGE) -> tuple[torch.Tensor, int]:
    """(each worker's result [N, d], the values each worker sent) of the protocol on G [N, d] (row i: worker i's
    gradient), every block a worker receives delivered by ``wire`` (``cerar.formats.wire.wire_for``; None: as sent).
    The rounds, their order and the dtype of every block are those of the distributed ``cerar.all_reduce``."""
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
    return result, code.L * m
