"""CERAR written straight from /work/shared/cerar-construction.md, independent of ``cerar``.

Nothing here comes from the package: the matrices A_j and D_i are rebuilt from a code's points
(section "The code"), the least-squares decoders from the condition-number-constrained objective
(section "Why it works"), and the protocol runs literally, one worker and one round at a time in
numpy float64 (section "The protocol at worker i"):

    u_i(t) = row t of A_i G_i (0 outside 1..c),   x_i(t) = u_i(t) + yhat_i(t-1),   y_i(t) = x_{i-1}(t),
    yhat_i(t) = y_i(t) - u_i(t-N+1),              S_hat_i = G_i + D_i Yhat_i.

It is slow and simple on purpose: it is what the fast code is held to.
"""

from __future__ import annotations

import numpy as np


def spec_points_order(points: np.ndarray) -> np.ndarray:
    """The points with each conjugate pair (a, conj a) adjacent, Im a > 0 first, real points first."""
    points = np.asarray(points, dtype=np.complex128)
    real = points[np.abs(points.imag) <= 1e-12 * np.abs(points).max()]
    upper = points[points.imag > 1e-12 * np.abs(points).max()]
    return np.concatenate([real.real.astype(np.complex128), np.stack([upper, upper.conj()], 1).reshape(-1)])


def spec_F(points: np.ndarray) -> np.ndarray:
    """F: a real point carries one component; a pair (a, conj a) carries (p, q) as (p + iq, p - iq)."""
    c = len(points)
    F = np.zeros((c, c), np.complex128)
    r = 0
    while r < c:
        if points[r].imag == 0:
            F[r, r] = 1
            r += 1
        else:
            F[r, r], F[r, r + 1], F[r + 1, r], F[r + 1, r + 1] = 1, 1j, 1, -1j
            r += 2
    return F


def spec_matrices(points: np.ndarray, N: int) -> tuple[np.ndarray, np.ndarray]:
    """A_j = V^-1 diag(a^j) F (j = 0..N-1) and D_i = F^-1 diag(a^-(i-1)) V_L (i = 0..N-1), real parts
    after checking that the imaginary parts vanish to rounding."""
    a = spec_points_order(points)
    c = len(a)
    L = c + N - 2
    V = np.array([[a[r] ** t for t in range(c)] for r in range(c)])
    V_L = np.array([[a[r] ** t for t in range(L)] for r in range(c)])
    F = spec_F(a)
    A = np.array([np.linalg.inv(V) @ np.diag(a**j) @ F for j in range(N)])
    D = np.array([np.linalg.inv(F) @ np.diag(a ** -(i - 1.0)) @ V_L for i in range(N)])
    for M in (A, D):
        assert np.abs(M.imag).max() <= 1e-6 * max(1.0, np.abs(M).max()), "points not conjugate-closed"
    return A.real.copy(), D.real.copy()


def spec_least_squares_decoders(A: np.ndarray, N: int) -> np.ndarray:
    """The decoders minimising || D_i [E_1(A_{i-1}), ..., E_{N-1}(A_{i-N+1})] - [I, ..., I] ||_F."""
    c = A.shape[-1]
    L = c + N - 2
    D = np.empty((N, c, L))
    for i in range(N):
        M = np.zeros((L, (N - 1) * c))
        for h in range(1, N):
            M[h - 1 : h - 1 + c, (h - 1) * c : h * c] = A[(i - h) % N]
        D[i] = np.linalg.lstsq(M.T, np.tile(np.eye(c), (1, N - 1)).T, rcond=1e-13)[0].T
    return D


def spec_all_reduce(G: np.ndarray, A: np.ndarray, D: np.ndarray, deliver=None) -> np.ndarray:
    """Every worker's S_hat_i for gradients G [N, d], in float64: the protocol of the spec, literally.
    ``deliver(x)``: what the link delivers when x is sent (default: x itself), e.g. a 16-bit wire's rounding."""
    N, d = G.shape
    c = A.shape[-1]
    L = c + N - 2 if N > 1 else 0
    m = -(-d // c)
    padded = np.zeros((N, c * m))
    padded[:, :d] = G
    Gi = padded.reshape(N, c, m)
    U = [A[i] @ Gi[i] for i in range(N)]

    def u(i, t):  # u_i(t), 1-based; zero outside 1..c
        return U[i][t - 1] if 1 <= t <= c else np.zeros(m)

    yhat = [[np.zeros(m)] for _ in range(N)]  # yhat_i(0) = 0
    for t in range(1, L + 1):
        x = [u(i, t) + yhat[i][t - 1] for i in range(N)]  # 1. send x_i(t) to i+1
        for i in range(N):
            y = x[(i - 1) % N] if deliver is None else deliver(x[(i - 1) % N])  # 2. receive y_i(t) from i-1
            yhat[i].append(y - u(i, t - N + 1))  # 3. take out the own contribution
    S_hat = np.stack([Gi[i] + D[i] @ np.array(yhat[i][1:]).reshape(L, m) for i in range(N)])
    return S_hat.reshape(N, c * m)[:, :d]
