"""Where optimized codes come from: the table shipped with the package, the host's cache, a search.

The search (``cerar.coding.optimize``) takes seconds to minutes per (N, c, kappa_max), and every process of
every host would pay it on first use. So ``optimized_code`` looks in three places, in order:

1. The shipped table, ``cerar/coding/data/optimized_codes.json`` (``scripts/codes/build_shipped_codes.py``
   rebuilds it; its header says which shapes it holds and what each cost to search). For each
   (N, c, kappa_max) it keeps the points and the kind of decoder the search chose; the matrices are
   rebuilt from them (``cerar.coding.optimize.matrices_from_points``, milliseconds): bit for bit the
   searched ones on a machine whose linear algebra rounds alike, within rounding elsewhere, as for
   every construction. The table also records the shapes whose budget the search cannot meet, with
   the least kappa it reached, so that ``make_code`` refuses them at once instead of searching for
   seconds to minutes before the same refusal. The table is used only while its
   ``search_code_version`` and ``search_parameters`` are the current search's
   (``SEARCH_CODE_VERSION``, blind to comments and docstrings, and ``SEARCH_PARAMETERS``): an edited
   search gets its own results at once, as it does from the cache, and
   ``tests/test_shipped_codes.py`` fails until the table is rebuilt, so that a stale table never ships.
2. The host's cache, ``$CERAR_CACHE_DIR`` (default ``~/.cache/cerar``): one file per search, named
   with the search code's version and a digest of its parameters and shared by every process of the
   host. A search that found no code within the budget is kept too, as the refusal it ended in: a
   failure costs its search once per host, not once per call and process.
3. The search itself, whose result (a code or a refusal) goes to the cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from cerar.coding import optimize
from cerar.coding.closed_forms import Code, code_from_matrices, max_condition

SHIPPED_TABLE = Path(__file__).resolve().parent / "data" / "optimized_codes.json"
TABLE_FORMAT = 2


class ShippedTableError(RuntimeError):
    """The shipped table is malformed, or one of its codes does not rebuild to what it records."""


def optimized_code(N: int, c: int, eps: float | None = None, kappa_max: float | None = None) -> Code:
    """The ``optimized`` code for N >= 2 workers and c > N components (arguments already validated):
    from the shipped table, else the cache, else a search (then cached). The kappa budget is
    ``cerar.coding.optimize.budget``'s. Raises ``cerar.coding.optimize.UnreachableBudgetError`` (a ValueError)
    when the search finds no code within it: at once where the table or the cache records that it
    does not."""
    kappa_max = optimize.budget(N, c, eps, kappa_max)
    shipped = shipped_code(N, c, kappa_max)
    if shipped is not None:
        return shipped
    refused = shipped_unreachable().get((N, c, float(kappa_max)))
    if refused is not None:
        raise optimize.UnreachableBudgetError(N, c, kappa_max, refused["best_kappa"])
    path = _cache_path(N, c, kappa_max)
    try:
        with np.load(path) as saved:
            points, A, D = saved["points"], saved["A"], saved["D"]
    except (OSError, KeyError, ValueError):
        points, A, D = _search_and_cache(N, c, kappa_max, path)
    return _code(N, c, kappa_max, points, A, D)


def _search_and_cache(N: int, c: int, kappa_max: float, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The search's (points, A, D), kept at ``path``; a refusal recorded beside it is raised without
    searching, and a new refusal is recorded before it is raised."""
    failure_path = _failure_path(path)
    best_kappa = _recorded_failure(failure_path, N, c, kappa_max)
    if best_kappa is not None:
        raise optimize.UnreachableBudgetError(N, c, kappa_max, best_kappa)
    try:
        found = optimize.search(N, c, kappa_max)
    except optimize.UnreachableBudgetError as refusal:
        record = {
            "N": N,
            "c": c,
            "kappa_max": float(kappa_max),
            "best_kappa": refusal.best_kappa,
            **search_identity(),
        }
        _write_atomically(failure_path, lambda tmp: tmp.write_text(json.dumps(record), encoding="utf-8"))
        raise
    _write_atomically(path, lambda tmp: np.savez(tmp, points=found.points, A=found.A, D=found.D))
    return found.points, found.A, found.D


def _code(N, c, kappa_max, points, A, D) -> Code:
    eps_reached = float(np.abs(points**N - 1).max())
    return code_from_matrices(N, c, "optimized", eps_reached, kappa_max, points, A.copy(), D.copy())


# ---------------------------------------------------------------------------------------------
# The host's cache
# ---------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where searched codes are kept: ``$CERAR_CACHE_DIR``, default ``~/.cache/cerar``."""
    return Path(os.environ.get("CERAR_CACHE_DIR", Path.home() / ".cache" / "cerar"))


