"""Each worker's matrices for the rounds (``cerar.ring.rounds``), and the dtypes that may carry them.

The one home of the per-rank matrices: the distributed ``cerar.all_reduce`` and the oracle
``cerar.simulate`` both take them from here, so they run the same arithmetic.

Worker i keeps U_i = A_i G_i beside its gradient and stores the messages it forwards,
x(t+1) = yhat(t) + u(t+1). Since yhat(t) = x(t+1) - u(t+1) and G_i = A_i^-1 U_i, the spec's result

    S_hat_i = G_i + D_i Yhat_i = W_i [U_i; X_i],     W_i = [A_i^-1 - D_i[:, :c-1] S | D_i]

(S shifts U's rows up by one: S U = [u(2); ...; u(c)]) is one product of a c x (c + L) matrix with
the stacked encodings and messages. Folding the yhat correction and the identity term into W_i costs
c^2 entries instead of a pass over the gradient, and lets the last product write the result
straight into the caller's tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from cerar.coding.codes import Code, real_to_points

TRANSPORT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def encoder_inverse(code: Code, i: int) -> np.ndarray:
    """A_i^-1 = F^-1 diag(a^-i) V, from the points: no inversion of the ill-conditioned A_i, so its
    rounding is the unit roundoff times |F^-1| |V| rather than kappa(A_i) times that. Falls back to
    a numerical inverse where A_i is not of that form (the ring of one)."""
    A = np.asarray(code.A[i])
    points = np.asarray(code.points)
    if code.N > 1 and len(points) == code.c:
        V = np.vander(points, code.c, increasing=True)
        inverse = (np.linalg.inv(real_to_points(points)) @ (points[:, None] ** -float(i) * V)).real
        if np.abs(inverse @ A - np.eye(code.c)).max() <= 1e-6 * max(1.0, code.kappa * 1e-6):
            return inverse
    return np.linalg.inv(A)


def worker_matrices(code: Code, i: int) -> dict[str, np.ndarray]:
    """Worker i's float64 matrices: the encoder A_i (c x c), the decoder W_i (c x (c + L)) and W_i's
    last L columns (D_i) in reverse order."""
    c, L = code.c, code.L
    A, D = np.asarray(code.A[i]), np.asarray(code.D[i])
    W_U = encoder_inverse(code, i)
    shifted = min(c - 1, L)  # yhat(t) = x(t+1) - u(t+1) for t = 1..c-1
    W_U[:, 1 : 1 + shifted] -= D[:, :shifted]
    return {"A": A, "W": np.concatenate([W_U, D], axis=1), "D_reversed": D[:, ::-1].copy()}


def device_matrices(code: Code, i: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Worker i's matrices (``worker_matrices``) in the transport dtype on the device."""
    return {
        name: torch.tensor(value, dtype=torch.float64).to(device=device, dtype=dtype).contiguous()
        for name, value in worker_matrices(code, i).items()
    }
