"""Writes reports/code_design.md, reports/figures/error_vs_kappa.png and reports/data/code_design.csv.

The error-vs-kappa sweep of the CERAR constructions: every construction over a grid of (N, c) and
kappa budgets, measured with ``cerar.simulate`` by ``cerar.planning.design`` (the library's analysis), and
rendered here, with the scripts that own ``reports/``.

    python scripts/reporting/design_report.py --out reports
    python scripts/reporting/design_report.py --out /tmp/r --grid-N 4 --grid-c 4,8 --d 4096   # a reduced sweep
    python scripts/reporting/design_report.py --transport        # reports/code_design_transport.md only

``--transport`` writes the 16-bit messages' part (docs/cerar-16bit.md): for the shapes the 16-bit default
kappa_max is chosen over (``cerar.planning.design.TRANSPORT_SWEEP_SHAPES``), code error, rounding on the wire
(measured on Gaussian gradients) and their total against kappa_max on float32, float16 and bfloat16
messages, which budgets the rule admits, the kappa_max with the least total per shape, and the default
those choices support (``cerar.planning.design.chosen_default``) beside the one the library ships
(``cerar.formats.wire.DEFAULT_TRANSPORT_KAPPA_MAX``).
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

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cerar.planning.design import (  # noqa: E402  (the repository root is on sys.path)
    BAR_RATIO,
    CSV_COLUMNS,
    DEFAULT_BAR,
    DEFAULT_SWEEP_C,
    DEFAULT_SWEEP_EPS,
    DEFAULT_SWEEP_KAPPA_MAX,
    DEFAULT_SWEEP_N,
    DEFAULT_SWEEP_OPTIMIZED_KAPPA_MAX,
    REFERENCE_TABLE,
    UNIT_ROUNDOFF,
    DesignRow,
    _bar,
    _eps,
    _fmt,
    _kappa,
    _list_of,
    _positive_int,
    bar_rows,
    reference_rows,
    sweep_rows,
)


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


def _provenance() -> str:
    """The commit the numbers came from, and whether cerar/ differed from it (the measurement
    runs the simulator of the working tree)."""
    from scripts.reporting.provenance import checkout_state  # the repository root is on sys.path

    state = checkout_state(ROOT)
    if state is None:
        return "not a git checkout"
    commit, changed = state
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

Generated by `scripts/reporting/design_report.py` (measured by `cerar.planning.design`); do not edit by hand.
Raw rows: `{csv_path}`; figure: `{png_path}`.

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
- **optimized** (`cerar/coding/optimize.py`): the condition-number-constrained design. Least-squares
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


def run_transport(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """reports/code_design_transport.md and reports/data/code_design_transport.csv (module docstring)."""
    from cerar.formats.wire import DEFAULT_TRANSPORT_KAPPA_MAX
    from cerar.planning.design import (
        TRANSPORT_SWEEP_SHAPES,
        best_kappa_max,
        chosen_default,
        least_total_kappa_max,
        transport_rows,
    )

    started = time.perf_counter()
    out = Path(args.out)
    transports = ("float32", "float16", "bfloat16")
    rows = []
    for N, c in TRANSPORT_SWEEP_SHAPES:
        for construction in ("optimized", "perturbation"):
            rows += transport_rows(N, c, construction, transports=transports)
    seconds = time.perf_counter() - started
    csv_path, md_path = out / "data" / "code_design_transport.csv", out / "code_design_transport.md"
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    fields = [f.name for f in dataclasses.fields(rows[0])] + ["total"]
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for r in rows:
            writer.writerow([getattr(r, name) for name in fields])
    parts = [
        "# Code design for 16-bit messages: code error, rounding and their total against kappa_max\n",
        f"Written by `python scripts/reporting/design_report.py {shlex.join(argv)}` in {seconds:.0f} s "
        f"({_provenance()}). Code error: `code.predicted_error()` (Gaussian gradients, no rounding). Rounding on a "
        "16-bit wire: `cerar.ring.precision.expected_rounding(code, wire)`, what the wire adds on the same Gaussian "
        "gradients (the protocol run with and without it), relative to ||S||, float32 arithmetic; on float32: "
        "`rounding_bound`. Total: the two in quadrature. A code is admitted on a 16-bit wire when that rounding is "
        "at most the larger of its code error and the exact ring's rounding on the same wire "
        "(`cerar.ring.precision.admissible_kappa`; docs/cerar-16bit.md). Raw rows: `" + str(csv_path) + "`.\n",
    ]
    shapes = list(dict.fromkeys((r.N, r.c, r.construction) for r in rows))
    for N, c, construction in shapes:
        mine = [r for r in rows if (r.N, r.c, r.construction) == (N, c, construction)]
        body = []
        for kappa_max in dict.fromkeys(r.kappa_max for r in mine):
            by = {r.transport: r for r in mine if r.kappa_max == kappa_max}
            first = by["float32"]
            if not first.ok:
                body.append([_fmt(kappa_max), "unreachable", "", *["" for _ in transports]])
                continue
            cells = [
                f"{_fmt(by[t].rounding_error)} / {_fmt(by[t].total)}" + ("" if by[t].admissible else " (refused)")
                for t in transports
            ]
            body.append([_fmt(kappa_max), _fmt(first.kappa), _fmt(first.code_error), *cells])
        header = ["kappa_max", "kappa", "code error", *[f"{t}: rounding / total" for t in transports]]
        picks = ", ".join(
            f"{t} {_fmt(best_kappa_max(mine, t)) if best_kappa_max(mine, t) else 'none admitted'}"
            f" (least total admitted or not: {_fmt(least_total_kappa_max(mine, t) or math.nan)})"
            for t in transports
        )
        parts.append(f"## N={N}, c={c}, {construction}\n\n{_md_table(header, body)}\n\nLeast total: {picks}.\n")
    optimized = [r for r in rows if r.construction == "optimized"]
    parts.append(
        "## The 16-bit defaults\n\n"
        + "\n".join(
            f"- {t}: the optimized codes' per-shape choices support kappa_max {_fmt(chosen_default(optimized, t))}; "
            f"the library ships {_fmt(DEFAULT_TRANSPORT_KAPPA_MAX[t])} (`cerar.default_kappa_max`)."
            for t in ("float16", "bfloat16")
        )
        + "\n"
    )
    md_path.write_text("\n".join(parts))
    print(f"wrote {md_path}, {csv_path} in {seconds:.0f} s")
    return 0


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
    command = (
        f"CERAR_CACHE_DIR={shlex.quote(cache_dir)} " if cache_dir else ""
    ) + "python scripts/reporting/design_report.py "
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python scripts/reporting/design_report.py",
        description="Sweep the CERAR constructions' error against kappa and write the code-design report.",
    )
    ap.add_argument("--out", default="reports", help="report directory (default reports)")
    ap.add_argument("--d", type=_positive_int, default=2**16, help="gradient length measured (default 65536)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the Gaussian gradients (default 0)")
    ap.add_argument(
        "--transport",
        action="store_true",
        help="write only reports/code_design_transport.md: error, rounding and total on float32/float16/bfloat16",
    )
    sweep = ap.add_argument_group("sweep")
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
    if args.transport:
        return run_transport(args, argv)
    return run_sweep(args, argv)


if __name__ == "__main__":
    sys.exit(main())
