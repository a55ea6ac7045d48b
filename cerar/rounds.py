"""One worker's side of the L rounds of the CERAR protocol, written once for every caller.

Both the distributed ``cerar.all_reduce`` and the single-process oracle ``cerar.simulate`` drive
``CodedRingWorker`` objects; they differ only in how x_i(t) reaches worker i+1 (point-to-point
messages, or a hand-over between objects in one process), so they do the same arithmetic.

The messages are the specification's (section "The protocol at worker i"):

    x_i(t) = yhat_i(t-1) + u_i(t),   yhat_i(t) = y_i(t) - u_i(t-N+1),   u_i(t) = row t of A_i G_i

rearranged so that only one addition of m values lies between receiving y(t) and sending x(t+1):

    x(t+1) = y(t) + (u(t+1) - u(t-N+1))       (u(j) = 0 outside 1..c)

The bracket is formed while round t's blocks are in flight. During round 1 the worker turns G_i
into U_i = A_i G_i in place (one matrix product, a few columns at a time through the injection
buffer), so each later injection is a difference of two stored rows. Decoding uses the messages
themselves: since yhat(t) = x(t+1) - u(t+1),

    S_hat = G + sum_t D_i[:, t] yhat(t) = B_i G + sum_t D_i[:, t] x(t+1),   B_i = I - sum_t D_i[:, t] A_i[t+1, :]

with acc = B_i G formed during round 1 before G is overwritten, and the other terms added in batches
of N-1 messages while the newest of them is on the wire.

Work per call: c d multiply-adds to encode and c d for B_i G (once each), one subtraction of m
values per round, and L c m multiply-adds to decode in L/(N-1) passes over the accumulator.
Storage beyond the input: the accumulator (c blocks), N message blocks and the injection:
(1 + (N+1)/c) d, the spec's (1 + N/c) d plus one block. The caller's tensor holds U_i during the
call, and the result after it.

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
    """Worker i's float64 matrices for the rearranged rounds: A_i (c x c), its first row, D_i (c x L)
    and B_i (c x c)."""
    c, L = code.c, code.L
    A, D = code.A[i], code.D[i]
    B = np.eye(c) - (D[:, : c - 1] @ A[1:] if L else 0)
    return {"A": A, "first": A[:1], "D": D, "B": B}


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
    tail: [c-k, m], the rows of G_i; during round 1 they are overwritten with U_i = A_i G_i (after
    acc = B_i G_i), so each later injection is a difference of two rows. messages: [R, m] buffers
    (R = ``message_rows(N)``); x(t) lives in row (t-1) mod R. Messages are decoded in batches of
    R-1 while the last of them is on the wire.
    """

    def __init__(self, matrices: dict[str, torch.Tensor], head, tail, messages, N: int, timer=None):
        self.A, self.D, self.B = matrices["A"], matrices["D"], matrices["B"]
        self.head, self.tail, self.messages, self.N = head, tail, messages, N
        self.c, self.k = self.A.shape[0], head.shape[0]
        self.rows = messages.shape[0]
        self.timer = timer or PhaseTimer(head.device, enabled=False)
        self.acc = head.new_empty(self.c, head.shape[-1])
        self.injection = torch.empty_like(messages[0])
        self.decoded_up_to = 1  # x(1) carries no decoding term
        self.t = 1
        with self.timer.phase("encode"):
            self._times_G(matrices["first"], out=messages[0].view(1, -1))  # x(1) = u(1)

    def _times_G(self, rows: torch.Tensor, out: torch.Tensor, columns=slice(None)) -> None:
        """out = rows @ G[:, columns], with G = [head; tail]."""
        torch.mm(rows[:, : self.k], self.head[:, columns], out=out)
        if self.tail.shape[0]:
            out.addmm_(rows[:, self.k :], self.tail[:, columns])

    def _encode_in_place(self) -> None:
        """[head; tail] <- A_i [head; tail], a few columns at a time (U_i replaces G_i), through the
        injection buffer, which is free until the first injection is formed."""
        m = self.head.shape[-1]
        width = max(1, m // self.c)
        if self.c * width <= m:
            block = self.injection[: self.c * width].view(self.c, width)
        else:  # m < c: a block of a few values
            block = self.head.new_empty(self.c, width)
        for a in range(0, m, width):
            b = min(m, a + width)
            encoded = block[:, : b - a]
            self._times_G(self.A, out=encoded, columns=slice(a, b))
            self.head[:, a:b].copy_(encoded[: self.k])
            self.tail[:, a:b].copy_(encoded[self.k :])

    def _u(self, j: int) -> torch.Tensor:
        """u(j) = row j (1-based) of U_i."""
        return self.head[j - 1] if j <= self.k else self.tail[j - 1 - self.k]

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
        """Round 1: acc = B_i G, then G -> U in place. Later rounds: decode the waiting messages once
        R-1 have gathered (x(t) is only read). Every round: the injection u(t+1) - u(t-N+1)."""
        if t == 1:
            with self.timer.phase("decode"):
                self._times_G(self.B, out=self.acc)
            with self.timer.phase("encode"):
                self._encode_in_place()
        elif t - self.decoded_up_to >= self.rows - 1:
            with self.timer.phase("decode"):
                self._decode_through(t)
        with self.timer.phase("encode"):
            new, old = t + 1, t - self.N + 1  # rows outside 1..c are zero
            if new <= self.c and old >= 1:
                torch.sub(self._u(new), self._u(old), out=self.injection)
            elif new <= self.c:
                self.injection.copy_(self._u(new))
            elif old >= 1:
                torch.neg(self._u(old), out=self.injection)
            else:
                self.injection.zero_()

    def receive(self, t: int, y: torch.Tensor) -> None:
        """x(t+1) = y(t) + u(t+1) - u(t-N+1), in y's buffer."""
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
            CodedRingWorker(matrices, self.head[:, a:b], self.tail[:, a:b], flat.new_empty(rows, b - a), N, timer)
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
