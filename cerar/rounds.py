"""One worker's side of the L rounds of the CERAR protocol, written once for every caller.

Both the distributed ``cerar.all_reduce`` and the single-process oracle ``cerar.simulate`` drive
``CodedRingWorker`` objects; they differ only in how x_i(t) reaches worker i+1 (point-to-point
messages, or a hand-over between objects in one process), so they do the same arithmetic.

The messages are the specification's (section "The protocol at worker i"):

    x_i(t) = yhat_i(t-1) + u_i(t),   yhat_i(t) = y_i(t) - u_i(t-N+1),   u_i(t) = row t of A_i G_i

rearranged so that only one addition of m values lies between receiving y(t) and sending x(t+1):

    x(t+1) = y(t) + Delta_t G,        Delta_t = row t+1 of A_i - row t-N+1 of A_i (rows outside 1..c are 0)

Delta_t G is computed while round t's blocks are in flight. Decoding uses the messages themselves:
since yhat(t) = x(t+1) - u(t+1),

    S_hat = G + sum_t D_i[:, t] yhat(t) = B_i G + sum_t D_i[:, t] x(t+1),   B_i = I - sum_t D_i[:, t] A_i[t+1, :]

where the terms are added in batches of N-1 messages, while the newest of them is on the wire.
Per round: one row-times-G product (d multiply-adds); every N-1 rounds one product of D_i's
columns with the waiting messages (one pass over the accumulator); B_i G once, during the first round.
Storage beyond the input: the accumulator (c blocks), N message blocks and Delta_t G:
(1 + (N+1)/c) d, the spec's (1 + N/c) d plus one block.

G_i arrives as rows of length m in two parts, ``head`` (the rows that are a view of the caller's
tensor) and ``tail`` (the last, zero-padded rows), so the input is never copied whole.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
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


def worker_matrices(code, i: int) -> dict[str, np.ndarray]:
    """Worker i's float64 matrices for the rearranged rounds: the first encoder row, Delta (L x c),
    D_i (c x L) and B_i (c x c)."""
    N, c, L = code.N, code.c, code.L
    A, D = code.A[i], code.D[i]

    def row(j):  # row j (1-based) of A_i, zero outside 1..c
        return A[j - 1] if 1 <= j <= c else np.zeros(c)

    delta = np.stack([row(t + 1) - row(t - N + 1) for t in range(1, L + 1)]) if L else np.zeros((0, c))
    B = np.eye(c) - (D[:, : c - 1] @ A[1:] if L else 0)
    return {"first": row(1)[None, :], "delta": delta, "D": D, "B": B}


def message_rows(N: int) -> int:
    """How many message blocks a worker keeps: N. Received messages wait in them until N-1 have
    gathered and are decoded by one matrix product (one pass over the accumulator for every N-1
    rounds instead of every round), which keeps storage at the spec's (1 + N/c) d plus one block."""
    return max(N, 2)


