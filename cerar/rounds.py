"""The L rounds of the CERAR protocol, written once for one worker or a batch of simulated workers.

Both the distributed ``cerar.all_reduce`` and the single-process oracle ``cerar.simulate`` run this
loop; they differ only in ``exchange``, which sends x_i(t) to worker i+1 and returns y_i(t) from
worker i-1 (point-to-point messages, or a roll of the batch).

Per round t = 1..L at worker i (spec, "The protocol at worker i"):
    x_i(t)    = u_i(t) + yhat_i(t-1)          u_i(t) = row t of A_i G_i, zero for t > c
    y_i(t)    = what worker i-1 sent
    yhat_i(t) = y_i(t) - u_i(t - N + 1)       its own injection, back after going round once
    acc_i    += D_i[:, t] yhat_i(t)           decoding as blocks arrive
and finally S_hat_i = G_i + acc_i.

Storage beyond the input: the accumulator (c blocks), the injections of the last N rounds
(N blocks) and the block in flight: (1 + (N + 1)/c) d. Encoding is one row of A_i times G_i per
round and decoding one rank-1 update per round, both batched matrix products on G's device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Accumulates seconds per phase; on CUDA through events, so the hot path never synchronises."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def totals(self) -> dict[str, float]:
        """Seconds per phase (synchronises once on CUDA)."""
        if self._events:
            self._events[-1][2].synchronize()
            for name, start, end in self._events:
                self.seconds[name] = self.seconds.get(name, 0.0) + start.elapsed_time(end) / 1e3
            self._events.clear()
        return dict(self.seconds)


def run_rounds(
    G: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    N: int,
    exchange: Callable[[torch.Tensor, int], torch.Tensor],
    timer: PhaseTimer | None = None,
) -> torch.Tensor:
    """Run the L rounds for a batch of B workers and return S_hat (B x c x m, G's dtype).

    G: [B, c, m] the workers' component matrices; A: [B, c, c]; D: [B, c, L] in G's dtype and on
    G's device. ``exchange(x, t)`` sends x ([B, m], worker b's x(t)) round the ring and returns the
    [B, m] blocks received in round t. The returned tensor is freshly allocated.
    """
    timer = timer or PhaseTimer(G.device, enabled=False)
    B, c, m = G.shape
    L = D.shape[-1]
    acc = torch.zeros_like(G)
    injections = G.new_zeros(N, B, 1, m)  # u(t) lives in slot t mod N until round t + N - 1
    yhat = G.new_zeros(B, 1, m)
    for t in range(1, L + 1):
        if t <= c:
            with timer.phase("encode"):
                u_t = injections[t % N]
                torch.bmm(A[:, t - 1 : t, :], G, out=u_t)
                x = yhat.add_(u_t)
        else:
            x = yhat
        with timer.phase("comm"):
            y = exchange(x.view(B, m), t).view(B, 1, m)
        with timer.phase("decode"):
            s = t - N + 1
            if 1 <= s <= c:
                y.sub_(injections[s % N])
            yhat = y
            acc.baddbmm_(D[:, :, t - 1 : t], yhat)
    with timer.phase("decode"):
        return acc.add_(G)
