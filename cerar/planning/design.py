"""Code design explorer: error, conditioning and rates of the CERAR constructions.

What
----
``python -m cerar.planning.design --N 4 --c 16`` builds each construction for one (N, c) and prints one row
per construction: eps, kappa, the predicted (analytic, rounding-free) worst-worker error, the error
measured by running the protocol with ``cerar.simulate`` on Gaussian gradients in the transport
dtype, the worst and best worker, the communication rate against the exact ring's, and the storage
rate. Constructions whose kappa budget cannot be met, and 16-bit dtypes the code is too
ill-conditioned for, are shown as rows that say so instead of stopping the run.

``sweep_rows`` measures the worst-worker error against kappa for every construction over a grid of
(N, c) and kappa budgets; ``scripts/reporting/design_report.py`` runs it and writes ``reports/code_design.md``,
``reports/figures/error_vs_kappa.png`` and the raw rows ``reports/data/code_design.csv``.

Why
---
Every construction trades truncation error (O(eps)) against conditioning (kappa grows as eps
shrinks), and float transport adds rounding of about kappa times the unit roundoff. Seeing both
terms side by side is how a code is chosen for training, and the report records the optimiser's
bar: at N = 4, c = 16, float32, kappa_max = 1e4 the optimised construction must err at most half
as much as the perturbation construction tuned to the same budget.

The measured error is max_i ||S_hat_i - S|| / ||S|| with S = sum_i G_i computed in float64 from
the same dtype-rounded G, so it contains truncation and transport rounding but no input rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from cerar.coding.codes import CONSTRUCTIONS, DEFAULT_KAPPA_MAX, make_code
from cerar.ring.simulate import simulate

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

UNIT_ROUNDOFF = {"float32": 2.0**-24, "float64": 2.0**-53, "bfloat16": 2.0**-8, "float16": 2.0**-11}
"""Half the spacing of the dtype's floats at 1: transport rounding is about kappa times this."""

SWEEP_CONSTRUCTIONS = ("vandermonde", "perturbation", "optimized")
DEFAULT_SWEEP_N = (4, 8)
DEFAULT_SWEEP_C = (8, 16, 32)
DEFAULT_SWEEP_KAPPA_MAX = tuple(f * 10.0**k for k in range(1, 9) for f in (1, 3))[:-1]
"""1e1, 3e1, ..., 1e8: the closed forms build in well under a second, so they get a fine grid."""
DEFAULT_SWEEP_OPTIMIZED_KAPPA_MAX = (1e2, 1e3, 1e4, 1e6, 1e7)
"""Fewer budget points for the optimiser: outside the table shipped with the package (which holds
this sweep's grid, ``cerar.coding.stored_codes``) it searches for seconds to minutes per (N, c, kappa_max)."""
DEFAULT_SWEEP_EPS = (0.9, 0.5, 0.3, 0.1, 0.03, 0.01)
"""Explicit eps for the closed forms: places the Vandermonde code (kappa beyond any sane budget at
c >= 8) on the plot at all, and extends the perturbation curve into the rounding-broken regime."""
DEFAULT_BAR = (4, 16, 1e4)
"""(N, c, kappa_max) of the optimiser's bar: optimized worst-worker error <= half perturbation's."""
BAR_RATIO = 0.5

REFERENCE_TABLE = (
    # N, c, delta (= eps), the spec's kappa(V), the spec's float32 worst-worker error
    (8, 16, 0.01, 4.0e2, 6.6e-3),
    (4, 8, 0.01, 4.0e2, 6.1e-3),
    (4, 16, 0.1, 3.9e5, 3.9e-2),
    (4, 16, 0.03, 1.4e7, 0.61),
)
"""The perturbation figures of the specification (cerar-construction.md, "Numerics")."""

CSV_COLUMNS = (
    "N", "c", "construction", "sweep", "kappa_max", "requested_eps", "eps", "kappa", "predicted_error",
    "measured_error", "best_measured_error", "worst_worker", "best_worker", "comm_rate", "ring_rate",
    "storage_rate", "dtype", "d", "seed", "status", "seconds",
)  # fmt: skip


