"""Alpha-beta(-gamma) cost model of the exact ring all-reduce versus CERAR.

What
----
Per worker, one all-reduce of ``d`` values of ``itemsize`` bytes takes

    T = rounds * alpha + bytes_sent / bandwidth + work * gamma

with ``alpha`` the per-round latency (s), ``beta = 1/bandwidth`` (s per byte on the slowest link
of the ring) and ``gamma`` seconds per arithmetic operation (a mult-add or an add), and

============  ====================  ==========================  ==========================================
algorithm     rounds                bytes sent per worker       work per worker (operations)
============  ====================  ==========================  ==========================================
exact ring    2(N-1)                2(N-1) ceil(d/N) itemsize   (N-1) ceil(d/N) adds (~ d)
CERAR         L = c+N-2             L m itemsize, m=ceil(d/c)   c*c*m (encode A_i G_i, ~ c d)
                                                                + c*L*m (decode D_i Yhat_i)
                                                                + 2 L m (per-round add and subtract)
============  ====================  ==========================  ==========================================

Why
---
CERAR sends ``(1 + (N-2)/c) d`` values instead of ``2(N-1)/N d`` but needs ``c+N-2`` rounds instead
of ``2(N-1)`` and ``O(c d)`` arithmetic instead of ``O(d)``. Whether it is faster depends on the
balance of the three terms; the model makes that explicit, can be fitted to measured all-reduce
times (``reports/data/allreduce.csv``), and projects the saving for Pythia-sized gradients on
PCIe-class and NVLink-class links.

Pure numpy, no torch.distributed, nothing from ``train/``. Run
``python -m cerar.costmodel --csv reports/data/allreduce.csv --out reports/costmodel.md``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

CSV_COLUMNS = (
    "where", "rate_mbit", "aggregator", "construction", "N", "c", "bytes",
    "seconds_median", "seconds_min", "seconds_max", "repeats",
)  # fmt: skip

PYTHIA_PARAMS = {
    "70m": 70_426_624,
    "160m": 162_322_944,
    "410m": 405_334_016,
    "1b": 1_011_781_632,
    "1.4b": 1_414_647_808,
    "2.8b": 2_775_208_960,
    "6.9b": 6_857_302_016,
    "12b": 11_846_072_320,
}

PAPER_CLAIMS = {
    "allreduce_saving_pcie": 0.47,  # -47 % all-reduce time vs NCCL, A100 PCIe
    "training_saving_pythia_1.4b": 0.17,  # -17 % training time, Pythia-1.4B
}


# --------------------------------------------------------------------------- closed forms


def _check_nc(N: int, c: int | None = None) -> None:
    if not isinstance(N, (int, np.integer)) or N < 2:
        raise ValueError(f"N (number of workers) must be an integer >= 2, got {N!r}")
    if c is not None and (not isinstance(c, (int, np.integer)) or c < 1):
        raise ValueError(f"c (number of components) must be an integer >= 1, got {c!r}")


def ring_rounds(N: int) -> int:
    """Communication rounds of the exact ring all-reduce (reduce-scatter + all-gather)."""
    _check_nc(N)
    return 2 * (N - 1)


def ring_values(d, N: int):
    """Values sent per worker by the exact ring: 2(N-1) blocks of ceil(d/N)."""
    _check_nc(N)
    return 2 * (N - 1) * -(-np.asarray(d) // N)


def ring_work(d, N: int):
    """Arithmetic per worker of the exact ring: the reduce-scatter adds, (N-1) ceil(d/N) ~ d."""
    _check_nc(N)
    return (N - 1) * -(-np.asarray(d) // N)


def cerar_rounds(N: int, c: int) -> int:
    """Communication rounds of CERAR: L = c + N - 2."""
    _check_nc(N, c)
    return c + N - 2


def cerar_values(d, N: int, c: int):
    """Values sent per worker by CERAR: L blocks of m = ceil(d/c)."""
    _check_nc(N, c)
    return (c + N - 2) * -(-np.asarray(d) // c)


def cerar_work(d, N: int, c: int):
    """Arithmetic per worker of CERAR: encode c*c*m + decode c*L*m + 2*L*m round adds."""
    _check_nc(N, c)
    m = -(-np.asarray(d) // c)
    L = c + N - 2
    return c * c * m + c * L * m + 2 * L * m


def byte_ratio_limit(N: int, c: int) -> float:
    """CERAR bytes / ring bytes for d divisible by c and N: (1 + (N-2)/c) / (2(N-1)/N)."""
    _check_nc(N, c)
    return (1 + (N - 2) / c) / (2 * (N - 1) / N)


def features(aggregator: str, d, N: int, c: int | None, itemsize: int = 4) -> np.ndarray:
    """Model regressors [rounds, bytes_sent, work] for one all-reduce (per worker)."""
    d = np.asarray(d)
    if aggregator == "ring":
        return np.array([ring_rounds(N), ring_values(d, N) * itemsize, ring_work(d, N)], dtype=float)
    if aggregator == "cerar":
        if c is None:
            raise ValueError("aggregator 'cerar' needs c (number of components)")
        return np.array([cerar_rounds(N, c), cerar_values(d, N, c) * itemsize, cerar_work(d, N, c)],
                        dtype=float)  # fmt: skip
    raise ValueError(f"unknown aggregator {aggregator!r}: expected 'ring' or 'cerar'")


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """alpha: s per round; bandwidth: bytes/s per direction; throughput: arithmetic ops/s."""

    alpha: float
    bandwidth: float
    throughput: float
    name: str = ""
    note: str = ""

    def __post_init__(self):
        if not (self.alpha >= 0 and self.bandwidth > 0 and self.throughput > 0):
            raise ValueError(f"LinkModel needs alpha >= 0, bandwidth > 0, throughput > 0; got {self}")

    @property
    def coef(self) -> np.ndarray:
        return np.array([self.alpha, 1.0 / self.bandwidth, 1.0 / self.throughput])

    def ring_time(self, d, N: int, itemsize: int = 4) -> float:
        return float(self.coef @ features("ring", d, N, None, itemsize))

    def cerar_time(self, d, N: int, c: int, itemsize: int = 4) -> float:
        return float(self.coef @ features("cerar", d, N, c, itemsize))

    def cerar_times(self, d: int, N: int, cs: np.ndarray, itemsize: int = 4) -> np.ndarray:
        """Vectorised CERAR times over an array of c values."""
        cs = np.asarray(cs, dtype=np.int64)
        m = -(-d // cs)
        L = cs + N - 2
        work = cs * cs * m + cs * L * m + 2 * L * m
        return self.alpha * L + L * m * itemsize / self.bandwidth + work / self.throughput

    def best_c(self, d: int, N: int, itemsize: int = 4, c_max: int | None = None) -> tuple[int, float]:
        """The c in 1..c_max (default 64N) minimising CERAR's time, and that time."""
        _check_nc(N)
        cs = np.arange(1, (c_max or 64 * N) + 1)
        t = self.cerar_times(d, N, cs, itemsize)
        k = int(np.argmin(t))
        return int(cs[k]), float(t[k])


