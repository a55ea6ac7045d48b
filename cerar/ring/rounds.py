"""One worker's side of the L rounds of the CERAR protocol, written once for every caller.

Both the distributed ``cerar.all_reduce`` and the single-process oracle ``cerar.simulate`` drive
``CodedRingWorker`` objects; they differ only in how x_i(t) reaches worker i+1 (point-to-point
messages, or a hand-over between objects in one process), so they do the same arithmetic.

The messages are the specification's (section "The protocol at worker i"):

    x_i(t) = yhat_i(t-1) + u_i(t),   yhat_i(t) = y_i(t) - u_i(t-N+1),   u_i(t) = row t of A_i G_i

rearranged so that one operation on m values lies between receiving y(t) and sending x(t+1):

    x(t+1) = y(t) + u(t+1) - u(t-N+1)       (u(j) = 0 outside 1..c)

In the rounds N..c-1, where both rows exist, that operation is one product written into y's buffer,
y += [-1, 1] [u(t-N+1); u(t+1)]: rows t-N+1 and t+1 of U_i lie exactly N rows apart, so the pair is a
strided 2 x m view of U_i and no injection is formed or stored; in the other rounds y(t) takes the one
row with one addition (or subtraction), and rounds c..N-1 (c < N) have none. Every operation of a call
is a product or an addition written in place: U_i = A_i G_i (two products, x(1) first so that round 1
can leave), one per round, and the decoding products. U_i lives in its own c blocks, beside the stored
messages, and the caller's tensor keeps G_i until the first decoding product overwrites it with the
result. Decoding uses the stored messages themselves (``cerar.coding.matrices``):

    S_hat_i = W_i [U_i; x(2); ...; x(L+1)],   W_i = [A_i^-1 - D_i[:, :c-1] S | D_i]   (c x (c + L))

Storage knob (``storage``, ``DEFAULT_STORAGE``): ``"spec"`` (the default) keeps N message blocks
and decodes each batch of N-1 messages with one product while the next blocks travel (the rows are
swept up and down so that a batch is always contiguous), the first product fused with W_i's
U-columns, the last one scaled by 1/N; ``"messages"`` keeps all L messages and decodes with one
product at the end, written straight into the caller's tensor with 1/N folded into its alpha.

The count (per rank and call, c dividing d, m = d/c; a "pass" is d values read or written by the
arithmetic, not by the transport; an "operation" is one dispatched tensor operation, a GPU's kernel).
``cerar.planning.costmodel.cerar_arithmetic`` and ``cerar_operations`` compute the new column;
``tests/test_costmodel.py`` measures the passes and ``tests/test_op_count.py`` the operations on the
dispatched tensor operations; the old column was measured the same way on the previous arithmetic
(``git show e259866:cerar/ring/rounds.py``).

=========================  =====================================  ====================================
                           before (commit e259866)                now
=========================  =====================================  ====================================
matrix products            U_i = A_i G (c d), W_i [U; X]          the same, and per round N..c-1 the
(multiply-adds)            ((c + L) d): (3c + N - 2) d            injection's [-1, 1] product (2 m)
additions                  (L - max(0, N-c)) m adds and           the other rounds' one addition
                           max(0, c-N) m injection subtractions   (L - |N - c|) m
passes: encode             3 (x(1), then the rest of U_i)         3
passes: rounds             3 (L + c - N) / c = 6 (c - 1) / c      (4 (c - N) + 3 (L - (c - N))) / c
                           (the injection formed in flight,       = (4c + 2N - 6) / c for c >= N:
                           then added)                            the injection in the round's product
passes: decode             (c + L)/c + 1 for the first product    the same
                           (it writes the result without
                           reading it), 2 per further one:
                           none with "messages", one per
                           N-1 messages with "spec"
passes: scale, write back  0 (1/N in the last products' alpha)    0
operations per chunk       2 + (L - max(0, N-c)) + max(0, c-N)    2 + (L - max(0, N-c)) + products:
                           + products: N=4, c=16: 38 ("spec"),    26 ("spec"), 21 ("messages");
                           33 ("messages"); N=8, c=32: 70, 65     46, 41
chunks per block           2 (m >= 2^17)                          2 on a CPU, 1 on CUDA
                                                                  (``CUDA_PIPELINE_MAX_CHUNKS``)
N=4, c=16, op="avg"        11.75 ("messages"), 21.75 ("spec")     10.25 ("messages"), 20.25 ("spec")
N=8, c=32, op="avg"        12.0 ("messages"), 22.0 ("spec")       10.5 ("messages"), 20.5 ("spec")
storage beyond the input   (c + N + 1) m = (1 + (N+1)/c) d        (c + N) m = (1 + N/c) d, the
                           ("spec"); (c + L + 1) m =              spec's ("spec"); (c + L) m =
                           (2 + (N-1)/c) d ("messages")           (2 + (N-2)/c) d ("messages")
=========================  =====================================  ====================================

``"spec"`` keeps the spec's storage, (1 + N/c) d; ``"messages"`` adds (L - N) m, about (1 - 2/c) d more, to
touch the gradient about half as often. Where c does not divide d, the partial last row costs each
product of the chunks that hold it one more product over its columns, and the row a zero, a copy in and
a copy out. The multiply-adds are the same in both modes to one d: the saving is in memory traffic,
which bounds these products on a GPU (the last one does c (c + L) / (2c + L) < c multiply-adds per
value it moves), and in operations, each of which costs a GPU's host a launch (on an H200 more than the
device's time for it: ``docs/arithmetic.md``).

The working storage is one flat workspace carved into these blocks (``CodedRingRank.workspace_numel``
values); ``cerar.all_reduce`` takes it from ``cerar.ring.workspace``, which keeps it between calls on CPU.

G_i arrives as rows of length m in two parts, ``head`` (the rows that are a view of the caller's
tensor) and ``tail`` (the last, zero-padded rows), so the input is never copied whole.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from cerar.ring import products


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


STORAGE_CHOICES = ("spec", "messages")
DEFAULT_STORAGE = "spec"
"""``"spec"`` keeps N messages and decodes them in batches while blocks travel: the spec's storage,
and on a slow link all but the last batch hide behind the transfers. ``"messages"`` keeps every
message and decodes once, at the end, into the caller's tensor: the fewest passes, for fast links
(where the arithmetic, not the link, sets the time) and memory to spare."""


def check_storage(storage: str) -> None:
    if storage not in STORAGE_CHOICES:
        raise ValueError(f"storage must be one of {STORAGE_CHOICES}, got {storage!r}")


def check_chunks(chunks, operation: str = "cerar") -> None:
    """``chunks``: None (the device's default) or a positive int; a ValueError naming it otherwise."""
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"{operation}: chunks must be None or a positive int (column chunks a block travels in), "
                         f"got {chunks!r}")