@dataclasses.dataclass
class DesignRow:
    """One construction at one (N, c, eps, kappa_max), measured in one dtype.

    ``status`` is "ok", "unreachable: <reason>" (no code meets the request) or "refused: <reason>"
    (the code exists but the dtype cannot carry it); numbers that were not obtained are NaN / -1.
    """

    N: int
    c: int
    construction: str
    sweep: str  # which part of the run made the row: "kappa_max", "eps", "exact", "bar", "reference", "cli"
    kappa_max: float | None
    requested_eps: float | None
    eps: float | None = None  # the code's own: largest |a^N - 1| (None for exact codes)
    kappa: float = math.nan
    predicted_error: float = math.nan
    measured_error: float = math.nan
    best_measured_error: float = math.nan
    worst_worker: int = -1
    best_worker: int = -1
    comm_rate: float = math.nan
    ring_rate: float = math.nan
    storage_rate: float = math.nan
    dtype: str = "float32"
    d: int = 0
    seed: int = 0
    status: str = "ok"
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def gaussian_gradients(N: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[N, d] i.i.d. standard normal gradients, drawn in float64 and rounded to ``dtype``, so every
    dtype sees the same values up to its own rounding."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(N, d, generator=generator, dtype=torch.float64).to(dtype)


def measured_worker_errors(code, dtype: torch.dtype, d: int, seed: int) -> np.ndarray:
    """Each worker's ||S_hat_i - S|| / ||S|| after running the protocol in ``dtype``.

    S is summed in float64 from the dtype-rounded inputs: the error is the code's and the
    transport's, not the input rounding's. Raises ValueError if the dtype is refused for the code.
    """
    G = gaussian_gradients(code.N, d, dtype, seed)
    exact_sum = G.to(torch.float64).sum(0)
    result = simulate(G, code).to(torch.float64)
    return ((result - exact_sum).norm(dim=1) / exact_sum.norm()).numpy()


def evaluate(
    N: int,
    c: int,
    construction: str,
    *,
    eps: float | None = None,
    kappa_max: float | None = None,
    dtype: str = "float32",
    d: int = 2**16,
    seed: int = 0,
    sweep: str = "cli",
) -> DesignRow:
    """Build one code and measure it; failures become the row's status rather than exceptions."""
    started = time.perf_counter()
    row = DesignRow(N, c, construction, sweep, kappa_max, eps, dtype=dtype, d=d, seed=seed)
    try:
        code = make_code(N, c, construction, eps=eps, kappa_max=kappa_max)
    except ValueError as err:
        row.status = f"unreachable: {err}"
        row.seconds = time.perf_counter() - started
        return row
    row.eps = code.eps
    row.kappa = code.kappa
    row.predicted_error = code.predicted_error()
    row.comm_rate, row.ring_rate, row.storage_rate = code.comm_rate, code.ring_rate, code.storage_rate
    try:
        errors = measured_worker_errors(code, DTYPES[dtype], d, seed)
    except ValueError as err:
        row.status = f"refused: {err}"
    else:
        row.measured_error = float(errors.max())
        row.best_measured_error = float(errors.min())
        row.worst_worker = int(errors.argmax())
        row.best_worker = int(errors.argmin())
    row.seconds = time.perf_counter() - started
    return row


# ---------------------------------------------------------------------------------------------
# Table mode
# ---------------------------------------------------------------------------------------------


def applicable_constructions(N: int, c: int) -> list[str]:
    """All constructions, less ``exact`` when c > N (it needs c of the N N-th roots of unity)."""
    return [name for name in CONSTRUCTIONS if name != "exact" or c <= N]


def _fmt(value: float | None, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_table(rows: Sequence[DesignRow]) -> str:
    """A fixed-width text table, one line per row; unreachable/refused rows carry their reason."""
    header = (
        "construction",
        "eps",
        "kappa",
        "predicted",
        "measured",
        "worst(i)",
        "best(i)",
        "comm vs ring",
        "storage",
    )
    lines = []
    for row in rows:
        rates = f"{row.comm_rate:.3f} vs {row.ring_rate:.3f}" if not math.isnan(row.comm_rate) else "-"
        worst = f"{_fmt(row.measured_error)} ({row.worst_worker})" if row.ok else "-"
        best = f"{_fmt(row.best_measured_error)} ({row.best_worker})" if row.ok else "-"
        cells = (
            row.construction,
            _fmt(row.eps),
            _fmt(row.kappa),
            _fmt(row.predicted_error),
            _fmt(row.measured_error),
            worst,
            best,
            rates,
            _fmt(row.storage_rate, ".3f"),
        )
        lines.append((cells, None if row.ok else row.status))
    widths = [max(len(h), *(len(cells[k]) for cells, _ in lines)) for k, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    for cells, note in lines:
        if note is not None and cells[1] == "-":  # nothing built: the reason replaces the numbers
            out.append(f"{cells[0].ljust(widths[0])}  {note}")
            continue
        out.append("  ".join(v.ljust(w) for v, w in zip(cells, widths, strict=True)).rstrip())
        if note is not None:
            out.append(f"{'':{widths[0]}}  {note}")
    return "\n".join(out)


def run_table(args: argparse.Namespace) -> int:
    constructions = args.construction or applicable_constructions(args.N, args.c)
    if args.kappa_max is None and args.eps is None:
        budget = f"kappa_max={DEFAULT_KAPPA_MAX:g} (default)"
    else:
        budget = f"kappa_max={_fmt(args.kappa_max)}, eps={_fmt(args.eps)}"
    print(
        f"CERAR codes for N={args.N}, c={args.c} (L={args.c + args.N - 2 if args.N > 1 else 0} rounds), "
        f"{budget}, dtype={args.dtype}, d={args.d}, "
        f"seed={args.seed}; errors are the worst worker's relative error, predicted = truncation only"
    )
    rows = [
        evaluate(
            args.N,
            args.c,
            name,
            eps=args.eps,
            kappa_max=args.kappa_max,
            dtype=args.dtype,
            d=args.d,
            seed=args.seed,
        )
        for name in constructions
    ]
    print(format_table(rows))
    return 0


# ---------------------------------------------------------------------------------------------
# Transport: code error, rounding and their total against kappa_max, per wire dtype
# ---------------------------------------------------------------------------------------------

TRANSPORT_SWEEP_KAPPA_MAX = (10.0, 15.0, 20.0, 32.0, 64.0, 100.0, 200.0, 1e3, 1e4)
"""kappa budgets of the transport sweep: fine where 16-bit messages balance (bf16 20-32, fp16 64-100), coarse up
to fp32's 1e4."""
TRANSPORT_SWEEP_SHAPES = ((4, 5), (4, 8), (8, 9), (8, 16))
"""(N, c) the 16-bit default kappa_max is chosen over: c = N + 1 and c = 2N at N = 4 and 8."""


@dataclasses.dataclass
class TransportRow:
    """One code (N, c, construction, kappa_max) on one wire dtype: its predicted (truncation) error, the
    rounding its messages add on that wire (16 bits: ``cerar.ring.precision.expected_rounding``, measured on
    Gaussian gradients like the code error; float32: the arithmetic's ``rounding_bound``), their total
    (in quadrature: the two are independent) and whether the rule admits it
    (``cerar.ring.precision.admissible_kappa``; float32: always)."""

    N: int
    c: int
    construction: str
    kappa_max: float
    transport: str
    kappa: float = math.nan
    code_error: float = math.nan
    rounding_error: float = math.nan
    admissible: bool = False
    status: str = "ok"

    @property
    def total(self) -> float:
        return math.hypot(self.code_error, self.rounding_error)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def transport_rows(
    N: int,
    c: int,
    construction: str = "optimized",
    kappa_grid: Sequence[float] = TRANSPORT_SWEEP_KAPPA_MAX,
    transports: Sequence[str] = ("float32", "float16", "bfloat16"),
) -> list[TransportRow]:
    """Every kappa_max of ``kappa_grid`` on every wire of ``transports``: a row each (an unreachable budget
    gives rows that say so)."""
    from cerar.formats.wire import transport_dtype
    from cerar.ring.precision import admissible_kappa, expected_rounding, rounding_bound

    rows = []
    for kappa_max in kappa_grid:
        try:
            code = make_code(N, c, construction, kappa_max=kappa_max)
        except ValueError as err:
            rows += [TransportRow(N, c, construction, kappa_max, t, status=f"unreachable: {err}") for t in transports]
            continue
        for transport in transports:
            wire = transport_dtype(transport)
            rounding = rounding_bound(code, torch.float32) if wire == torch.float32 else expected_rounding(code, wire)
            admissible = wire == torch.float32 or max(code.kappa, 1.0) <= admissible_kappa(code, torch.float32, wire)
            rows.append(
                TransportRow(
                    N, c, construction, kappa_max, transport, code.kappa, code.predicted_error(), rounding, admissible
                )
            )
    return rows


def best_kappa_max(rows: Sequence[TransportRow], transport: str) -> float | None:
    """The kappa_max whose code has the least total (code error and rounding in quadrature) on ``transport`` among the
    rows the rule admits; None where it admits none."""
    candidates = [r for r in rows if r.transport == transport and r.ok and r.admissible]
    return min(candidates, key=lambda r: (r.total, r.kappa_max)).kappa_max if candidates else None


def least_total_kappa_max(rows: Sequence[TransportRow], transport: str) -> float | None:
    """The kappa_max with the least total on ``transport`` whether the rule admits it or not (bf16: the rule
    admits almost nothing, and this is where its total is least all the same); None where none is reachable."""
    candidates = [r for r in rows if r.transport == transport and r.ok]
    return min(candidates, key=lambda r: (r.total, r.kappa_max)).kappa_max if candidates else None


def chosen_default(rows: Sequence[TransportRow], transport: str) -> float | None:
    """The 16-bit default kappa_max the rows support: the per-shape minimiser (``best_kappa_max``, else
    ``least_total_kappa_max``) that most shapes share, the smaller on a tie."""
    shapes = sorted({(r.N, r.c, r.construction) for r in rows})
    picks = []
    for shape in shapes:
        mine = [r for r in rows if (r.N, r.c, r.construction) == shape]
        pick = best_kappa_max(mine, transport) or least_total_kappa_max(mine, transport)
        if pick is not None:
            picks.append(pick)
    if not picks:
        return None
    return min(set(picks), key=lambda k: (-picks.count(k), k))


def format_transport_table(rows: Sequence[TransportRow]) -> str:
    """Rows of one shape as a text table: per kappa_max, kappa and code error, then rounding and total per wire."""
    transports = list(dict.fromkeys(r.transport for r in rows))
    header = ["kappa_max", "kappa", "code error"] + [f"{t} round / total" for t in transports]
    body = []
    for kappa_max in dict.fromkeys(r.kappa_max for r in rows):
        mine = {r.transport: r for r in rows if r.kappa_max == kappa_max}
        first = next(iter(mine.values()))
        if not first.ok:
            body.append([_fmt(kappa_max), "unreachable", ""] + ["" for _ in transports])
            continue
        cells = [
            f"{_fmt(mine[t].rounding_error)} / {_fmt(mine[t].total)}{'' if mine[t].admissible else ' (refused)'}"
            for t in transports
        ]
        body.append([_fmt(kappa_max), _fmt(first.kappa), _fmt(first.code_error), *cells])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)) for line in [header, *body]]
    return "\n".join(lines)


