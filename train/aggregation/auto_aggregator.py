"""aggregator=auto, the aggregator: every candidate built, the links measured, the errors measured on the step's
own gradients, the choice applied (the decision itself: train/aggregation/auto_choice.py).

At start (`prepare`, every rank): the links are measured on the run's own groups (`measure_links`: cerar's exact
ring timed at sizes growing x4 until the bytes dominate, inside each node and on the rails, one rail alone beside
all at once for the NICs' sharing, and a timed add for the memory bandwidth; `cerar.planning.link_probe`), or taken from
`aggregator.auto_links`,
and every candidate is priced by the two-tier cost model (`cerar.planning.costmodel.TwoTierCluster.time`, the model the
lab fitted) for one call on the run's d values. A probe that fails, or declared links that miss a tier, leave
the run exact (`nccl`) with a one-line warning: a guess is not a measurement.

At a check (`check`, before the step's aggregation): the SGD noise of the averaged gradient (as c=auto measures
it) and, for every candidate to measure, its worst rank's error on a seeded sample of the step's gradient, run
through the candidate's real call: the sample keeps the values that the call mixes or scales together (CERAR's
columns, int8's blocks, each inside its node shard for the two-tier ones; `TensorSample`), so the call's
error on the sample is its error on those units of the gradient, estimated per tensor with its standard error.
The candidates whose float16 messages are scaled by their largest value (`Candidate.whole`) run on a copy of the
whole gradient instead: a sample's message lacks the whole message's largest value, and its scale with it (the
sample under-rated `hier_fp16` up to 2x on tensors of 1e-7 among tensors of 1e2, issue 51). Every rank's numbers are
all-gathered and every rank decides from the same ones (`AutoChoice.decide`). When the choice may move, the
shortlist it names (the fitting candidates the model predicts fastest, and the exact one) is timed by the real call
on a copy of the step's whole gradient (`time_calls`: one untimed call, then `auto_trial_calls` timed, the slowest
rank's mean), and the fastest timed is taken.

Each aggregate call is timed on the host, per choice, so that the summary sets the measured seconds per step
beside the prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from train.aggregation.aggregators import Aggregator
from train.aggregation.auto_choice import EXACT, AutoChoice, Candidate, candidates
from train.distributed import bounded, guarded

log = logging.getLogger(__name__)


def auto_layout(cfg, world_size: int):
    """The node layout auto's candidates run on: as the hierarchical aggregators see it (aggregator.local_size
    or torchrun's LOCAL_WORLD_SIZE), one node when neither is known."""
    from cerar.hierarchical import NodeLayout
    from train.config import node_layout

    if cfg.aggregator.local_size is None and "LOCAL_WORLD_SIZE" not in os.environ:
        return NodeLayout(1, world_size)
    return node_layout(cfg, world_size)


def build_candidate(cand: Candidate, cfg, world_size: int, layout, flat_group) -> Aggregator:
    """The aggregator of one candidate (every rank builds every candidate, in the same order): the flat ones on
    one shared transport group, the two-tier ones on the layout's cached groups."""
    from train.aggregation import aggregators as agg
    from train.config import code_kappa_max

    a, timeout = cfg.aggregator, float(cfg.trainer.collective_timeout_s)
    kappa = code_kappa_max(a, cand.transport)
    if cand.kind == "nccl":
        return agg.AllReduceAggregator(world_size, timeout)
    if cand.kind in ("fp16", "bf16"):
        return agg.LowPrecisionAllReduce(world_size, timeout, torch.float16 if cand.kind == "fp16" else torch.bfloat16)
    fed = cand.window > 0  # aggregator.error_feedback: the quantized candidates keep this rank's residuals
    if cand.kind == "int8":
        return agg.QuantizedAggregator(world_size, timeout, int(a.block), group=flat_group, error_feedback=fed)
    if cand.kind == "cerar":
        return agg.CerarAggregator(world_size, timeout, cand.c, a.construction, a.eps, kappa, exact_ring=False,
                                   transport=cand.transport, group=flat_group,
                                   equilibrate=a.equilibrate)  # fmt: skip
    if cand.kind in ("hier_ring", "hier_cerar"):
        return agg.HierarchicalAggregator(world_size, timeout, layout, cand.c or layout.nodes, a.construction, a.eps,
                                          kappa, cand.kind == "hier_ring", False, transport=cand.transport,
                                          describe=False, equilibrate=a.equilibrate)  # fmt: skip
    if cand.kind == "hier_int8":
        return agg.HierarchicalQuantizedAggregator(world_size, timeout, layout, int(a.block), describe=False,
                                                   error_feedback=fed)  # fmt: skip
    if cand.kind == "int4":
        return agg.Int4Aggregator(world_size, timeout, int(a.block), bool(a.rotate), group=flat_group,
                                  error_feedback=fed)  # fmt: skip
    if cand.kind == "hier_int4":
        return agg.HierarchicalInt4Aggregator(world_size, timeout, layout, int(a.block), bool(a.rotate), str(a.intra),
                                              describe=False, error_feedback=fed)  # fmt: skip
    raise ValueError(f"aggregator=auto: no builder for candidate kind {cand.kind!r}")


