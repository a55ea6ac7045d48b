"""Rebuilds cerar/coding/data/optimized_codes.json, the optimized codes that ship with the package.

    nice -n 10 python scripts/codes/build_shipped_codes.py                      # every tier, resumes
    python scripts/codes/build_shipped_codes.py --tiers used,grid --max-hours 2  # stop starting shapes after 2 h
    python scripts/codes/build_shipped_codes.py --list                           # the plan, with what is done

What: runs ``cerar.coding.optimize.search`` for each (N, c, kappa_max) of the plan and records the points and
decoder kind of each result (from which ``cerar.coding.stored_codes`` rebuilds the matrices), its kappa and
predicted error, and what the search cost (wall and CPU seconds, one BLAS thread). A shape whose
budget the search cannot meet is recorded under ``unreachable`` with the least kappa the search
reached and what finding that out cost, so that ``make_code`` refuses it at once. The tiers, in
order:

- ``used``: the shapes the presets, the README and the tests build at the default kappa_max
  (N=8, c=16 and c=32; N=4, c=16; N=2 and N=4 at small c), and the root's c=16 and c=32 on 2 and 3
  ranks (``aggregator=cerar`` on the quick start's 2 processes), beyond 4N and unreachable at 1e4;
- ``grid``: N = 2..8, c = N+1..4N at the default kappa_max (c <= N is the exact code, no search),
  the cheap shapes first (those whose c is not 3N or 4N search no pattern);
- ``budgets``: the other budgets the tests use, then the design report's sweep (N = 4, 8;
  c = 8, 16, 32; kappa_max = 1e2 .. 1e7);
- ``large``: N = 9..16 at c = 2N, 3N, 4N and the powers of two between N and 4N;
- ``transport16``: the grid (N = 2..8, c = N+1..4N) at the 16-bit default budgets
  (``cerar.formats.wire.DEFAULT_TRANSPORT_KAPPA_MAX``: float16's, then bfloat16's), the cheap shapes first.

Why: a first use of ``make_code(N, c, "optimized")`` otherwise searches for seconds to minutes on
every host. The table is written after every shape, so an interrupted build keeps what it found and
a rerun continues where it stopped; a table searched by other search code (another
``SEARCH_CODE_VERSION``) is started afresh, since the package would not use it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "cerar" / "__init__.py").is_file())
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import scipy  # noqa: E402

from cerar.coding import optimize, stored_codes  # noqa: E402
from cerar.coding.closed_forms import DEFAULT_KAPPA_MAX  # noqa: E402
from cerar.formats.wire import DEFAULT_TRANSPORT_KAPPA_MAX  # noqa: E402

TIERS = ("used", "grid", "budgets", "large", "transport16")
DESIGN_SWEEP_BUDGETS = (1e2, 1e3, 1e4, 1e6, 1e7)  # cerar.planning.design.DEFAULT_SWEEP_OPTIMIZED_KAPPA_MAX


def plan(tiers: list[str]) -> list[tuple[str, int, int, float]]:
    """(tier, N, c, kappa_max) in the order they are searched, each shape once."""
    k = float(DEFAULT_KAPPA_MAX)
    shapes: dict[str, list[tuple[int, int, float]]] = {
        "used": [
            *[(4, 16, k), (8, 16, k), (8, 32, k), (2, 6, k), (2, 8, k), (4, 8, k), (4, 12, k), (3, 7, k)],
            *[(2, 16, k), (3, 16, k), (2, 32, k), (3, 32, k)],
        ],
        "grid": sorted(
            [(N, c, k) for N in range(2, 9) for c in range(N + 1, 4 * N + 1)],
            key=lambda s: (_searches_a_pattern(s[0], s[1]), s[0], s[1]),
        ),
        "large": sorted(
            [
                (N, c, k)
                for N in range(9, 17)
                for c in sorted({2 * N, 3 * N, 4 * N} | {2**e for e in range(4, 7) if N < 2**e <= 4 * N})
            ],
            key=lambda s: (_searches_a_pattern(s[0], s[1]), s[0], s[1]),
        ),
        "transport16": [
            (N, c, k16)
            for k16 in dict.fromkeys(DEFAULT_TRANSPORT_KAPPA_MAX[t] for t in ("float16", "bfloat16"))
            for N, c in sorted(
                {(N, c) for N in range(2, 9) for c in range(N + 1, 4 * N + 1)},
                key=lambda s: (_searches_a_pattern(*s), s),
            )
        ],
        "budgets": [
            (4, 8, 1e3),
            (4, 16, 1e3),
            (4, 12, 1e3),
            (4, 8, 1e2),
            *[(N, c, b) for b in DESIGN_SWEEP_BUDGETS for N in (4, 8) for c in (8, 16, 32) if c > N],
        ],
    }
    seen, out = set(), []
    for tier in tiers:
        for N, c, kappa_max in shapes[tier]:
            if (N, c, kappa_max) not in seen:
                seen.add((N, c, kappa_max))
                out.append((tier, N, c, kappa_max))
    return out


def _searches_a_pattern(N: int, c: int) -> bool:
    """Whether the search runs Nelder-Mead over a pattern (c = qN with q >= 3): the costly shapes."""
    return c % N == 0 and c // N >= 3


def fresh_table() -> dict:
    return {
        "format": stored_codes.TABLE_FORMAT,
        **stored_codes.search_identity(),
        "built": {
            "by": "scripts/codes/build_shipped_codes.py",
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "scipy": scipy.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default",
        },
        "cost_note": (
            "search_cpu_seconds is the search's own CPU time (one BLAS thread); search_seconds its wall "
            "time, which includes waiting for the CPU on a machine shared with other work"
        ),
        "codes": [],
        "unreachable": [],
    }


def search_one(N: int, c: int, kappa_max: float) -> tuple[str, dict]:
    """Search one shape: ("codes", its record), checked to rebuild the searched matrices bit for bit,
    or ("unreachable", the record of the refusal)."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        found = optimize.search(N, c, kappa_max)
    except optimize.UnreachableBudgetError as refusal:
        found = refusal
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    cost = {"search_seconds": round(wall, 2), "search_cpu_seconds": round(cpu, 2)}
    if isinstance(found, optimize.UnreachableBudgetError):
        return "unreachable", stored_codes.unreachable_entry(found, **cost)
    entry = stored_codes.table_entry(N, c, kappa_max, found, **cost)
    points, A, D = optimize.matrices_from_points(stored_codes.entry_points(entry), N, entry["decoders"])
    if not (np.array_equal(points, found.points) and np.array_equal(A, found.A) and np.array_equal(D, found.D)):
        raise SystemExit(f"N={N} c={c} kappa_max={kappa_max:g}: the recorded points do not rebuild the searched code")
    return "codes", entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated, from {TIERS}")
    ap.add_argument("--out", type=Path, default=stored_codes.SHIPPED_TABLE, help="the table (default: the package's)")
    ap.add_argument("--max-hours", type=float, default=None, help="start no shape after this many hours")
    ap.add_argument("--list", action="store_true", help="print the plan and what the table holds, search nothing")
    args = ap.parse_args(argv)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        ap.error(f"--tiers: unknown tier(s) {unknown or [args.tiers]}; choose from {TIERS}")

    try:
        table = stored_codes.read_table(args.out)
    except stored_codes.ShippedTableError as err:  # e.g. an older format: rebuilt, as a stale table
        print(f"{err}: starting afresh", flush=True)
        table = None
    current = fresh_table()
    if table is not None and any(table[key] != current[key] for key in ("search_code_version", "search_parameters")):
        print(f"{args.out} was searched by search code {table['search_code_version']} with parameters "
              f"{table['search_parameters']}; the current search is {current['search_code_version']} with "
              f"{current['search_parameters']}: starting afresh", flush=True)  # fmt: skip
        table = None
    table = current if table is None else table
    done = {(e["N"], e["c"], float(e["kappa_max"])) for part in ("codes", "unreachable") for e in table[part]}
    todo = plan(tiers)
    if args.list:
        for tier, N, c, kappa_max in todo:
            print(f"{tier:8s} N={N:2d} c={c:3d} kappa_max={kappa_max:g}  {'done' if (N, c, kappa_max) in done else ''}")
        return 0

    deadline = None if args.max_hours is None else time.monotonic() + 3600 * args.max_hours
    for tier, N, c, kappa_max in todo:
        if (N, c, kappa_max) in done:
            continue
        if deadline is not None and time.monotonic() > deadline:
            print(f"--max-hours reached: N={N} c={c} kappa_max={kappa_max:g} and later shapes not searched", flush=True)
            break
        part, entry = search_one(N, c, kappa_max)
        table[part].append(entry)
        table["built"]["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        stored_codes.write_table(table, args.out)
        done.add((N, c, kappa_max))
        found = (
            f"{entry['origin']}, kappa {entry['kappa']:.4g}, error {entry['predicted_error']:.4g}"
            if part == "codes"
            else f"unreachable, least kappa reached {entry['best_kappa']:.4g}"
        )
        print(
            f"{tier} N={N} c={c} kappa_max={kappa_max:g}: {found}, {entry['search_cpu_seconds']:.1f} s CPU "
            f"({entry['search_seconds']:.1f} s wall)  [{len(table['codes'])} codes, "
            f"{len(table['unreachable'])} unreachable in the table]",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
