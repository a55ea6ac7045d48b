"""aggregator=auto, the decision: the fastest aggregation whose error fits the run's own noise.

The candidates (`candidates`) are every aggregator that can run on the layout: flat, torch's all-reduce
(`nccl`, exact), its 16-bit all-reduce (`fp16`, `bf16`), the 8-bit and 4-bit all-reduces (`int8`, `int4`) and
CERAR at the c values c=auto would consider, over float32 messages (`cerar-c<c>`) and over float16 ones where the
code is admissible (`cerar16-c<c>`); on n >= 2 nodes of G >= 2 ranks also the two-tier ones: the exact hierarchy
(`hier_ring`), over float16 messages (`hier_fp16`), with int8 between the nodes (`hier_int8`), the 8/4 hierarchy
(`hier_int4`: aggregator.intra inside the nodes, 4 bits between them) and, on n >= 3 nodes (on two, the code sends
the exact ring's bytes), CERAR between them (`hier_cerar-c<c>`, `hier_cerar16-c<c>`). The 4-bit ones take the
config's `block` and `rotate` (and `intra`). Under aggregator.error_feedback=true the quantized ones are fed back
(`int8_ef`, `int4_ef`, `hier_int8_ef`, `hier_int4_ef`, in place of the unfed ones) and judged as the trainer judges a
fed run: the error of the sum of W consecutive calls against the summed noise (`Candidate.window` = W,
aggregator.feedback_window; train/aggregation/feedback_window.py), never one call's (docs/int4.md).

Each candidate carries its cost model name (`cerar.planning.costmodel.two_tier_features`) and the layout of its
arithmetic (`parts`, `pieces`, `unit`: the values that a call mixes or scales together), which is what a
sample of its error must keep (train/aggregation/auto_aggregator.py `measure_candidate`), and the keywords its
cost model entry takes (`quantized`: the formats' block, rotation and tier inside a node).

The schedule (`AutoChoice`), as c=auto's: until `warmup_steps` the run aggregates exactly (`nccl`); at that
step every candidate is measured (error and its standard error, on the step's own gradients) and priced
(predicted seconds per step, `seconds`); of those whose error bound (estimate + 2 standard errors) is at most
`budget` x the noise of every parameter tensor, each tensor's error against its own noise
(train/aggregation/tensor_errors.py), the `trials` the model predicts fastest and the exact one are timed by their real
call on the step's gradient (`time_calls`), and the fastest timed is taken: the model ranks, a measurement
decides, so a cost the model does not price (gloo's 16-bit arithmetic on a CPU, a link the probe misread) cannot
make the run slower than the exact all-reduce. Every `check_every` steps after, the choice is measured again
with the candidates more accurate than it; if it no longer fits it is excluded for the rest of the run and the
fastest that fits among the more accurate ones replaces it. The run therefore only ever moves to more accurate
choices and cannot oscillate; the exact candidates (error 0) always fit. The decisions are a pure function of
the numbers given to `decide`, and every rank is given the same numbers (all-reduced), so every rank switches
at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from train.aggregation.auto_c import DEFAULT_ERROR_BUDGET, SIGMAS, candidate_codes
from train.config import FAMILIES, FEEDBACK_KINDS, code_kappa_max, feedback_window_steps

EXACT = "nccl"
"""The exact flat all-reduce: the warm-up's aggregator and the fallback when the links are unknown."""


