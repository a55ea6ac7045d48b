"""Gradient aggregators: how the replicas' gradients become one averaged gradient.

Every aggregator offers the two modes of the loop:
- `aggregate(flat)`: average one flat gradient tensor in place across ranks (overlap=false, the
  paper's measurement: a separate, timed aggregation phase after backward);
- `register_hook(ddp)`: do the same as a DDP communication hook (overlap=true), overlapping with
  backward. `bytes_sent_by_hook()` then reports what the last step's hooks sent.

`nccl` is torch.distributed.all_reduce on the job's backend (gloo on CPU, NCCL on GPU); `ring` and
`cerar` go through the cerar library's public API only, with their messages on a process group of
their own (made when the aggregator is built, on every rank); `powersgd`, `fp16` and `bf16` are the hooks
torch ships (fp16/bf16 are also implemented on the flat gradient for overlap=false). `hier_cerar` and
`hier_ring` are the two-tier aggregators of `cerar.hierarchical` (exact inside each node; CERAR with a code
for the nodes, or the exact ring, between them), on process groups of their own per tier. `int8` and
`hier_int8` are the 8-bit all-reduce of `cerar.int8.all_reduce` (flat, and between the nodes of the two tiers);
`int4` and `hier_int4` the 4-bit one of `cerar.int4` (flat, and between the nodes with 8 bits inside them).

`ring`, `cerar`, `hier_cerar` and `hier_ring` take `aggregator.transport` (float32, float16, bfloat16): the
dtype their messages travel in (`cerar.formats.wire`: 16-bit messages, float32 arithmetic); `hier_fp16` and `hier_bf16`
are `hier_ring` with 16-bit transport, the 16-bit exact hierarchy (docs/cerar-16bit.md).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from train.distributed import await_work

log = logging.getLogger(__name__)


def ring_allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce (reduce-scatter + all-gather): 2(N-1)/N * d."""
    return int(2 * (world_size - 1) * numel * element_size // world_size) if world_size > 1 else 0


class Aggregator:
    """Average gradients across the ranks of the default process group."""

    name = "base"
    supports_flat = True
    # True where ranks may receive different aggregates from the next call on (approximate aggregation); it may change
    # during a run (c=auto's switch, aggregator=auto's choice): the loop reads it after every call
    replicas_differ = False

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size = world_size
        self.timeout_s = timeout_s

    @property
    def timeout(self) -> timedelta:
        """The collective timeout as the cerar calls and hooks take it."""
        return timedelta(seconds=self.timeout_s)

    tensor_sizes: list[int] | None = None
    """The parameter tensors' sizes in flat-gradient order (`use_tensors`); None: the gradient is one tensor."""

    def use_tensors(self, sizes) -> None:
        """Tell the aggregator the parameter tensors' sizes, in flat-gradient order (they sum to d; the trainer calls
        it once, before the first step). Aggregators that scale per tensor (`tensor_scales`) scale each of these
        segments by its own factor; the others ignore it. Not told, an aggregator treats the gradient as one tensor."""
        from cerar.ring.equilibrate import check_sizes

        self.tensor_sizes = check_sizes(sizes, sum(int(s) for s in sizes), f"aggregator={self.name}: use_tensors")

    def tensor_scales(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The per-tensor power-of-two scales (one per tensor of `use_tensors`) this aggregator would use for `flat`:
        a collective (every rank calls; the scales are agreed across ranks). None: it does not scale."""
        return None

    def segments(self, flat: torch.Tensor) -> list[int]:
        """The tensor sizes that tile `flat` (one segment when not told); a ValueError naming the mismatch."""
        if self.tensor_sizes is None:
            return [flat.numel()]
        if sum(self.tensor_sizes) != flat.numel():
            raise ValueError(
                f"aggregator={self.name}: the {len(self.tensor_sizes)} tensors of use_tensors hold "
                f"{sum(self.tensor_sizes)} values but the gradient holds {flat.numel()}"
            )
        return self.tensor_sizes

    def keeping_zero_tensors(self, flat: torch.Tensor, run, group):
        """(run()'s result, bytes sent to agree) for a coded call that is not equilibrated: every parameter tensor
        that is zero on every rank (an unused parameter's) comes back as exact zeros, its exact mean, where the
        code's mixing would leak its column-mates' values into it (3e-4 to 6e-4 at N=4, c=5: a step Adam takes in
        full). Agreed by one all-reduce of T largest magnitudes (MAX, float32: 2 (N-1)/N x 4 T bytes; 0 exactly
        where a tensor is zero on every rank), then one multiply per tensor by 1 or 0 after the call. (Equilibrated
        calls get the same from their scales' statistics, at no cost: `cerar.ring.equilibrate.equilibrated`.)
        One tensor, or none told: nothing to keep (a gradient zero everywhere codes to zero). A call on values the
        told tensors do not tile (aggregator=auto's sample of the gradient, whose caller zeroes those tensors' values
        itself, `TensorLayout.zero`) runs as it is."""
        if self.tensor_sizes is None or len(self.tensor_sizes) < 2 or sum(self.tensor_sizes) != flat.numel():
            return run(), 0
        from cerar.ring.equilibrate import agreed_statistics, restore_zero_segments, scales_bytes

        sizes = self.segments(flat)
        operation = f"aggregator={self.name}: tensors zero on every rank"
        stats, N = agreed_statistics(flat, sizes, group, self.timeout, "cast", operation=operation)
        result = run()
        restore_zero_segments(flat, sizes, stats)
        return result, scales_bytes(len(sizes), N, "cast")

    def check_scales(self, flat: torch.Tensor, scales: torch.Tensor | None) -> None:
        """`scales`, when given, must hold one value per position of `flat`; a ValueError naming the mismatch."""
        if scales is not None and (not isinstance(scales, torch.Tensor) or scales.numel() != flat.numel()):
            got = scales.numel() if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise ValueError(
                f"aggregator={self.name}: scales must be a tensor of one scale per value of the gradient "
                f"({flat.numel()}), got {got}"
            )

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        """Average `flat` across ranks in place; return the bytes this rank sent. `scales` (one per value of `flat`:
        the scale of each value's tensor, as `tensor_scales` gives them per tensor) replaces the scales the
        aggregator would agree on for `flat` itself, so that a sample of the gradient gets the arithmetic the
        whole gradient gets at those positions; aggregators that do not scale ignore it."""
        raise NotImplementedError

    def register_hook(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Install this aggregation as ddp's communication hook (default: DDP's own all-reduce)."""

    def bytes_sent_by_hook(self, numel: int) -> int:
        """Bytes sent during the last overlapped step."""
        return ring_allreduce_bytes(numel, 4, self.world_size)

    def step_metrics(self) -> dict:
        """Extra fields for the step's record (the hierarchical aggregators' bytes per tier)."""
        return {}

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of the aggregator's own decisions (aggregator=auto's); None: nothing."""
        return None

    def load_state_dict(self, state: dict) -> None:
        raise ValueError(f"aggregator={self.name} keeps no state, but the checkpoint holds some for it")

    feedback = None
    """This rank's error feedback, where the aggregator feeds roundings back: `cerar.int4.feedback.ErrorFeedback` for
    the flat gradient, or its hook's `BucketFeedback` (trainer.overlap=true: one per DDP bucket)."""

    def rank_state(self) -> dict | None:
        """What a checkpoint keeps of this rank's own state (each rank's, gathered): the error feedback's residuals;
        None: nothing."""
        return None if self.feedback is None else {"error_feedback": self.feedback.state_dict()}

    def load_rank_state(self, state: dict | None) -> None:
        """Restore ``rank_state``'s (None: nothing kept, as before error feedback); a ValueError naming the mismatch
        when the checkpoint and this aggregator disagree on keeping it."""
        if (state is None) != (self.feedback is None):
            kept = "keeps" if state is not None else "does not keep"
            raise ValueError(f"aggregator={self.name}: the checkpoint {kept} error feedback's residuals; this run "
                             f"{'does not feed back' if self.feedback is None else 'feeds back'}")  # fmt: skip
        if state is not None:
            self.feedback.load_state_dict(state["error_feedback"])


class AllReduceAggregator(Aggregator):
    """torch.distributed.all_reduce, then divide by N; hook mode is DDP's built-in reduction."""

    name = "nccl"

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        self.check_scales(flat, scales)
        if self.world_size > 1:
            await_work(dist.all_reduce(flat, async_op=True), self.timeout_s)  # the trainer's deadline, on NCCL too
            flat.div_(self.world_size)
        return ring_allreduce_bytes(flat.numel(), flat.element_size(), self.world_size)


class LowPrecisionAllReduce(Aggregator):
    """The backend's all-reduce in float16/bfloat16: half the bytes of the float32 all-reduce.

    Each parameter tensor (`use_tensors`; not told: the whole gradient) is multiplied by its own power of two
    before the cast, agreed across ranks by one all-reduce of T largest magnitudes (`cerar.ring.equilibrate`, rule
    "cast"): its largest value lies in [2^(14-b), 2^(15-b)), b = ceil(log2 N), so the sum of the N contributions
    stays below 2^15 (half of fp16's 65504) and a tensor near 1e-7 keeps fp16's full precision instead of
    underflowing (the issue: 0.67 of its own norm, cast unscaled at N=4). Each value of the mean is then within
    N u sum_j |g_j| of the exact one (u = 2^-11, 2^-8 for bf16), whatever its tensor's size. In the flat path on
    the default group, the waits within the trainer's deadline; as a DDP hook (`cerar.ddp.cast16_hook`), the same
    arithmetic per bucket, its tensors scaled apart, on a thread and a group of its own."""

    def __init__(self, world_size: int, timeout_s: float, dtype: torch.dtype):
        super().__init__(world_size, timeout_s)
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        self.hook_state = None

    def tensor_scales(self, flat: torch.Tensor) -> torch.Tensor | None:
        if self.world_size < 2:
            return None
        from cerar.ring.equilibrate import agreed_scales

        operation = f"aggregator={self.name}: per-tensor scales"
        return agreed_scales(flat, self.segments(flat), None, self.timeout, "cast", operation=operation)

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        self.check_scales(flat, scales)
        if self.world_size < 2:
            return 0
        from cerar.ring.equilibrate import cast_all_reduce

        sizes = [flat.numel()] if scales is not None else self.segments(flat)
        stats = cast_all_reduce(flat, self.dtype, sizes, None, "avg", self.timeout, scales=scales)
        return int(stats.bytes_sent)

    def register_hook(self, ddp) -> None:
        from cerar.ddp import Cast16HookState, cast16_hook

        self.hook_state = Cast16HookState(timeout=self.timeout, dtype=str(self.dtype).replace("torch.", ""))
        ddp.register_comm_hook(self.hook_state, cast16_hook)

    def bytes_sent_by_hook(self, numel: int) -> int:
        """The last step's buckets' bytes (the 16-bit all-reduces and their scales'), from the hook's record."""
        if self.hook_state is None:
            return ring_allreduce_bytes(numel, 2, self.world_size)
        stats = list(self.hook_state.last_stats)
        self.hook_state.reset_stats()
        return sum(int(s.bytes_sent) for s in stats)


class PowerSGDAggregator(Aggregator):
    """torch's PowerSGD hook (low-rank compression with error feedback); hook mode only."""

    name = "powersgd"
    supports_flat = False

    def __init__(self, world_size: int, timeout_s: float, rank: int, start_iter: int):
        super().__init__(world_size, timeout_s)
        self.rank, self.start_iter = rank, start_iter
        self.shapes: list[torch.Size] = []
        self.state = None

    def register_hook(self, ddp) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self.shapes = [p.shape for p in ddp.module.parameters() if p.requires_grad]
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=self.rank, start_powerSGD_iter=self.start_iter
        )
        ddp.register_comm_hook(self.state, powerSGD_hook.powerSGD_hook)

    def bytes_sent_by_hook(self, numel: int) -> int:
        """Estimate: before start_iter a plain all-reduce; after, P and Q factors for matrices."""
        if self.state is None or self.state.iter <= self.start_iter:
            return ring_allreduce_bytes(numel, 4, self.world_size)
        compressed = 0
        for shape in self.shapes:
            if len(shape) >= 2:
                n, m = shape[0], int(torch.Size(shape[1:]).numel())
                compressed += (n + m) * min(self.rank, n, m)
            else:
                compressed += int(shape.numel())
        return ring_allreduce_bytes(compressed, 4, self.world_size)

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        self.check_scales(flat, scales)
        raise RuntimeError("powersgd runs as a DDP communication hook only (trainer.overlap=true)")


class HookStatsBytes:
    """Aggregators whose DDP hook (cerar's) keeps each bucket's stats in `hook_state.last_stats`: the last step's
    bytes are read from them, and the record is cleared for the next step."""

    hook_state = None

    def take_hook_stats(self) -> list | None:
        """The stats of the buckets since the last call (None without a hook), cleared."""
        if self.hook_state is None:
            return None
        stats = list(self.hook_state.last_stats)
        self.hook_state.reset_stats()
        return stats

    def bytes_sent_by_hook(self, numel: int) -> int:
        stats = self.take_hook_stats()
        return 0 if stats is None else sum(int(s.bytes_sent) for s in stats)


class TwoTierBytes(HookStatsBytes):
    """What the two-tier aggregators report: the bytes each tier sent in the last step (`step_metrics`), from the
    calls' stats in flat mode or from their hook's (`bytes_sent_by_hook`)."""

    tier_bytes: dict

    def bytes_sent_by_hook(self, numel: int) -> int:
        stats = self.take_hook_stats()
        if stats is None:
            return 0
        self.tier_bytes = {
            "intra_node": sum(s.intra_node.bytes_sent for s in stats),
            "inter_node": sum(s.inter_node.bytes_sent for s in stats),
        }
        return sum(self.tier_bytes.values())

    def step_metrics(self) -> dict:
        return {f"bytes_sent/{tier}": sent for tier, sent in self.tier_bytes.items()}


class CerarAggregator(HookStatsBytes, Aggregator):
    """CERAR (or, with exact_ring, cerar's exact ring) through the cerar public API.

    equilibrate (aggregator.equilibrate, default true): each parameter tensor (`use_tensors`) is scaled by a power
    of two agreed across ranks (one all-reduce of T sums of squares: `cerar.ring.equilibrate`, rule "rms") so that every
    tensor's root mean square is near 1, coded, and unscaled after the decoding: CERAR mixes the c components of a
    column, so without it a tensor 100x smaller than its column-mates takes an error 100x its own share (the issue:
    0.61 of its own norm at N=4, c=5 over fp16 messages). The exact ring (aggregator=ring, or c=auto while exact)
    mixes nothing and is not scaled; `tensor_scales` still gives c=auto the scales its codes will use."""

    def __init__(
        self,
        world_size: int,
        timeout_s: float,
        c: int,
        construction: str,
        eps: float | None,
        kappa_max: float | None,
        exact_ring: bool,
        transport: str = "float32",
        group=None,
        equilibrate: bool = True,
    ):
        super().__init__(world_size, timeout_s)
        import cerar

        self.cerar = cerar
        self.c, self.construction, self.eps, self.kappa_max = c, construction, eps, kappa_max
        self.exact_ring = exact_ring
        self.transport = (
            transport  # the wire dtype (cerar.formats.wire); the exact ring on 16 bits: the same bits everywhere
        )
        self.replicas_differ = not exact_ring  # every rank but N-1 its own approximation (c=auto: from its choice on)
        self.equilibrate = bool(equilibrate) and not exact_ring  # aggregator=ring never codes: nothing to scale
        self.name = ("ring" if exact_ring else f"cerar-{construction}") + _transport_suffix(transport)
        self.code = None
        if not exact_ring and world_size > 1:
            self.code = cerar.make_code(world_size, c, construction=construction, eps=eps, kappa_max=kappa_max)
            if transport != "float32":
                from cerar.formats.wire import transport_dtype
                from cerar.ring.precision import check_admissible

                check_admissible(self.code, torch.float32, transport_dtype(transport), f"transport={transport}")
        self.hook_state = None
        self.group = group  # CERAR's own group (given, or made here): its batches never mix with the loop's
        if group is None and world_size > 1 and dist.is_initialized():
            from cerar.ddp import transport_group

            self.group = transport_group(None, self.timeout)

    def use_code(self, code) -> None:
        """Aggregate with `code` from the next call on (c=auto's switch; every rank switches at the same step).
        An exact code aggregates by the exact ring instead: the same bytes, and the same bits on every rank, so
        the replicas stay identical until c=auto chooses an approximate code."""
        self.code, self.c, self.exact_ring = code, code.c, code.is_exact
        self.replicas_differ = not code.is_exact

    def scales_tensors(self) -> bool:
        """Whether this aggregator equilibrates: asked to, and told of more than one tensor."""
        return self.equilibrate and self.world_size > 1 and self.tensor_sizes is not None and len(self.tensor_sizes) > 1

    def tensor_scales(self, flat: torch.Tensor) -> torch.Tensor | None:
        if not self.scales_tensors():
            return None
        from cerar.ring.equilibrate import agreed_scales

        operation = f"aggregator={self.name}: equilibrate"
        return agreed_scales(flat, self.segments(flat), self.group, self.timeout, "rms", operation=operation)

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        self.check_scales(flat, scales)
        if self.world_size < 2:
            return 0
        if self.exact_ring:
            stats = self.cerar.ring_all_reduce(
                flat, self.group, op="avg", timeout=self.timeout, transport=self.transport
            )
            return int(stats.bytes_sent)

        def run():
            return self.cerar.all_reduce(
                flat, self.code, self.group, op="avg", timeout=self.timeout, transport=self.transport
            )

        if scales is None and not self.scales_tensors():  # not equilibrated: the zero tensors kept apart
            stats, agreed = self.keeping_zero_tensors(flat, run, self.group)
            return int(stats.bytes_sent) + agreed
        if not self.equilibrate:  # a sample's call (scales given): its caller keeps the zero tensors
            return int(run().bytes_sent)
        from cerar.ring.equilibrate import equilibrated

        sizes = [flat.numel()] if scales is not None else self.segments(flat)
        operation = f"aggregator={self.name}: equilibrate"
        stats, agreed = equilibrated(flat, sizes, run, self.group, self.timeout, scales=scales, operation=operation)
        return int(stats.bytes_sent) + agreed

    def register_hook(self, ddp) -> None:
        from cerar.ddp import CerarHookState, cerar_hook

        self.hook_state = CerarHookState(
            process_group=None,
            construction=self.construction,
            c=self.c,
            eps=self.eps,
            kappa_max=self.kappa_max,
            exact_ring=self.exact_ring,
            timeout=self.timeout,
            transport=self.group,
            transport_dtype=self.transport,
            equilibrate=self.equilibrate,
        )
        ddp.register_comm_hook(self.hook_state, cerar_hook)


class HierarchicalAggregator(TwoTierBytes, Aggregator):
    """Two tiers (`cerar.hierarchical`): exact reduce-scatter and all-gather inside each node and, between
    the nodes, CERAR with a code for n = nodes (or, with exact_ring, the exact ring: the baseline).

    Every rank of a node receives the same average; under CERAR node i receives what worker i of the
    code does, so the last node's ranks, rank N-1 among them (torchrun numbers ranks node-major), receive
    the exact one under the closed-form constructions: the loop's reference replica stays rank N-1.
    `step_metrics` reports the bytes each tier sent in the last step."""

    def __init__(
        self,
        world_size: int,
        timeout_s: float,
        layout,
        c: int,
        construction: str,
        eps: float | None,
        kappa_max: float | None,
        exact_ring: bool,
        coded_on_two_nodes: bool,
        transport: str = "float32",
        describe: bool = True,
        equilibrate: bool = True,
    ):
        super().__init__(world_size, timeout_s)
        import warnings

        import cerar
        from cerar import hierarchical

        self.hierarchical, self.layout = hierarchical, layout
        self.c, self.construction, self.eps, self.kappa_max = c, construction, eps, kappa_max
        self.coded_on_two_nodes = coded_on_two_nodes
        self.transport = transport  # both tiers' wire dtype (cerar.formats.wire)
        self.name = ("hier_ring" if exact_ring else f"hier_cerar-{construction}") + _transport_suffix(transport)
        self.method = hierarchical.method_between_nodes(layout.nodes, not exact_ring, coded_on_two_nodes)
        self.code = None
        if self.method == "cerar":
            self.code = cerar.make_code(layout.nodes, c, construction=construction, eps=eps, kappa_max=kappa_max)
            if transport != "float32":
                cerar.ring.precision.check_admissible(
                    self.code, torch.float32, cerar.formats.wire.transport_dtype(transport), f"transport={transport}"
                )
        self.replicas_differ = self.code is not None and not self.code.is_exact
        self.equilibrate = bool(equilibrate) and self.code is not None  # only a code between the nodes mixes
        self.tier_bytes = {"intra_node": 0, "inter_node": 0}
        self.hook_state = None
        self.groups = None  # the tiers' own groups: their batches never mix with the loop's collectives
        if world_size > 1 and dist.is_initialized():
            self.groups = hierarchical.tier_groups(layout, self.timeout)
        if describe:
            self._describe(exact_ring)
        warnings.filterwarnings("ignore", category=hierarchical.HierarchicalWarning)  # _describe said it once

    def _describe(self, exact_ring: bool) -> None:
        """The layout, what runs between the nodes and why, on rank 0's console."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        n, where = self.layout.nodes, "LOCAL_WORLD_SIZE" if self.layout.from_launcher else "aggregator.local_size"
        log.info("%s: %s (local size from %s); between the nodes: %s", self.name, self.layout, where, self.method)
        if self.code is not None:
            log.info(
                "%s: code for n=%d nodes, c=%d: %d rounds, %.4f d per node between nodes (the exact ring: %.4f d), "
                "kappa %.3g, predicted error %.3g; the last node's ranks are exact%s",
                self.name,
                n,
                self.c,
                self.code.L,
                self.code.comm_rate,
                self.code.ring_rate,
                self.code.kappa,
                self.code.predicted_error(),
                "" if self.transport == "float32" else f" up to the rounding of {self.transport} messages",
            )
        elif not exact_ring and n == 2:
            log.warning(
                "%s on 2 nodes: CERAR would send as many bytes between the nodes as the exact ring (d per node "
                "either way) and add its error, so the exact ring runs between them "
                "(aggregator.coded_on_two_nodes=true runs the code anyway)",
                self.name,
            )
        elif not exact_ring and n == 1:
            log.warning("%s on one node (%s): aggregation is exact, nothing is coded", self.name, self.layout)

    def scales_tensors(self) -> bool:
        """Whether this aggregator equilibrates (as CerarAggregator's): a code between the nodes, asked to, and
        told of more than one tensor. The scales are agreed over every rank, so the tiers sum like with like."""
        return self.equilibrate and self.world_size > 1 and self.tensor_sizes is not None and len(self.tensor_sizes) > 1

    def tensor_scales(self, flat: torch.Tensor) -> torch.Tensor | None:
        if not self.scales_tensors():
            return None
        from cerar.ring.equilibrate import agreed_scales

        operation = f"aggregator={self.name}: equilibrate"
        return agreed_scales(flat, self.segments(flat), self.groups.all_ranks, self.timeout, "rms",
                             operation=operation)  # fmt: skip

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        self.check_scales(flat, scales)
        if self.world_size < 2:
            return 0
        if self.code is None:
            stats = self.hierarchical.hierarchical_ring_all_reduce(
                flat, self.groups, op="avg", timeout=self.timeout, transport=self.transport
            )
            agreed = 0
        else:

            def run():
                return self.hierarchical.hierarchical_all_reduce(
                    flat,
                    self.code,
                    self.groups,
                    op="avg",
                    timeout=self.timeout,
                    coded_on_two_nodes=True,
                    transport=self.transport,
                )

            if scales is None and not self.scales_tensors():  # not equilibrated: the zero tensors kept apart
                stats, agreed = self.keeping_zero_tensors(flat, run, self.groups.all_ranks)
            elif not self.equilibrate:  # a sample's call (scales given): its caller keeps the zero tensors
                stats, agreed = run(), 0
            else:
                from cerar.ring.equilibrate import equilibrated

                sizes = [flat.numel()] if scales is not None else self.segments(flat)
                operation = f"aggregator={self.name}: equilibrate"
                stats, agreed = equilibrated(flat, sizes, run, self.groups.all_ranks, self.timeout, scales=scales,
                                             operation=operation)  # fmt: skip
        # the scales' all-reduce spans every rank: counted with the bytes between the nodes
        inter = stats.inter_node.bytes_sent + agreed
        self.tier_bytes = {"intra_node": stats.intra_node.bytes_sent, "inter_node": inter}
        return int(stats.bytes_sent) + agreed

    def register_hook(self, ddp) -> None:
        self.hook_state = self.hierarchical.HierarchicalHookState(
            construction=self.construction,
            c=self.c,
            eps=self.eps,
            kappa_max=self.kappa_max,
            exact_ring=self.code is None,
            timeout=self.timeout,
            layout=self.layout,
            coded_on_two_nodes=True,  # self.method already says what runs between the nodes
            transport_dtype=self.transport,
            equilibrate=self.equilibrate,
        )
        ddp.register_comm_hook(self.hook_state, self.hierarchical.hierarchical_hook)


def _error_feedback(on: bool):
    """A new `cerar.int4.feedback.ErrorFeedback` for this rank when `on` (aggregator.error_feedback), else None."""
    if not on:
        return None
    from cerar.int4.feedback import ErrorFeedback

    return ErrorFeedback()


def _transport_suffix(transport: str) -> str:
    """The aggregator name's mark of 16-bit messages: "" for float32, "-float16" / "-bfloat16"."""
    return "" if transport == "float32" else f"-{transport}"


# ------------------------------------------------------------------------------------------------
# The 8-bit all-reduce (cerar.int8.all_reduce, issue 25): aggregator=int8 and aggregator=hier_int8
# ------------------------------------------------------------------------------------------------


class QuantizedAggregator(HookStatsBytes, Aggregator):
    """`cerar.int8.all_reduce.quantized_all_reduce`: int8 messages with one float32 scale per `block` values, each
    contribution quantized once and summed in float32, the reduced shards quantized once and all-gathered.
    Every rank decodes the same bytes, so every rank receives the same average and the replicas stay
    identical (replicas_differ stays False: the loop checks that they do). On a process group of its own."""

    name = "int8"

    def __init__(self, world_size: int, timeout_s: float, block: int, group=None, error_feedback: bool = False):
        super().__init__(world_size, timeout_s)
        from cerar.int8 import all_reduce as quantized

        self.quantized, self.block = quantized, block
        self.feedback = _error_feedback(error_feedback)
        self.hook_state = None
        self.transport = group  # its own group (given, or made here): its batches never mix with the loop's
        if group is None and world_size > 1 and dist.is_initialized():
            from cerar.ddp import transport_group

            self.transport = transport_group(None, self.timeout)

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        self.check_scales(flat, scales)
        if self.world_size < 2:
            return 0
        stats = self.quantized.quantized_all_reduce(
            flat, self.transport, op="avg", timeout=self.timeout, block=self.block, feedback=self.feedback
        )
        return int(stats.bytes_sent)

    def register_hook(self, ddp) -> None:
        from cerar.int8.hook import QuantizedHookState, quantized_hook

        self.hook_state = QuantizedHookState(timeout=self.timeout, transport=self.transport, block=self.block,
                                             error_feedback=self.feedback is not None)  # fmt: skip
        self.feedback = self.hook_state.feedback  # overlap: the residuals per DDP bucket
        ddp.register_comm_hook(self.hook_state, quantized_hook)


class HierarchicalQuantizedAggregator(TwoTierBytes, Aggregator):
    """`cerar.int8.two_tier`: exact float32 reduce-scatter and all-gather inside each node, the 8-bit
    all-reduce on the rails between the nodes. Every rank receives the same average (the replicas stay
    identical). `step_metrics` reports the bytes each tier sent in the last step."""

    name = "hier_int8"

    def __init__(self, world_size: int, timeout_s: float, layout, block: int, describe: bool = True,
                 error_feedback: bool = False):  # fmt: skip
        super().__init__(world_size, timeout_s)
        from cerar.hierarchical import tier_groups
        from cerar.int8 import two_tier as quantized

        self.hierarchical_quantized, self.layout, self.block = quantized, layout, block
        self.feedback = _error_feedback(error_feedback)
        self.method = quantized.RAIL_METHOD if layout.nodes > 1 else "none"
        self.tier_bytes = {"intra_node": 0, "inter_node": 0}
        self.hook_state = None
        self.groups = None  # the tiers' own groups: their batches never mix with the loop's collectives
        if world_size > 1 and dist.is_initialized():
            self.groups = tier_groups(layout, self.timeout)
        if describe and (not dist.is_initialized() or dist.get_rank() == 0):
            where = "LOCAL_WORLD_SIZE" if layout.from_launcher else "aggregator.local_size"
            log.info("%s: %s (local size from %s); between the nodes: %s, block %d", self.name, layout, where,
                     self.method, block)  # fmt: skip

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        self.check_scales(flat, scales)
        if self.world_size < 2:
            return 0
        stats = self.hierarchical_quantized.hierarchical_quantized_all_reduce(
            flat, self.groups, op="avg", timeout=self.timeout, block=self.block, feedback=self.feedback
        )
        self.tier_bytes = {"intra_node": stats.intra_node.bytes_sent, "inter_node": stats.inter_node.bytes_sent}
        return int(stats.bytes_sent)

    def register_hook(self, ddp) -> None:
        from cerar.int8.hook import HierarchicalQuantizedHookState, hierarchical_quantized_hook

        self.hook_state = HierarchicalQuantizedHookState(timeout=self.timeout, layout=self.layout, block=self.block,
                                                         error_feedback=self.feedback is not None)  # fmt: skip
        self.feedback = self.hook_state.feedback  # overlap: the residuals per DDP bucket
        ddp.register_comm_hook(self.hook_state, hierarchical_quantized_hook)


# ------------------------------------------------------------------------------------------------
# The 4-bit all-reduce (cerar.int4, issue 54): aggregator=int4 and aggregator=hier_int4
# ------------------------------------------------------------------------------------------------


class Int4Aggregator(QuantizedAggregator):
    """`cerar.int4.all_reduce.int4_all_reduce`: int4 messages, two values a byte, one float32 scale per `block` values,
    each full block rotated first unless `rotate` is false; the 8-bit call's two shots, so every rank receives the
    same average and the replicas stay identical. On a process group of its own (made as int8's)."""

    name = "int4"

    def __init__(self, world_size: int, timeout_s: float, block: int, rotate: bool = True, seed: int = 0, group=None,
                 error_feedback: bool = False):  # fmt: skip
        super().__init__(world_size, timeout_s, block, group, error_feedback)
        from cerar.int4 import all_reduce

        self.int4, self.rotate, self.seed = all_reduce, rotate, seed

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        self.check_scales(flat, scales)
        if self.world_size < 2:
            return 0
        stats = self.int4.int4_all_reduce(flat, self.transport, op="avg", timeout=self.timeout, block=self.block,
                                          rotate=self.rotate, seed=self.seed, feedback=self.feedback)  # fmt: skip
        return int(stats.bytes_sent)

    def register_hook(self, ddp) -> None:
        from cerar.int4.hook import Int4HookState, int4_hook

        self.hook_state = Int4HookState(timeout=self.timeout, transport=self.transport, block=self.block,
                                        rotate=self.rotate, seed=self.seed,
                                        error_feedback=self.feedback is not None)  # fmt: skip
        self.feedback = self.hook_state.feedback  # overlap: the residuals per DDP bucket
        ddp.register_comm_hook(self.hook_state, int4_hook)


class HierarchicalInt4Aggregator(HierarchicalQuantizedAggregator):
    """`cerar.int4.two_tier`: the 8-bit (or exact) reduce-scatter inside each node, the 4-bit all-reduce on the rails
    between the nodes, the exact all-gather inside each node (the tiers' groups made as hier_int8's). Every rank
    receives the same average. `step_metrics` reports the bytes each tier sent in the last step."""

    name = "hier_int4"

    def __init__(self, world_size: int, timeout_s: float, layout, block: int, rotate: bool = True,
                 intra: str = "int8", seed: int = 0, describe: bool = True, error_feedback: bool = False):  # fmt: skip
        super().__init__(world_size, timeout_s, layout, block, describe=False, error_feedback=error_feedback)
        from cerar.int4 import two_tier

        self.two_tier, self.rotate, self.intra, self.seed = two_tier, rotate, intra, seed
        self.method = two_tier.RAIL_METHOD if layout.nodes > 1 else "none"
        if describe and (not dist.is_initialized() or dist.get_rank() == 0):
            where = "LOCAL_WORLD_SIZE" if layout.from_launcher else "aggregator.local_size"
            log.info("%s: %s (local size from %s); inside the nodes: %s; between the nodes: %s, block %d%s",
                     self.name, layout, where, intra, self.method, block, ", rotated" if rotate else "")  # fmt: skip

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        self.check_scales(flat, scales)
        if self.world_size < 2:
            return 0
        stats = self.two_tier.hierarchical_int4_all_reduce(
            flat, self.groups, op="avg", timeout=self.timeout, block=self.block, intra=self.intra,
            intra_block=self.block, rotate=self.rotate, seed=self.seed, feedback=self.feedback,
        )  # fmt: skip
        self.tier_bytes = {"intra_node": stats.intra_node.bytes_sent, "inter_node": stats.inter_node.bytes_sent}
        return int(stats.bytes_sent)

    def register_hook(self, ddp) -> None:
        from cerar.int4.hook import HierarchicalInt4HookState, hierarchical_int4_hook

        self.hook_state = HierarchicalInt4HookState(
            timeout=self.timeout, layout=self.layout, block=self.block, rotate=self.rotate, seed=self.seed,
            intra=self.intra, intra_block=self.block, error_feedback=self.feedback is not None,
        )  # fmt: skip
        self.feedback = self.hook_state.feedback  # overlap: the residuals per DDP bucket
        ddp.register_comm_hook(self.hook_state, hierarchical_int4_hook)
