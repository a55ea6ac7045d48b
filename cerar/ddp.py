"""CERAR as a DDP communication hook.

    state = CerarHookState(c=16)                      # construction, eps, kappa_max as in make_code
    ddp_model.register_comm_hook(state, cerar_hook)
    # DDP(model, bucket_cap_mb=default_bucket_cap_mb(N, 16)) for buckets sized for CERAR

Algorithm: each gradient bucket of d values is averaged with ``cerar.all_reduce`` over the ranks of
the DDP process group, with a code for N = world size and c components (built once and cached).
Each rank sends (1 + (N-2)/c) d values in c + N - 2 rounds instead of DDP's 2 (N-1)/N d; the price
is the code's approximation error, which differs between ranks and makes replicas drift apart
slowly (the last rank receives the exact average under the closed-form constructions): trainers
should measure the drift and re-synchronise parameters now and then. With ``exact_ring=True`` the
hook runs ``cerar.ring_all_reduce`` instead: the exact baseline on the same transport. With
``transport_dtype="float16"`` (or ``"bfloat16"``) the messages travel in 16 bits (``cerar.formats.wire``:
float32 arithmetic, each block cast with a power-of-two scale), and a code built here without an
explicit kappa_max gets the 16-bit default (``cerar.default_kappa_max``). With ``equilibrate=True``
each parameter tensor of the bucket (``bucket.gradients()``) is first scaled by a power of two agreed
across the ranks so that every tensor has about the same root mean square, and unscaled after the
decoding (``cerar.ring.equilibrate``): CERAR mixes the components of a column, so without it a tensor much
smaller than its bucket's others takes an error relative to theirs, not to its own.

A tensor of the bucket that is zero on every rank (a parameter whose gradient is exactly zero: a branch behind a
gate that starts at 0, an adapter's A while its B is 0) comes back as exact zeros, its exact mean, where the code's
mixing would leak its column-mates' values into it (6e-5 at N=4, c=8: a step Adam takes in full).
Equilibrated, the scales' statistics already say which ones (no extra cost). Without equilibration it costs, per
coded bucket of T >= 2 tensors, one all-reduce of the T largest magnitudes over the ranks (MAX, float32:
2 (N-1)/N x 4 T bytes, counted in ``last_stats``' bytes_sent), a pass over the bucket to take them and one
multiply per tensor by 1 or 0 after the decoding. No collective the hook already makes per bucket can carry them:
CERAR's rounds are point-to-point and mix every value they carry, and the call's agreement check is made once per
bucket length, not per bucket. The flags stay on the device (no ``.item()``): the hook's thread waits for the all-reduce
within the timeout before it posts the rounds, as for the scales (``cerar.ring.transport``: gloo ``Work.wait(timeout)``;
NCCL its completion polled, then ``Work.wait()``, which orders the hook's stream), and the multiply is queued on the
hook's stream after the decoding. The exact ring and a one-tensor bucket need none (a gradient zero everywhere
codes to zero).

``Cast16HookState`` / ``cast16_hook``: the 16-bit all-reduce (``cerar.ring.equilibrate.cast_all_reduce``), each
tensor of the bucket scaled by its own agreed power of two before the cast, in place of torch's
``fp16_compress_hook`` / ``bf16_compress_hook`` (which cast ``bucket / N`` with no scale: a tensor near
1e-7 underflows float16). It runs like the CERAR hook, on a thread and a process group of its own, every
wait within the timeout.

How it runs, so that communication overlaps the rest of backward:

- on a thread of its own, one bucket at a time in the order DDP hands them over (every rank gets
  them in the same order, which the rounds need);
- on a process group of its own (``transport_group``, made when the state is created: a collective
  call on every rank of the default group), so its point-to-point batches are never coalesced with,
  or ordered against, collectives other threads issue on DDP's group meanwhile;
- on CUDA, on a stream of its own: the hook records an event on the stream that produced the bucket
  and the hook's stream waits for it, so the reduction starts only once the gradients are written;
  the future carries the bucket's device and its result is set on the hook's stream, so DDP's
  reads of the result wait for that stream (torch's CUDA-aware futures), not for the host;
- the per-phase timers are off (on CUDA their read-out would synchronise once per bucket); the
  rounds' deadlines are kept on the hook's thread (``cerar.ring.transport``), never on backward's. On
  NCCL that thread enqueues a bucket's rounds on the hook's stream without waiting for them (the
  streams order round t+1 after round t) and polls one round's completion per look-behind window
  and the last one; a stalled peer raises ``CollectiveError`` there, which DDP surfaces from
  backward. The group is then unusable: abort it (``torch.distributed.distributed_c10d.
  _abort_process_group``) and end the process, as the trainer does.
"""

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from cerar.coding.codes import Code, make_code
from cerar.formats.wire import default_kappa_max, transport_name
from cerar.ring.equilibrate import (
    agreed_statistics,
    cast_all_reduce,
    equilibrated,
    restore_zero_segments,
    scales_bytes,
)
from cerar.ring.protocol import AllReduceStats, all_reduce, ring_all_reduce
from cerar.ring.transport import _as_timedelta