@dataclass(frozen=True)
class Candidate:
    """One aggregator auto may choose: its `name` (the metrics' and summary's), its aggregator config (`kind`,
    `c`, `transport`), the cost model's name for it (`model`), whether it is exact, and the layout its arithmetic
    works in: `parts` equal shards (G for the two-tier ones, whose node reduce-scatters first), each cut into
    `pieces` (CERAR's c components, int8's shards), whose values are mixed or scaled together in `unit`s (int8's
    blocks; 1 otherwise). `whole`: measured on the whole gradient, not a sample, because its float16 messages are
    each scaled by their largest value (`cerar.formats.wire`), which a sample of the message does not carry: the
    two-tier ring over float16 (`hier_fp16`), and CERAR over float16 where aggregator.equilibrate is off (with it,
    every tensor's root mean square is near 1, and the scale moves only values below 2^-29 of a message's largest,
    by at most 2^-39 of that largest: far below any tensor's own rounding unless one value is some 2^29 times its
    tensor's root mean square). `quantized`: the cost model's keywords for a quantized candidate's format
    (`cerar.planning.costmodel.two_tier_features`: block, rotate, intra, intra_block), as (key, value) pairs.
    `window`: a fed-back candidate's (aggregator.error_feedback) W, the steps its error is summed over when it is
    judged; 0 for the unfed ones, judged on one call."""

    name: str
    kind: str
    model: str
    c: int | None = None
    transport: str = "float32"
    exact: bool = False
    parts: int = 1
    pieces: int = 1
    unit: int = 1
    whole: bool = False
    quantized: tuple = ()
    window: int = 0

    def price(self, cluster, d: int) -> float:
        """Predicted seconds of one call on d values on `cluster` (`cerar.planning.costmodel.TwoTierCluster`)."""
        return cluster.time(self.model, d, self.c, **dict(self.quantized))


def _cerar_codes(N: int, a, transport: str) -> dict[int, object]:
    """c -> code of the inexact CERAR codes c=auto would consider on N workers (train/aggregation/auto_c.py), for
    messages
    of `transport`: with float16 the codes built within its default kappa_max and admissible on its wire."""
    import torch

    import cerar
    from cerar.ring.precision import check_admissible

    codes = {}
    for c, code in candidate_codes(N, a.construction, a.eps, code_kappa_max(a, transport)).items():
        if code.is_exact:
            continue
        if transport != "float32":
            try:
                check_admissible(code, torch.float32, cerar.formats.wire.transport_dtype(transport))
            except ValueError:
                continue
        codes[c] = code
    return codes


def candidates(N: int, nodes: int, local_size: int, a) -> dict[str, Candidate]:
    """name -> Candidate for N = nodes x local_size ranks and aggregator config `a` (construction, eps,
    kappa_max, block, auto_aggregators: the kinds to keep, null: all; error_feedback: the quantized ones fed back,
    `fed`)."""
    block = int(a.block)
    keep = a.auto_aggregators

    def kept(family: str) -> bool:  # CERAR's codes are built only for a family kept (seconds each, the first time)
        return keep is None or family in keep

    unequilibrated = not getattr(a, "equilibrate", True)  # CERAR's float16 messages then carry raw magnitudes
    four = (("block", block), ("rotate", bool(getattr(a, "rotate", True))))  # the 4-bit format, as configured
    pool = [
        Candidate(EXACT, "nccl", "ring", exact=True),
        Candidate("fp16", "fp16", "ring16"),
        Candidate("bf16", "bf16", "ring16"),
        Candidate("int8", "int8", "int8", pieces=N, unit=block, quantized=(("block", block),)),
        Candidate("int4", "int4", "int4", pieces=N, unit=block, quantized=four),
    ]
    for transport, family in (("float32", "cerar"), ("float16", "cerar16")):
        for c in sorted(_cerar_codes(N, a, transport)) if kept(family) else ():
            whole = transport == "float16" and unequilibrated
            pool.append(Candidate(f"{family}-c{c}", "cerar", family, c, transport, pieces=c, whole=whole))
    n, G = nodes, local_size
    if n >= 2 and G >= 2:
        pool += [
            Candidate("hier_ring", "hier_ring", "hier_ring", exact=True),
            Candidate("hier_fp16", "hier_ring", "hier_ring16", transport="float16", whole=True),
            Candidate("hier_int8", "hier_int8", "hier_int8", parts=G, pieces=n, unit=block,
                      quantized=(("block", block),)),
            Candidate("hier_int4", "hier_int4", "hier_int4", parts=G, pieces=n, unit=block,
                      quantized=(*four, ("intra", str(getattr(a, "intra", "int8"))), ("intra_block", block))),
        ]
        if n >= 3:
            for transport, family in (("float32", "hier_cerar"), ("float16", "hier_cerar16")):
                for c in sorted(_cerar_codes(n, a, transport)) if kept(family) else ():
                    whole = transport == "float16" and unequilibrated
                    pool.append(Candidate(f"{family}-c{c}", "hier_cerar", family, c, transport, parts=G, pieces=c,
                                          whole=whole))  # fmt: skip
    if keep is not None:
        unknown = sorted(set(keep) - set(FAMILIES))
        if unknown:
            raise ValueError(f"aggregator.auto_aggregators holds {unknown}: not among {', '.join(FAMILIES)}")
        pool = [cand for cand in pool if cand.exact or cand.model in keep or cand.name in keep]
    if getattr(a, "error_feedback", False):
        pool = [fed(cand, feedback_window_steps(a)) for cand in pool]
    return {cand.name: cand for cand in pool}


