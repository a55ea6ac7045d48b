"""One worker's side of the L rounds of the CERAR protocol, written once for every caller.

Both the distributed ``cerar.all_reduce`` and the single-process oracle ``cerar.simulate`` drive
``CodedRingWorker`` objects; they differ only in how x_i(t) reaches worker i+1 (point-to-point
messages, or a hand-over between objects in one process).

Per round t = 1..L at worker i (spec, "The protocol at worker i"):
    x_i(t)    = yhat_i(t-1) + u_i(t)          u_i(t) = row t of A_i G_i, zero for t > c
    y_i(t)    = what worker i-1 sent
    yhat_i(t) = y_i(t) - u_i(t - N + 1)       its own injection, back after going round once
    acc_i    += D_i[:, t] yhat_i(t)           decoding as blocks arrive
and finally S_hat_i = G_i + acc_i.

Storage beyond the input is the accumulator (c blocks) and the two blocks in flight, (1 + 2/c) d:
instead of keeping the last N-1 injections (the spec's (1 + N/c) d), each injection is recomputed
from G_i when it comes back round, so encoding costs 2 c d multiply-adds instead of c d. Every
step is an in-place batched matrix product on G's device.

G_i arrives as rows of length m in two parts, ``head`` (the rows that are a view of the caller's
tensor) and ``tail`` (the last, zero-padded rows), so the input is never copied whole.
"""

from __future__ import annotations

import time
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


class CodedRingWorker:
    """One worker's state through the L rounds: ``outgoing(t)`` forms x(t), ``incoming(t, y)``
    takes y(t), and ``result()`` is S_hat once all L rounds have run.

    head: [1, k, m] and tail: [1, c-k, m], the rows of the worker's G (k may be 0 or c).
    A: [1, c, c] and D: [1, c, L] are A_i and D_i in G's dtype on G's device. first_message is a
    zeroed [1, 1, m] buffer that becomes x(1); each received block becomes the next message, in
    place, so the caller must receive each round into a buffer other than the one it sent.
    The distributed protocol and the oracle drive the same objects, so they do the same arithmetic.
    """

    def __init__(self, head, tail, A, D, N: int, first_message: torch.Tensor, timer: PhaseTimer | None = None):
        self.head, self.tail, self.A, self.D, self.N = head, tail, A, D, N
        self.c = A.shape[-1]
        self.timer = timer or PhaseTimer(head.device, enabled=False)
        self.acc = head.new_zeros(1, self.c, head.shape[-1])
        self.yhat = first_message

    def _add_injection(self, block: torch.Tensor, t: int, sign: int) -> None:
        """block += sign * u(t), u(t) = row t of A_i G_i, with G_i = [head; tail]."""
        k = self.head.shape[1]
        if k:
            block.baddbmm_(self.A[:, t - 1 : t, :k], self.head, alpha=sign)
        if self.tail.shape[1]:
            block.baddbmm_(self.A[:, t - 1 : t, k:], self.tail, alpha=sign)

    def outgoing(self, t: int) -> torch.Tensor:
        """x(t) = yhat(t-1) + u(t), formed in place in yhat's buffer."""
        if t <= self.c:
            with self.timer.phase("encode"):
                self._add_injection(self.yhat, t, +1)
        return self.yhat

    def incoming(self, t: int, y: torch.Tensor) -> None:
        """yhat(t) = y(t) - u(t - N + 1), in place in y's buffer; acc += D_i[:, t] yhat(t)."""
        with self.timer.phase("decode"):
            s = t - self.N + 1
            if 1 <= s <= self.c:
                self._add_injection(y, s, -1)
            self.yhat = y
            self.acc.baddbmm_(self.D[:, :, t - 1 : t], y)

    def result(self) -> torch.Tensor:
        """S_hat = G + acc, as [1, c, m] (in the accumulator's buffer)."""
        with self.timer.phase("decode"):
            k = self.head.shape[1]
            self.acc[:, :k] += self.head
            self.acc[:, k:] += self.tail
        return self.acc
