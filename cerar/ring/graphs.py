"""CERAR's call replayed from a CUDA graph where its shapes repeat (opt-in: ``GraphedAllReduce``).

Why: on a GPU an eager call is bound by its host. Each round costs the host a ``batch_isend_irecv`` (Python and
C++: two ``P2POp``, a coalescing manager, ``pointToPoint`` twice, ``endCoalescing``), a ``Work.wait()`` and a
launch, against a few microseconds of the device's time at 64 MiB on NVLink (one H200 ran one rank's arithmetic
at 0.81 ms of GPU time in 2.75 ms of wall time, ``docs/gpus.md``). A graph replays every kernel of the call,
NCCL's included, from one launch.

Whether NCCL's point-to-point can be captured under torch's ProcessGroupNCCL: yes, on conditions this module
keeps (``docs/gpus.md``, "CUDA graphs and NCCL's point-to-point", cites the functions): the communicator and
its connections to both peers exist before the capture (an eager call made them); no host poll of a work
inside the capture (asking an event captured in a graph whether it completed is an error:
``TransportContract.host_polls=False``); the same
operations captured, and the graph replayed, on every rank (NCCL: capture is a collective property of an
operation); no ``wait(timeout)`` or ``TORCH_NCCL_BLOCKING_WAIT`` (they poll). A work made during a capture is
not enqueued to torch's watchdog, so the only bound on a replay is this module's: an event after it, polled
against the deadline.

How a call runs (``CapturePlan``). A key names what makes two calls one graph: the fields every rank agreed on
(``cerar.ring.protocol.coded_call_fields``: the code, d, the dtype, the wire, the chunks), the op, the storage,
the group and the device. Per key, the first ``warmup`` calls run eagerly (``cerar.all_reduce``: the agreement check,
NCCL's communicator and its connections, the matrices and the injection row on the device); the next one is
captured into a graph (on a side stream, ``cudaStreamCaptureModeThreadLocal``, without the device-wide
synchronise of ``torch.cuda.graph``'s entry) and then replayed; every later one replays. A graph works on a
buffer of its own (the addresses are in the graph): the caller's values are copied in, the graph replayed,
the result copied out, one pass over d each way; then an event is recorded and polled until the call is done,
or ``timeout`` has passed (``CollectiveError``; the group must then be aborted: its kernels still wait for the
peer). At most ``max_graphs`` keys are captured; a new key beyond them runs eagerly, for good. The plan
depends on the sequence of keys alone, which is the same on every rank that makes the same calls (DDP's
buckets). One ``GraphedAllReduce`` serves one thread of calls.

On a CPU there is no graph: ``GraphedAllReduce`` calls ``cerar.all_reduce``. ``HostGraphs`` stands in for
CUDA's graphs in the tests: its "capture" keeps the host function and its replay calls it again, so the plan,
the buffer, the copies, the absence of host polls and the deadline run as on CUDA, on gloo.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from cerar.coding.codes import Code
from cerar.formats.wire import message_bytes, wire_for
from cerar.ring.checks import check_coded_call
from cerar.ring.fp32_products import check_no_tf32_override, full_fp32_products
from cerar.ring.protocol import (
    AllReduceStats,
    _cached_device_matrices,
    all_reduce,
    check_group_size,
    coded_call_fields,
    coded_rounds,
)
from cerar.ring.rounds import (
    DEFAULT_STORAGE,
    CodedRingRank,
    PhaseTimer,
    check_chunks,
    default_pipeline_chunks,
    injection_row,
    pipeline_chunks,
)
from cerar.ring.transport import _FIRST_POLL_PAUSE, _LAST_POLL_PAUSE, _bytes, _Ring

DEFAULT_WARMUP_CALLS = 1
"""Eager calls of a key before its capture: one makes the communicator and connects the peers."""
DEFAULT_MAX_GRAPHS = 16
"""Keys captured at most: each graph keeps its static buffer and working storage, (2 + N/c) d ("spec")."""

GRAPH_PIPELINE_MAX_CHUNKS = 2
"""Chunks a replayed call cuts its blocks into: with no host cost per message (``LinkModel.host_per_message`` = 0),
two chunks hide each round's product beside the other chunk's transfer (``LinkModel.best_chunks``: 11-25 % on
NVLink at 64-256 MiB, 2 % on PCIe); an eager call on CUDA sends one (``cerar.ring.rounds.CUDA_PIPELINE_MAX_CHUNKS``)."""

EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"


@dataclass(frozen=True)
class GraphKey:
    """What makes two calls one graph: agreed across ranks (``fields``) or fixed by the program (the rest)."""

    fields: tuple
    op: str
    storage: str
    group: int
    device: str


class CapturePlan:
    """Per key: ``warmup`` eager calls, then one capture, then replays; at most ``max_graphs`` keys
    captured, later new keys eager for good. ``next(key)`` says what this call of ``key`` does; it
    depends on the sequence of keys alone, so ranks making the same calls decide alike."""

    def __init__(self, warmup: int = DEFAULT_WARMUP_CALLS, max_graphs: int = DEFAULT_MAX_GRAPHS):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(
                f"warmup must be an int >= 1 (eager calls before a capture; the first connects NCCL), got {warmup!r}"
            )
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 0:
            raise ValueError(f"max_graphs must be an int >= 0, got {max_graphs!r}")
        self.warmup, self.max_graphs = warmup, max_graphs
        self.calls: dict[GraphKey, int] = {}
        self.captured: set[GraphKey] = set()

    def next(self, key: GraphKey) -> str:
        seen = self.calls.get(key, 0)
        self.calls[key] = seen + 1
        if key in self.captured:
            return REPLAY
        if seen < self.warmup or len(self.captured) >= self.max_graphs:
            return EAGER
        self.captured.add(key)
        return CAPTURE


class CudaGraphs:
    """torch's CUDA graphs. Captures run on a side stream of their own per device, in thread-local mode
    (another thread's CUDA calls, the watchdog's event queries or the training loop's, do not break it); the
    side stream first waits for the current one, and the current one then waits for it. Unlike
    ``torch.cuda.graph`` nothing synchronises the device. ``eager`` runs a warm-up call on the same side stream,
    so that the per-stream state the capture needs (cuBLAS's handle and workspace) exists before it."""

    def __init__(self):
        self.streams: dict[str, torch.cuda.Stream] = {}

    def _on_side(self, fn, device: torch.device, capture=None):
        side = self.streams.get(str(device))
        if side is None:
            side = self.streams[str(device)] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            if capture is None:
                result = fn()
            else:
                capture.capture_begin(capture_error_mode="thread_local")
                try:
                    fn()
                finally:
                    capture.capture_end()
                result = capture
        current.wait_stream(side)
        return result

    def eager(self, fn, device: torch.device):
        return self._on_side(fn, device)

    def capture(self, fn, device: torch.device):
        return self._on_side(fn, device, torch.cuda.CUDAGraph())

    def replay(self, graph) -> None:
        graph.replay()

    def completion(self, queue, device: torch.device):  # noqa: ARG002  CUDA orders on the current stream
        """A callable that says whether everything issued so far on the current stream has run."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event.query


class HostGraphs:
    """The stand-in for CUDA graphs on a CPU (tests): "capturing" keeps the host function, a replay
    calls it; completion is a no-op issued on the call's device queue (in order after its work)."""

    def eager(self, fn, device: torch.device):  # noqa: ARG002
        return fn()

    def capture(self, fn, device: torch.device):  # noqa: ARG002
        return fn

    def replay(self, graph) -> None:
        graph()

    def completion(self, queue, device: torch.device):  # noqa: ARG002
        return queue.submit(lambda: None).done


@dataclass
class _Captured:
    graph: object
    static: torch.Tensor  # the graph's own d values, flat: the caller's are copied in and out
    workspace: torch.Tensor
    bytes_sent: int
    bytes_received: int
    rounds: int


class GraphedAllReduce:
    """``cerar.all_reduce`` through CUDA graphs where a call's shapes repeat (module docstring). Call it as
    ``cerar.all_reduce`` (no timers: a graph has none; ``chunks`` default ``GRAPH_PIPELINE_MAX_CHUNKS``, every
    call of a key, its eager ones too). ``backend``: ``CudaGraphs()`` for CUDA tensors (default),
    ``HostGraphs()`` to run the plan on a CPU (tests); None on a CPU: every call eager, ``cerar.all_reduce``'s."""

    def __init__(self, warmup: int = DEFAULT_WARMUP_CALLS, max_graphs: int = DEFAULT_MAX_GRAPHS, backend=None):
        self.plan = CapturePlan(warmup, max_graphs)
        self.backend = backend
        self.graphs: dict[GraphKey, _Captured] = {}
        self.steps: list[str] = []  # what each call did, in order (for the checks and the benchmark)

    def __call__(self, tensor: torch.Tensor, code: Code, group=None, op: str = "sum", timeout=None,
                 storage: str = DEFAULT_STORAGE, *, transport=None, chunks=None) -> AllReduceStats:  # fmt: skip
        operation = "cerar.GraphedAllReduce"
        check_coded_call(tensor, code, op, storage, operation, transport)
        check_chunks(chunks, operation)
        backend = self.backend or (CudaGraphs() if tensor.device.type == "cuda" else None)
        if chunks is None:
            chunks = default_pipeline_chunks(tensor.device) if backend is None else GRAPH_PIPELINE_MAX_CHUNKS
        eager = dict(timed=False, transport=transport, chunks=chunks)
        ring = _Ring.of(group, timeout, operation)
        # a graph holds device work only: a host-waited contract (gloo) has rounds the host must wait for
        if backend is None or code.N == 1 or tensor.numel() == 0 or not ring.contract.stream_ordered:
            self.steps.append(EAGER)
            return all_reduce(tensor, code, group, op, timeout, storage, **eager)
        check_group_size(ring, code, operation)
        key = GraphKey(
            tuple(coded_call_fields(code, tensor, transport, chunks).items()),
            op,
            storage,
            id(ring.group),
            str(tensor.device),
        )
        step = self.plan.next(key)
        self.steps.append(step)
        if step == EAGER:  # on the stream the capture will use
            return backend.eager(lambda: all_reduce(tensor, code, group, op, timeout, storage, **eager), tensor.device)
        if step == CAPTURE:
            self.graphs[key] = self._capture(backend, ring, tensor, code, op, storage, transport, chunks)
        return self._replay(backend, ring, self.graphs[key], tensor)

    def _capture(self, backend, ring: _Ring, tensor, code: Code, op, storage, transport, chunks) -> _Captured:
        """Capture one call on a flat buffer of the graph's own (allocated before the capture, so that it
        outlives it), under the ring's contract without host polls; nothing runs until the replay."""
        check_no_tf32_override(tensor.device)
        _cached_device_matrices(code, ring.rank, tensor.dtype, tensor.device)  # made outside the capture,
        injection_row(tensor.dtype, tensor.device)  # where a copy to the device may synchronise
        captured_ring = dataclasses.replace(
            ring, contract=dataclasses.replace(ring.contract, host_polls=False, name=f"{ring.contract.name}, captured")
        )
        d = tensor.numel()
        static = torch.empty(d, dtype=tensor.dtype, device=tensor.device)
        needed = CodedRingRank.workspace_numel(d, code.c, code.m_for(d), code.N, code.L, storage)
        workspace = torch.empty(needed, dtype=tensor.dtype, device=tensor.device)
        wire, timer = wire_for(transport), PhaseTimer(tensor.device, enabled=False)

        def call():  # issued, not finished: the replay's completion bounds it (``_replay``)
            with torch.no_grad(), full_fp32_products(tensor.device):
                coded_rounds(captured_ring, code, static, timer, storage, wire, chunks, workspace, op)

        graph = backend.capture(call, tensor.device)
        m = code.m_for(d)  # every replay moves what one eager call does: L blocks of m per rank, in its chunks
        sent = message_bytes(code.L * m, code.L * len(pipeline_chunks(m, chunks)), transport)
        return _Captured(graph, static, workspace, sent, sent, code.L)

    def _replay(self, backend, ring: _Ring, entry: _Captured, tensor) -> AllReduceStats:
        """Copy in, replay, copy out (any shape and strides: the graph sees d values); then poll an event
        after them until the call is done or its deadline has passed."""
        queue, static = ring.contract.device_queue, entry.static.view(tensor.shape)
        queue.submit(static.copy_, tensor)
        backend.replay(entry.graph)
        queue.submit(tensor.copy_, static)
        done = backend.completion(queue, tensor.device)
        deadline = time.monotonic() + ring.timeout.total_seconds()
        pause = _FIRST_POLL_PAUSE
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ring._failure(
                    f"the captured call ({entry.rounds} rounds, replayed from a graph): receive and send", ring.peers
                )
            time.sleep(min(pause, left))
            pause = min(2 * pause, _LAST_POLL_PAUSE)
        return AllReduceStats(
            bytes_sent=entry.bytes_sent,
            bytes_received=entry.bytes_received,
            rounds=entry.rounds,
            peak_extra_bytes=_bytes(entry.static, entry.workspace),
        )