def fed(cand: Candidate, window: int) -> Candidate:
    """`cand` fed back, named `<name>_ef` and judged over windows of `window` steps, where its kind feeds back (every
    rounding a rank's own message: FEEDBACK_KINDS); the others unchanged (the casts' and CERAR's errors are not a
    rank's own rounding, docs/int4.md)."""
    if cand.kind not in FEEDBACK_KINDS:
        return cand
    return replace(cand, name=f"{cand.name}_ef", window=window)


def fastest_within(seconds: dict[str, float], bound: dict[str, float], allowed: float) -> str:
    """The candidate with the fewest predicted seconds whose error bound is at most `allowed` (ties: the smaller
    bound, then the name); when none fits, the one with the smallest bound. A non-finite bound never fits."""
    if not bound:
        raise ValueError("fastest_within needs at least one measured candidate")
    missing = sorted(set(bound) - set(seconds))
    if missing:
        raise ValueError(f"fastest_within: no predicted seconds for {missing}")

    def error(name: str) -> float:
        return bound[name] if math.isfinite(bound[name]) else math.inf

    fits = [name for name in bound if error(name) <= allowed]
    if fits:
        return min(fits, key=lambda name: (seconds[name], error(name), name))
    return min(bound, key=lambda name: (error(name), seconds[name], name))


def refusals(measured: dict[str, tuple[float, float]], allowed: float, tensors: dict[str, str]) -> dict[str, str]:
    """name -> why, for each measured candidate whose bound (rho + SIGMAS se) exceeds `allowed`: its figures and
    the tensor that set them."""
    out = {}
    for name, (error, se) in sorted(measured.items()):
        if not error + SIGMAS * se <= allowed:
            where = f" on tensor {tensors[name]}" if name in tensors else ""
            out[name] = f"error/noise {error:.3g} + {SIGMAS:g} x {se:.3g} > budget {allowed:g}{where}"
    return out


def worst_tensors(record: dict) -> str:
    """'; worst tensor: name rho, ...' of a decision record's measured candidates (the console's last clause)."""
    named = record.get("worst_tensors", {}).items()
    pairs = [f"{name} {tensor} {record['errors'][name]:.3g}" for name, tensor in named]
    return "; worst tensor (error/noise): " + ", ".join(pairs) if pairs else ""