def run_transport_sweep(args: argparse.Namespace) -> int:
    constructions = args.construction or ["optimized"]
    for construction in constructions:
        rows = transport_rows(args.N, args.c, construction)
        print(f"N={args.N} c={args.c} {construction}: code error (predicted), rounding on each wire, total")
        print(format_transport_table(rows))
        for transport in ("float32", "float16", "bfloat16"):
            best = best_kappa_max(rows, transport)
            print(
                f"  {transport}: least total among admitted codes at kappa_max={_fmt(best) if best else 'none'}"
                f" (least total, admitted or not: {_fmt(least_total_kappa_max(rows, transport) or math.nan)})"
            )
    return 0


# ---------------------------------------------------------------------------------------------
# Sweep mode
# ---------------------------------------------------------------------------------------------


def sweep_rows(args: argparse.Namespace, log=print) -> list[DesignRow]:
    """Every (N, c, construction, budget) of the sweep grid, float32-measured."""
    rows = []
    for N in args.grid_N:
        for c in args.grid_c:
            requests = []
            if c <= N:
                requests.append(("exact", None, None, "exact"))
            for name in ("vandermonde", "perturbation"):
                requests += [(name, None, k, "kappa_max") for k in args.grid_kappa_max]
                requests += [(name, e, None, "eps") for e in args.grid_eps]
            requests += [("optimized", None, k, "kappa_max") for k in args.grid_optimized_kappa_max]
            for name, eps, kappa_max, sweep in requests:
                row = evaluate(
                    N,
                    c,
                    name,
                    eps=eps,
                    kappa_max=kappa_max,
                    dtype="float32",
                    d=args.d,
                    seed=args.seed,
                    sweep=sweep,
                )
                rows.append(row)
                log(
                    f"N={N} c={c} {name:12s} {sweep}={_fmt(kappa_max if sweep == 'kappa_max' else eps)}: "
                    f"kappa={_fmt(row.kappa)} predicted={_fmt(row.predicted_error)} "
                    f"measured={_fmt(row.measured_error)} [{row.seconds:.1f}s]"
                    + ("" if row.ok else f" {row.status[:90]}")
                )
    return rows