class CodedRingWorker:
    """One worker's state through the L rounds.

    Per round t: ``message()`` is x(t) (send it) and ``receive_buffer(t)`` is where y(t) must
    arrive; ``while_in_flight(t)`` does the round's arithmetic while the blocks travel;
    ``receive(t, y)`` turns y(t) into x(t+1) in its own buffer. ``result()`` is S_hat at the end.

    matrices: ``worker_matrices`` as tensors of G's dtype on G's device. head: [k, m] and
    tail: [c-k, m], the rows of G_i. messages: [R, m] buffers (R = ``message_rows(N)``); x(t) lives
    in row (t-1) mod R. Messages are decoded in batches of R-1 while the last of them is on the wire.
    """

    def __init__(self, matrices: dict[str, torch.Tensor], head, tail, messages, timer: PhaseTimer | None = None):
        # x(1) is formed here; acc = B_i G during round 1's flight (``while_in_flight(1)``).
        self.first, self.delta, self.D, self.B = (matrices[k] for k in ("first", "delta", "D", "B"))
        self.head, self.tail, self.messages = head, tail, messages
        self.k = head.shape[0]
        self.rows = messages.shape[0]
        self.timer = timer or PhaseTimer(head.device, enabled=False)
        self.acc = head.new_empty(self.B.shape[0], head.shape[-1])
        self.injection = torch.empty_like(messages[0])
        self.decoded_up_to = 1  # x(1) carries no decoding term
        self.t = 1
        with self.timer.phase("encode"):
            self._times_G(self.first, out=messages[0])  # x(1) = u(1)

    def _times_G(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """out = rows @ G for rows [1, c] (or [c', c] into [c', m]), with G = [head; tail]."""
        out = out.view(rows.shape[0], -1)
        torch.mm(rows[:, : self.k], self.head, out=out)
        if self.tail.shape[0]:
            out.addmm_(rows[:, self.k :], self.tail)

    def message(self) -> torch.Tensor:
        """x(t), the block to send this round."""
        return self.messages[(self.t - 1) % self.rows]

    def receive_buffer(self, t: int) -> torch.Tensor:
        return self.messages[t % self.rows]

    def _decode_through(self, s: int) -> None:
        """acc += D_i[:, j-1] x(j) for the waiting messages x(decoded_up_to + 1 .. s)."""
        first = self.decoded_up_to + 1
        while first <= s:
            row = (first - 1) % self.rows
            last = min(s, first + self.rows - 1 - row)  # stop where the rows wrap round
            self.acc.addmm_(self.D[:, first - 2 : last - 1], self.messages[row : row + last - first + 1])
            first = last + 1
        self.decoded_up_to = s

    def while_in_flight(self, t: int) -> None:
        """Decode the waiting messages once R-1 have gathered (x(t) is only read), and compute
        Delta_t G for x(t+1)."""
        with self.timer.phase("decode"):
            if t == 1:
                self._times_G(self.B, out=self.acc)  # acc starts as B_i G, off the critical path
            elif t - self.decoded_up_to >= self.rows - 1:
                self._decode_through(t)
        with self.timer.phase("encode"):
            self._times_G(self.delta[t - 1 : t], out=self.injection)

    def receive(self, t: int, y: torch.Tensor) -> None:
        """x(t+1) = y(t) + Delta_t G, in y's buffer."""
        with self.timer.phase("encode"):
            y.add_(self.injection)
        self.t = t + 1

    def result(self) -> torch.Tensor:
        """S_hat = B_i G + sum_t D_i[:, t] x(t+1), as [c, m] in the accumulator's buffer."""
        with self.timer.phase("decode"):
            if self.D.shape[1] == 0:
                self._times_G(self.B, out=self.acc)  # no rounds (N = 1): S_hat = G
            self._decode_through(self.D.shape[1] + 1)
        return self.acc


PIPELINE_MIN_CHUNK = 2**16
"""Fewest values per message: smaller blocks go whole, where another message costs more than it hides."""
PIPELINE_MAX_CHUNKS = 2


def pipeline_chunks(m: int) -> list[tuple[int, int]]:
    """Column ranges of the blocks that travel as separate messages. Chunks let a rank send chunk 1
    of round t+1 while the later chunks of round t are still arriving, so the link does not idle
    between rounds."""
    parts = max(1, min(PIPELINE_MAX_CHUNKS, m // PIPELINE_MIN_CHUNK))
    edges = [p * m // parts for p in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


class CodedRingRank:
    """One rank's side of the protocol: its gradient (the first d values of ``flat``) as c rows of
    m, cut into column chunks (``pipeline_chunks``) that run as independent CodedRingWorkers.

    The rows wholly inside ``flat`` are used in place; the last, partial row is copied into a
    zero-padded tail. ``write_result(out)`` writes S_hat's first d values into ``out``.
    """

    def __init__(self, matrices: dict[str, torch.Tensor], flat: torch.Tensor, c: int, m: int, N: int, timer=None):
        d = flat.numel()
        self.d, self.c, self.m = d, c, m
        self.k = d // m  # rows wholly inside the tensor
        self.head = flat[: self.k * m].view(self.k, m)
        self.tail = flat.new_zeros(c - self.k, m)
        self.tail.view(-1)[: d - self.k * m] = flat[self.k * m :]
        self.chunks = pipeline_chunks(m)
        rows = message_rows(N)
        self.workers = [
            CodedRingWorker(matrices, self.head[:, a:b], self.tail[:, a:b], flat.new_empty(rows, b - a), timer)
            for a, b in self.chunks
        ]

    def extra_bytes(self) -> int:
        """Bytes this rank allocated beyond its input: accumulators, messages, injections, tail."""
        tensors = [self.tail] + [t for w in self.workers for t in (w.acc, w.messages, w.injection)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write_result(self, out: torch.Tensor, scale: float | None = None) -> None:
        """out[:d] = S_hat (times ``scale``), chunk by chunk."""
        k, m = self.k, self.m
        rest = self.d - k * m  # values of row k that lie inside the tensor
        head_out = out[: k * m].view(k, m)
        for (a, b), worker in zip(self.chunks, self.workers, strict=True):
            result = worker.result()
            if scale is not None:
                result.mul_(scale)
            head_out[:, a:b].copy_(result[:k])
            if a < rest:
                out[k * m + a : k * m + min(b, rest)].copy_(result[k, : min(b, rest) - a])