# --------------------------------------------------------------------------- fitting


@dataclasses.dataclass
class Fit:
    """Least-squares fit of (alpha, beta, gamma) to measured rows of one setting."""

    alpha: float
    beta: float
    gamma: float
    n_rows: int
    rel_rmse: float
    rel_rmse_by_aggregator: dict[str, float]

    @property
    def bandwidth(self) -> float:
        return math.inf if self.beta == 0 else 1.0 / self.beta

    @property
    def throughput(self) -> float:
        return math.inf if self.gamma == 0 else 1.0 / self.gamma

    def predict(self, aggregator: str, d, N: int, c: int | None, itemsize: int = 4) -> float:
        return float(np.array([self.alpha, self.beta, self.gamma]) @ features(aggregator, d, N, c, itemsize))


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||X b - y|| subject to b >= 0 by trying every support (3 columns: 7 subsets)."""
    k = X.shape[1]
    best, best_res = np.zeros(k), float(np.sum(y**2))
    for r in range(1, k + 1):
        for sub in itertools.combinations(range(k), r):
            b_sub, *_ = np.linalg.lstsq(X[:, sub], y, rcond=None)
            if np.any(b_sub < 0):
                continue
            b = np.zeros(k)
            b[list(sub)] = b_sub
            res = float(np.sum((X @ b - y) ** 2))
            if res < best_res - 1e-15 * max(best_res, 1e-300):
                best, best_res = b, res
    return best


def fit(rows: Iterable[dict], itemsize: int = 4, relative: bool = True) -> Fit:
    """Fit alpha, beta, gamma >= 0 to rows with keys aggregator, N, c, bytes, seconds_median.

    ``bytes`` is the size of the reduced tensor (d * itemsize). With ``relative`` the residuals
    are relative (each row divided by its measured time), so 1 MB and 256 MB rows weigh alike.
    Rows of aggregators other than 'ring'/'cerar' (e.g. the backend's own all_reduce) are ignored.
    """
    feats, ys, aggs = [], [], []
    for row in rows:
        agg = row["aggregator"]
        if agg not in ("ring", "cerar"):
            continue
        nbytes = int(float(row["bytes"]))
        if nbytes % itemsize:
            raise ValueError(f"row bytes={nbytes} is not a multiple of itemsize={itemsize}")
        c = row.get("c")
        c = int(float(c)) if c not in (None, "") else None
        feats.append(features(agg, nbytes // itemsize, int(float(row["N"])), c, itemsize))
        ys.append(float(row["seconds_median"]))
        aggs.append(agg)
    if len(ys) < 3:
        raise ValueError(f"need at least 3 'ring'/'cerar' rows to fit 3 parameters, got {len(ys)}")
    X, y = np.array(feats), np.array(ys)
    if np.any(y <= 0):
        raise ValueError("seconds_median must be positive in every row")
    w = 1.0 / y if relative else np.ones_like(y)
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    b = _nonneg_lstsq(X * w[:, None] / scale, y * w) / scale
    rel = (X @ b - y) / y
    by = {a: float(np.sqrt(np.mean(rel[np.array(aggs) == a] ** 2))) for a in sorted(set(aggs))}
    return Fit(float(b[0]), float(b[1]), float(b[2]), len(y), float(np.sqrt(np.mean(rel**2))), by)


def read_csv(path: str | Path) -> list[dict]:
    """Rows of an allreduce.csv; raises ValueError naming missing columns."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"measurement CSV not found: {path}")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [col for col in CSV_COLUMNS if col not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        return list(reader)


def fit_groups(rows: Sequence[dict], itemsize: int = 4) -> dict[tuple[str, str], Fit | str]:
    """One fit per (where, rate_mbit) setting; a string explains settings that cannot be fitted."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["where"], r["rate_mbit"]), []).append(r)
    out: dict[tuple[str, str], Fit | str] = {}
    for key, rs in sorted(groups.items()):
        try:
            out[key] = fit(rs, itemsize)
        except ValueError as e:
            out[key] = str(e)
    return out


# --------------------------------------------------------------------------- scenarios


TOKENS_PER_WORKER = 16_384  # micro-batch 8 x 2048 tokens, one all-reduce per step (weak scaling)
PYTHIA_GLOBAL_TOKENS = 1024 * 2048  # Pythia's own global batch


def step_compute_seconds(params: int, tokens_per_worker: float = TOKENS_PER_WORKER,
                         peak_flops: float = 312e12, mfu: float = 0.4) -> float:  # fmt: skip
    """Forward+backward time of one step per worker: 6 * params * tokens / (peak * MFU).

    Defaults: A100 bf16 peak 312 TFLOP/s at 40 % model FLOPs utilisation.
    """
    return 6.0 * params * tokens_per_worker / (peak_flops * mfu)


# Stated assumptions: A100-class workers, fp32 gradients, flat ring bounded by its slowest link.
SCENARIOS = {
    "pcie-node": LinkModel(10e-6, 25e9, 5e12, "PCIe-class (one node)",
                           "25 GB/s per direction (PCIe 4.0 x16), alpha 10 us"),
    "ib-200g": LinkModel(20e-6, 25e9, 5e12, "inter-node 200 Gbit/s",
                         "200 Gbit/s = 25 GB/s per direction, alpha 20 us"),
    "ib-100g": LinkModel(20e-6, 12.5e9, 5e12, "inter-node 100 Gbit/s",
                         "100 Gbit/s = 12.5 GB/s per direction, alpha 20 us"),
    "nvlink": LinkModel(5e-6, 300e9, 5e12, "NVLink-class (A100 NVLink3)",
                        "300 GB/s per direction, alpha 5 us"),
}  # fmt: skip
N_VALUES = (4, 8, 16, 64, 256, 1024)
C_MULTIPLES = (1, 2, 4, 8)


def projection(link: LinkModel, params: int, N: int, itemsize: int = 4,
               tokens_per_worker: float = TOKENS_PER_WORKER) -> dict:  # fmt: skip
    """Ring vs CERAR (fixed c multiples and the best c) for one model size on one link."""
    ring = link.ring_time(params, N, itemsize)
    out = {"ring": ring}
    for k in C_MULTIPLES:
        out[f"c={k}N"] = link.cerar_time(params, N, k * N, itemsize)
    c_best, t_best = link.best_c(params, N, itemsize)
    out["best_c"], out["best"] = c_best, t_best
    step = step_compute_seconds(params, tokens_per_worker)
    out["step_compute"] = step
    out["step_saving"] = (ring - t_best) / (step + ring)
    out["ar_saving"] = (ring - t_best) / ring
    return out


def min_c_for_byte_saving(N: int, saving: float) -> int | None:
    """Smallest c whose byte count is ``saving`` below the ring's, or None if impossible."""
    # (1 + (N-2)/c) * N/(2(N-1)) <= 1 - saving  <=>  c >= (N-2) / ((1-saving) 2(N-1)/N - 1)
    denom = (1 - saving) * 2 * (N - 1) / N - 1
    if denom <= 0:
        return None
    return max(1, math.ceil((N - 2) / denom - 1e-12))


# --------------------------------------------------------------------------- report


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _sec(x: float) -> str:
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} us"