# --------------------------------------------------------------------------------------------- the links


def measure_links(groups, d: int, device: torch.device, timeout, retries: int = 2) -> dict:
    """Time the layout's tiers (every rank calls): cerar's exact ring inside each node and on the rails (all
    rails at once, as the two-tier calls run them, then rail 0 alone at the largest size), and the memory
    bandwidth; the timings are all-reduced (the slowest rank's) so that every rank fits the same numbers.
    Then, up to ``retries`` times, the sizes that miss their tier's line by more than
    ``cerar.planning.link_probe.MISS`` (``misfits``: a loaded moment only adds time) are timed again, every tier at once
    as before, and each keeps the faster of its agreed times: a probe beside other jobs (issue 34) fits the
    link, not the moment. Every rank names the same sizes from the same agreed numbers, so the retries stay
    collective. Returns the raw record: (d, seconds) per tier, rail 0's seconds alone, the memory bandwidth,
    and the sizes retried per attempt."""
    from cerar.planning.link_probe import MAX_VALUES, misfits, probe_memory_bandwidth, time_ring

    layout = groups.layout
    k = int(math.log2(MAX_VALUES)) + 1  # room for every size time_ring may reach
    # a shared NIC (several rails a node) is measured with its contention: the median keeps what the fastest call
    # hides; one rail a node shares nothing, and there, as inside a node, the fastest call is the link's
    rail_statistic = statistics.median if layout.local_size > 1 else min
    tiers = [(0, groups.intra_node, layout.local_size, min)] if layout.local_size > 1 else []
    tiers += [(1, groups.rail, layout.nodes, rail_statistic)] if layout.nodes > 1 else []

    slots = torch.zeros(2, k, dtype=torch.float64)  # [tier, size]: seconds; 0 where a tier did not take a size
    extra = torch.zeros(2, dtype=torch.float64)  # rail 0 alone at the rails' largest size; seconds per byte
    for tier, group, _, statistic in tiers:
        timed = time_ring(group, timeout=timeout, device=device, statistic=statistic)
        for size, t in timed:
            slots[tier, int(math.log2(size))] = t
        if tier == 1 and groups.local_rank == 0:  # one rail alone: the NIC's own bandwidth (the others wait)
            alone = time_ring(group, [timed[-1][0]], 5, timeout, device, grow=False, statistic=statistics.median)
            extra[0] = alone[0][1]
    extra[1] = 1.0 / probe_memory_bandwidth(device)  # seconds per byte: the slowest rank's after the MAX
    both = torch.cat([slots.reshape(-1), extra]).to(device)
    bounded("aggregator=auto: link timings all_reduce",
            lambda: dist.all_reduce(both, dist.ReduceOp.MAX, async_op=True))  # fmt: skip
    both = both.cpu()
    slots, extra = both[: 2 * k].view(2, k).clone(), both[2 * k :].tolist()

    def rows(tier: int) -> list[tuple[int, float]]:  # the slowest node's (rail's) time at each size
        return [(1 << e, float(t)) for e, t in enumerate(slots[tier].tolist()) if t > 0]

    def slowest_rank(values: torch.Tensor) -> torch.Tensor:  # the slowest rank's, the same on every rank
        values = values.to(device)
        bounded("aggregator=auto: link timings (again) all_reduce",
                lambda: dist.all_reduce(values, dist.ReduceOp.MAX, async_op=True))  # fmt: skip
        return values.cpu()

    retried = []
    for _ in range(retries):
        again = {tier: misfits(rows(tier), size, 1.0 / extra[1]) for tier, _, size, _ in tiers}
        if not any(again.values()):
            break
        retried.append({("intra", "inter")[tier]: sizes for tier, sizes in again.items() if sizes})
        fresh = torch.zeros(2, k, dtype=torch.float64)
        for tier, group, _, statistic in tiers:
            if again[tier]:
                for size, t in time_ring(group, again[tier], timeout=timeout, device=device, grow=False,
                                         statistic=statistic):  # fmt: skip
                    fresh[tier, int(math.log2(size))] = t
        fresh = slowest_rank(fresh.reshape(-1)).view(2, k)
        slots = torch.where(fresh > 0, torch.minimum(slots, fresh), slots)

    return {
        "intra": rows(0) if layout.local_size > 1 else None,
        "inter": rows(1) if layout.nodes > 1 else None,
        "inter_alone_s": extra[0] if layout.nodes > 1 else None,
        "memory_bandwidth": 1.0 / extra[1],
        "retried": retried,
    }