DDP_DEFAULT_BUCKET_CAP_MB = 25.0


def default_bucket_cap_mb(N: int, c: int) -> float:
    """A DDP bucket size (MiB) for CERAR with N ranks and c components: 25 MiB x c / N, at least 25.

    Why: DDP's default 25 MiB is sized for NCCL's ring all-reduce, whose steps carry d/N values; a
    CERAR round carries d/c values and there are c + N - 2 of them per bucket, each paying the
    link's latency once. Scaling the bucket by c/N keeps CERAR's messages as large as the ring's
    steps at DDP's default, so the per-round latency stays as small a share as it is for DDP;
    never below DDP's default, so c < N does not make buckets smaller (more calls, same bytes).
    """
    if N < 1 or c < 1:
        raise ValueError(f"N and c must be positive, got N={N}, c={c}")
    return max(DDP_DEFAULT_BUCKET_CAP_MB, DDP_DEFAULT_BUCKET_CAP_MB * c / N)


def transport_group(process_group: dist.ProcessGroup | None = None, timeout=None) -> dist.ProcessGroup:
    """A new process group over the ranks of ``process_group`` (default: all ranks) for CERAR's
    point-to-point traffic. A collective call: every rank of the default group must make it, in the
    same order. Its own timeout (NCCL's watchdog: past it torch aborts the communicator and, in its default
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, takes the process down) is three times CERAR's timeout T (at least
    a minute): CERAR's own deadline (per round on gloo, per look-behind round on NCCL) reports a stalled peer
    at T, a caller's host watchdog (train/watchdog.py) ends a host held inside a call at 2T, and torch's
    watchdog is the backstop after both."""
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    backstop = 3 * _as_timedelta(timeout)
    return dist.new_group(ranks=ranks, timeout=max(backstop, timedelta(seconds=60)))