def report(rows: Sequence[dict] | None, csv_path: str | None = None, itemsize: int = 4) -> str:
    """The markdown report: fitted parameters, projections, paper comparison, assumptions."""
    L = ["# CERAR vs exact ring: alpha-beta cost model", ""]
    L += [
        "Generated by `python -m cerar.costmodel`. Model per worker and all-reduce:",
        "",
        "    T = rounds * alpha + bytes_sent / bandwidth + work / throughput",
        "",
        "| | rounds | bytes sent per worker | work (ops) per worker |",
        "| --- | --- | --- | --- |",
        "| exact ring | 2(N-1) | 2(N-1) ceil(d/N) itemsize | (N-1) ceil(d/N) adds |",
        "| CERAR | L = c+N-2 | L ceil(d/c) itemsize | c^2 m + c L m + 2 L m, m = ceil(d/c) |",
        "",
        "Assumptions: one flat ring whose time is set by its slowest link; full-duplex links (a worker "
        "sends and receives at the full rate at once); no overlap of communication with computation "
        f"(so savings are upper bounds for an overlapped trainer); itemsize = {itemsize} bytes (fp32 "
        "transport, which CERAR needs for kappa > 1); one arithmetic throughput for encode/decode "
        "GEMMs and the ring's adds.",
        "",
    ]
    # ---- fits
    L += ["## Fitted parameters", ""]
    if not rows:
        L += [f"No measured rows{f' in `{csv_path}`' if csv_path else ''}: nothing fitted yet; the "
              "projections below use the stated scenario parameters only.", ""]  # fmt: skip
    else:
        L += [f"Source: `{csv_path}` ({len(rows)} rows). Relative least squares on `seconds_median` "
              "of the `ring` and `cerar` rows of each setting (the backend's own all-reduce is not "
              "a ring of this form and is not fitted). `bandwidth vs link` compares the fitted "
              "bandwidth with the lab's shaped rate.", "",
              "| where | rate (Mbit/s) | rows | alpha | bandwidth | bandwidth vs link | throughput (ops/s) "
              "| rel. RMSE (ring / cerar) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for (where, rate), f in fit_groups(rows, itemsize).items():
            if isinstance(f, str):
                L.append(f"| {where} | {rate or '-'} | - | not fitted: {f} | | | | |")
                continue
            link = ""
            if rate not in ("", None) and math.isfinite(f.bandwidth):
                link = f"{f.bandwidth * 8 / (float(rate) * 1e6):.2f}"
            rr = " / ".join(f"{f.rel_rmse_by_aggregator.get(a, float('nan')):.2f}" for a in ("ring", "cerar"))
            L.append(
                f"| {where} | {rate or '-'} | {f.n_rows} | {_sec(f.alpha)} | "
                f"{f.bandwidth / 1e6:.1f} MB/s | {link or '-'} | {f.throughput:.3g} | {rr} |"
            )
        L.append("")
    # ---- byte ratios
    L += ["## Closed-form byte ratio (CERAR / ring)", "",
          "(1 + (N-2)/c) / (2(N-1)/N); below 1 only for c > N; never below N/(2(N-1)) -> 1/2.", "",
          "| N | c=N | c=2N | c=4N | c=8N | c->inf |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for N in N_VALUES:
        cells = [f"{byte_ratio_limit(N, k * N):.3f}" for k in C_MULTIPLES]
        L.append(f"| {N} | {' | '.join(cells)} | {N / (2 * (N - 1)):.3f} |")
    L.append("")
    # ---- projections
    L += ["## Projections for Pythia gradients", "",
          "Scenario parameters (A100-class worker; throughput = effective encode/decode rate, an "
          "assumption: small-c GEMMs are memory bound):", ""]  # fmt: skip
    for key, s in SCENARIOS.items():
        L.append(f"- `{key}`: {s.name}: {s.note}, throughput {s.throughput:.1e} ops/s")
    L += ["", f"Training step: compute = 6 * params * {TOKENS_PER_WORKER:,} tokens per worker / (312 TFLOP/s "
          "* 0.40 MFU) (weak scaling: fixed micro-batch 8 x 2048 per worker), one fp32 gradient all-reduce "
          "per step, not overlapped. Cells: change of the all-reduce time with CERAR at its best c "
          "(searched over 1..64N) relative to the ring, then the change of the step time, then that c. "
          "Negative = CERAR faster; positive = CERAR slower even at its best c.", ""]  # fmt: skip
    for key, link in SCENARIOS.items():
        L += [f"### {link.name} (`{key}`)", "",
              "| model | " + " | ".join(f"N={N}" for N in N_VALUES) + " |",
              "| --- |" + " --- |" * len(N_VALUES)]  # fmt: skip
        for name, p in PYTHIA_PARAMS.items():
            cells = []
            for N in N_VALUES:
                pr = projection(link, p, N, itemsize)
                cells.append(f"{_pct(-pr['ar_saving'])} / {_pct(-pr['step_saving'])} (c={pr['best_c']})")
            L.append(f"| {name} | " + " | ".join(cells) + " |")
        L.append("")
    # ---- detail for 1.4b
    p = PYTHIA_PARAMS["1.4b"]
    L += ["### Pythia-1.4B in detail (all-reduce times)", "",
          "| link | N | ring | c=N | c=2N | c=4N | c=8N | best c | best | step compute |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for key, link in SCENARIOS.items():
        for N in (4, 8, 64, 1024):
            pr = projection(link, p, N, itemsize)
            L.append(f"| {key} | {N} | {_sec(pr['ring'])} | "
                     + " | ".join(_sec(pr[f'c={k}N']) for k in C_MULTIPLES)
                     + f" | {pr['best_c']} | {_sec(pr['best'])} | {_sec(pr['step_compute'])} |")  # fmt: skip
    L.append("")
    # ---- sensitivity to throughput
    L += ["### Sensitivity: Pythia-1.4B, N=8, all-reduce saving at best c vs assumed throughput", "",
          "| link | 0.5e12 ops/s | 5e12 | 50e12 | infinite |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for key, link in SCENARIOS.items():
        cells = []
        for thr in (0.5e12, 5e12, 50e12, 1e30):
            lk = dataclasses.replace(link, throughput=thr)
            pr = projection(lk, p, 8, itemsize)
            cells.append(f"{_pct(-pr['ar_saving'])} (c={pr['best_c']})")
        L.append(f"| {key} | " + " | ".join(cells) + " |")
    L.append("")
    # ---- paper comparison
    L += ["## Comparison with the paper's claims", "",
          "| claim (paper) | model | comment |", "| --- | --- | --- |"]  # fmt: skip
    pcie = SCENARIOS["pcie-node"]
    best8 = projection(pcie, p, 8, itemsize)
    best4 = projection(pcie, p, 4, itemsize)
    target = PAPER_CLAIMS["allreduce_saving_pcie"]
    need = {N: min_c_for_byte_saving(N, target) for N in (4, 8, 16, 32, 64, 1024)}
    need_s = ", ".join(f"N={N}: {'impossible' if c is None else f'c >= {c}'}" for N, c in need.items())
    L.append(f"| -47% all-reduce time vs NCCL, A100 PCIe | {_pct(-best4['ar_saving'])} (N=4), "
             f"{_pct(-best8['ar_saving'])} (N=8), Pythia-1.4B, best c | A pure byte saving of 47% needs "
             f"{need_s}: the byte ratio never drops below N/(2(N-1)). A 47% cut on a 4-8 GPU PCIe node "
             "therefore cannot come from bytes alone; it implies the NCCL baseline ran below the link "
             "rate (e.g. PCIe host-bridge traffic, protocol overheads) or a different ring/N. |")  # fmt: skip
    tr4 = projection(pcie, p, 4, itemsize)["step_saving"]
    tr8 = best8["step_saving"]
    g8 = projection(pcie, p, 8, itemsize, PYTHIA_GLOBAL_TOKENS / 8)["step_saving"]
    share = PAPER_CLAIMS["training_saving_pythia_1.4b"] / PAPER_CLAIMS["allreduce_saving_pcie"]
    L.append(f"| -17% training time, Pythia-1.4B | {_pct(-tr4)} (N=4), {_pct(-tr8)} (N=8) at "
             f"{TOKENS_PER_WORKER:,} tokens/worker; {_pct(-g8)} (N=8) with Pythia's 2M-token global batch "
             "and one all-reduce per step | -17% of the step from -47% of the all-reduce means the "
             f"all-reduce was >= {100 * share:.0f}% of the step (not overlapped): a small per-worker batch "
             "on a slow link. The saving scales with that share; overlap shrinks it. |")  # fmt: skip
    nv = projection(SCENARIOS["nvlink"], p, 8, itemsize)
    L.append(f"| worse on NVLink | {_pct(-nv['ar_saving'])} (N=8, best c={nv['best_c']}) | On fast links "
             "the O(c d) encode/decode and extra rounds outweigh the bytes saved; the model agrees in "
             "direction if the throughput assumed is modest (see the sensitivity table). |")  # fmt: skip
    L.append("")
    return "\n".join(L) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fit and project the CERAR vs ring cost model.")
    ap.add_argument("--csv", default=None, help="measured rows (reports/data/allreduce.csv)")
    ap.add_argument("--out", default=None, help="write the markdown report here (default: stdout)")
    ap.add_argument("--itemsize", type=int, default=4, help="bytes per gradient value (default 4, fp32)")
    args = ap.parse_args(argv)
    if args.itemsize not in (1, 2, 4, 8):
        ap.error(f"--itemsize must be 1, 2, 4 or 8, got {args.itemsize}")
    rows = None
    if args.csv:
        try:
            rows = read_csv(args.csv)
        except (FileNotFoundError, ValueError) as e:
            print(f"costmodel: {e}", file=sys.stderr)
            return 2
    text = report(rows, args.csv, args.itemsize)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
