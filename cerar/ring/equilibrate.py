"""Per-tensor scales for a flat gradient: every segment (a parameter tensor) brought to a common magnitude before a
collective that mixes or rounds values, and back after, so that each tensor's error is relative to its own size.

    sizes = [p.numel() for p in model.parameters()]                 # the segments of the flat gradient, in order
    scales = agreed_scales(flat, sizes, group, timeout)             # T powers of two, the same on every rank
    apply_scales(flat, sizes, scales)                               # in place, one multiply per segment
    cerar.all_reduce(flat, code, group, op="avg")                   # or any linear collective
    apply_scales(flat, sizes, scales, inverse=True)                 # exact: the scales are powers of two

    stats = cast_all_reduce(flat, torch.float16, sizes, group)      # the 16-bit all-reduce, a scale per tensor

Why. Adam divides each parameter's step by that parameter's own gradient scale, so an aggregation error must be
small against each tensor's own magnitude, not only against the whole gradient's. Two collectives fail that:

- **CERAR mixes components.** Worker i's result is S_hat_i = S + sum_h R_ih G_{i-h} column by column, with the
  c x c error operators R_ih = D_i E_h(A_{i-h}) - I (``Code.residuals``): the error on a value of component k is a
  combination of the values of the same column in every component. A tensor 100x smaller than the values it
  shares its columns with takes an error 100x its share (the issue measured 0.61 of the small tensor's own norm
  at N=4, c=5 over fp16 messages, where the whole gradient erred 0.017). With every segment scaled to a root mean
  square near 1 (rule ``"rms"``), the values a column mixes are of one size, and tensor t's expected relative
  error is at most 2 sqrt(sum_{h,l} R_ih[k, l]^2 / N), twice the code's own error on component k: each scaled
  RMS lies in [2^-1/2, 2^1/2), so no two differ by more than 2x.
- **A plain 16-bit cast underflows small tensors.** ``flat / N`` cast to float16 keeps full precision only down
  to 6.1e-5 and flushes values under 3e-8 to zero (the issue: a tensor near 1e-7 beside one near 1e-3, N=4, erred
  0.67 of itself). Rule ``"cast"`` scales each segment so that its largest magnitude lies in
  [2^(14-b), 2^(15-b)), b = ceil(log2 N): the sum of the N scaled contributions, and every partial sum, stays
  below 2^15 = 32768, half of fp16's largest 65504 (the headroom: rounding a value below 2^15 cannot carry it
  past 65504); every value down to 2^-(28-b) of its tensor's largest is a normal fp16 number, rounded within
  u = 2^-11 of itself. Each value of the mean then errs at most N u sum_j |g_j| (one cast per contribution and
  N - 1 rounded additions) plus fp16's absolute floor, 2^-25 per operation in scaled units. bfloat16 has
  float32's range and the same rule changes nothing but which bf16 numbers carry the values (u = 2^-8).

The scales are powers of two 2^k, |k| <= 126: multiplying by one is exact in float32 (only the exponent moves),
so scaling and unscaling add no rounding. They are agreed across ranks by one all-reduce of T values (a sum of
squares per segment for ``"rms"``, a largest magnitude for ``"cast"``, MAX), so every rank scales a tensor by the
same factor and the collective still sums like with like; the wait for it keeps the call's deadline (a stalled
peer raises ``CollectiveError`` naming it). A segment that is all zero or not finite keeps scale 1 (an overflowed
step stays non-finite). Cost: one pass over the gradient for the statistics, one to scale and one to unscale
(``torch._foreach_norm`` and ``torch._foreach_mul_`` over views of the segments: no temporary of d values), and
the all-reduce of T values: ``scales_bytes``.

The statistics are accumulated in float64 from the float32 values (``torch._foreach_norm(..., dtype=float64)``: on
the CPU each norm is taken in float64, and CUDA's fused kernel accumulates in the output's dtype, torch's
``foreach_reduce.cuh`` ``LpNormFunctor``), so that no sum of squares underflows or overflows before the scale is
chosen: in float32, 3,000 values of 1e-23 summed to 0 and 3,000 of 1e18 to inf, both fell back to scale 1, and CERAR
c=5 then erred 1.5e26 times a 1e-30 tensor's own norm (issue 51).

A segment that is zero on every rank (an unused parameter's gradient) has an exact sum of zero, but a collective
that mixes it with the others (CERAR) leaks their values into it: 3e-4 to 6e-4 at N=4, c=5, a step Adam would
take in full. ``equilibrated`` therefore returns every segment whose agreed statistic is 0 (a float64 sum of
squares or a largest magnitude, 0 only where every value of every rank is 0) as exact zeros: its unscaling factor
is 0, so this costs no pass and no collective beyond the scales' (a non-finite value stays non-finite: 0 x inf
is nan). ``restore_zero_segments`` does the same after a collective that is not equilibrated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from cerar.formats.wire import K_LIMIT, _power_of_two, transport_dtype
from cerar.ring.protocol import AllReduceStats
from cerar.ring.transport import _Ring

RULES = ("rms", "cast")
"""How a segment's scale is chosen: "rms" (CERAR: root mean square over the ranks near 1) or "cast" (a 16-bit
all-reduce: the largest magnitude over the ranks just below 2^15 / N)."""

CAST_TOP = 15
"""Rule "cast": the sum of N scaled contributions stays below 2^CAST_TOP (fp16's largest is 65504 < 2^16)."""

STAT_DTYPE = {"rms": torch.float64, "cast": torch.float32}
"""The statistics' dtype on the wire: sums of squares in float64, accumulated in float64 (no underflow or overflow
for any float32 gradient: a float32 value's square lies within float64's normal range); largest magnitudes in
float32 (exact)."""


def check_sizes(sizes: Sequence[int], numel: int, operation: str) -> list[int]:
    """The segment sizes as a list of ints that tile a tensor of ``numel`` values; a ValueError naming the call
    otherwise."""
    try:
        sizes = [int(s) for s in sizes]
    except (TypeError, ValueError):
        raise ValueError(f"{operation}: sizes must be a sequence of integers, got {sizes!r}") from None
    if not sizes:
        raise ValueError(f"{operation}: sizes is empty (one size per segment of the tensor)")
    if min(sizes) < 0:
        raise ValueError(f"{operation}: sizes must be >= 0, got {min(sizes)}")
    if sum(sizes) != numel:
        raise ValueError(
            f"{operation}: the sizes of the {len(sizes)} segments sum to {sum(sizes)}, but the tensor holds {numel} "
            "values (one size per tensor, in the flat gradient's order)"
        )
    return sizes


def _views(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(flat.reshape(-1).split(sizes))


def segment_statistics(flat: torch.Tensor, sizes: list[int], rule: str) -> torch.Tensor:
    """This rank's statistic per segment (T values): the sum of squares ("rms", float64) or the largest
    magnitude ("cast", float32); 0 for an empty segment."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    views = _views(flat, sizes)
    if rule == "rms":  # accumulated in float64 (module docstring), then squared: no float32 sum of squares
        return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float64)).square()
    # an empty segment's largest magnitude is 0 (torch's infinity norm of an empty tensor raises: no identity)
    views = [v if v.numel() else v.new_zeros(1) for v in views]
    return torch.stack(torch._foreach_norm(views, math.inf)).to(torch.float32)


def scales_from(stats: torch.Tensor, sizes: list[int], N: int, rule: str) -> torch.Tensor:
    """The powers of two 2^k (float32, T values) for the agreed statistics: "rms", stats the sums of squares over
    the N ranks: k = -round(log2 rms), rms = sqrt(stats / (N size)), so the scaled rms lies in [2^-1/2, 2^1/2);
    "cast", stats the largest magnitude over the ranks, in [2^(e-1), 2^e): k = 15 - ceil(log2 N) - e. k is
    clamped to +-126; a segment that is empty, all zero or not finite gets k = 0."""
    if rule == "rms":
        counts = torch.tensor(sizes, dtype=torch.float64, device=stats.device).clamp(min=1)
        rms = (stats.to(torch.float64) / (N * counts)).sqrt()
        k = -torch.round(torch.log2(rms))
        ok = torch.isfinite(rms) & (rms > 0)
    elif rule == "cast":
        _, e = torch.frexp(stats.to(torch.float32))
        k = (CAST_TOP - math.ceil(math.log2(max(N, 1))) - e).to(torch.float64)
        ok = torch.isfinite(stats) & (stats > 0)
    else:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    k = torch.where(ok, k, torch.zeros_like(k)).clamp_(-K_LIMIT, K_LIMIT)
    return _power_of_two(k)


def agreed_statistics(
    flat: torch.Tensor,
    sizes: Sequence[int],
    group=None,
    timeout=None,
    rule: str = "rms",
    *,
    operation: str = "cerar.ring.equilibrate.agreed_statistics",
) -> tuple[torch.Tensor, int]:
    """(the T statistics agreed over ``group``, its size N): each rank's ``segment_statistics`` all-reduced, SUM
    for "rms", MAX for "cast" (a collective: every rank calls, with the same sizes). A statistic is 0 exactly where
    the segment is zero on every rank. The wait keeps ``timeout`` (seconds or timedelta, cerar's default 5
    minutes): a stalled or dead peer raises CollectiveError naming ``operation``."""
    sizes = check_sizes(sizes, flat.numel(), operation)
    stats = segment_statistics(flat, sizes, rule)
    if not dist.is_available() or not dist.is_initialized():
        return stats, 1
    ring = _Ring.of(group, timeout, operation)
    if ring.size > 1:
        reduce = dist.ReduceOp.SUM if rule == "rms" else dist.ReduceOp.MAX
        what = f"agreeing on {len(sizes)} per-tensor scales ({rule})"
        try:
            work = dist.all_reduce(stats, op=reduce, group=group, async_op=True)
        except Exception as error:
            raise ring._failure(what, "(all ranks of the group)", error) from error
        ring.await_works([work], what, "(all ranks of the group)")
    return stats, ring.size


def agreed_scales(
    flat: torch.Tensor,
    sizes: Sequence[int],
    group=None,
    timeout=None,
    rule: str = "rms",
    *,
    operation: str = "cerar.ring.equilibrate.agreed_scales",
) -> torch.Tensor:
    """The T per-segment scales every rank of ``group`` uses for ``flat`` (a collective: every rank calls, with
    the same sizes): the agreed statistics (``agreed_statistics``) turned into powers of two (``scales_from``)."""
    sizes = check_sizes(sizes, flat.numel(), operation)
    stats, N = agreed_statistics(flat, sizes, group, timeout, rule, operation=operation)
    return scales_from(stats, sizes, N, rule)


def restore_zero_segments(tensor: torch.Tensor, sizes: Sequence[int], stats: torch.Tensor) -> None:
    """Set to zero, in place, every segment whose agreed statistic (``agreed_statistics``) is 0, i.e. that is zero
    on every rank: its exact sum. One multiply per segment, by 1 or 0 (no host sync; a non-finite value stays
    non-finite)."""
    keep = (stats != 0).to(tensor.device, tensor.dtype)
    with torch.no_grad():
        torch._foreach_mul_(_views(tensor, list(sizes)), list(keep.unbind()))


def scales_bytes(segments: int, N: int, rule: str = "rms") -> int:
    """Bytes one rank sends to agree on ``segments`` scales: a ring all-reduce of that many statistics,
    2 (N - 1) / N x segments x 8 bytes ("rms", float64) or x 4 ("cast", float32)."""
    size = 8 if rule == "rms" else 4
    return int(2 * (N - 1) * segments * size // N) if N > 1 else 0


def apply_scales(flat: torch.Tensor, sizes: Sequence[int], scales: torch.Tensor, *, inverse: bool = False) -> None:
    """Multiply each segment of ``flat`` in place by its scale (``inverse``: divide; exact for powers of two).
    ``scales``: one per segment (T values, applied with ``torch._foreach_mul_`` over views: no temporary), or one
    per value of ``flat`` (a per-position tensor, e.g. a sample's: multiplied elementwise)."""
    if scales.numel() != len(sizes) and scales.numel() == flat.numel():
        if inverse:
            flat.reshape(-1).div_(scales.to(flat.device, flat.dtype))
        else:
            flat.reshape(-1).mul_(scales.to(flat.device, flat.dtype))
        return
    if scales.numel() != len(sizes):
        raise ValueError(
            f"scales holds {scales.numel()} values: one per segment ({len(sizes)}) or one per value ({flat.numel()})"
        )
    factors = scales.to(flat.device, flat.dtype)
    if inverse:
        factors = factors.reciprocal()  # exact: powers of two
    torch._foreach_mul_(_views(flat, list(sizes)), list(factors.unbind()))


def per_position(scales: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The scale of each value: segment t's scale repeated sizes[t] times (d values)."""
    return torch.repeat_interleave(scales, torch.tensor(list(sizes), device=scales.device))


def equilibrated(
    tensor: torch.Tensor,
    sizes: Sequence[int],
    run,
    group=None,
    timeout=None,
    *,
    scales: torch.Tensor | None = None,
    operation: str = "cerar.ring.equilibrate.equilibrated",
):
    """``run()`` (a linear collective on ``tensor`` in place, e.g. ``cerar.all_reduce``) between the segments'
    scaling and unscaling: the scales agreed over ``group`` by rule "rms" (a collective, within ``timeout``), or
    ``scales`` as given (one per segment or one per value). With agreed scales, every segment that is zero on
    every rank comes back as exact zeros (its unscaling factor is 0; module docstring); with given scales the
    caller knows no such thing and nothing is zeroed. Returns (what ``run`` returned, the bytes this rank sent to
    agree on the scales: 0 when given)."""
    agreed = 0
    unscale = None
    if scales is None:
        sizes = check_sizes(sizes, tensor.numel(), operation)
        stats, N = agreed_statistics(tensor, sizes, group, timeout, "rms", operation=operation)
        scales = scales_from(stats, sizes, N, "rms")
        unscale = torch.where(stats != 0, scales.reciprocal().to(stats.dtype), torch.zeros_like(stats))
        agreed = scales_bytes(len(sizes), N, "rms")
    with torch.no_grad():
        apply_scales(tensor, sizes, scales)
    result = run()
    with torch.no_grad():
        if unscale is None:
            apply_scales(tensor, sizes, scales, inverse=True)
        else:  # 1 / scale (exact: a power of two), 0 for a segment zero on every rank
            apply_scales(tensor, sizes, unscale)
    return result, agreed


def cast_all_reduce(
    tensor: torch.Tensor,
    dtype,
    sizes: Sequence[int] | None = None,
    group=None,
    op: str = "avg",
    timeout=None,
    *,
    scales: torch.Tensor | None = None,
) -> AllReduceStats:
    """The backend's all-reduce (``dist.all_reduce``: NCCL's or gloo's) of ``tensor`` (float32, contiguous) cast to
    ``dtype`` (float16 or bfloat16), each segment scaled first by its agreed power of two (rule "cast", module
    docstring; ``sizes`` None: the whole tensor one segment), in place. ``scales``: use these instead of agreeing
    on them (one per segment, or one per value: the scales of the values' segments, e.g. for a sample of the
    gradient); the arithmetic at each value is then the same as on the whole tensor. Every rank receives the same
    bits. Each wait keeps ``timeout``; ``stats.bytes_sent`` counts the 16-bit ring's 2 (N-1)/N d x 2 bytes and
    the scales' all-reduce (``scales_bytes``)."""
    operation = f"cerar.ring.equilibrate.cast_all_reduce ({transport_dtype(dtype)})"
    wire = transport_dtype(dtype)
    if wire not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{operation}: dtype must be float16 or bfloat16, got {dtype}")
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"{operation}: tensor must be a contiguous float32 torch.Tensor")
    if op not in ("sum", "avg"):
        raise ValueError(f"{operation}: op must be 'sum' or 'avg', got {op!r}")
    ring = _Ring.of(group, timeout, operation)
    N, d = ring.size, tensor.numel()
    sizes = check_sizes([d] if sizes is None else sizes, d, operation)
    stats = AllReduceStats(rounds=2 * (N - 1) if N > 1 else 0)
    if N == 1 or d == 0:
        return stats
    agreed = 0
    if scales is None:
        scales = agreed_scales(tensor, sizes, group, timeout, "cast", operation=operation)
        agreed = scales_bytes(len(sizes), N, "cast")
    with torch.no_grad():
        apply_scales(tensor, sizes, scales)
        low = tensor.to(wire)
        what = f"the {str(wire)[6:]} all-reduce"
        try:
            work = dist.all_reduce(low, group=group, async_op=True)
        except Exception as error:
            raise ring._failure(what, "(all ranks of the group)", error) from error
        ring.await_works([work], what, "(all ranks of the group)")
        tensor.copy_(low)
        apply_scales(tensor, sizes, scales, inverse=True)
        if op == "avg":
            tensor.div_(N)
    stats.bytes_sent = 2 * (N - 1) * d * low.element_size() // N + agreed
    stats.bytes_received = stats.bytes_sent
    return stats


__all__ = [
    "RULES",
    "agreed_scales",
    "agreed_statistics",
    "apply_scales",
    "cast_all_reduce",
    "check_sizes",
    "equilibrated",
    "per_position",
    "restore_zero_segments",
    "scales_bytes",
    "scales_from",
    "segment_statistics",
]
