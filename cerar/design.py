"""Code design explorer: error, conditioning and rates of the CERAR constructions.

What
----
``python -m cerar.design --N 4 --c 16`` builds each construction for one (N, c) and prints one row
per construction: eps, kappa, the predicted (analytic, rounding-free) worst-worker error, the error
measured by running the protocol with ``cerar.simulate`` on Gaussian gradients in the transport
dtype, the worst and best worker, the communication rate against the exact ring's, and the storage
rate. Constructions whose kappa budget cannot be met, and 16-bit dtypes the code is too
ill-conditioned for, are shown as rows that say so instead of stopping the run.

``python -m cerar.design --sweep`` measures the worst-worker error against kappa for every
construction over a grid of (N, c) and kappa budgets and writes ``reports/code_design.md``,
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
import csv
import dataclasses
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from cerar.codes import CONSTRUCTIONS, DEFAULT_KAPPA_MAX, LOW_PRECISION_KAPPA_LIMIT, make_code
from cerar.simulate import simulate

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
"""The optimiser takes seconds to a minute per (N, c, kappa_max); it gets fewer budget points."""
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


def write_csv(rows: Sequence[DesignRow], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            values = dataclasses.asdict(row)
            writer.writerow(["" if values[k] is None else values[k] for k in CSV_COLUMNS])


KAPPA_AXIS_MAX = 1e18
"""The figure's kappa axis reaches the Vandermonde codes (1e9..1e17 at c >= 8); beyond ~1e15 even
their float64 construction, and so their predicted error, is unreliable."""


def plot_error_vs_kappa(rows: Sequence[DesignRow], path: Path) -> None:
    """One panel per (N, c), one curve per construction: measured float32 worst-worker error
    (solid, markers) and predicted truncation error (dashed) against kappa, with the float32
    rounding scale kappa * 2^-24 for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ns = sorted({r.N for r in rows})
    cs = sorted({r.c for r in rows})
    colours = {
        "exact": "black",
        "vandermonde": "tab:red",
        "perturbation": "tab:blue",
        "optimized": "tab:green",
    }
    fig, axes = plt.subplots(
        len(Ns), len(cs), figsize=(4.2 * len(cs), 3.6 * len(Ns)), squeeze=False, sharex=True, sharey=True
    )
    for a, N in enumerate(Ns):
        for b, c in enumerate(cs):
            ax = axes[a][b]
            panel = [r for r in rows if r.N == N and r.c == c and r.ok]
            for name in ("vandermonde", "perturbation", "optimized", "exact"):  # exact drawn on top
                points = sorted((r.kappa, r.measured_error, r.predicted_error) for r in panel if r.construction == name)
                if not points:
                    continue
                kappa, measured, predicted = (np.array(v) for v in zip(*points, strict=True))
                style = {"marker": "*", "ms": 11} if name == "exact" else {"marker": "o", "ms": 4}
                ax.loglog(kappa, measured, "-", color=colours[name], label=f"{name} (float32)", **style)
                shown = predicted > 0
                if shown.any():
                    ax.loglog(kappa[shown], predicted[shown], "--", color=colours[name], lw=1, alpha=0.7)
            grid = np.geomspace(1, KAPPA_AXIS_MAX, 50)
            ax.loglog(grid, grid * UNIT_ROUNDOFF["float32"], ":", color="grey", lw=1, label="kappa * 2^-24")
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set_xlim(0.5, KAPPA_AXIS_MAX)
            ax.set_ylim(1e-8, 1e10)
            ax.set_title(f"N={N}, c={c}")
            ax.grid(True, which="major", alpha=0.3)
            if a == len(Ns) - 1:
                ax.set_xlabel("kappa = max_j cond(A_j)")
            if b == 0:
                ax.set_ylabel("worst-worker relative error")
    handles, labels = {}, {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
            labels.setdefault(label, label)
    fig.legend(handles.values(), labels.values(), loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle("CERAR: worst-worker error vs kappa (solid: measured float32, dashed: predicted truncation)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def _provenance() -> str:
    """The commit the numbers came from, and whether cerar/ differed from it (the measurement
    runs the simulator of the working tree)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "cerar"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    changed = sorted({line[3:] for line in dirty if line.strip()} - {"cerar/design.py"})
    return f"commit {commit}" + (f", with uncommitted changes to {', '.join(changed)}" if changed else "")


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs; Python "
        f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}; CPU only"
    )


def _md_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def _rounding_dominated(row: DesignRow) -> bool:
    """Whether float32 transport rounding, not truncation, makes most of the measured error."""
    return row.ok and row.measured_error > 2 * row.predicted_error


def _rounding_error(row: DesignRow) -> float:
    """The measured error's part not explained by truncation: sqrt(measured^2 - predicted^2).

    Truncation and rounding errors are nearly uncorrelated, so their squares add."""
    return math.sqrt(max(row.measured_error**2 - row.predicted_error**2, 0.0))


def _rounding_summary(rows: Sequence[DesignRow]) -> str:
    """Where float32 rounding overtakes truncation, from the sweep's own rows: the rounding part's
    size against kappa * 2^-24, and per curve the best float32 operating point and the smallest
    kappa at which rounding dominates."""
    unit = UNIT_ROUNDOFF["float32"]
    inexact = [r for r in rows if r.ok and r.predicted_error > 1e-12 and r.sweep != "eps"]
    # Only rounding-dominated rows estimate the rounding part well: elsewhere it is lost in the
    # sampling noise of the truncation part.
    ratios = [_rounding_error(r) / (r.kappa * unit) for r in inexact if _rounding_dominated(r)]
    lines = [
        "Transport rounding grows like kappa x 2^-24 (~ kappa x 6e-8, the dotted line in the figure);",
        "truncation is the code's predicted error and falls as the kappa budget grows. A row is",
        'marked "rounding" when its measured error exceeds twice the predicted one. The exact codes',
        "(c <= N) and the last worker of every code have no truncation error: they show rounding alone.",
        "",
    ]
    if ratios:
        lines.append(
            f"Across the {len(ratios)} rounding-dominated inexact kappa-budget rows, the rounding part "
            f"sqrt(measured^2 - predicted^2) is {np.median(ratios):.2g} x kappa x 2^-24 (median; range "
            f"{min(ratios):.2g}-{max(ratios):.2g}). Where rounding dominates, the measured figure depends on "
            "the order of float32 operations, so it can change with the simulator's implementation."
        )
        lines.append("")
    body = []
    for N, c, name in sorted({(r.N, r.c, r.construction) for r in inexact}):
        curve = sorted((r for r in inexact if (r.N, r.c, r.construction) == (N, c, name)), key=lambda r: r.kappa)
        best = min(curve, key=lambda r: r.measured_error)
        dominated = [r for r in curve if _rounding_dominated(r)]
        body.append(
            (
                str(N),
                str(c),
                name,
                f"{best.measured_error:.2g} at kappa {best.kappa:.2g}",
                f"{dominated[0].kappa:.2g}" if dominated else "not in grid",
            )
        )
    if body:
        lines.append(
            _md_table(
                (
                    "N",
                    "c",
                    "construction",
                    "best float32 error (kappa-budget rows)",
                    "rounding dominates from kappa",
                ),
                body,
            )
        )
    return "\n".join(lines)


def render_report(
    rows: Sequence[DesignRow],
    bar: tuple[DesignRow, DesignRow],
    references: Sequence[DesignRow],
    command: str,
    seconds: float,
    csv_path: str,
    png_path: str,
) -> str:
    """The markdown report: constructions, the bar, the reference comparison, the sweep, numerics."""
    pert, opt = bar
    N, c = pert.N, pert.c
    if pert.ok and opt.ok:
        ratio = opt.measured_error / pert.measured_error
        verdict = "**met**" if ratio <= BAR_RATIO else "**NOT met**"
        bar_line = (
            f"optimized / perturbation = {opt.measured_error:.3g} / {pert.measured_error:.3g} = "
            f"**{ratio:.3f}** (bar: <= {BAR_RATIO}): {verdict}."
        )
    else:
        bar_line = f"could not be measured: perturbation {pert.status}; optimized {opt.status}."
    bar_table = _md_table(
        (
            "construction",
            "eps",
            "kappa",
            "predicted error",
            "measured error (float32)",
            "worst / best worker",
        ),
        [
            (
                r.construction,
                _fmt(r.eps),
                _fmt(r.kappa),
                _fmt(r.predicted_error),
                _fmt(r.measured_error),
                f"{r.worst_worker} / {r.best_worker}",
            )
            for r in bar
        ],
    )
    reference_table = _md_table(
        (
            "N",
            "c",
            "delta = eps",
            "spec kappa(V)",
            "our kappa = max cond(A_j)",
            "spec error",
            "floor delta sqrt((N-1)/c)",
            "our predicted",
            "our measured",
        ),
        [
            (
                str(N_),
                str(c_),
                f"{delta:g}",
                f"{kappa_spec:.2g}",
                _fmt(r.kappa, ".2g"),
                f"{err_spec:.2g}",
                f"{delta * math.sqrt((N_ - 1) / c_):.2g}",
                _fmt(r.predicted_error, ".2g"),
                _fmt(r.measured_error, ".2g") if r.ok else r.status,
            )
            for (N_, c_, delta, kappa_spec, err_spec), r in zip(REFERENCE_TABLE, references, strict=True)
        ],
    )
    sweep_body = []
    for r in rows:
        budget = (
            _fmt(r.kappa_max)
            if r.sweep == "kappa_max"
            else ("-" if r.requested_eps is None else f"eps={r.requested_eps:g}")
        )
        if r.ok:
            regime = "rounding" if _rounding_dominated(r) else "truncation"
            sweep_body.append(
                (
                    str(r.N),
                    str(r.c),
                    r.construction,
                    budget,
                    _fmt(r.eps),
                    _fmt(r.kappa),
                    _fmt(r.predicted_error),
                    _fmt(r.measured_error),
                    regime,
                )
            )
        else:
            reason = r.status.split(";")[0].replace("|", "/")
            sweep_body.append((str(r.N), str(r.c), r.construction, budget, "-", "-", "-", "-", reason))
    sweep_table = _md_table(
        (
            "N",
            "c",
            "construction",
            "budget",
            "eps",
            "kappa",
            "predicted",
            "measured (float32)",
            "regime / status",
        ),
        sweep_body,
    )
    rounding_section = _rounding_summary(rows)
    return f"""# CERAR code design: error against conditioning

Generated by `cerar/design.py`; do not edit by hand. Raw rows: `{csv_path}`; figure: `{png_path}`.

## How this was made

```
{command}
```

- Machine: {_machine()}.
- Code: {_provenance()}.
- Sweep wall time: {seconds:.0f} s (optimized codes are cached on disk, `$CERAR_CACHE_DIR` or
  `~/.cache/cerar`; a first run searches them, later runs reuse them).
- Measurement: N i.i.d. standard normal gradients of length d = {rows[0].d if rows else pert.d}
  (seed {pert.seed}), drawn in float64 and rounded to float32; `cerar.simulate` runs the protocol in
  float32; error = max_i ||S_hat_i - S|| / ||S|| with S summed in float64 from the rounded inputs.
  "Predicted" is `Code.predicted_error()`: the expected worst-worker error from the matrices alone
  (truncation, no rounding).

## The constructions

- **exact** (c <= N): c conjugate-closed N-th roots of unity. Every worker exact up to rounding;
  kappa = 1 at c = N. Sends as much as the ring at c = N, so it saves nothing.
- **vandermonde**: c real points clustered at 1 with a^N = 1 + eps b_k. Error O(eps), kappa
  O(eps^-(c-1)): at c >= 8 kappa exceeds 1e9 even at eps near 1, so it is on the plot only through
  explicit eps, and it is unusable in float32. Beyond kappa ~ 1e15 even its float64 construction
  fails, so its predicted errors there (some above 1) are meaningless too.
- **perturbation**: q = ceil(c/N) rings of N-th roots scaled by rho_s, rho_s^N = 1 + eps b_s. Error
  O(eps), kappa O(eps^-(q-1)). With a kappa budget, eps is the smallest meeting it.
- **optimized** (`cerar/optimize.py`): the condition-number-constrained design. Least-squares
  decoders per worker, and encoders from a searched conjugate-closed pattern of points around each
  N-th root of unity, sized to the smallest pattern meeting kappa_max. Never worse than the
  perturbation code it starts from.

All share L = c + N - 2 rounds, (1 + (N-2)/c) d values sent per worker (against the ring's
2(N-1)/N d) and (1 + N/c) d storage.

## The optimiser's bar: N={N}, c={c}, float32, kappa_max={_fmt(pert.kappa_max)}

{bar_table}

{bar_line}

## The specification's reference figures, re-measured

Perturbation construction, eps = delta (the largest |rho^N - 1|), float32, worst worker. The spec
quotes kappa(V), we quote max_j cond(A_j) (the quantity rounding scales with), so those columns
differ by construction. "Floor" is the smallest worst-worker error any such code can have: the
outermost level holds N points with |a^N - 1| = delta, and worker 0 errs on each of their
components by delta times the sum of N-1 gradients, so its relative error is at least
delta sqrt((N-1)/c). A spec error below the floor cannot come from this construction as specified.

{reference_table}

## Where float32 rounding dominates

{rounding_section}

## The sweep

![worst-worker error vs kappa]({Path(png_path).relative_to(Path(png_path).parent.parent)})

{sweep_table}
"""


def run_sweep(args: argparse.Namespace, argv: Sequence[str]) -> int:
    started = time.perf_counter()
    out = Path(args.out)
    rows = sweep_rows(args, log=lambda line: print(line, flush=True))
    bar = bar_rows(args)
    references = reference_rows(args)
    seconds = time.perf_counter() - started
    csv_path, png_path, md_path = (
        out / "data" / "code_design.csv",
        out / "figures" / "error_vs_kappa.png",
        out / "code_design.md",
    )
    write_csv([*rows, *bar, *references], csv_path)
    plot_error_vs_kappa(rows, png_path)
    cache_dir = os.environ.get("CERAR_CACHE_DIR")
    command = (f"CERAR_CACHE_DIR={shlex.quote(cache_dir)} " if cache_dir else "") + "python -m cerar.design "
    command += shlex.join(argv)
    md_path.write_text(render_report(rows, bar, references, command, seconds, str(csv_path), str(png_path)))
    pert, opt = bar
    print(
        f"bar N={pert.N} c={pert.c} kappa_max={_fmt(pert.kappa_max)} float32: perturbation "
        f"{_fmt(pert.measured_error)}, optimized {_fmt(opt.measured_error)}, ratio "
        f"{_fmt(opt.measured_error / pert.measured_error) if pert.ok and opt.ok else '-'}"
    )
    print(f"wrote {md_path}, {png_path}, {csv_path} in {seconds:.0f} s")
    return 0


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
        prog="python -m cerar.design",
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
        help=f"transport dtype of the measurement; 16-bit only for kappa <= {LOW_PRECISION_KAPPA_LIMIT:g}",
    )
    ap.add_argument("--d", type=_positive_int, default=2**16, help="gradient length measured (default 65536)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the Gaussian gradients (default 0)")
    sweep = ap.add_argument_group("sweep (writes the report, figure and csv)")
    sweep.add_argument("--sweep", action="store_true", help="run the error-vs-kappa sweep instead of one table")
    sweep.add_argument("--out", default="reports", help="report directory (default reports)")
    sweep.add_argument("--grid-N", type=_list_of(_positive_int), default=DEFAULT_SWEEP_N, help="e.g. 4,8")
    sweep.add_argument("--grid-c", type=_list_of(_positive_int), default=DEFAULT_SWEEP_C, help="e.g. 8,16,32")
    sweep.add_argument(
        "--grid-kappa-max",
        type=_list_of(_kappa),
        default=DEFAULT_SWEEP_KAPPA_MAX,
        help="kappa budgets for vandermonde and perturbation (default 1e1..1e8, one per decade)",
    )
    sweep.add_argument(
        "--grid-optimized-kappa-max",
        type=_list_of(_kappa),
        default=DEFAULT_SWEEP_OPTIMIZED_KAPPA_MAX,
        help="kappa budgets for optimized (fewer: its search is slow)",
    )
    sweep.add_argument(
        "--grid-eps",
        type=_list_of(_eps),
        default=DEFAULT_SWEEP_EPS,
        help="explicit eps for vandermonde and perturbation",
    )
    sweep.add_argument(
        "--bar",
        type=_bar,
        default=DEFAULT_BAR,
        help="N,c,kappa_max of the optimiser's bar reported (default 4,16,1e4)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.sweep:
        return run_sweep(args, argv)
    return run_table(args)


if __name__ == "__main__":
    sys.exit(main())