@dataclass
class AutoChoice:
    """The aggregator=auto schedule and its decisions (module docstring). `seconds` holds each candidate's
    predicted seconds per step (empty while unpriced: the run then stays exact); `choice` is the candidate in
    use; `excluded` those that exceeded the budget at a re-check; `decisions` one record per check; `trials` how
    many fitting candidates (the model's fastest) a decision that moves times beside the exact one (0: the model
    alone decides)."""

    candidates: dict[str, Candidate]
    seconds: dict[str, float] = field(default_factory=dict)
    budget: float = DEFAULT_ERROR_BUDGET
    warmup_steps: int = 100
    check_every: int = 100
    choice: str = EXACT
    excluded: list[str] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    bounds: dict[str, float] = field(default_factory=dict)  # each candidate's last measured error bound
    trials: int = 3
    retry_at: int | None = None  # a check whose evidence was not finite: the step that checks again
    last_step: int | None = None  # the run's last step (trainer.max_steps): never checked

    def __post_init__(self) -> None:
        if EXACT not in self.candidates:
            raise ValueError(f"AutoChoice needs the exact candidate {EXACT!r}")
        if self.warmup_steps < 1 or self.check_every < 0 or self.trials < 0:
            raise ValueError(
                f"AutoChoice: warmup_steps={self.warmup_steps} must be >= 1, check_every={self.check_every} and "
                f"trials={self.trials} >= 0"
            )

    @property
    def priced(self) -> bool:
        return bool(self.seconds)

    @property
    def chosen(self) -> bool:
        """Whether a check has decided yet (a refused one, on evidence that was not finite, has not)."""
        return any("not finite" not in d["reason"] for d in self.decisions)

    def due(self, step: int) -> bool:
        """Whether `step` checks: the end of warm-up, then every check_every steps, while something can move
        (never while unpriced, nor at `last_step`: a check there costs seconds to change at most the one aggregation
        left, issue 53)."""
        if not self.priced or step < self.warmup_steps or not self.to_measure():
            return False
        if self.last_step is not None and step >= self.last_step:
            return False
        if step == self.retry_at:
            return True
        since = step - self.warmup_steps
        return since == 0 if self.check_every == 0 else since % self.check_every == 0

    def to_measure(self) -> list[str]:
        """The inexact candidates a check measures: at the first check all of them; afterwards the choice (if
        inexact) and those not excluded whose last bound was below the choice's (only a more accurate one may
        replace it)."""
        inexact = [name for name, cand in self.candidates.items() if not cand.exact and name not in self.excluded]
        if not self.chosen:
            return sorted(inexact)
        if self.candidates[self.choice].exact:
            return []
        ceiling = self.bounds.get(self.choice, math.inf)
        return sorted(name for name in inexact if name == self.choice or self.bounds.get(name, 0.0) < ceiling)

    def shortlist(self, pool: dict[str, float], allowed: float) -> list[str]:
        """The candidates of `pool` (name -> error bound) a decision times: the `trials` fitting ones with the
        fewest predicted seconds, and the exact one (always fits, the yardstick), fastest predicted first."""
        fits = sorted((name for name, b in pool.items() if b <= allowed), key=lambda n: (self.seconds[n], pool[n], n))
        short = fits[: self.trials]
        if EXACT in pool and EXACT not in short:
            short.append(EXACT)
        return short

    def decide(
        self,
        step: int,
        noise: float,
        measured: dict[str, tuple[float, float]],
        time_calls: Callable[[list[str]], dict[str, float]] | None = None,
        worst_tensors: dict[str, str] | None = None,
    ) -> dict:
        """Take a check's numbers (per candidate: its worst tensor's error against that tensor's noise, rho, and
        its standard error; train/aggregation/tensor_errors.py) and return the decision record, switching `choice`
        when it
        says so: a candidate fits when rho + SIGMAS se <= budget; the record's `refused` says, for each one that
        does not, its figures and its worst tensor. `noise` (the whole gradient's relative noise)
        and `worst_tensors` (the tensor that set each rho) are recorded, not decided on. When the choice may
        move and `time_calls` is given, it is called with `shortlist` and returns each one's measured seconds
        per call (the same on every rank); the fastest measured is taken. Evidence that is not a number (nan: a
        non-finite gradient) is refused, never read as "exceeds": the choice stays, nothing is excluded, and the
        next step checks again (`due`). An infinite rho (an error on a tensor with no noise) is a measurement: that
        candidate fits no budget."""
        before = self.choice
        allowed = self.budget
        tensors = dict(sorted((worst_tensors or {}).items()))
        if any(math.isnan(v) for pair in measured.values() for v in pair):
            self.retry_at = step + 1
            record = {"step": step, "noise": noise, "allowed": allowed,
                      "errors": {name: measured[name][0] for name in sorted(measured)},
                      "standard_errors": {name: measured[name][1] for name in sorted(measured)},
                      "worst_tensors": tensors, "refused": {}, "before": before, "choice": before,
                      "predicted_s": self.seconds[before], "timed_s": {},
                      "reason": f"evidence not finite: keeps {before}, checks again at step {step + 1}"}  # fmt: skip
            self.decisions.append(record)
            return record
        self.retry_at = None
        bound = {name: error + SIGMAS * se for name, (error, se) in measured.items()}
        bound.update({name: 0.0 for name, cand in self.candidates.items() if cand.exact})
        self.bounds.update(bound)
        if not self.chosen:
            reason, pool = "first choice", bound
        elif bound.get(before, math.inf) <= allowed:
            reason, pool = "still fits", {before: bound[before]}
        else:
            reason = f"{before} exceeds the budget"
            self.excluded.append(before)
            pool = {name: b for name, b in bound.items() if name not in self.excluded and b < bound[before]}
            pool.update({name: 0.0 for name, cand in self.candidates.items() if cand.exact})
        self.choice = fastest_within(self.seconds, pool, allowed)
        timed: dict[str, float] = {}
        short = self.shortlist(pool, allowed) if time_calls is not None and reason != "still fits" else []
        if len(short) > 1:  # trials=0: the exact one alone
            times = time_calls(short)
            timed = {name: float(times[name]) for name in short}
            self.choice = min(short, key=lambda name: (timed[name], pool[name], name))
        record = {
            "step": step,
            "noise": noise,
            "allowed": allowed,
            "errors": {name: measured[name][0] for name in sorted(measured)},
            "standard_errors": {name: measured[name][1] for name in sorted(measured)},
            "worst_tensors": tensors,
            "refused": refusals(measured, allowed, tensors),
            "before": before,
            "choice": self.choice,
            "predicted_s": self.seconds[self.choice],
            "timed_s": timed,
            "reason": reason,
        }
        self.decisions.append(record)
        return record

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the choice, the exclusions, the bounds and every decision."""
        return {
            "choice": self.choice,
            "excluded": list(self.excluded),
            "bounds": dict(self.bounds),
            "decisions": [dict(d) for d in self.decisions],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["choice"] not in self.candidates:
            raise ValueError(f"the checkpoint's aggregator=auto chose {state['choice']}, not a candidate of this run")
        self.choice = state["choice"]
        self.excluded = list(state["excluded"])
        self.bounds = dict(state["bounds"])
        self.decisions = [dict(d) for d in state["decisions"]]

    def describe(self, record: dict) -> str:
        """One console line for a decision: the choice, its predicted time against the exact one's, the
        evidence."""
        fits = sorted(
            (name for name, e in record["errors"].items() if self.bounds.get(name, math.inf) <= record["allowed"]),
            key=lambda name: self.seconds[name],
        )
        move = f"keeps {record['choice']}" if record["choice"] == record["before"] else (
            f"{record['before']} -> {record['choice']}")  # fmt: skip
        timed = record.get("timed_s") or {}
        trial = "; timed per call: " + ", ".join(
            f"{name} {1e3 * s:.3g} ms" for name, s in sorted(timed.items(), key=lambda kv: kv[1])
        ) if timed else ""  # fmt: skip
        windows = sorted({self.candidates[name].window for name in record["errors"]} - {0})
        fed = f" (the fed-back _ef: the sum of {windows[0]} calls' errors, the noise summed alike)" if windows else ""
        return (
            f"step {record['step']}: aggregator=auto {record['reason']}: {move}, predicted "
            f"{1e3 * record['predicted_s']:.3g} ms per step (exact {EXACT}: {1e3 * self.seconds[EXACT]:.3g} ms); "
            f"noise {record['noise']:.3g}; per tensor, error <= {self.budget:g} x that tensor's noise{fed}; "
            f"{len(record['errors'])} measured, fitting by predicted time: {', '.join(fits) or 'none but the exact'}"
            f"{trial}{worst_tensors(record)}"
        )