def cluster_from_timings(layout, timings: dict):
    """The TwoTierCluster the timings describe (`cerar.planning.link_probe.fit_tier` per tier); raises LinkProbeError
    when a tier's timings describe no link. Returns (cluster, fit record)."""
    from cerar.planning.costmodel import TwoTierCluster
    from cerar.planning.link_probe import NicSharing, fit_tier

    n, G, memory = layout.nodes, layout.local_size, timings["memory_bandwidth"]
    fits, tiers = {}, {}
    for tier, size in (("intra", G), ("inter", n)):
        if timings[tier] is not None:
            tiers[tier], rmse = fit_tier(timings[tier], size, memory, f"measured {tier}")
            fits[tier] = {"alpha_s": tiers[tier].alpha, "bandwidth_bytes_s": tiers[tier].bandwidth, "rel_rmse": rmse}
    nics = 1
    if n > 1 and G > 1:
        nics = NicSharing(timings["inter_alone_s"], timings["inter"][-1][1], G).nics_per_node
        # the fit's bandwidth is one rail's among all at once: the NIC's own is that times the rails sharing it
        shared = -(-G // nics)
        tiers["inter"] = dataclasses.replace(
            tiers["inter"], bandwidth=tiers["inter"].bandwidth * shared, note=f"{nics} NIC(s) per node"
        )
        fits["inter"]["bandwidth_bytes_s"] = tiers["inter"].bandwidth
    intra = tiers.get("intra", tiers.get("inter"))
    inter = tiers.get("inter", intra)
    cluster = TwoTierCluster(n, G, intra, inter, nics, memory)
    return cluster, {"tiers": fits, "nics_per_node": nics, "memory_bandwidth_bytes_s": memory, "timings": timings}


def cluster_from_declared(layout, links: dict):
    """The TwoTierCluster of aggregator.auto_links; raises LinkProbeError naming a missing key the layout
    needs. Returns (cluster, record)."""
    from cerar.planning.costmodel import Tier, TwoTierCluster
    from cerar.planning.link_probe import LinkProbeError

    n, G = layout.nodes, layout.local_size
    needed = ["memory_gbyte_s"] + (["intra_alpha_s", "intra_gbit_s"] if G > 1 else [])
    needed += ["inter_alpha_s", "inter_gbit_s"] if n > 1 else []
    missing = [key for key in needed if links.get(key) is None]
    if missing:
        raise LinkProbeError(f"aggregator.auto_links misses {', '.join(missing)} for {layout}")

    def tier(which: str):
        return Tier(float(links[f"{which}_alpha_s"]), float(links[f"{which}_gbit_s"]) * 1e9 / 8, f"declared {which}")

    intra = tier("intra") if G > 1 else tier("inter")
    inter = tier("inter") if n > 1 else intra
    nics = int(links.get("nics_per_node") or 1)
    cluster = TwoTierCluster(n, G, intra, inter, nics, float(links["memory_gbyte_s"]) * 1e9)
    return cluster, {"declared": dict(links)}


# --------------------------------------------------------------------------------------------- the errors


@contextlib.contextmanager
def own_feedback(aggregator: Aggregator):
    """While a fed-back candidate is called outside the run's aggregation (a check's sample, a trial's timing), it
    rounds with residuals of its own, fresh, dropped after: the run's residuals hold what the run's aggregates
    dropped and nothing else (a trial's rounding of this step's gradient, kept, would be added to this step's
    aggregate). Unfed aggregators are called as they are."""
    from cerar.int4.feedback import ErrorFeedback

    kept = aggregator.feedback
    if kept is not None:
        aggregator.feedback = ErrorFeedback()
    try:
        yield
    finally:
        if kept is not None:
            aggregator.feedback = kept


def measure_candidate(
    aggregator: Aggregator, cand: Candidate, flat: torch.Tensor, layout, noise: torch.Tensor, generator,
    per_tensor: int, sizes: dict | None = None, g_bar: torch.Tensor | None = None, zero: torch.Tensor | None = None,
) -> list:  # fmt: skip
    """[rho, standard error, tensor] of this rank's aggregate under `cand` (every rank calls, with the same
    generator state): the candidate's real call on a `TensorSample` of `flat` (its units, drawn for every tensor
    of `layout`) against the exact mean of the sample, each tensor's error estimated and set against its noise
    (`noise`: sigma_t), the worst tensor's (train/aggregation/tensor_errors.py). An aggregator that scales per tensor is
    given the scales it would use on the whole gradient, so that the sample gets the same arithmetic; the tensors
    `zero` marks (zero on every rank, `TensorLayout.zero`) are set to 0 after the sample's call, as the whole
    call returns them. `sizes` keeps the units' sizes and inclusion probabilities per layout (parts, pieces, unit)
    across the candidates of one check: candidates of one layout (fp16 and bf16; CERAR's c over 32- and 16-bit
    messages) share one all-reduce of the sizes and one computation of the probabilities (each still draws its
    own units). A `whole` candidate runs on a copy of the whole gradient instead, against `g_bar` (the exact
    mean): each tensor's error exactly, standard error 0 (one more gradient-sized buffer while it runs, one
    aggregation's time). A fed-back candidate (`cand.window` = W > 0) is judged as the trainer judges a fed run
    (train/aggregation/feedback_window.py): with residuals of its own (`own_feedback`), one call fills them, then the
    error of the sum of the next W calls on the same sample, against sqrt(W) sigma_t (W steps' independent noises,
    each taken as this step's). Fed back, that sum is E_first - E_after, two residuals, however many calls: what it
    measures is the size of this gradient's residuals, which the gradients of the next steps share (the same
    tensors, blocks and scales), where one call's error would not say what the optimizer integrates."""
    from train.aggregation.tensor_errors import TensorSample, unit_sizes, worst_tensor

    if cand.whole:
        if g_bar is None:
            raise ValueError(f"aggregator=auto: {cand.name} is measured on the whole gradient and needs its exact mean")
        x = flat.clone()
        with guarded(f"aggregator=auto: measuring {cand.name}"):
            aggregator.aggregate(x)
        error = layout.squared_norms(x.sub_(g_bar)).cpu()
        del x
        return list(worst_tensor(error, torch.zeros_like(error), noise))
    shape = (cand.parts, cand.pieces, cand.unit)
    sizes = {} if sizes is None else sizes
    if shape not in sizes:
        z = unit_sizes(flat, *shape)
        sizes[shape] = (z, TensorSample.inclusion(z, layout, *shape, per_tensor))
    z, pi = sizes[shape]
    sample = TensorSample.draw(z, layout, cand.parts, cand.pieces, cand.unit, generator, per_tensor, pi)
    x = sample.values(flat).float()
    exact = x.double()
    bounded(f"aggregator=auto: exact sample all_reduce ({cand.name})", lambda: dist.all_reduce(exact, async_op=True))
    exact /= dist.get_world_size()
    scales = aggregator.tensor_scales(flat)
    scales = None if scales is None else sample.scales(scales.to(x))
    zeros = None if zero is None else sample.in_tensors(zero).to(x.device)

    def error(y: torch.Tensor) -> torch.Tensor:  # the candidate's real call on the sample, its error in float64
        with guarded(f"aggregator=auto: measuring {cand.name}"):
            aggregator.aggregate(y) if scales is None else aggregator.aggregate(y, scales=scales)
        if zeros is not None:
            y[zeros] = 0.0
        return y.double() - exact

    if not cand.window:
        estimate, variance = sample.estimate(error(x).square())
        return list(worst_tensor(estimate, variance, noise))
    with own_feedback(aggregator):
        error(x.clone())  # fills the residuals: each call after carries the last one's
        summed = sum(error(x.clone()) for _ in range(cand.window))
    estimate, variance = sample.estimate(summed.square())
    return list(worst_tensor(estimate, variance, noise * math.sqrt(cand.window)))


# --------------------------------------------------------------------------------------------- the aggregator


class AutoAggregator(Aggregator):
    """aggregator=auto (module docstring): the chosen candidate aggregates; `prepare` measures and prices at start,
    `check` measures and decides at the schedule's steps."""

    name = "auto"

    def __init__(self, cfg, world_size: int):
        super().__init__(world_size, float(cfg.trainer.collective_timeout_s))
        a = cfg.aggregator
        self.layout = auto_layout(cfg, world_size)
        self.choice = AutoChoice(
            candidates(world_size, self.layout.nodes, self.layout.local_size, a),
            budget=float(a.error_budget),
            warmup_steps=int(a.auto_warmup_steps),
            check_every=int(a.auto_check_every),
            trials=int(a.auto_trials),
            last_step=int(cfg.trainer.max_steps),
        )
        self.trial_calls = int(a.auto_trial_calls)
        self.sample_values = int(a.auto_sample_values)
        declared = {key: value for key, value in a.auto_links.items() if value is not None}
        self.declared = declared or None  # None: measure the links
        self.groups = self.flat_group = None
        if world_size > 1 and dist.is_initialized():
            from cerar.ddp import transport_group
            from cerar.hierarchical import tier_groups

            self.flat_group = transport_group(None, self.timeout)
            self.groups = tier_groups(self.layout, self.timeout)
        self.aggregators = {
            name: build_candidate(cand, cfg, world_size, self.layout, self.flat_group)
            for name, cand in self.choice.candidates.items()
        }
        self.links: dict = {}
        self.fallback: str | None = None
        self.measured: dict[str, list[float]] = {}  # choice -> [calls, host seconds]

    @property
    def current(self) -> Aggregator:
        return self.aggregators[self.choice.choice]

    @property
    def feedback(self):
        """The residuals of the choice now aggregating (None: it does not feed back): what a checkpoint keeps of this
        rank (`rank_state`), restored after the choice (`Trainer.restore` loads the choice first)."""
        return self.current.feedback

    @property
    def replicas_differ(self) -> bool:
        """Whether the choice now aggregating may leave the ranks different aggregates (a CERAR candidate); the
        exact warm-up and torch's, the 16-bit and the 8-bit all-reduces give every rank the same bits."""
        return self.current.replicas_differ

    def prepare(self, d: int, device: torch.device) -> None:
        """Measure (or read) the links and price every candidate for calls of d values (every rank calls). A
        failure leaves the run exact, with a one-line warning."""
        from cerar.planning.link_probe import LinkProbeError

        if self.world_size < 2:
            return
        start = time.perf_counter()
        try:
            if self.declared is not None:
                cluster, self.links = cluster_from_declared(self.layout, dict(self.declared))
            else:
                timings = measure_links(self.groups, d, device, self.timeout)
                cluster, self.links = cluster_from_timings(self.layout, timings)
            self.choice.seconds = {name: cand.price(cluster, d) for name, cand in self.choice.candidates.items()}
        except (LinkProbeError, ValueError) as err:
            self.fallback = f"aggregator=auto: no link measurement ({err}); aggregating exactly ({EXACT}) throughout"
            self.choice.seconds = {}
            if dist.get_rank() == 0:
                log.warning("%s", self.fallback)
            return
        self.links["probe_seconds"] = time.perf_counter() - start
        if dist.get_rank() == 0:
            log.info("%s", self.describe_links())

    def describe_links(self) -> str:
        tiers = (
            "; ".join(
                f"{tier}: alpha {1e6 * fit['alpha_s']:.3g} us, {8 * fit['bandwidth_bytes_s'] / 1e9:.3g} Gbit/s "
                f"(fit {fit['rel_rmse']:.0%} RMS)"
                for tier, fit in self.links.get("tiers", {}).items()
            )
            or f"declared {self.links.get('declared')}"
        )
        ranked = sorted(self.choice.seconds, key=self.choice.seconds.get)
        fastest = ", ".join(f"{name} {1e3 * self.choice.seconds[name]:.3g} ms" for name in ranked[:4])
        return (
            f"aggregator=auto on {self.layout}: links {tiers}; {self.links.get('nics_per_node', 1)} NIC(s) per node; "
            f"{len(ranked)} candidates, fastest predicted {fastest}; exact ({EXACT}) until step "
            f"{self.choice.warmup_steps}, then the fastest whose error <= {self.choice.budget:g} x the noise, "
            "tensor by tensor"
        )

    def due(self, step: int) -> bool:
        return self.world_size > 1 and self.choice.due(step)

    def check(self, flat: torch.Tensor, step: int, seed: int, layout=None) -> dict:
        """One check on this step's per-rank gradients `flat` (every rank calls, before aggregating): each
        parameter tensor's noise (`layout`, train/aggregation/tensor_errors.py; one tensor when None), each candidate's
        worst tensor's error against its noise, the decision. Returns the record to log."""
        from train.aggregation.auto_c import SIGMAS
        from train.aggregation.tensor_errors import TensorLayout, per_tensor_units, tensor_noise
        from train.loop import exact_mean, gradient_noise

        if not self.choice.priced:  # as `due` says: an unpriced run stays exact and is never checked
            raise RuntimeError(
                f"aggregator=auto: step {step}: check called on an unpriced run "
                f"({self.fallback or 'prepare() has not priced the candidates'}); it aggregates exactly ({EXACT})"
            )
        names = self.choice.to_measure()
        layout = layout or TensorLayout.single(flat.numel())
        exact = exact_mean(flat)
        noise = gradient_noise(flat, exact)
        sigma = tensor_noise(flat, exact, layout)
        zero = layout.zero(exact, sigma)  # the tensors zero on every rank: every candidate returns them as zeros
        numbers = torch.zeros(len(names) + 1, 3, dtype=torch.float64)
        generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)
        sizes: dict = {}  # the units' sizes per layout, all-reduced once for every candidate of that layout
        for k, name in enumerate(names):
            cand = self.choice.candidates[name]
            units = per_tensor_units(self.sample_values, len(layout.sizes), cand.parts * cand.pieces * cand.unit)
            numbers[k] = torch.tensor(measure_candidate(self.aggregators[name], cand, flat, layout, sigma, generator,
                                                        units, sizes, exact, zero))  # fmt: skip
        if dist.get_rank() == 0:
            numbers[-1, 0] = noise  # every rank records rank 0's noise, bit for bit
        numbers = numbers.to(flat.device)
        gathered = [torch.empty_like(numbers) for _ in range(self.world_size)]
        bounded("aggregator=auto: errors all_gather", lambda: dist.all_gather(gathered, numbers, async_op=True))
        every = torch.stack(gathered).cpu()  # [rank, candidate, (rho, standard error, tensor)]
        bounds = every[:, :-1, 0] + SIGMAS * every[:, :-1, 1]
        refused = bounds.isnan().any(0)  # some rank's evidence is nan: the candidate's number is nan (refused)
        worst = bounds.nan_to_num(math.inf).argmax(0)  # inf (no noise, some error) is a number: it fits nothing
        measured = {name: (math.nan, 0.0) if refused[k] else tuple(every[worst[k], k, :2].tolist())
                    for k, name in enumerate(names)}  # fmt: skip
        tensors = {name: layout.names[int(every[worst[k], k, 2])] for k, name in enumerate(names)}
        before = self.choice.choice
        record = self.choice.decide(step, float(every[0, -1, 0]), measured,
                                    lambda short: self.time_calls(short, flat), tensors)  # fmt: skip
        if self.choice.choice != before and self.aggregators[before].feedback is not None:
            from cerar.int4.feedback import ErrorFeedback

            # a choice left has exceeded the budget and is never chosen again: its residuals, one call's roundings,
            # are dropped once (and their memory freed)
            self.aggregators[before].feedback = ErrorFeedback()
        if dist.get_rank() == 0:
            log.info("%s", self.choice.describe(record))
        out = {"auto/noise": record["noise"], "auto/allowed_error": record["allowed"]}
        out.update({f"auto/error/{name}": e for name, e in record["errors"].items()})
        out.update({f"auto/error_se/{name}": e for name, e in record["standard_errors"].items()})
        out.update({f"auto/timed_s/{name}": s for name, s in record["timed_s"].items()})
        return out

    def time_calls(self, names: list[str], flat: torch.Tensor) -> dict[str, float]:
        """Seconds per real call of each named candidate on a copy of this step's gradient `flat` (every rank
        calls, in the same order): one untimed call (connections, buffers), then `trial_calls` timed, each after
        the device has drained; the slowest rank's mean (all-reduced MAX), so every rank ranks the same numbers.
        Each call keeps its aggregator's deadline, so a stalled peer ends the trial with the trainer's error."""
        from cerar.planning.link_probe import sync_device

        scratch = torch.empty_like(flat)
        seconds = torch.zeros(len(names), dtype=torch.float64)
        for k, name in enumerate(names):
            with own_feedback(self.aggregators[name]):  # a fed candidate's trials never touch the run's residuals
                for call in range(1 + self.trial_calls):
                    scratch.copy_(flat)
                    sync_device(flat.device)
                    start = time.perf_counter()
                    with guarded(f"aggregator=auto: timing {name}"):
                        self.aggregators[name].aggregate(scratch)
                    sync_device(flat.device)
                    if call:
                        seconds[k] += (time.perf_counter() - start) / self.trial_calls
        seconds = seconds.to(flat.device)
        bounded("aggregator=auto: trial timings all_reduce",
                lambda: dist.all_reduce(seconds, dist.ReduceOp.MAX, async_op=True))  # fmt: skip
        return dict(zip(names, seconds.cpu().tolist(), strict=True))

    def use_tensors(self, sizes) -> None:
        """Every candidate is told the parameter tensors (those that scale per tensor scale each apart)."""
        super().use_tensors(sizes)
        for aggregator in self.aggregators.values():
            aggregator.use_tensors(sizes)

    def tensor_scales(self, flat: torch.Tensor) -> torch.Tensor | None:
        return self.current.tensor_scales(flat)

    def aggregate(self, flat: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        start = time.perf_counter()
        sent = self.current.aggregate(flat, scales)
        tally = self.measured.setdefault(self.choice.choice, [0, 0.0])
        tally[0] += 1
        tally[1] += time.perf_counter() - start
        return sent

    def step_metrics(self) -> dict:
        names = sorted(self.choice.candidates)
        record = {"auto/choice": names.index(self.choice.choice)}  # the index in the summary's sorted candidates
        if self.choice.priced:
            record["auto/predicted_s"] = self.choice.seconds[self.choice.choice]
        return {**record, **self.current.step_metrics()}

    def state_dict(self) -> dict:
        return self.choice.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.choice.load_state_dict(state)

    def summary(self) -> dict:
        """The decision, its evidence and the measured seconds per call beside the predicted ones."""
        return {
            "candidates": sorted(self.choice.candidates),
            "choice": self.choice.choice,
            "fallback": self.fallback,
            "links": self.links,
            "predicted_s": dict(sorted(self.choice.seconds.items())),
            "measured_s": {name: seconds / calls for name, (calls, seconds) in self.measured.items() if calls},
            "calls": {name: calls for name, (calls, _) in self.measured.items()},
            **self.choice.state_dict(),
        }
