"""Where optimized codes come from: the table shipped with the package, the host's cache, a search.

The search (``cerar.optimize``) takes seconds to minutes per (N, c, kappa_max), and every process of
every host would pay it on first use. So ``optimized_code`` looks in three places, in order:

1. The shipped table, ``cerar/data/optimized_codes.json`` (``scripts/codes/build_shipped_codes.py``
   rebuilds it; its header says which shapes it holds and what each cost to search). For each
   (N, c, kappa_max) it keeps the points and the kind of decoder the search chose; the matrices are
   rebuilt from them (``cerar.optimize.matrices_from_points``, milliseconds): bit for bit the
   searched ones on a machine whose linear algebra rounds alike, within rounding elsewhere, as for
   every construction. The table is used only while its ``search_code_version`` is the current
   search code's (``SEARCH_CODE_VERSION``, blind to comments and docstrings): an edited search gets
   its own results at once, as it does from the cache, and ``tests/test_shipped_codes.py`` fails
   until the table is rebuilt, so that a stale table never ships.
2. The host's cache, ``$CERAR_CACHE_DIR`` (default ``~/.cache/cerar``): one file per searched code,
   named with the search code's version and shared by every process of the host.
3. The search itself, whose result goes to the cache.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

from cerar import optimize
from cerar.closed_forms import Code, code_from_matrices, max_condition

SHIPPED_TABLE = Path(__file__).resolve().parent / "data" / "optimized_codes.json"
TABLE_FORMAT = 1


class ShippedTableError(RuntimeError):
    """The shipped table is malformed, or one of its codes does not rebuild to what it records."""


def optimized_code(N: int, c: int, eps: float | None = None, kappa_max: float | None = None) -> Code:
    """The ``optimized`` code for N >= 2 workers and c > N components (arguments already validated):
    from the shipped table, else the cache, else a search (then cached). The kappa budget is
    ``cerar.optimize.budget``'s."""
    kappa_max = optimize.budget(N, c, eps, kappa_max)
    shipped = shipped_code(N, c, kappa_max)
    if shipped is not None:
        return shipped
    path = _cache_path(N, c, kappa_max)
    try:
        with np.load(path) as saved:
            points, A, D = saved["points"], saved["A"], saved["D"]
    except (OSError, KeyError, ValueError):
        found = optimize.search(N, c, kappa_max)
        points, A, D = found.points, found.A, found.D
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(tmp, points=points, A=A, D=D)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home only costs the search again
    return _code(N, c, kappa_max, points, A, D)


def _code(N, c, kappa_max, points, A, D) -> Code:
    eps_reached = float(np.abs(points**N - 1).max())
    return code_from_matrices(N, c, "optimized", eps_reached, kappa_max, points, A.copy(), D.copy())


# ---------------------------------------------------------------------------------------------
# The host's cache
# ---------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where searched codes are kept: ``$CERAR_CACHE_DIR``, default ``~/.cache/cerar``."""
    return Path(os.environ.get("CERAR_CACHE_DIR", Path.home() / ".cache" / "cerar"))


def _cache_path(N: int, c: int, kappa_max: float) -> Path:
    return cache_dir() / f"optimized-{optimize.SEARCH_CODE_VERSION}-N{N}-c{c}-k{kappa_max!r}.npz"


# ---------------------------------------------------------------------------------------------
# The shipped table
# ---------------------------------------------------------------------------------------------


def shipped_code(N: int, c: int, kappa_max: float) -> Code | None:
    """The table's code for (N, c, kappa_max), rebuilt from its points; None when the table does not
    hold the shape or was searched by other search code. Raises ShippedTableError when the rebuilt
    code breaks its budget or does not err as the table records."""
    entry = shipped_entries().get((N, c, float(kappa_max)))
    if entry is None:
        return None
    points, A, D = optimize.matrices_from_points(entry_points(entry), N, entry["decoders"])
    code = _code(N, c, kappa_max, points, A, D)
    recorded = entry["predicted_error"]
    if code.kappa > kappa_max * (1 + 1e-9) or abs(code.predicted_error() - recorded) > 1e-6 * recorded + 1e-12:
        raise ShippedTableError(
            f"{SHIPPED_TABLE}: the code for N={N}, c={c}, kappa_max={kappa_max:g} rebuilds to kappa "
            f"{code.kappa:.6g} and predicted error {code.predicted_error():.6g}; the table records "
            f"{entry['kappa']:.6g} and {recorded:.6g}. Rebuild it with scripts/codes/build_shipped_codes.py"
        )
    return code


def shipped_entries() -> dict[tuple[int, int, float], dict]:
    """The table's entries by (N, c, kappa_max), only while it was searched by the current search
    code; empty otherwise or when there is no table."""
    table = read_table()
    if table is None or table["search_code_version"] != optimize.SEARCH_CODE_VERSION:
        return {}
    return _entries_by_shape(table)


def _entries_by_shape(table: dict) -> dict[tuple[int, int, float], dict]:
    return {(e["N"], e["c"], float(e["kappa_max"])): e for e in table["codes"]}


def read_table(path: Path | None = None) -> dict | None:
    """The table at ``path`` (default ``SHIPPED_TABLE``) as stored, None if there is no such file.
    Raises ShippedTableError naming the file when it is not a table of this format."""
    path = SHIPPED_TABLE if path is None else path
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return _read_cached(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read_cached(path: str, mtime_ns: int, size: int) -> dict:
    return _read(Path(path))


def _read(path: Path) -> dict:
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ShippedTableError(f"{path} is not readable JSON: {err}") from err
    required = {"format", "search_code_version", "search_parameters", "codes"}
    if not isinstance(table, dict) or not required <= set(table) or table["format"] != TABLE_FORMAT:
        raise ShippedTableError(f"{path} is not a table of optimized codes of format {TABLE_FORMAT}")
    for entry in table["codes"]:
        missing = {"N", "c", "kappa_max", "decoders", "points", "kappa", "predicted_error"} - set(entry)
        if missing:
            raise ShippedTableError(f"{path}: an entry lacks {sorted(missing)}: {str(entry)[:120]}")
    return table


def entry_points(entry: dict) -> np.ndarray:
    """An entry's points as complex128 (stored as [real, imaginary] pairs of exact float64 values)."""
    return np.array([complex(re, im) for re, im in entry["points"]], dtype=np.complex128)


def table_entry(N: int, c: int, kappa_max: float, found: optimize.Found, **measured) -> dict:
    """The table's record of one searched code (``measured``: what the builder adds, e.g. the
    search's cost). Floats are written by ``json`` as the shortest text that reads back exactly."""
    return {
        "N": N,
        "c": c,
        "kappa_max": float(kappa_max),
        "decoders": found.decoders,
        "origin": found.origin,
        "kappa": max_condition(found.A),
        "predicted_error": float(found.error),
        **measured,
        "points": [[float(z.real), float(z.imag)] for z in found.points],
    }


def write_table(table: dict, path: Path | None = None) -> None:
    """Write the table (default ``SHIPPED_TABLE``) atomically: the header indented, one line per code."""
    path = SHIPPED_TABLE if path is None else path
    header = {key: value for key, value in table.items() if key != "codes"}
    text = json.dumps(header, indent=1)[:-2]  # drop the closing "\n}"
    lines = [json.dumps(entry, separators=(",", ":")) for entry in table["codes"]]
    text += ',\n "codes": [\n' + ",\n".join(lines) + "\n ]\n}\n"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