def search_parameters_digest() -> str:
    """A short digest of ``cerar.coding.optimize.SEARCH_PARAMETERS`` as they are now: with the search code's
    version it names what a search's result depends on."""
    text = json.dumps(optimize.SEARCH_PARAMETERS, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def search_identity() -> dict:
    """What a search's result depends on besides its shape: the search code's version and its
    parameters (as JSON reads them back). The table and the cache record it with every result and use
    a result only while it is the current search's."""
    return {
        "search_code_version": optimize.SEARCH_CODE_VERSION,
        "search_parameters": json.loads(json.dumps(optimize.SEARCH_PARAMETERS)),
    }


def _cache_path(N: int, c: int, kappa_max: float) -> Path:
    """The searched code's file: named by the search code's version, its parameters and the shape."""
    key = f"{optimize.SEARCH_CODE_VERSION}-p{search_parameters_digest()}"
    return cache_dir() / f"optimized-{key}-N{N}-c{c}-k{kappa_max!r}.npz"


def _failure_path(code_path: Path) -> Path:
    """Where a search that found no code records its refusal: beside the code it would have kept."""
    return code_path.with_suffix(".unreachable.json")


def _recorded_failure(path: Path, N: int, c: int, kappa_max: float) -> float | None:
    """The least kappa of the recorded failed search for exactly this shape and search, else None (no
    record, an unreadable one, or one from another search: then the search runs again)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        same = (record["N"], record["c"], float(record["kappa_max"])) == (N, c, float(kappa_max))
        if same and all(record[key] == value for key, value in search_identity().items()):
            best_kappa = float(record["best_kappa"])
            return best_kappa if best_kappa > kappa_max else None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_atomically(path: Path, write) -> None:
    """``write(tmp)`` then rename over ``path``, so that no process reads half a file. A cache that
    cannot be written (a read-only home) only costs the search again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp{path.suffix}")
        write(tmp)
        os.replace(tmp, path)
    except OSError:
        pass


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
    # the prediction is float64 arithmetic through matrices of condition kappa: another machine's BLAS moves it by
    # up to ~kappa u (c + L) (1e-11 on a kappa 1e7 code whose error is 1.5e-7), which is not a different code
    rounding = code.kappa * 2.0**-53 * (c + code.L)
    if code.kappa > kappa_max * (1 + 1e-9) or abs(code.predicted_error() - recorded) > 1e-6 * recorded + rounding:
        raise ShippedTableError(
            f"{SHIPPED_TABLE}: the code for N={N}, c={c}, kappa_max={kappa_max:g} rebuilds to kappa "
            f"{code.kappa:.6g} and predicted error {code.predicted_error():.6g}; the table records "
            f"{entry['kappa']:.6g} and {recorded:.6g}. Rebuild it with scripts/codes/build_shipped_codes.py"
        )
    return code


def shipped_entries() -> dict[tuple[int, int, float], dict]:
    """The table's codes by (N, c, kappa_max), only while it was searched by the current search
    code with the current parameters; empty otherwise or when there is no table."""
    table = _current_table()
    return {} if table is None else _by_shape(table["codes"])


def shipped_unreachable() -> dict[tuple[int, int, float], dict]:
    """The table's failed searches by (N, c, kappa_max), each with the least kappa the search reached;
    as ``shipped_entries``, only from a table of the current search."""
    table = _current_table()
    return {} if table is None else _by_shape(table["unreachable"])


def _current_table() -> dict | None:
    table = read_table()
    if table is None or {key: table[key] for key in search_identity()} != search_identity():
        return None
    return table


def _by_shape(entries: list[dict]) -> dict[tuple[int, int, float], dict]:
    return {(e["N"], e["c"], float(e["kappa_max"])): e for e in entries}


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
    required = {"format", "search_code_version", "search_parameters", "codes", "unreachable"}
    if not isinstance(table, dict) or not required <= set(table) or table["format"] != TABLE_FORMAT:
        raise ShippedTableError(f"{path} is not a table of optimized codes of format {TABLE_FORMAT}")
    needs = {
        "codes": {"N", "c", "kappa_max", "decoders", "points", "kappa", "predicted_error"},
        "unreachable": {"N", "c", "kappa_max", "best_kappa"},
    }
    for part, keys in needs.items():
        for entry in table[part]:
            missing = keys - set(entry)
            if missing:
                raise ShippedTableError(f"{path}: an entry of {part!r} lacks {sorted(missing)}: {str(entry)[:120]}")
    for entry in table["unreachable"]:
        if not entry["best_kappa"] > entry["kappa_max"]:
            raise ShippedTableError(
                f"{path}: N={entry['N']}, c={entry['c']}, kappa_max={entry['kappa_max']:g} is recorded as "
                f"unreachable with a least kappa of {entry['best_kappa']:g}, within the budget"
            )
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


def unreachable_entry(refusal: optimize.UnreachableBudgetError, **measured) -> dict:
    """The table's record of one search that found no code within its budget."""
    return {
        "N": refusal.N,
        "c": refusal.c,
        "kappa_max": refusal.kappa_max,
        "best_kappa": refusal.best_kappa,
        **measured,
    }


def write_table(table: dict, path: Path | None = None) -> None:
    """Write the table (default ``SHIPPED_TABLE``) atomically: the header indented, one line per code
    and per failed search."""
    path = SHIPPED_TABLE if path is None else path
    lists = ("codes", "unreachable")
    header = {key: value for key, value in table.items() if key not in lists}
    text = json.dumps(header, indent=1)[:-2]  # drop the closing "\n}"
    for key in lists:
        lines = [json.dumps(entry, separators=(",", ":")) for entry in table[key]]
        text += f',\n "{key}": [\n' + ",\n".join(lines) + "\n ]"
    text += "\n}\n"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
