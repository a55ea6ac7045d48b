"""c=auto: the largest byte saving whose aggregation error stays inside the gradient's own SGD noise.

CERAR at N workers and c components sends L m = (c + N - 2) ceil(d/c) values per rank; the larger c, the fewer
bytes and (in general) the larger the worst rank's relative error ||S_hat_i - S|| / ||S||. The averaged
gradient g_bar already carries sampling noise, the relative standard deviation that the trainer estimates
from the N per-rank gradients (`noise/rel_std_mean`, train/loop.py). `choose_c` picks, among measured codes,
the one with the fewest bytes whose error is at most `budget` x that noise.

Why the default budget is 0.01 (reports/fidelity.md, N=4, 3,000 steps on corpus v2, same seed as nccl): the
loss gap grew in proportion to error/noise, 13-14 % of gap per unit of the ratio: perturbation c=16 at ratio
0.152 ended +1.98 %, optimized c=16 at 0.041 ended +0.58 %, optimized c=8 at 0.00049 ended +0.01 % (13.0,
14.1 and 20 x; the last is at the edge of what two runs resolve). nccl's own seeds ended 0.17 % apart. A budget
of 0.01 predicts a gap near 0.14 %, inside that seed band; 0.04 (what c=16 had) did not stay inside it. The gap
grew with steps (c=16: +0.29 % at step 500, +0.71 % at 3,000), so runs much longer than 3,000 steps may want a
smaller budget.

The schedule (`AutoC`): until `warmup_steps` the run aggregates exactly (c = N, by the exact ring: the ring's bytes,
and the same bits on every rank); at that step
every candidate is measured on the step's own gradients and the cheapest that fits is taken; every
`check_every` steps after, the code in use is measured again and, if it no longer fits, the cheapest code with
more bytes that fits replaces it. c only ever moves down, so the run cannot oscillate between codes. The
decisions are a pure function of the numbers given to `decide`; the trainer hands every rank the same numbers
(all-reduced), so every rank switches at the same step.

How an error is measured (train/aggregation/tensor_errors.py): per parameter tensor, as Adam sees it. Code c splits the
gradient into a c x m matrix and the protocol mixes only within a column (element t of every component), so a
code's error on a subset of columns is exactly its error on those columns. The trainer draws a seeded sample of
columns (the same on every rank, `TensorSample`: every tensor gets columns of its own, the heavy columns with
probability near 1), gathers every rank's values there and runs `cerar.simulate` on them; each tensor's squared
error is estimated from the sample (Horvitz-Thompson, with its standard error) and set against that tensor's own
SGD noise sigma_t, measured exactly on the whole gradient. A code's number is its worst rank's worst tensor's
ratio rho = error / noise; decisions use rho plus two standard errors, and a code fits when that is at most the
budget. Where the whole-gradient figure is what one tensor would be, rho is ||error|| / ||noise||, the
figure the budget was set on above; with many tensors max_t rho_t is never below it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

DEFAULT_ERROR_BUDGET = 0.01
SIGMAS = 2.0
"""Standard errors added to a sampled error before it is compared with the budget."""


def bytes_per_call(code, d: int, itemsize: int = 4) -> int:
    """Bytes one rank sends in one CERAR all-reduce of d values: L blocks of m = ceil(d/c) values."""
    return code.L * code.m_for(d) * itemsize


def choose_c(noise: float, errors_by_c: dict[int, float], bytes_by_c: dict[int, int], budget: float) -> int:
    """The c with the fewest bytes whose error is at most budget x noise (ties: the smaller error, then the
    smaller c); when none fits, the c with the smallest error. A non-finite error never fits."""
    if not errors_by_c:
        raise ValueError("choose_c needs at least one measured code")
    missing = sorted(set(errors_by_c) - set(bytes_by_c))
    if missing:
        raise ValueError(f"choose_c: no byte count for c={missing}")
    if not budget > 0:
        raise ValueError(f"choose_c: the error budget must be > 0, got {budget!r}")

    def error(c: int) -> float:
        value = errors_by_c[c]
        return value if math.isfinite(value) else math.inf

    allowed = budget * noise if math.isfinite(noise) else -math.inf
    fits = [c for c in errors_by_c if error(c) <= allowed]
    if fits:
        return min(fits, key=lambda c: (bytes_by_c[c], error(c), c))
    return min(errors_by_c, key=lambda c: (error(c), bytes_by_c[c], c))


def candidate_codes(N: int, construction: str, eps, kappa_max, candidates=None) -> dict[int, object]:
    """c -> code for c=auto: the exact code c = N (the fallback: the ring's bytes, no error) and the candidates,
    `candidates` when given (a c that cerar cannot build raises ValueError naming it), else every c in (N, 4N]
    that sends fewer values than the ring, can be built within kappa_max and is not beaten on both values sent
    (Code.comm_rate) and predicted error (Code.predicted_error, the expected error on Gaussian gradients) by
    another: a beaten code is never the right choice unless the run's gradients rank the codes otherwise, and
    measuring it would only cost time. At N=4: c = 5, 6, 8, 12, 16."""
    import cerar

    codes = {N: cerar.make_code(N, N, construction="exact")}
    if candidates is not None:
        for c in candidates:
            try:
                codes.setdefault(int(c), cerar.make_code(N, int(c), construction=construction, eps=eps,
                                                         kappa_max=kappa_max))  # fmt: skip
            except ValueError as err:
                raise ValueError(f"candidate c={c}: {err}") from None
        return codes
    pool = {}
    for c in range(N + 1, 4 * N + 1):
        try:
            code = cerar.make_code(N, c, construction=construction, eps=eps, kappa_max=kappa_max)
        except ValueError:
            continue  # not buildable within kappa_max: not a candidate
        if code.comm_rate < code.ring_rate:
            pool[c] = (code, code.comm_rate, float(code.predicted_error()))
    for c, (code, rate, error) in pool.items():
        beaten = any(r <= rate and e <= error and (r, e) != (rate, error) for o, (_, r, e) in pool.items())
        if not beaten:
            codes[c] = code
    return codes


def sample_indices(
    d: int, parts: int, pieces: int, unit: int, values: int, generator: torch.Generator
) -> tuple[torch.Tensor, int, int]:
    """(indices, units sampled, units in all) of a uniform sample of about `values` values (0: all) of a d-value
    gradient that keeps a call's arithmetic (`unit_indices`): the same on every rank for the same generator."""
    P = -(-d // parts)  # a part: a node's shard
    M = -(-P // pieces)  # a piece: a CERAR component, an int8 shard
    slots = -(-M // unit)
    count = slots if values <= 0 else min(slots, max(1, -(-values // (parts * pieces * unit))))
    picked = torch.arange(slots) if count == slots else torch.randperm(slots, generator=generator)[:count].sort().values
    return unit_indices(d, parts, pieces, unit, picked), count, slots


def unit_indices(d: int, parts: int, pieces: int, unit: int, picked: torch.Tensor) -> torch.Tensor:
    """The flat positions of the units `picked` (sorted slot numbers) of a d-value gradient, laid out as a call
    sees them: `parts` equal shards, each cut into `pieces`, whose values are mixed or scaled together in
    `unit`s (train/aggregation/auto_choice.py `Candidate`; CERAR's columns: 1 part, c pieces, unit 1). The same units
    at the
    same offsets in every part and piece, laid out part-major, then piece-major, so that the call on the sample
    splits it into parts, pieces and units exactly where its call on the gradient would. Positions >= d are
    padding (zero): beyond the gradient, or beyond a piece's end."""
    P = -(-d // parts)  # a part: a node's shard (as_equal_shards)
    M = -(-P // pieces)
    count = picked.numel()
    offsets = (picked.view(1, 1, count, 1) * unit + torch.arange(unit)).view(1, 1, count, unit)
    within = torch.arange(pieces).view(1, pieces, 1, 1) * M + offsets
    indices = torch.arange(parts).view(parts, 1, 1, 1) * P + within
    padding = (offsets >= M) | (within >= P) | (indices >= d)
    return torch.where(padding, torch.full_like(indices, d), indices).reshape(-1)


def gather_columns(flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """This rank's values at `indices` (zero where an index is padding beyond the gradient)."""
    indices = indices.to(flat.device)
    values = flat[indices.clamp(max=flat.numel() - 1)]
    return values.masked_fill_(indices >= flat.numel(), 0)


def worst_tensors(record: dict) -> str:
    """'; worst tensor: c=8 name, ...' of a c=auto decision record (the console's last clause)."""
    pairs = [f"c={c} {tensor}" for c, tensor in record.get("worst_tensors", {}).items()]
    return "; worst tensor: " + ", ".join(pairs) if pairs else ""


@dataclass
class AutoC:
    """The c=auto schedule and its decisions: which c aggregates, when to measure, what to measure.

    `codes` maps every candidate c to its code and must hold the exact code c = N, the fallback (error 0 up
    to float rounding: it is not measured). `c` is the code in use; `decisions` one record per check."""

    N: int
    codes: dict[int, object]
    bytes_by_c: dict[int, int]
    budget: float = DEFAULT_ERROR_BUDGET
    warmup_steps: int = 100
    check_every: int = 100
    c: int = 0
    decisions: list[dict] = field(default_factory=list)
    retry_at: int | None = None  # a check whose evidence was not finite: the step that checks again

    def __post_init__(self) -> None:
        if self.N not in self.codes or not self.codes[self.N].is_exact:
            raise ValueError(f"AutoC needs the exact code c=N={self.N} among its codes")
        if self.warmup_steps < 1 or self.check_every < 0:
            raise ValueError(f"AutoC: warmup_steps={self.warmup_steps} must be >= 1, check_every >= 0")
        self.c = self.c or self.N

    @property
    def code(self):
        return self.codes[self.c]

    def due(self, step: int) -> bool:
        """Whether `step` measures: the end of warm-up, then every check_every steps, while c can still move."""
        if step < self.warmup_steps or not self.to_measure():
            return False
        if step == self.retry_at:
            return True
        since = step - self.warmup_steps
        return since == 0 if self.check_every == 0 else since % self.check_every == 0

    def to_measure(self) -> list[int]:
        """The inexact candidates a check measures: all of them at the first check; afterwards the code in use
        and those with more bytes (c only moves down). Exact codes need no measurement."""
        floor = self.bytes_by_c[self.c] if any("not finite" not in d["reason"] for d in self.decisions) else 0
        return sorted(c for c, code in self.codes.items() if not code.is_exact and self.bytes_by_c[c] >= floor)

    def decide(
        self, step: int, noise: float, measured: dict[int, tuple[float, float]], worst_tensors: dict | None = None
    ) -> dict:
        """Take a check's numbers (per c: its worst tensor's error against that tensor's noise, rho, and its
        standard error; train/aggregation/tensor_errors.py) and return the decision record, switching `c` when it says
        so:
        a code fits when rho + SIGMAS se <= budget. `noise` (the whole gradient's relative noise) and
        `worst_tensors` (c -> the tensor that set rho) are recorded, not decided on. The first check picks among
        all codes; later ones keep the code in use while it fits, else pick among the codes with more bytes.
        Evidence that is not a number (nan: a non-finite gradient) is refused, not read as "exceeds": c stays and
        the next step checks again (`due`). An infinite rho (an error on a tensor with no noise) is a measurement:
        that code fits no budget."""
        before = self.c
        allowed = self.budget
        evidence = [v for pair in measured.values() for v in pair]
        if any(math.isnan(v) for v in evidence):  # nan: refused, checked again
            self.retry_at = step + 1
            record = {"step": step, "noise": noise, "allowed": allowed, "c_before": before, "c": before,
                      "errors": {c: measured[c][0] for c in sorted(measured)},
                      "standard_errors": {c: measured[c][1] for c in sorted(measured)},
                      "worst_tensors": dict(sorted((worst_tensors or {}).items())),
                      "reason": f"evidence not finite: keeps c={before}, checks again at step {step + 1}"}  # fmt: skip
            self.decisions.append(record)
            return record
        self.retry_at = None
        bound = {c: error + SIGMAS * se for c, (error, se) in measured.items()}
        bound.update({c: 0.0 for c, code in self.codes.items() if code.is_exact})
        if not self.decisions or all("not finite" in d["reason"] for d in self.decisions):
            reason = "first choice"
            pool = bound
        elif bound.get(before, math.inf) <= allowed:
            reason = "still fits"
            pool = {before: bound[before]}
        else:
            reason = f"c={before} exceeds the budget"
            pool = {c: e for c, e in bound.items() if self.bytes_by_c[c] > self.bytes_by_c[before]}
        self.c = choose_c(1.0, pool, self.bytes_by_c, self.budget) if pool else before  # ratios: noise is 1
        record = {
            "step": step,
            "noise": noise,
            "allowed": allowed,
            "errors": {c: measured[c][0] for c in sorted(measured)},
            "standard_errors": {c: measured[c][1] for c in sorted(measured)},
            "worst_tensors": dict(sorted((worst_tensors or {}).items())),
            "c_before": before,
            "c": self.c,
            "reason": reason,
        }
        self.decisions.append(record)
        return record

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the c in use and every decision (plain Python values)."""
        return {"c": self.c, "decisions": [dict(d) for d in self.decisions]}

    def load_state_dict(self, state: dict) -> None:
        if state["c"] not in self.codes:
            raise ValueError(f"the checkpoint's c=auto chose c={state['c']}, not a candidate of this run")
        self.c = int(state["c"])
        self.decisions = [dict(d) for d in state["decisions"]]

    def describe(self, record: dict) -> str:
        """One console line for a decision: the choice and the evidence."""
        errors = ", ".join(
            f"c={c} {e:.3g}" + (f"+-{record['standard_errors'][c]:.1g}" if record["standard_errors"][c] else "")
            for c, e in sorted(record["errors"].items())
        )
        saving = self.bytes_by_c[record["c"]] / self.bytes_by_c[self.N]
        move = (
            f"keeps c={record['c']}"
            if record["c"] == record["c_before"]
            else f"c={record['c_before']} -> {record['c']}"
        )
        return (
            f"step {record['step']}: c=auto {record['reason']}: {move} ({saving:.3f} of the ring's bytes); noise "
            f"{record['noise']:.3g}; per tensor, error <= {self.budget:g} x that tensor's noise; worst rank's worst "
            f"tensor's error/noise {errors or 'none measured'} (+-: standard error of the column sample)"
            + worst_tensors(record)
        )


def build_auto_c(N: int, d: int, a) -> AutoC:
    """The AutoC of aggregator config `a` (construction, eps, kappa_max, error_budget, auto_*) for N ranks and a
    gradient of d values."""
    codes = candidate_codes(N, a.construction, a.eps, a.kappa_max, a.auto_candidates)
    return AutoC(
        N=N,
        codes=codes,
        bytes_by_c={c: bytes_per_call(code, d) for c, code in codes.items()},
        budget=float(a.error_budget),
        warmup_steps=int(a.auto_warmup_steps),
        check_every=int(a.auto_check_every),
    )
