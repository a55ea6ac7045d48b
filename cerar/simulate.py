"""The single-process oracle: all N workers of the CERAR ring in one process."""

from __future__ import annotations

import torch

from cerar.codes import LOW_PRECISION_KAPPA_LIMIT, Code
from cerar.rounds import CodedRingRank, worker_matrices

TRANSPORT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_transport_dtype(dtype: torch.dtype, code: Code, name: str = "tensor") -> None:
    """Refuse dtypes the protocol cannot carry: integers always, 16-bit floats unless the code is
    well conditioned enough (kappa <= LOW_PRECISION_KAPPA_LIMIT) for their rounding."""
    if dtype not in TRANSPORT_DTYPES:
        raise ValueError(f"{name} must be a floating-point tensor (float32 or float64), got dtype {dtype}")
    if dtype in (torch.float16, torch.bfloat16) and code.kappa > LOW_PRECISION_KAPPA_LIMIT:
        raise ValueError(
            f"{name} has dtype {dtype}, whose rounding the code's kappa={code.kappa:.3g} would amplify; "
            f"16-bit transport needs kappa <= {LOW_PRECISION_KAPPA_LIMIT} (an exact code, c <= N): "
            "use float32"
        )


def device_matrices(code: Code, i: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Worker i's matrices (``worker_matrices``) in the transport dtype on the device."""
    return {
        name: torch.tensor(value, dtype=torch.float64).to(device=device, dtype=dtype)
        for name, value in worker_matrices(code, i).items()
    }


def simulate(G: torch.Tensor, code: Code, *, return_values_sent: bool = False):
    """Run the protocol for all N workers in one process and return each worker's result [N, d].

    G is [N, d]: row i is worker i's gradient, float32 or float64, on any device. The rounds,
    their order and the dtype of every block are those of the distributed ``cerar.all_reduce``,
    so this is the oracle it is tested against. With ``return_values_sent`` also returns the
    number of values each worker sent (L * ceil(d / c)).
    """
    if not isinstance(G, torch.Tensor):
        raise ValueError(f"G must be a torch.Tensor of shape [N, d], got {type(G).__name__}")
    check_transport_dtype(G.dtype, code, "G")
    if G.dim() != 2 or G.shape[0] != code.N:
        raise ValueError(f"G must have shape [N, d] with N={code.N} (the code's N), got {tuple(G.shape)}")
    N, d = G.shape
    c, m = code.c, code.m_for(d)
    result = G.clone()
    with torch.no_grad():
        ranks = [CodedRingRank(device_matrices(code, i, G.dtype, G.device), G[i].clone(), c, m, N) for i in range(N)]
        for t in range(1, code.L + 1):
            sent = [[worker.message().clone() for worker in rank.workers] for rank in ranks]
            for rank in ranks:
                for worker in rank.workers:
                    worker.while_in_flight(t)
            for i, rank in enumerate(ranks):
                for p, worker in enumerate(rank.workers):
                    y = worker.receive_buffer(t)
                    y.copy_(sent[i - 1][p])  # worker i receives what worker i-1 sent
                    worker.receive(t, y)
        for i, rank in enumerate(ranks):
            rank.write_result(result[i])
    return (result, code.L * m) if return_values_sent else result