def bar_rows(args: argparse.Namespace) -> tuple[DesignRow, DesignRow]:
    """The perturbation and optimized codes at the bar's (N, c, kappa_max), float32-measured."""
    N, c, kappa_max = args.bar
    return tuple(
        evaluate(N, c, name, kappa_max=kappa_max, dtype="float32", d=args.d, seed=args.seed, sweep="bar")
        for name in ("perturbation", "optimized")
    )


def reference_rows(args: argparse.Namespace) -> list[DesignRow]:
    """The spec's perturbation reference figures, re-measured by this code."""
    return [
        evaluate(N, c, "perturbation", eps=delta, dtype="float32", d=args.d, seed=args.seed, sweep="reference")
        for N, c, delta, _, _ in REFERENCE_TABLE
    ]


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _checked(convert, valid, requirement: str):
    """An argparse type: ``convert`` the text, then require ``valid`` (the message names what)."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value

    return parse


_positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
_kappa = _checked(float, lambda v: v >= 1 and math.isfinite(v), "a finite number >= 1")
_eps = _checked(float, lambda v: 0 < v < 1, "a number in (0, 1)")


def _list_of(item):
    """A comma-separated list parsed item by item (an empty list is refused)."""

    def parse(text: str) -> tuple:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError("must be a non-empty comma-separated list")
        return tuple(item(p.strip()) for p in parts)

    return parse


def _constructions(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in CONSTRUCTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown construction(s) {unknown or [text]}; choose from {CONSTRUCTIONS}")
    return names


def _bar(text: str) -> tuple[int, int, float]:
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"must be N,c,kappa_max, got {text!r}")
    return _positive_int(parts[0]), _positive_int(parts[1]), _kappa(parts[2])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m cerar.planning.design",
        description="Compare CERAR constructions: eps, kappa, predicted and measured error, rates.",
    )
    ap.add_argument("--N", type=_positive_int, default=4, help="workers on the ring (default 4)")
    ap.add_argument("--c", type=_positive_int, default=16, help="components per gradient (default 16)")
    ap.add_argument(
        "--construction",
        type=_constructions,
        action="extend",
        help=f"one of {', '.join(CONSTRUCTIONS)}; repeatable or comma-separated (default: all applicable)",
    )
    ap.add_argument(
        "--kappa-max",
        type=_kappa,
        default=None,
        help=f"condition-number budget (default: make_code's, {DEFAULT_KAPPA_MAX:g}, when --eps is absent)",
    )
    ap.add_argument("--eps", type=_eps, default=None, help="largest |a^N - 1|, in (0, 1) (default: from kappa)")
    ap.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="float32",
        help="dtype of the measurement (all arithmetic in it); 16-bit only for admissible codes (cerar.ring.precision)",
    )
    ap.add_argument("--d", type=_positive_int, default=2**16, help="gradient length measured (default 65536)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the Gaussian gradients (default 0)")
    ap.add_argument(
        "--transport-sweep",
        action="store_true",
        help="code error, rounding (16 bits: measured on Gaussian gradients) and total against kappa_max on "
        "float32/float16/bfloat16 messages, and the kappa_max with the least total (default construction: optimized)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.transport_sweep:
        return run_transport_sweep(args)
    return run_table(args)


if __name__ == "__main__":
    sys.exit(main())