def message_rows(N: int, L: int, storage: str = DEFAULT_STORAGE) -> int:
    """How many message blocks a worker keeps: all L (``"messages"``) or N (``"spec"``), at least 2."""
    check_storage(storage)
    return max(L if storage == "messages" else N, 2)


def message_row(j: int, rows: int) -> int:
    """The buffer row of message j (x(j+1), j = 1..L): the rows are swept up and down, 0, 1, ...,
    R-1, R-2, ..., 0, 1, ..., so each batch of R-1 consecutive messages fills contiguous rows
    (forwards in even batches, backwards in odd ones) and is decoded by one product."""
    p = (j - 1) % (2 * (rows - 1))
    return p if p < rows else 2 * (rows - 1) - p


_INJECTION_ROWS: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def injection_row(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[[-1, 1]] in ``dtype`` on ``device``: the coefficients of [u(t-N+1); u(t+1)] in the round's one
    product. Kept per dtype and device (on CUDA its first copy to the device synchronises once; a
    captured call finds it made by the eager call before the capture)."""
    key = (dtype, str(device))
    row = _INJECTION_ROWS.get(key)
    if row is None:
        row = _INJECTION_ROWS.setdefault(key, torch.tensor([[-1.0, 1.0]], dtype=dtype).to(device))
    return row


class CodedRingWorker:
    """One worker's state through the L rounds, on a column chunk of its gradient.

    Per round t: ``message()`` is x(t) (send it) and ``receive_buffer(t)`` is where y(t) must
    arrive; ``while_in_flight(t)`` does what of the round's arithmetic can run while the blocks
    travel (the rest of the encoding in round 1, a batch's decoding product); ``receive(t, y)``
    turns y(t) into x(t+1) in its own buffer, in one operation. ``finish(scale)`` leaves S_hat
    (times ``scale``) in [head; tail].

    matrices: ``cerar.coding.matrices.worker_matrices`` as tensors (A: c x c, W: c x (c + L), D_reversed:
    W's message columns in reverse order, for the batches stored backwards). head: [k, w]
    and tail: [c-k, w], the rows of G_i: read to encode, then overwritten by the result (of the
    tail only the ``tail_width`` leading columns of its first row, the rest being padding). buffer:
    [c + R, w], U_i = A_i G_i in its first c rows and the messages x(j+1) after them, in row
    ``message_row(j, R)``, so the first product is one with [U_i; x(2); ...; x(R)].
    """

    def __init__(self, matrices, head, tail, buffer, N: int, tail_width: int, timer=None):
        self.A, self.W, self.W_reversed = matrices["A"], matrices["W"], matrices["D_reversed"]
        self.head, self.tail, self.N = head, tail, N
        self.c, self.k = self.A.shape[0], head.shape[0]
        self.L = self.W.shape[1] - self.c
        self.U, self.messages = buffer[: self.c], buffer[self.c :]
        self.buffer = buffer
        self.rows = self.messages.shape[0]
        # messages per decoding product: all at once when every message has its own row, else R-1
        # (the R-th row is receiving)
        self.batch = self.rows if self.rows >= self.L else self.rows - 1
        self.tail_width = tail_width
        self.timer = timer or PhaseTimer(head.device, enabled=False)
        self.coefficients = injection_row(buffer.dtype, buffer.device)
        self.decoded = 0  # messages x(2..decoded+1) are in the result
        self.encoded = False
        self.t = 1

    def start(self) -> None:
        """x(1) = u(1) = A_i[0] G, the block round 1 sends."""
        with self.timer.phase("encode"):
            self._encode(slice(0, 1))

    def _encode(self, rows: slice) -> None:
        """U[rows] = A[rows] G, G = [head; tail] (only the tail's first row can hold values)."""
        out = self.U[rows]
        if not out.shape[0]:  # c = 1: x(1) was all of U_i
            return
        products.mm(self.A[rows, : self.k], self.head, out)
        if self.tail_width:
            width = self.tail_width
            products.addmm_(out[:, :width], self.A[rows, self.k : self.k + 1], self.tail[:1, :width])

    def _finish_encoding(self) -> None:
        if not self.encoded:
            with self.timer.phase("encode"):
                self._encode(slice(1, self.c))
            self.encoded = True

    def message(self, t: int | None = None) -> torch.Tensor:
        """x(t), the block to send in round t (default: this round). Where x(t) lives depends on t
        alone, so a caller that issues the rounds' arithmetic ahead of time (a device queue) can
        name the block before ``receive(t - 1)`` has run."""
        t = self.t if t is None else t
        return self.U[0] if t == 1 else self.messages[message_row(t - 1, self.rows)]

    def receive_buffer(self, t: int) -> torch.Tensor:
        return self.messages[message_row(t, self.rows)]

    def _batch_end(self, j: int) -> int:
        """The last message of message j's batch."""
        return min(self.L, (j - 1) // self.batch * self.batch + self.batch)

    def _decode(self, last: int, alpha: float = 1.0, beta: float = 1.0) -> None:
        """[head; tail] = beta [head; tail] + alpha (W_i's terms for the messages decoded+1..last,
        which lie in one batch of contiguous rows). The first product also applies W_i's U-columns
        and overwrites G (U_i holds all it had)."""
        self._finish_encoding()
        first = self.decoded + 1
        if first == 1:  # W_i [U; x(2) ... x(last+1)]: rows 0..c+last-1 of the buffer
            rows, cols, beta = self.buffer[: self.c + last], self.W[:, : self.c + last], 0.0
        else:
            a, b = message_row(first, self.rows), message_row(last, self.rows)
            if a <= b:  # a forward batch: message j in row a + (j - first)
                rows, cols = self.messages[a : b + 1], self.W[:, self.c + first - 1 : self.c + last]
            else:  # a backward one: rows b..a hold messages last..first
                rows, cols = self.messages[b : a + 1], self.W_reversed[:, self.L - last : self.L - first + 1]
        products.addmm_(self.head, cols[: self.k], rows, beta=beta, alpha=alpha)
        if self.tail_width:  # only the partial row's values inside the tensor are ever read
            width = self.tail_width
            products.addmm_(self.tail[:1, :width], cols[self.k : self.k + 1], rows[:, :width], beta=beta, alpha=alpha)
        self.decoded = last

    def while_in_flight(self, t: int) -> None:
        """Round 1: the rest of U_i = A_i G_i. When a batch of R-1 messages is complete and more
        rounds follow (only with fewer rows than rounds), decode it; its rows are needed next.
        Nothing else: the round's injection rides on ``receive``'s one product."""
        if t == 1:
            self._finish_encoding()
        if t < self.L and t - 1 - self.decoded >= self.batch:
            with self.timer.phase("decode"):
                self._decode(self._batch_end(self.decoded + 1))

    def receive(self, t: int, y: torch.Tensor) -> None:
        """x(t+1) = y(t) + u(t+1) - u(t-N+1) in y's buffer, one operation (u(j) = 0 outside 1..c):
        where both rows exist, one product y += [-1, 1] [u(t-N+1); u(t+1)], whose two rows lie N rows
        apart in U_i, a strided 2 x w view (read 3 blocks, write 1); where one exists, one addition."""
        new, old = t + 1, t - self.N + 1
        if new <= self.c or old >= 1:
            with self.timer.phase("encode"):
                if new <= self.c and old >= 1:
                    products.addmm_(y.unsqueeze(0), self.coefficients, self.U[old - 1 : new : self.N])
                elif new <= self.c:
                    y.add_(self.U[new - 1])
                else:
                    y.sub_(self.U[old - 1])
        self.t = t + 1

    def finish(self, scale: float | None = None) -> None:
        """S_hat_i (times ``scale``) into [head; tail]: the messages not yet decoded, one product per
        batch (with ``storage="messages"`` the only product of the call); the scale rides on them."""
        alpha = 1.0 if scale is None else scale
        with self.timer.phase("decode"):
            beta = alpha  # scales what earlier products left; message L is always still to come
            while True:
                self._decode(self._batch_end(self.decoded + 1), alpha, beta)
                beta = 1.0
                if self.decoded >= self.L:
                    break


PIPELINE_MIN_CHUNK = 2**16
"""Fewest values per message: smaller blocks go whole, where another message costs more than it hides."""
PIPELINE_MAX_CHUNKS = 2
"""Most messages a round's block is cut into on a CPU (gloo), where the arithmetic streams memory about as
fast as the link moves it, so chunk k's arithmetic beside chunk k+1's transfer pays."""
CUDA_PIPELINE_MAX_CHUNKS = 1
"""The same on CUDA: one. A GPU's memory is 10-100 x faster than its link (an H200: about 4 TB/s against
450 GB/s of NVLink), so the round's one product, left exposed, costs under half a round's transfer on
NVLink and about 1 % on PCIe, while each further chunk doubles what the host does per round (a
``batch_isend_irecv`` and a launch), which sets the time of an eager call on a fast link
(``cerar.planning.costmodel.LinkModel.host_per_message``, ``docs/arithmetic.md``)."""


def default_pipeline_chunks(device: torch.device) -> int:
    """The most chunks a call on ``device`` cuts its blocks into (``PIPELINE_MAX_CHUNKS`` on a CPU,
    ``CUDA_PIPELINE_MAX_CHUNKS`` on a GPU); read when called, so a benchmark may set either."""
    return PIPELINE_MAX_CHUNKS if torch.device(device).type == "cpu" else CUDA_PIPELINE_MAX_CHUNKS


def pipeline_chunks(m: int, max_chunks: int | None = None) -> list[tuple[int, int]]:
    """Column ranges of the blocks that travel as separate messages, at most ``max_chunks`` (default
    ``PIPELINE_MAX_CHUNKS``) of at least ``PIPELINE_MIN_CHUNK`` values. Chunks let a rank send chunk 1
    of round t+1 while the later chunks of round t are still arriving, so the link does not idle
    between rounds."""
    most = PIPELINE_MAX_CHUNKS if max_chunks is None else max_chunks
    if most < 1:
        raise ValueError(f"max_chunks must be at least 1, got {most}")
    parts = max(1, min(most, m // PIPELINE_MIN_CHUNK))
    edges = [p * m // parts for p in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


class CodedRingRank:
    """One rank's side of the protocol: its gradient (the first d values of ``flat``) as c rows of
    m, cut into column chunks (``pipeline_chunks``) that run as independent CodedRingWorkers.

    The rows wholly inside ``flat`` are read in place and receive the result in place; the last,
    partial row is copied into a zero-padded tail. ``write_result(out, scale)`` finishes the
    decoding into ``flat`` (scaled) and copies S_hat's first d values into ``out`` where ``out`` is
    another tensor. ``storage``: see ``message_rows``. ``workspace``: a flat tensor of at least
    ``workspace_numel`` values to carve the working storage from (a fresh one when None).
    ``chunks``: the most column chunks (default ``default_pipeline_chunks`` of ``flat``'s device).
    ``start``: whether to issue ``start()`` (the partial row into the tail, and x(1)) at once; a caller whose
    device work goes through a queue issues it there instead (``cerar.ring.protocol.coded_rounds``).
    """

    def __init__(
        self,
        matrices: dict[str, torch.Tensor],
        flat: torch.Tensor,
        c: int,
        m: int,
        N: int,
        timer=None,
        storage: str = DEFAULT_STORAGE,
        workspace: torch.Tensor | None = None,
        chunks: int | None = None,
        start: bool = True,
    ):
        d = flat.numel()
        self.flat, self.d, self.c, self.m = flat, d, c, m
        self.k = _whole_rows(d, c, m)
        self.rest = d - self.k * m  # values of row k that lie inside the tensor
        self.head = flat[: self.k * m].view(self.k, m)
        self.chunks = pipeline_chunks(m, default_pipeline_chunks(flat.device) if chunks is None else chunks)
        L = matrices["W"].shape[1] - c
        rows = message_rows(N, L, storage)
        needed = self.workspace_numel(d, c, m, N, L, storage)
        if workspace is None:
            workspace = flat.new_empty(needed)
        elif workspace.numel() < needed or workspace.dtype != flat.dtype or workspace.device != flat.device:
            raise ValueError(f"workspace: need {needed} values of {flat.dtype} on {flat.device}")
        carve = _Carver(workspace)
        self.tail = carve(c - self.k, m)
        self.workers = []
        for a, b in self.chunks:
            buffer = carve(c + rows, b - a)
            self.workers.append(
                CodedRingWorker(
                    matrices, self.head[:, a:b], self.tail[:, a:b], buffer, N, max(0, min(b, self.rest) - a), timer
                )
            )
        if start:
            self.start()

    def start(self) -> None:
        """The rows past the tensor's end into the tail (zeros, and the partial row's values: none when c
        divides d), then every chunk's x(1)."""
        if self.k < self.c:
            self.tail.zero_()
            if self.rest:
                self.tail.view(-1)[: self.rest] = self.flat[self.k * self.m :]
        for worker in self.workers:
            worker.start()

    @staticmethod
    def workspace_numel(d: int, c: int, m: int, N: int, L: int, storage: str = DEFAULT_STORAGE) -> int:
        """Values of working storage a rank needs: the padded tail, and per chunk its encodings and
        messages (c + R rows of the chunk's width): (c - k) m + (c + R) m, however the columns are cut."""
        return (c - _whole_rows(d, c, m)) * m + (c + message_rows(N, L, storage)) * m

    def extra_bytes(self) -> int:
        """Bytes of working storage this rank uses beyond its input: encodings and messages, tail."""
        tensors = [self.tail] + [w.buffer for w in self.workers]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write_result(self, out: torch.Tensor, scale: float | None = None) -> None:
        """out[:d] = S_hat (times ``scale``): the last products write into ``flat`` directly."""
        for worker in self.workers:
            worker.finish(scale)
        k, m, rest = self.k, self.m, self.rest
        if out.data_ptr() != self.flat.data_ptr():
            out[: k * m].copy_(self.flat[: k * m])
        if rest:
            out[k * m : k * m + rest].copy_(self.tail.view(-1)[:rest])


def _whole_rows(d: int, c: int, m: int) -> int:
    """How many of the c rows of m values lie wholly inside a tensor of d values."""
    return min(c, d // m) if m else c


class _Carver:
    """Consecutive views of a flat workspace, each contiguous."""

    def __init__(self, workspace: torch.Tensor):
        self.workspace, self.used = workspace, 0

    def __call__(self, *shape: int) -> torch.Tensor:
        n = 1
        for size in shape:
            n *= size
        view = self.workspace[self.used : self.used + n].view(*shape)
        self.used += n
        return view