@dataclass
class CerarHookState:
    """Configuration and per-step record of the CERAR DDP hook.

    process_group: DDP's group (whose ranks CERAR reduces over); transport: the group CERAR's
    messages travel on (made by ``transport_group`` when not given: creating a state is then a
    collective call on every rank); transport_dtype: the dtype on the wire ("float32", "float16",
    "bfloat16"; ``cerar.formats.wire``). equilibrate: scale each parameter tensor of a bucket to a common root mean
    square before CERAR and back after (``cerar.ring.equilibrate``; the exact ring needs none). Either way a coded
    bucket's tensors that are zero on every rank come back as zeros (module docstring). ``last_stats`` collects each
    bucket's AllReduceStats (the scales' all-reduce, or the zero flags', counted in bytes_sent).
    """

    process_group: dist.ProcessGroup | None = None
    construction: str = "perturbation"
    c: int = 16
    eps: float | None = None
    kappa_max: float | None = None
    exact_ring: bool = False
    timeout: float | timedelta | None = None
    transport: dist.ProcessGroup | None = None
    transport_dtype: str = "float32"
    equilibrate: bool = False
    last_stats: list[AllReduceStats] = field(default_factory=list)
    _codes: dict[int, Code] = field(default_factory=dict, repr=False)
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _streams: dict[torch.device, torch.cuda.Stream] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.transport_dtype = transport_name(self.transport_dtype)  # a ValueError naming the choices
        if not self.exact_ring:
            self.code_for(1)  # validate the arguments now, not inside backward
        _as_timedelta(self.timeout)
        if self.transport is None and dist.is_initialized():
            self.transport = transport_group(self.process_group, self.timeout)

    def code_for(self, bucket_numel: int) -> Code:
        """The code used for a bucket of this length (one code per length, cached)."""
        if bucket_numel not in self._codes:
            N = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
            self._codes[bucket_numel] = make_code(N, self.c, self.construction, eps=self.eps, kappa_max=self.budget)
        return self._codes[bucket_numel]

    @property
    def budget(self) -> float | None:
        """kappa_max for the codes: the one given, else (16-bit transport) ``cerar.default_kappa_max``'s."""
        if self.kappa_max is None and self.eps is None and self.transport_dtype != "float32":
            return default_kappa_max(self.transport_dtype)
        return self.kappa_max

    def reset_stats(self) -> None:
        with self._lock:
            self.last_stats = []

    def _reduce(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> AllReduceStats:
        """Average one bucket in place; ``sizes``: its parameter tensors' sizes, to equilibrate them or keep the
        ones zero on every rank at zero (``_coded``)."""
        group = self.transport if self.transport is not None else self.process_group
        if self.exact_ring:
            return ring_all_reduce(
                tensor, group, op="avg", timeout=self.timeout, timed=False, transport=self.transport_dtype
            )
        code = self.code_for(tensor.numel())

        def run() -> AllReduceStats:
            return all_reduce(
                tensor, code, group, op="avg", timeout=self.timeout, timed=False, transport=self.transport_dtype
            )

        stats, agreed = self._coded(tensor, sizes, run, group, "cerar_hook")
        stats.bytes_sent += agreed
        return stats

    def _coded(self, tensor: torch.Tensor, sizes: list[int] | None, run, group, hook: str):
        """(``run()``'s result, the bytes this rank sent to agree per tensor): ``run`` a coded call on the bucket in
        place, its tensors (``sizes``) equilibrated around it over ``group`` when ``self.equilibrate``, else those
        zero on every rank restored to zero after it, from the T largest magnitudes agreed over ``group``
        (``cerar.ring.equilibrate.agreed_statistics``, rule "cast"; module docstring). No sizes, or one tensor:
        ``run()`` as it is."""
        if not sizes or len(sizes) < 2:
            return run(), 0
        if self.equilibrate:
            return equilibrated(tensor, sizes, run, group, self.timeout, operation=f"{hook}: equilibrate")
        operation = f"{hook}: tensors zero on every rank"
        flags, N = agreed_statistics(tensor, sizes, group, self.timeout, "cast", operation=operation)
        result = run()
        restore_zero_segments(tensor, sizes, flags)
        return result, scales_bytes(len(sizes), N, "cast")

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def submit(self, tensor: torch.Tensor, sizes: list[int] | None = None, feedback=None) -> torch.futures.Future:
        """Average ``tensor`` in place on the hook's thread (and, on CUDA, the hook's stream, after
        the work now queued on the current stream); the future completes with it. ``sizes``: the
        bucket's parameter tensors' sizes (``bucket_sizes``), for the states that scale per tensor or keep
        its tensors that are zero on every rank at zero. ``feedback``: the bucket's error feedback
        (`cerar.int4.feedback.ErrorFeedback`), for the quantized states that feed their roundings back."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cerar-ddp-hook")
        if tensor.is_cuda:
            future: torch.futures.Future = torch.futures.Future(devices=[tensor.device])
            stream = self._stream(tensor.device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))  # the bucket's gradients are written
            tensor.record_stream(stream)  # the allocator must not reuse the bucket before the hook's stream is done
        else:
            future = torch.futures.Future()
            stream = ready = None

        def run():
            try:
                with contextlib.ExitStack() as scope:
                    if stream is not None:
                        scope.enter_context(torch.cuda.device(tensor.device))  # NCCL: the thread's GPU is the bucket's
                        scope.enter_context(torch.cuda.stream(stream))
                        stream.wait_event(ready)
                    args = () if sizes is None else (sizes,)
                    stats = self._reduce(tensor, *args, **({} if feedback is None else {"feedback": feedback}))
                    with self._lock:
                        self.last_stats.append(stats)
                    future.set_result(tensor)  # on CUDA: recorded on the hook's stream, which DDP then waits for
            except BaseException as error:  # surfaced to DDP through the future
                future.set_exception(error)

        self._executor.submit(run)
        return future


def bucket_sizes(bucket: dist.GradBucket) -> list[int]:
    """The sizes of the bucket's parameter tensors in buffer order (``bucket.gradients()`` are views of
    consecutive slices of ``bucket.buffer()``); a ValueError when they do not tile the buffer."""
    sizes = [g.numel() for g in bucket.gradients()]
    if sum(sizes) != bucket.buffer().numel():
        raise ValueError(
            f"DDP bucket {bucket.index()}: its {len(sizes)} gradients hold {sum(sizes)} values but its buffer "
            f"{bucket.buffer().numel()}: cannot scale per tensor"
        )
    return sizes


def cerar_hook(state: CerarHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket with CERAR (or the exact ring), its tensors
    equilibrated first when ``state.equilibrate``; coded, its tensors zero on every rank stay zero. (This module
    keeps its annotations evaluated: DDP checks that ``bucket`` is annotated as ``dist.GradBucket`` itself.)"""
    sizes = None if state.exact_ring else bucket_sizes(bucket)
    return state.submit(bucket.buffer(), sizes)


@dataclass
class Cast16HookState(CerarHookState):
    """Configuration and per-step record of the 16-bit hook (``cast16_hook``): ``dtype`` ("float16" or
    "bfloat16"), the timeout, DDP's process group and the group the all-reduces travel on (made when
    not given). ``last_stats`` collects each bucket's AllReduceStats (the scales' all-reduce included).
    The CERAR fields it inherits (c, construction, eps, kappa_max, exact_ring, transport_dtype,
    equilibrate) are not used: every bucket is scaled per tensor."""

    dtype: str = "float16"

    def __post_init__(self):
        self.dtype = transport_name(self.dtype)  # a ValueError naming the choices
        if self.dtype == "float32":
            raise ValueError("Cast16HookState: dtype must be float16 or bfloat16, got float32")
        _as_timedelta(self.timeout)
        if self.transport is None and dist.is_initialized():
            self.transport = transport_group(self.process_group, self.timeout)

    def _reduce(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> AllReduceStats:
        group = self.transport if self.transport is not None else self.process_group
        return cast_all_reduce(tensor, self.dtype, sizes, group, op="avg", timeout=self.timeout)


def cast16_hook(state: Cast16HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket in 16 bits, each of its tensors scaled by its own agreed
    power of two before the cast (``cerar.ring.equilibrate.cast_all_reduce``)."""
    return state.submit(bucket.buffer(), bucket_sizes(bucket))
