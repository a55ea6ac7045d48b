"""Alpha-beta(-gamma) cost model of the exact ring all-reduce versus CERAR.

What
----
Per worker, one all-reduce of ``d`` values of ``itemsize`` bytes takes

    T = rounds * alpha + bytes_sent / bandwidth + bytes_moved * gamma

with ``alpha`` the per-round latency (s), ``beta = 1/bandwidth`` (s per byte on the slowest link
of the ring) and ``gamma = 1/memory_bandwidth`` (s per byte the arithmetic reads or writes: its
products and additions are memory bound), and

============  ====================  ==========================  ==========================================
algorithm     rounds                bytes sent per worker       values the arithmetic moves per worker
============  ====================  ==========================  ==========================================
exact ring    2(N-1)                2(N-1) ceil(d/N) itemsize   3 (N-1) ceil(d/N) (reduce-scatter adds)
CERAR         L = c+N-2             L m itemsize, m=ceil(d/c)   ``cerar_arithmetic``: about 20 d for
                                                                ``storage="spec"``, 10 d for
                                                                ``"messages"`` (``cerar.ring.rounds``)
============  ====================  ==========================  ==========================================

Why
---
CERAR sends ``(1 + (N-2)/c) d`` values instead of ``2(N-1)/N d`` but needs ``c+N-2`` rounds instead
of ``2(N-1)`` and more passes over the gradient. Whether it is faster depends on the balance of the
three terms; the model makes that explicit, can be fitted to measured all-reduce times
(``reports/data/allreduce.csv``), and projects CERAR against NCCL's ring for Pythia-sized gradients
on PCIe-class and NVLink-class nodes, with the link bandwidth where they cross over
(``crossover_bandwidth``).

Pure numpy, no torch, nothing from ``train/``. ``python -m cerar.planning.costmodel --csv
reports/data/allreduce.csv`` prints the fits and the projection; ``scripts/reporting/costmodel_report.py``
renders ``reports/costmodel.md``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import math
import re
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


def ring_values_moved(d, N: int):
    """Values the exact ring's arithmetic reads or writes per worker: each reduce-scatter add reads
    two blocks and writes one, 3 (N-1) ceil(d/N) ~ 3 d."""
    return 3 * ring_work(d, N)


def cerar_rounds(N: int, c: int) -> int:
    """Communication rounds of CERAR: L = c + N - 2."""
    _check_nc(N, c)
    return c + N - 2


def cerar_values(d, N: int, c: int):
    """Values sent per worker by CERAR: L blocks of m = ceil(d/c)."""
    _check_nc(N, c)
    return (c + N - 2) * -(-np.asarray(d) // c)


STORAGE_CHOICES = ("spec", "messages")  # cerar.ring.rounds.STORAGE_CHOICES, without importing torch
DEFAULT_STORAGE = "spec"  # cerar.ring.rounds.DEFAULT_STORAGE


def _check_storage(storage: str) -> None:
    if storage not in STORAGE_CHOICES:
        raise ValueError(f"storage must be one of {STORAGE_CHOICES}, got {storage!r}")


def decode_products(N: int, c, storage: str = DEFAULT_STORAGE):
    """Decoding products of one CERAR call (the first also takes U_i): one with ``"messages"``
    (every message has its row); with ``"spec"``, one per batch of N-1 messages (the N-th row is
    receiving), or one when N >= L. ``c`` may be an array."""
    _check_storage(storage)
    c = np.asarray(c)
    L = c + N - 2
    rows = np.maximum(L if storage == "messages" else N, 2)
    batch = np.where(rows >= L, rows, rows - 1)
    return -(-L // batch)


def _round_kinds(N: int, c):
    """Rounds by what ``receive`` does (``cerar.ring.rounds``): (both, one, none): rounds N..c-1 add u(t+1) and
    take out u(t-N+1) in one product; the others add or take out one row, except rounds c..N-1 (c < N),
    which have none. ``c`` may be an array."""
    c = np.asarray(c)
    L = c + N - 2
    both, none = np.maximum(0, c - N), np.maximum(0, N - c)
    return both, L - both - none, none


def _arithmetic(d, N: int, c, storage: str) -> dict:
    c = np.asarray(c)
    products = decode_products(N, c, storage)
    m = -(-np.asarray(d) // c)
    L = c + N - 2
    both, one, _ = _round_kinds(N, c)
    encode = 2 * c * m + c * m  # G read twice (x(1) first, then the rest), U written once
    rounds = (4 * both + 3 * one) * m  # y(t) read and written, and the one or two rows of U read
    decode = (c + L) * m + c * m + 2 * c * m * (products - 1)  # [U; X] read, result written
    moved = encode + rounds + decode
    rows = np.maximum(L if storage == "messages" else N, 2)
    return {
        "mult_adds": (2 * c + L) * c * m + 2 * both * m,
        "adds": one * m,
        "values_moved": moved,
        "passes": moved / (c * m),
        "products": products,
        "storage_values": (c + rows) * m,
    }


def cerar_arithmetic(d, N: int, c: int, storage: str = DEFAULT_STORAGE) -> dict:
    """The arithmetic of one CERAR call per rank (``cerar.ring.rounds`` derives it; exact when c divides d):

    - ``mult_adds``: matrix products, U_i = A_i G_i (c d), W_i [U_i; X] ((c + L) d), and the rounds N..c-1's
      one product [-1, 1] [u(t-N+1); u(t+1)] into y(t) (2 m each: an addition and a subtraction, carried
      by a product so that the round is one operation);
    - ``adds``: the other rounds' one addition (or subtraction) of a row into y(t);
    - ``values_moved``: values the arithmetic reads or writes, and ``passes`` = values_moved / d;
    - ``products``: decoding products; ``storage_values``: working storage beyond the input, the spec's
      (c + N) m = (1 + N/c) d for ``"spec"``.
    """
    _check_nc(N, c)
    _check_storage(storage)
    return _arithmetic(d, N, c, storage)


def cerar_operations(N: int, c: int, storage: str = DEFAULT_STORAGE, chunks: int = 1) -> dict:
    """The operations (on a GPU, kernels) one rank's arithmetic dispatches per call when c divides d
    (``cerar.ring.rounds``), ``chunks`` times those of one chunk: ``encode``, 2 products (x(1) before the first
    post, then the rest of U_i; 1 when c = 1); ``rounds``, one operation per round with a row of U_i to add or
    take out (L - max(0, N - c)); ``decode``, one product per batch of messages (``decode_products``). Where c
    does not divide d, each product of the chunks holding the partial last row runs once more for it, and the
    row is zeroed, copied in and out (``tests/test_op_count.py``). The transport's operations (a post, its
    ordering wait) and a 16-bit wire's casts are not arithmetic and not counted here."""
    _check_nc(N, c)
    _check_storage(storage)
    both, one, _ = _round_kinds(N, c)
    encode = (2 if c > 1 else 1) * chunks
    rounds = int(both + one) * chunks
    decode = int(decode_products(N, c, storage)) * chunks
    return {"encode": encode, "rounds": rounds, "decode": decode, "total": encode + rounds + decode}


def cerar_exposed_values(d, N: int, c, storage: str = DEFAULT_STORAGE):
    """Values the arithmetic moves that no transfer can hide, per rank and call (exact when c
    divides d): x(1)'s encoding before the first send ((c + 1) m: G read, one row written), the
    addition after the last round's message arrives (3 m, for c >= 2), and the decoding products
    after the last round: every message not decoded in flight (a batch is decoded in flight once
    complete and before round L: none with ``"messages"``), each product reading its rows and
    reading and writing the result (2 c m), except a first product, which reads U_i's c rows
    instead of the result. The rest runs beside the transfers once the blocks travel in two or
    more pipeline chunks (``cerar.ring.rounds.pipeline_chunks``): chunk k's arithmetic while chunk k+1
    is on the wire. ``c`` may be an array."""
    _check_storage(storage)
    c = np.asarray(c)
    m = -(-np.asarray(d) // c)
    L = c + N - 2
    rows = np.maximum(L if storage == "messages" else N, 2)
    batch = np.where(rows >= L, rows, rows - 1)
    in_flight = np.where(batch < L, batch * (np.maximum(L - 2, 0) // batch), 0)  # messages decoded before round L ends
    left = L - in_flight
    products = -(-left // batch)
    decode = np.where(
        in_flight == 0, (c + left) * m + c * m + (products - 1) * 2 * c * m, left * m + products * 2 * c * m
    )
    return (c + 1) * m + np.where(c >= 2, 3 * m, 0) + decode


DDP_FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``): the last parameters' gradients,
reduced first, whatever ``bucket_cap_mb``."""
DDP_DEFAULT_BUCKET_CAP_MB = 25.0  # cerar.ddp.DDP_DEFAULT_BUCKET_CAP_MB, without importing torch


def ddp_bucket_cap_mb(N: int, c: int) -> float:
    """The bucket size (MiB) the trainer gives DDP with CERAR: ``cerar.ddp.default_bucket_cap_mb``,
    25 MiB x c / N, at least 25."""
    _check_nc(N, c)
    return max(DDP_DEFAULT_BUCKET_CAP_MB, DDP_DEFAULT_BUCKET_CAP_MB * c / N)


PIPELINE_MIN_CHUNK = 2**16  # cerar.ring.rounds.PIPELINE_MIN_CHUNK, without importing torch
PIPELINE_MAX_CHUNKS = 2  # cerar.ring.rounds.PIPELINE_MAX_CHUNKS


CUDA_PIPELINE_MAX_CHUNKS = 1  # cerar.ring.rounds.CUDA_PIPELINE_MAX_CHUNKS


def pipeline_chunk_count(m: int, max_chunks: int = PIPELINE_MAX_CHUNKS) -> int:
    """How many column chunks a block of m values travels in (``cerar.ring.rounds.pipeline_chunks``), at most
    ``max_chunks`` (2 on a CPU, ``CUDA_PIPELINE_MAX_CHUNKS`` on CUDA): one below 2 x 2^16 values, i.e. for
    d < 2^17 c."""
    return max(1, min(max_chunks, int(m) // PIPELINE_MIN_CHUNK))


def cerar_round_values(N: int, c: int, storage: str = DEFAULT_STORAGE) -> dict:
    """The arithmetic of one CERAR call per round, in units of m values moved (``cerar.ring.rounds``; exact
    when c divides d), as the device stream sees it with ONE chunk:

    - ``before``: x(1)'s encoding, before round 1 is posted (c + 1: G's rows read, one row written);
    - ``in_flight[t-1]``: issued right after round t is posted, so it runs beside round t's transfer:
      round 1: the rest of the encoding (2c - 1: G read again, U's other rows written), which round 2's
      post waits for; with ``"spec"``, a decoding product once a batch of messages is complete, before
      round L (2c + batch);
    - ``receive[t-1]``: after round t's message arrives and before round t+1 is posted: x(t+1) = y(t) +
      u(t+1) - u(t-N+1) in one operation, 4 where both rows exist (rounds N..c-1), 3 where one does, 0 in
      rounds c..N-1;
    - ``after``: after the last round: the decoding left (``cerar_exposed_values`` less x(1) and the
      last addition).

    ``before + sum(in_flight) + sum(receive) + after`` is ``cerar_arithmetic``'s values_moved / m;
    ``before + receive[-1] + after`` is ``cerar_exposed_values`` / m."""
    _check_nc(N, c)
    _check_storage(storage)
    L = c + N - 2
    t = np.arange(1, L + 1)
    in_flight = np.zeros(L, dtype=int)
    in_flight[0] = 2 * c - 1
    rows = max(L if storage == "messages" else N, 2)
    batch = rows if rows >= L else rows - 1
    if batch < L:
        for k in range(1, max(L - 2, 0) // batch + 1):  # a batch of messages decoded in flight, before round L
            in_flight[k * batch] += 2 * c + batch
    receive = np.where((t >= N) & (t <= c - 1), 4, np.where((t >= c) & (t <= N - 1), 0, 3))
    exposed = int(cerar_exposed_values(c, N, c, storage))  # m = 1
    after = exposed - (c + 1) - int(receive[-1])
    return {"before": c + 1, "in_flight": in_flight, "receive": receive, "after": after}


def cerar_work(d, N: int, c: int, storage: str = DEFAULT_STORAGE):
    """Arithmetic operations per worker of CERAR: multiply-adds plus additions (``cerar_arithmetic``)."""
    counts = cerar_arithmetic(d, N, c, storage)
    return counts["mult_adds"] + counts["adds"]


def byte_ratio_limit(N: int, c: int) -> float:
    """CERAR bytes / ring bytes for d divisible by c and N: (1 + (N-2)/c) / (2(N-1)/N)."""
    _check_nc(N, c)
    return (1 + (N - 2) / c) / (2 * (N - 1) / N)


def features(
    aggregator: str, d, N: int, c: int | None, itemsize: int = 4, storage: str = DEFAULT_STORAGE
) -> np.ndarray:
    """Model regressors [rounds, bytes_sent, bytes_moved] for one all-reduce (per worker):
    bytes_moved is the memory traffic of the arithmetic (``cerar_arithmetic``'s values_moved)."""
    d = np.asarray(d)
    if aggregator == "ring":
        return np.array([ring_rounds(N), ring_values(d, N) * itemsize, ring_values_moved(d, N) * itemsize],
                        dtype=float)  # fmt: skip
    if aggregator == "cerar":
        if c is None:
            raise ValueError("aggregator 'cerar' needs c (number of components)")
        moved = cerar_arithmetic(d, N, c, storage)["values_moved"]
        return np.array([cerar_rounds(N, c), cerar_values(d, N, c) * itemsize, moved * itemsize],
                        dtype=float)  # fmt: skip
    raise ValueError(f"unknown aggregator {aggregator!r}: expected 'ring' or 'cerar'")


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """alpha: s per round; bandwidth: link bytes/s per direction; memory_bandwidth: bytes/s at which
    the arithmetic streams its operands (it is memory bound: ``cerar.ring.rounds``)."""

    alpha: float
    bandwidth: float
    memory_bandwidth: float
    name: str = ""
    note: str = ""
    storage: str = DEFAULT_STORAGE  # CERAR's storage choice (``cerar.ring.rounds``)
    shares_memory: bool = False
    """The transfers move their bytes through the same memory the arithmetic streams from (NVLink:
    a GPU's sends are read from, and its receives written to, its HBM by the copy engines or NCCL's
    kernels), so beside the arithmetic each round adds 2 x its bytes of memory traffic. False for
    PCIe and network links, whose bytes are the bottleneck long before HBM's."""
    host_per_message: float = 0.0
    """Host seconds per message an eager call posts: its ``batch_isend_irecv``, its ordering ``wait()`` and the
    round's launch, which the host must do before the device can run them. 0 prices a host that keeps ahead
    of the device (a slow link, or a call replayed from a CUDA graph: ``cerar.ring.graphs``); on a fast link
    an eager call is bound by it, L x chunks x host_per_message (``cerar_time_chunks``)."""

    def __post_init__(self):
        _check_storage(self.storage)
        if not (self.alpha >= 0 and self.bandwidth > 0 and self.memory_bandwidth > 0 and self.host_per_message >= 0):
            raise ValueError(
                f"LinkModel needs alpha >= 0, bandwidth > 0, memory_bandwidth > 0, host_per_message >= 0; got {self}"
            )

    @property
    def coef(self) -> np.ndarray:
        return np.array([self.alpha, 1.0 / self.bandwidth, 1.0 / self.memory_bandwidth])

    def ring_time(self, d, N: int, itemsize: int = 4) -> float:
        return float(self.coef @ features("ring", d, N, None, itemsize))

    def cerar_time(self, d, N: int, c: int, itemsize: int = 4) -> float:
        return float(self.coef @ features("cerar", d, N, c, itemsize, self.storage))

    def cerar_times(self, d: int, N: int, cs: np.ndarray, itemsize: int = 4) -> np.ndarray:
        """Vectorised CERAR times over an array of c values."""
        cs = np.asarray(cs, dtype=np.int64)
        m = -(-d // cs)
        L = cs + N - 2
        moved = _arithmetic(d, N, cs, self.storage)["values_moved"]
        return self.alpha * L + L * m * itemsize / self.bandwidth + moved * itemsize / self.memory_bandwidth

    def ring_time_overlapped(self, d, N: int, itemsize: int = 4) -> float:
        """The ring with its additions beside its transfers, as NCCL's ring kernel pipelines them:
        rounds * alpha + max(bytes / bandwidth, bytes moved / memory bandwidth), the memory traffic
        including the transfers' own (2 x bytes sent) where the link shares memory (NVLink)."""
        rounds, sent, moved = features("ring", d, N, None, itemsize)
        memory = moved + (2 * sent if self.shares_memory else 0)
        return float(self.alpha * rounds + max(sent / self.bandwidth, memory / self.memory_bandwidth))

    def cerar_time_overlapped(self, d, N: int, c: int, itemsize: int = 4) -> float:
        """CERAR with its arithmetic beside its transfers (a GPU: NCCL's stream and the compute stream
        run at once), as ``cerar.ring.protocol`` issues a call:

        - two or more chunks (m >= 2 x 2^16, ``pipeline_chunk_count``): chunk k's arithmetic runs while
          chunk k+1 is on the wire: rounds * alpha + max(bytes / bandwidth, hideable traffic / memory
          bandwidth) + exposed traffic / memory bandwidth (``cerar_exposed_values``);
        - one chunk (d < 2^17 c: DDP's first 1 MiB bucket, most buckets of small models): nothing
          else travels while a round's message is received and added, so every round's addition is
          exposed, and only what is issued right after a post runs beside that round's transfer
          (round 1: the rest of the encoding, which round 2's post waits for): ``cerar_time_one_chunk``.

        Where the link shares memory (NVLink) the traffic beside the transfers includes the
        transfers' own 2 x bytes sent."""
        return self.cerar_time_chunks(d, N, c, PIPELINE_MAX_CHUNKS, itemsize)

    def cerar_time_chunks(self, d, N: int, c: int, chunks: int, itemsize: int = 4) -> float:
        """The overlapped time of a call whose blocks travel in at most ``chunks`` column chunks
        (``pipeline_chunk_count``): one chunk priced round by round (``cerar_time_one_chunk``), more with
        everything but the exposed traffic beside the transfers (``cerar_time_pipelined``); and at least
        the host's time to post them, L x chunks x ``host_per_message`` (the host runs ahead of the device,
        so the two overlap)."""
        parts = pipeline_chunk_count(-(-int(d) // c), chunks)
        device = self.cerar_time_one_chunk(d, N, c, itemsize) if parts == 1 else self.cerar_time_pipelined(
            d, N, c, itemsize
        )
        return max(device, cerar_rounds(N, c) * parts * self.host_per_message)

    def best_chunks(self, d, N: int, c: int, itemsize: int = 4, most: int = PIPELINE_MAX_CHUNKS) -> int:
        """The chunk count in 1..``most`` that ``cerar_time_chunks`` prices lowest (the fewer on a tie)."""
        times = [self.cerar_time_chunks(d, N, c, k, itemsize) for k in range(1, most + 1)]
        return 1 + int(np.argmin(times))

    def cerar_time_pipelined(self, d, N: int, c: int, itemsize: int = 4) -> float:
        """The overlapped time of two or more chunks (``cerar_time_overlapped``): everything but the
        exposed traffic beside the transfers. For a one-chunk call it is a best case, the model before
        the per-chunk one."""
        rounds, sent, moved = features("cerar", d, N, c, itemsize, self.storage)
        exposed = float(cerar_exposed_values(d, N, c, self.storage)) * itemsize
        beside = moved - exposed + (2 * sent if self.shares_memory else 0)
        hidden = max(sent / self.bandwidth, beside / self.memory_bandwidth)
        return float(self.alpha * rounds + hidden + exposed / self.memory_bandwidth)

    def cerar_time_one_chunk(self, d, N: int, c: int, itemsize: int = 4) -> float:
        """One chunk on the device stream, round by round (``cerar_round_values``):
        (before + sum of the receives + after) m / memory bandwidth, plus per round t
        max(alpha + m / bandwidth, (in_flight_t m + 2 m if the link shares memory) / memory bandwidth),
        in bytes of ``itemsize``."""
        m = -(-int(d) // c) * itemsize
        r = cerar_round_values(N, c, self.storage)
        serial = (r["before"] + int(r["receive"].sum()) + r["after"]) * m / self.memory_bandwidth
        transfer = self.alpha + m / self.bandwidth
        beside = (r["in_flight"] + (2 if self.shares_memory else 0)) * m / self.memory_bandwidth
        return float(serial + np.maximum(transfer, beside).sum())

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
    def memory_bandwidth(self) -> float:
        """Bytes/s of the arithmetic's memory traffic (1/gamma)."""
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


_TWO_TIER_WHERE = re.compile(r"-\d+x\d+(-|$)")


def is_two_tier_row(row: dict) -> bool:
    """Whether a measured row ran on hosts of several ranks (``where`` like ``lab-4x2``: bench_allreduce's
    ``setting_name``), whose times the two-tier model describes."""
    return bool(_TWO_TIER_WHERE.search(row.get("where", "")))


def fit_groups(rows: Sequence[dict], itemsize: int = 4) -> dict[tuple[str, str], Fit | str]:
    """One fit per (where, rate_mbit) setting; a string explains settings that cannot be fitted.
    Rows of two-tier runs (more than one rank per host) are ``fit_two_tier_groups``'s."""
    return _fit_each_setting([r for r in rows if not is_two_tier_row(r)], fit, itemsize)


def _fit_each_setting(rows: Sequence[dict], fitter, itemsize: int) -> dict[tuple[str, str], object]:
    """``fitter(rows of one (where, rate_mbit) setting, itemsize)`` for every setting, in order; a
    setting that cannot be fitted gets the ValueError's text instead."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["where"], r["rate_mbit"]), []).append(r)
    out: dict[tuple[str, str], object] = {}
    for key, rs in sorted(groups.items()):
        try:
            out[key] = fitter(rs, itemsize)
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


# Stated assumptions: A100-class workers (HBM2, about 1.5 TB/s streamed), fp32 gradients, a flat ring
# bounded by its slowest link; NCCL's ring all-reduce modelled as the exact ring on the same link.
HBM_BANDWIDTH = 1.5e12
SCENARIOS = {
    "pcie-node": LinkModel(10e-6, 25e9, HBM_BANDWIDTH, "PCIe-class node (A100 PCIe)",
                           "25 GB/s per direction (PCIe 4.0 x16), alpha 10 us"),
    "nvlink": LinkModel(5e-6, 300e9, HBM_BANDWIDTH, "NVLink-class node (A100 SXM, NVLink3)",
                        "300 GB/s per direction, alpha 5 us; the transfers share HBM with the arithmetic",
                        shares_memory=True),
    "ib-200g": LinkModel(20e-6, 25e9, HBM_BANDWIDTH, "inter-node 200 Gbit/s",
                         "200 Gbit/s = 25 GB/s per direction, alpha 20 us"),
    "ib-100g": LinkModel(20e-6, 12.5e9, HBM_BANDWIDTH, "inter-node 100 Gbit/s",
                         "100 Gbit/s = 12.5 GB/s per direction, alpha 20 us"),
}  # fmt: skip
PYTHIA_PROJECTED = ("160m", "410m", "1b", "1.4b")

PASSES_BEFORE_324C4C8 = {(4, 16): 34.19, (8, 32): 36.47}
"""Passes over d of the arithmetic up to commit 324c4c8 (op="avg", c dividing d), measured on its dispatched tensor
operations as ``tests/test_costmodel.py`` measures today's: the before column of ``cerar.ring.rounds``."""


def crossover_bandwidth(link: LinkModel, d: int, N: int, c: int, itemsize: int = 4,
                        passes: float | None = None) -> float:  # fmt: skip
    """The link bandwidth (bytes/s per direction) below which CERAR at c beats the exact ring on
    ``link``'s latency, memory bandwidth and storage choice: 0 if it never does, inf if it always
    does. ``passes`` overrides CERAR's memory traffic (e.g. ``PASSES_BEFORE_324C4C8``)."""
    ring, cerar = features("ring", d, N, None, itemsize), features("cerar", d, N, c, itemsize, link.storage)
    if passes is not None:
        cerar[2] = passes * d * itemsize
    saved_bytes = ring[1] - cerar[1]
    extra_seconds = link.alpha * (cerar[0] - ring[0]) + (cerar[2] - ring[2]) / link.memory_bandwidth
    if saved_bytes <= 0:
        return 0.0
    return math.inf if extra_seconds <= 0 else float(saved_bytes / extra_seconds)


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


# --------------------------------------------------------------------------- two tiers


@dataclasses.dataclass(frozen=True)
class Tier:
    """The links of one tier: ``alpha`` s per round, ``bandwidth`` bytes/s per direction of one link
    (what a collective achieves on it, not the line rate: see ``ethernet_tier``)."""

    alpha: float
    bandwidth: float
    name: str = ""
    note: str = ""

    def __post_init__(self):
        if not (self.alpha >= 0 and self.bandwidth > 0):
            raise ValueError(f"Tier needs alpha >= 0 and bandwidth > 0; got {self}")


TWO_TIER_AGGREGATORS = ("hier_ring", "hier_cerar", "hier_ring16", "ring", "cerar", "ring16")
"""``hier_ring``: the exact hierarchy (reduce-scatter in the node, exact ring on each rail, all-gather);
``hier_cerar``: CERAR on the rails with a code for the nodes; ``hier_ring16``: the exact hierarchy on
16-bit messages (the fp32 gradient cast there and back); ``ring`` / ``cerar`` / ``ring16``: one flat
ring over all n G ranks (node-major; NCCL's ring), whose every round waits for its slowest hop."""

# issue 25: the 8-bit all-reduce (cerar.int8.all_reduce; cerar.int8.two_tier), priced by its bytes (int8
# values and a float32 scale per block, as cerar.formats.int8_blocks lays them out) and by its quantize/dequantize
# passes
TWO_TIER_AGGREGATORS = (*TWO_TIER_AGGREGATORS, "hier_int8", "int8", "hier_cerar16", "cerar16")
"""``hier_int8``: the exact fp32 tier inside the node, the 8-bit all-reduce on the rails; ``int8``: the
8-bit all-reduce flat over all n G ranks; ``hier_cerar16``: ``hier_cerar`` over 16-bit messages on both tiers
(``cerar.formats.wire``: 2-byte values, the arithmetic in float32, each block cast on its way out and back in);
``cerar16``: the flat ``cerar`` over 16-bit messages the same way (aggregator=auto prices it)."""
FLAT_AGGREGATORS = ("ring", "cerar", "ring16", "cerar16")
"""The flat rings over all n G ranks, whose every round waits for its slowest hop (``TwoTierCluster.time``)."""
INT8_BLOCK = 128
"""Values per float32 scale (``cerar.formats.int8_blocks.DEFAULT_BLOCK``)."""
INT8_QUANTIZE_BYTES = 25
"""Memory traffic per value quantized (``cerar.formats.int8_blocks.quantize_into``): absmax read 4, times the inverse
scale read 4 + write 4, rounded read 4 + write 4, stored read 4 + write 1."""
INT8_DEQUANTIZE_ADD_BYTES = 17
"""Per value dequantized and added: int8 read 1 + float32 write 4, then read 4 + 4, write 4."""
INT8_DEQUANTIZE_BYTES = 13
"""Per value dequantized into place: int8 read 1 + write 4, then read 4 + write 4 (scaled)."""


def int8_message_bytes(s, block: int = INT8_BLOCK):
    """Bytes of one 8-bit message of s values: s int8 values and 4 per block's float32 scale."""
    return np.asarray(s) + 4 * _ceil(s, block)


def quantized_rail_terms(s, n: int, message_bytes, quantize: float, dequantize_add: float,
                         dequantize: float) -> tuple[int, np.ndarray, np.ndarray]:  # fmt: skip
    """(rounds, bytes one rank sends, bytes its arithmetic moves) of a two-shot quantized all-reduce of s values
    over n ranks (shards of ceil(s/n); ``cerar.int8.all_reduce``, ``cerar.int4.two_shot``): n-1 shards quantized
    and sent, n-1 received dequantized and added, the reduced shard quantized, n messages dequantized after the
    all-gather (its own decoded back, the n-1 received). ``message_bytes(shard)``: one message's bytes;
    ``quantize``, ``dequantize_add``, ``dequantize``: the format's memory traffic per value."""
    shard = _ceil(s, n)
    if n == 1:
        return 0, 0 * shard, 0 * shard
    moved = shard * ((n - 1) * (quantize + dequantize_add) + quantize + n * dequantize)
    return 2 * (n - 1), 2 * (n - 1) * message_bytes(shard), moved


def int8_rail_terms(s, n: int, block: int = INT8_BLOCK) -> tuple[int, np.ndarray, np.ndarray]:
    """``quantized_rail_terms`` of ``quantized_all_reduce`` (8-bit messages of ``block`` values per scale)."""
    return quantized_rail_terms(s, n, lambda shard: int8_message_bytes(shard, block), INT8_QUANTIZE_BYTES,
                                INT8_DEQUANTIZE_ADD_BYTES, INT8_DEQUANTIZE_BYTES)  # fmt: skip


def quantized_two_tier_features(flat: bool, d, n: int, G: int, nics_per_node: int, rail, message_bytes,
                                intra=None) -> np.ndarray:  # fmt: skip
    """``TWO_TIER_TERMS`` of a quantized all-reduce, flat (``flat``) or on two tiers, from its format's
    ``rail(s, n)`` (``quantized_rail_terms`` of s values over n ranks) and ``message_bytes(s)``.

    Two tiers: inside the node ``intra(s)`` (rounds, bytes sent, bytes moved) of the shard s = ceil(d/G); None:
    as ``hier_ring`` in fp32 (2 (G-1) rounds, 2 (G-1) s x 4 bytes, the reduce-scatter's adds); on each rail
    ``rail`` of the shard, the ceil(G / NICs) rails that share a NIC adding up there. Flat (N = n G ranks,
    message m of ceil(d/N) values): 2 (N-1) rounds; on a node's NIC, the all-to-all's G (N - G) messages that
    leave the node (over ceil(G / NICs) ... shared as the rails are) plus the node-major ring all-gather's N - 1
    that cross to the next node; on one node everything counts as the intra tier."""
    d = np.asarray(d)
    if flat:
        N = n * G
        rounds, sent, moved = rail(d, N)
        if n == 1:
            return np.array([rounds, sent, 0, 0, moved], dtype=float)
        message = message_bytes(_ceil(d, N))
        link = -(-G // nics_per_node) * (N - G) * message + (N - 1) * message
        return np.array([0, 0, rounds, link, moved], dtype=float)
    s = _ceil(d, G)
    rounds, sent, moved = rail(s, n)
    sharing = -(-G // nics_per_node)
    intra_rounds, intra_sent, intra_moved = (2 * (G - 1), 2 * (G - 1) * s * 4, 3 * (G - 1) * s * 4) if intra is None \
        else intra(s)  # fmt: skip
    return np.array([intra_rounds, intra_sent, rounds, sent * sharing, intra_moved + moved], dtype=float)


def int8_two_tier_features(aggregator: str, d, n: int, G: int, nics_per_node: int = 1, block: int = INT8_BLOCK):
    """``TWO_TIER_TERMS`` of ``hier_int8`` (the exact fp32 tier inside the node, ``int8_rail_terms`` on the rails)
    and ``int8`` (flat) (``quantized_two_tier_features``; ``two_tier_features`` calls it)."""
    return quantized_two_tier_features(aggregator == "int8", d, n, G, nics_per_node,
                                       lambda s, ranks: int8_rail_terms(s, ranks, block),
                                       lambda s: int8_message_bytes(s, block))  # fmt: skip


# issue 54: the 4-bit all-reduce (cerar.int4.all_reduce; cerar.int4.two_tier), priced by its bytes (two values a
# byte and a float32 scale per block, cerar.formats.int4_blocks) and by its eager format's passes, the rotation's
# log2 B stages included
TWO_TIER_AGGREGATORS = (*TWO_TIER_AGGREGATORS, "int4", "hier_int4")
"""``int4``: the 4-bit all-reduce flat over all n G ranks; ``hier_int4``: the 8-bit (``intra="int8"``, the
trainer's default) or exact fp32 (``intra="exact"``) reduce-scatter inside the node, the 4-bit all-reduce on the
rails, the exact all-gather inside the node."""
INT4_BLOCK = 128
"""Values per float32 scale (``cerar.formats.int4_blocks.DEFAULT_BLOCK``)."""
INT4_QUANTIZE_BYTES = 56.5
"""Memory traffic per value quantized by the eager 4-bit format (``cerar.formats.int4_blocks.quantize_eager``), not
rotated, rounded to nearest: copied into the work buffer (read 4, write 4), the block's largest and least value
(4 + 4), times the inverse scale (4 + 4), rounded (4 + 4), clamped (4 + 4), offset by 8 (4 + 4), each pair of
nibbles summed (read 2 + 2, write 2) and stored as a byte (read 2, write 1/2)."""
INT4_DITHER_BYTES = 28
"""Stochastic rounding's extra traffic per value: the dither built from its float32 table (the table read and the
sum with the chunk's offset written, 4 + 4, then its fractional part, 4 + 4), added (4 + 4 + 4) and floored
(4 + 4) where nearest rounding rounds (4 + 4)."""
INT4_STAGE_BYTES = 12
"""Per value and stage of the rotation's fast Walsh-Hadamard transform (``fwht_``): the sums and the differences,
each reading two halves and writing one (2 + 2 + 2, twice); a block of B takes log2 B stages. The quantizer
always runs them; the decoder only above ``INT4_UNROTATE_PRODUCT_MOST``."""
INT4_HADAMARD_PRODUCT_BYTES = 8
"""Per value, the decoder's H q as one product with the B x B matrix (read 4, write 4; the matrix stays in cache):
``cerar.formats.int4_blocks._unrotate`` up to ``INT4_UNROTATE_PRODUCT_MOST``."""
INT4_UNROTATE_PRODUCT_MOST = 256
"""``cerar.formats.int4_blocks.UNROTATE_PRODUCT_MOST`` (held equal by tests/test_costmodel_int4.py)."""
INT4_SIGNS_BYTES = 8
"""Per value, the product by the rotation's signs (read 4, write 4): on quantizing it writes the work buffer
in place of the copy; on dequantizing it is one more pass."""
INT4_DEQUANTIZE_BYTES = 23
"""Per value dequantized into place, not rotated: the nibbles unpacked (the bytes read 1/2 and masked or shifted
into 1/2, then read 1/2 and written as float32 4, twice: 7), the offset taken off (4 + 4), times the scale into
place (read 4, write 4)."""
INT4_DEQUANTIZE_ADD_BYTES = 27
"""Per value dequantized and added, not rotated: as ``INT4_DEQUANTIZE_BYTES``, the product added to its target
(read 4 + 4, write 4)."""


def int4_message_bytes(s, block: int = INT4_BLOCK):
    """Bytes of one 4-bit message of s values: ceil(s/2) bytes of values and 4 per block's float32 scale
    (``cerar.formats.int4_blocks.message_bytes``)."""
    return _ceil(s, 2) + 4 * _ceil(s, block)


def int4_value_bytes(block: int = INT4_BLOCK, rotate: bool = True, rounding: str = "stochastic") -> dict[str, float]:
    """The eager 4-bit format's memory traffic per value (exact where B divides the values; a short last block is
    copied, not rotated): ``quantize``, ``dequantize`` (into place) and ``dequantize_add``. Rotated, quantizing
    adds log2 B stages (the signs' product replaces the copy) and dequantizing the product by H (log2 B stages
    above ``INT4_UNROTATE_PRODUCT_MOST``) and the signs' product; ``rounding`` "stochastic" (the all-reduce's
    default) adds the dither's traffic."""
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rotate and (not isinstance(block, (int, np.integer)) or block < 1 or block & (block - 1)):
        raise ValueError(f"a rotated block must be a power of two, got {block!r}")
    stages = INT4_STAGE_BYTES * int(math.log2(block)) if rotate else 0
    product = INT4_HADAMARD_PRODUCT_BYTES if block <= INT4_UNROTATE_PRODUCT_MOST else stages
    undo = product + INT4_SIGNS_BYTES if rotate else 0
    return {
        "quantize": INT4_QUANTIZE_BYTES + (INT4_DITHER_BYTES if rounding == "stochastic" else 0) + stages,
        "dequantize": INT4_DEQUANTIZE_BYTES + undo,
        "dequantize_add": INT4_DEQUANTIZE_ADD_BYTES + undo,
    }


def int4_rail_terms(s, n: int, block: int = INT4_BLOCK, rotate: bool = True) -> tuple[int, np.ndarray, np.ndarray]:
    """``quantized_rail_terms`` of ``int4_all_reduce`` (4-bit messages, stochastic rounding, rotated unless
    ``rotate`` is false)."""
    value = int4_value_bytes(block, rotate)
    return quantized_rail_terms(s, n, lambda shard: int4_message_bytes(shard, block), value["quantize"],
                                value["dequantize_add"], value["dequantize"])  # fmt: skip


def int4_two_tier_features(
    aggregator: str, d, n: int, G: int, nics_per_node: int = 1, block: int = INT4_BLOCK, rotate: bool = True,
    intra: str = "int8", intra_block: int = INT8_BLOCK,
) -> np.ndarray:  # fmt: skip
    """``TWO_TIER_TERMS`` of ``int4`` (flat) and ``hier_int4`` (``quantized_two_tier_features``;
    ``two_tier_features`` calls it). Inside the node of ``hier_int4``, ``intra="exact"`` as ``hier_int8``;
    ``intra="int8"`` (``cerar.int4.two_tier``): 2 (G-1) rounds, the 8-bit reduce-scatter's G-1 messages of s values
    (``intra_block`` per scale) and the exact all-gather's (G-1) s x 4 bytes; G-1 shards quantized and G-1
    messages dequantized and added, at the 8-bit format's prices."""
    if intra not in ("exact", "int8"):
        raise ValueError(f"intra must be 'exact' or 'int8' (inside a node), got {intra!r}")
    G1 = G - 1

    def inside(s):
        return (2 * G1, G1 * int8_message_bytes(s, intra_block) + G1 * s * 4,
                G1 * s * (INT8_QUANTIZE_BYTES + INT8_DEQUANTIZE_ADD_BYTES))  # fmt: skip

    return quantized_two_tier_features(aggregator == "int4", d, n, G, nics_per_node,
                                       lambda s, ranks: int4_rail_terms(s, ranks, block, rotate),
                                       lambda s: int4_message_bytes(s, block),
                                       inside if intra == "int8" else None)  # fmt: skip


TWO_TIER_TERMS = ("rounds_intra", "bytes_intra", "rounds_inter", "bytes_inter_link", "bytes_moved")
CAST_BYTES_PER_VALUE = 12  # fp32 -> 16 bit and back: read 4 + write 2, read 2 + write 4 bytes per value


def _ceil(a, b):
    return -(-np.asarray(a) // b)


def two_tier_features(
    aggregator: str,
    d,
    nodes: int,
    local_size: int,
    c: int | None = None,
    itemsize: int = 4,
    nics_per_node: int = 1,
    storage: str = DEFAULT_STORAGE,
    coded_on_two_nodes: bool = False,
    block: int = INT8_BLOCK,
    rotate: bool = True,
    intra: str = "int8",
    intra_block: int = INT8_BLOCK,
) -> np.ndarray:
    """Regressors ``TWO_TIER_TERMS`` of one all-reduce of d values on n nodes of G ranks, per rank:

    - ``rounds_intra``, ``bytes_intra``: rounds and bytes one rank sends inside its node: 2 (G-1) and
      2 (G-1) s itemsize with s = ceil(d/G) (the reduce-scatter and the all-gather);
    - ``rounds_inter``, ``bytes_inter_link``: rounds between nodes, and the bytes the busiest NIC
      carries: a rail's per-rank bytes (exact ring 2 (n-1) ceil(s/n), CERAR L ceil(s/c), L = c+n-2)
      times the ceil(G / nics_per_node) rails that share one NIC;
    - ``bytes_moved``: the memory traffic of the arithmetic (the reduce-scatter adds, the rail's
      additions or CERAR's ``cerar_arithmetic`` on the shard, the casts of ``hier_ring16``).

    The quantized ones (``int8``, ``hier_int8``, ``int4``, ``hier_int4``) take their format's ``block`` (values
    per scale); the 4-bit ones also ``rotate`` and, ``hier_int4``, ``intra`` ("int8" or "exact") and
    ``intra_block`` (``int4_two_tier_features``).

    As ``cerar.hierarchical``: ``hier_cerar`` on two nodes runs the exact ring unless
    ``coded_on_two_nodes``; on one node nothing crosses; with G = 1 it is the flat call. A flat ring
    (``ring``, ``cerar``) sends one rank's stream over each NIC and waits for it every round: its
    rounds and bytes count as the inter tier's (the intra-node hops run meanwhile); with several NICs
    per node, one ring per NIC carries 1/nics_per_node of the tensor, as NCCL's channels do."""
    _check_nc(max(nodes * local_size, 2))
    for name, value in (("nodes", nodes), ("local_size", local_size), ("nics_per_node", nics_per_node)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if aggregator not in TWO_TIER_AGGREGATORS:
        raise ValueError(f"unknown aggregator {aggregator!r}: expected one of {TWO_TIER_AGGREGATORS}")
    _check_storage(storage)
    if aggregator in ("hier_int8", "int8"):  # issue 25; ``block``: values per scale
        return int8_two_tier_features(aggregator, d, nodes, local_size, nics_per_node, block)
    if aggregator in ("hier_int4", "int4"):  # issue 54; ``rotate``, ``intra``, ``intra_block``: the 4-bit ones'
        return int4_two_tier_features(aggregator, d, nodes, local_size, nics_per_node, block, rotate, intra,
                                      intra_block)  # fmt: skip
    d = np.asarray(d)
    n, G = nodes, local_size
    if aggregator in FLAT_AGGREGATORS:
        N = n * G
        cast, arithmetic_itemsize = 0, itemsize
        if aggregator == "ring16":
            itemsize, arithmetic_itemsize, cast = 2, 2, CAST_BYTES_PER_VALUE * d
        if aggregator == "cerar16":  # 2-byte messages, float32 arithmetic, each block cast out and back
            itemsize, arithmetic_itemsize, cast = 2, 4, CAST_BYTES_PER_VALUE * d
        if aggregator in ("ring", "ring16"):
            rounds, values, moved = ring_rounds(N), ring_values(d, N), ring_values_moved(d, N)
        else:
            if c is None:
                raise ValueError(f"aggregator {aggregator!r} needs c (number of components)")
            rounds, values = cerar_rounds(N, c), cerar_values(d, N, c)
            moved = cerar_arithmetic(d, N, c, storage)["values_moved"]
        # one ring per NIC (as NCCL lays its channels), each on 1/nics of the tensor
        tier = [rounds, values * itemsize / nics_per_node] if n > 1 else [0, 0]
        first = [rounds, values * itemsize] if n == 1 else [0, 0]
        return np.array([*first, *tier, moved * arithmetic_itemsize + cast], dtype=float)
    sixteen = aggregator == "hier_cerar16"
    if sixteen:  # the bytes on both tiers in 2-byte values; the arithmetic's traffic in float32, plus the casts
        aggregator, itemsize = "hier_cerar", 2
    coded = aggregator == "hier_cerar" and n > 1 and (n > 2 or coded_on_two_nodes)
    if aggregator == "hier_cerar" and c is None:
        raise ValueError("aggregator 'hier_cerar' needs c (number of components of the code for the nodes)")
    if aggregator == "hier_ring16":
        itemsize = 2
    s = _ceil(d, G)
    intra_rounds, intra_values = 2 * (G - 1), 2 * (G - 1) * s
    intra_moved = 3 * (G - 1) * s  # the reduce-scatter's adds: two blocks read, one written
    if n == 1:
        inter_rounds, inter_values, inter_moved = 0, 0 * s, 0 * s
    elif coded:
        inter_rounds, inter_values = cerar_rounds(n, c), cerar_values(s, n, c)
        inter_moved = cerar_arithmetic(s, n, c, storage)["values_moved"]
    else:
        inter_rounds, inter_values, inter_moved = ring_rounds(n), ring_values(s, n), ring_values_moved(s, n)
    sharing = -(-G // nics_per_node)
    moved = (intra_moved + inter_moved) * itemsize
    if aggregator == "hier_ring16":
        moved = moved + CAST_BYTES_PER_VALUE * d
    if sixteen:
        moved = (intra_moved + inter_moved) * 4 + CAST_BYTES_PER_VALUE * d
    return np.array(
        [intra_rounds, intra_values * itemsize, inter_rounds, inter_values * itemsize * sharing, moved], dtype=float
    )


@dataclasses.dataclass(frozen=True)
class TwoTierCluster:
    """n nodes of G ranks: the ``intra`` tier inside a node, the ``inter`` tier between nodes,
    ``nics_per_node`` NICs per node (1: the node's ranks share one; G: one per rank, rails), and the
    memory bandwidth at which the arithmetic streams its operands. Times are per all-reduce, the
    tiers one after the other (no overlap)."""

    nodes: int
    local_size: int
    intra: Tier
    inter: Tier
    nics_per_node: int = 1
    memory_bandwidth: float = 1.5e12
    storage: str = DEFAULT_STORAGE

    def __post_init__(self):
        _check_storage(self.storage)
        if not self.memory_bandwidth > 0:
            raise ValueError(f"memory_bandwidth must be > 0, got {self.memory_bandwidth!r}")
        two_tier_features("hier_ring", 1, self.nodes, self.local_size, nics_per_node=self.nics_per_node)

    @property
    def coef(self) -> np.ndarray:
        """Seconds per unit of each of ``TWO_TIER_TERMS``."""
        return np.array([self.intra.alpha, 1 / self.intra.bandwidth, self.inter.alpha, 1 / self.inter.bandwidth,
                         1 / self.memory_bandwidth])  # fmt: skip

    def terms(self, aggregator: str, d, c: int | None = None, itemsize: int = 4, **quantized) -> np.ndarray:
        """Seconds per term of ``TWO_TIER_TERMS`` (their sum is ``time``). ``quantized``: the quantized
        aggregators' format (``two_tier_features``' block, rotate, intra, intra_block)."""
        x = two_tier_features(aggregator, d, self.nodes, self.local_size, c, itemsize, self.nics_per_node,
                              self.storage, **quantized)  # fmt: skip
        return self.coef * x

    def time(self, aggregator: str, d, c: int | None = None, itemsize: int = 4, **quantized) -> float:
        """Seconds of one all-reduce. A flat ring's round lasts as long as its slower hop: the sum of
        ``terms`` when that is the one between nodes (the lab's case, and the fit's), the intra tier's
        rate otherwise (a PCIe node with a fast network). ``quantized`` as for ``terms``."""
        t = self.terms(aggregator, d, c, itemsize, **quantized)
        if aggregator in FLAT_AGGREGATORS and self.nodes > 1:
            x = two_tier_features(aggregator, d, self.nodes, self.local_size, c, itemsize, self.nics_per_node,
                                  self.storage)  # fmt: skip
            intra_hop = self.intra.alpha * x[2] + x[3] * self.nics_per_node / self.intra.bandwidth
            slowest = max(intra_hop, t[2] + t[3])
            return float(slowest + t[4])
        return float(t.sum())

    def best_c(self, d: int, c_max: int, itemsize: int = 4) -> tuple[int, float]:
        """The c in 1..c_max for which hierarchical CERAR is fastest, and that time."""
        if c_max < 1:
            raise ValueError(f"c_max must be >= 1, got {c_max}")
        times = [self.time("hier_cerar", d, c, itemsize) for c in range(1, c_max + 1)]
        k = int(np.argmin(times))
        return k + 1, float(times[k])


@dataclasses.dataclass
class TwoTierFit:
    """Least-squares fit of the two tiers' coefficients (``TWO_TIER_TERMS``: alpha and beta = 1/bandwidth
    of each tier, gamma = 1/memory bandwidth) to measured rows of one lab setting."""

    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    gamma: float
    n_rows: int
    rel_rmse: float
    rel_rmse_by_aggregator: dict[str, float]
    residuals: list[tuple[str, float]]  # (row label, predicted / measured - 1)

    @property
    def coef(self) -> np.ndarray:
        return np.array([self.alpha_intra, self.beta_intra, self.alpha_inter, self.beta_inter, self.gamma])

    def tier(self, which: str) -> Tier:
        alpha, beta = (self.alpha_intra, self.beta_intra) if which == "intra" else (self.alpha_inter, self.beta_inter)
        return Tier(alpha, math.inf if beta == 0 else 1 / beta, f"fitted {which}-node tier")


def _int(value, default: int | None = None) -> int | None:
    if value in (None, ""):
        return default
    return int(float(value))


def two_tier_row_features(row: dict, itemsize: int = 4) -> tuple[str, np.ndarray] | None:
    """The aggregator and ``TWO_TIER_TERMS`` of a row of ``scripts/bench/bench_allreduce.py --ranks-per-host``
    (columns aggregator, N, ranks_per_host, rails, c, bytes, inter_node_method, storage; ``hier_int4_exact`` is
    ``hier_int4`` with exact sums inside the node); None for rows the model does not describe (the backend's own
    all-reduce, whose algorithm is its own)."""
    agg = row["aggregator"]
    quantized = {}
    if agg == "hier_int4_exact":  # bench_allreduce's hier_int4 with exact sums inside the node
        agg, quantized = "hier_int4", {"intra": "exact"}
    if agg not in TWO_TIER_AGGREGATORS:
        return None
    G = _int(row.get("ranks_per_host"), 1)
    N = _int(row["N"])
    if N % G:
        raise ValueError(f"row N={N} is not a multiple of ranks_per_host={G}")
    nbytes = _int(row["bytes"])
    if nbytes % itemsize:
        raise ValueError(f"row bytes={nbytes} is not a multiple of itemsize={itemsize}")
    if agg == "hier_cerar" and row.get("inter_node_method") == "exact ring":
        agg = "hier_ring"  # the library ran the exact rail (two nodes)
    nics = G if str(row.get("rails", "")) in ("1", "True", "true") else 1
    storage = row.get("storage") or DEFAULT_STORAGE
    storage = storage if storage in STORAGE_CHOICES else DEFAULT_STORAGE
    c = _int(row.get("c"))
    return agg, two_tier_features(agg, nbytes // itemsize, N // G, G, c, itemsize, nics, storage,
                                  coded_on_two_nodes=row.get("inter_node_method") == "cerar",
                                  block=_int(row.get("int8_block"), INT8_BLOCK), **quantized)  # fmt: skip


def fit_two_tier(rows: Iterable[dict], itemsize: int = 4) -> TwoTierFit:
    """Fit the two tiers' alpha and beta and the memory term, all >= 0, to rows of one lab setting
    (relative residuals, so every size weighs alike). Rows of ``nccl`` are left out, as in ``fit``."""
    feats, ys, labels = [], [], []
    for row in rows:
        got = two_tier_row_features(row, itemsize)
        if got is None:
            continue
        agg, x = got
        feats.append(x)
        ys.append(float(row["seconds_median"]))
        code = " ".join(x for x in (row.get("construction"), f"c={row['c']}" if row.get("c") else "") if x)
        labels.append((agg, " ".join(x for x in (agg, code, f"{int(row['bytes']) / 2**20:g} MiB") if x)))
    if len(ys) < len(TWO_TIER_TERMS):
        raise ValueError(f"need at least {len(TWO_TIER_TERMS)} rows of {TWO_TIER_AGGREGATORS} to fit "
                         f"{len(TWO_TIER_TERMS)} parameters, got {len(ys)}")  # fmt: skip
    X, y = np.array(feats), np.array(ys)
    if np.any(y <= 0):
        raise ValueError("seconds_median must be positive in every row")
    w = 1.0 / y
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    b = _nonneg_lstsq(X * w[:, None] / scale, y * w) / scale
    rel = (X @ b - y) / y
    aggs = np.array([a for a, _ in labels])
    by = {a: float(np.sqrt(np.mean(rel[aggs == a] ** 2))) for a in sorted(set(aggs))}
    residuals = [(label, float(r)) for (_, label), r in zip(labels, rel, strict=True)]
    return TwoTierFit(*(float(v) for v in b), len(y), float(np.sqrt(np.mean(rel**2))), by, residuals)


def fit_two_tier_groups(rows: Sequence[dict], itemsize: int = 4) -> dict[tuple[str, str], TwoTierFit | str]:
    """One two-tier fit per (where, rate_mbit) setting of rows with more than one rank per host."""
    return _fit_each_setting([r for r in rows if is_two_tier_row(r)], fit_two_tier, itemsize)


# The projection's cluster: 8-GPU nodes, NVLink or PCIe inside, Ethernet between. Bandwidths are what
# NCCL achieves on them, not line rates.
GPUS_PER_NODE = 8
INTRA_NODE_TIERS = {
    "NVLink": Tier(5e-6, 300e9, "NVLink", "300 GB/s per GPU and direction (A100 NVLink3; H100's is 450), alpha 5 us"),
    "PCIe": Tier(10e-6, 18e9, "PCIe", "18 GB/s per GPU and direction (NCCL measures 12-24 GB/s on PCIe 4.0 nodes), "
                 "alpha 10 us"),
}  # fmt: skip
ETHERNET_GBIT = (25, 100, 400)
TCP_EFFICIENCY = 0.5
"""The fraction of an Ethernet line rate NCCL's all-reduce reaches over TCP sockets (40-60 %: NVIDIA/nccl
issues 450 and 209); RDMA (RoCE) reaches more: ``ethernet_tier(..., efficiency=0.9)``."""
ETHERNET_ALPHA = 30e-6
NODE_COUNTS = (2, 4, 8, 16, 32, 64)
HIER_C_MAX_MULT = 4
"""Hierarchical CERAR's c is searched in 1..4n: beyond c = 4n the optimized codes at kappa <= 1e4 err more
than a few percent (``reports/code_design.md``) for a byte count within 1/(4n) d of its limit, d."""


def ethernet_tier(gbit: float, efficiency: float = TCP_EFFICIENCY, alpha: float = ETHERNET_ALPHA) -> Tier:
    """The inter-node tier of ``gbit`` Gbit/s Ethernet NICs, at ``efficiency`` of the line rate."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    return Tier(alpha, gbit * 1e9 / 8 * efficiency, f"{gbit:g} GbE",
                f"{gbit:g} Gbit/s at {efficiency:.0%} of line rate, alpha {alpha * 1e6:g} us")  # fmt: skip


def two_tier_projection(
    d: int,
    intra: Tier,
    inter: Tier,
    nodes: int,
    local_size: int = GPUS_PER_NODE,
    nics_per_node: int = 1,
    memory_bandwidth: float = HBM_BANDWIDTH,
    c_max: int | None = None,
) -> dict:
    """All-reduce seconds of each choice on one cluster and which one to use.

    Keys: ``flat_ring``, ``hier_ring``, ``hier_cerar`` (at ``hier_c``, the best c in 1..``c_max``,
    default 4n; on two nodes the exact rail, as the library runs it), ``half`` (16-bit messages on the
    faster of the hierarchy and the flat ring; ``half_layout`` says which), ``cerar_ratio``,
    ``flat_ratio`` and ``half_ratio`` (each over ``hier_ring``), ``coded_pays`` (hierarchical CERAR
    faster than the exact hierarchy), ``choice_fp32`` (the fastest of the flat ring, the exact hierarchy
    and hierarchical CERAR) and ``choice`` (the same with 16-bit messages allowed). Ties go to the exact
    choices, and to 16-bit messages before the codes (they err less)."""
    cluster = TwoTierCluster(nodes, local_size, intra, inter, nics_per_node, memory_bandwidth)
    out = {"flat_ring": cluster.time("ring", d), "hier_ring": cluster.time("hier_ring", d)}
    half = {"hierarchy": cluster.time("hier_ring16", d), "flat ring": cluster.time("ring16", d)}
    out["half_layout"] = min(half, key=lambda k: (half[k], k != "hierarchy"))
    out["half"] = half[out["half_layout"]]
    if nodes > 2:
        out["hier_c"], out["hier_cerar"] = cluster.best_c(d, c_max or HIER_C_MAX_MULT * nodes)
    else:
        out["hier_c"], out["hier_cerar"] = None, out["hier_ring"]
    for ratio, key in (("cerar_ratio", "hier_cerar"), ("flat_ratio", "flat_ring"), ("half_ratio", "half")):
        out[ratio] = out[key] / out["hier_ring"]
    out["coded_pays"] = out["hier_cerar"] < out["hier_ring"] * (1 - 1e-9)
    fp32 = [(out["hier_ring"], 0, "exact hierarchy"), (out["flat_ring"], 1, "flat ring"),
            (out["hier_cerar"] if out["coded_pays"] else math.inf, 3, "hierarchical CERAR")]  # fmt: skip
    out["choice_fp32"] = min(fp32)[2]
    out["choice"] = min([*fp32, (out["half"], 2, "16-bit messages")])[2]
    # issue 25: the 8-bit hierarchy (hier_int8) and the choice when 8-bit messages are acceptable too (ties go
    # to the wider messages, which err less)
    out["int8"] = cluster.time("hier_int8", d)
    out["int8_ratio"] = out["int8"] / out["hier_ring"]
    out["choice_int8"] = min([*fp32, (out["half"], 2, "16-bit messages"), (out["int8"], 4, "8-bit messages")])[2]
    # issue 25: hierarchical CERAR over fp16 messages at c = 2n (the fp16 default kappa_max reaches it at every n),
    # against the 16-bit exact hierarchy
    if nodes > 2:
        out["cerar16"] = cluster.time("hier_cerar16", d, 2 * nodes)
        out["cerar16_ratio_to_half"] = out["cerar16"] / cluster.time("hier_ring16", d)
    else:
        out["cerar16"], out["cerar16_ratio_to_half"] = None, None
    return out


# --------------------------------------------------------------------------- command line


def summary(rows: Sequence[dict] | None, itemsize: int = 4) -> str:
    """Plain-text fits (when rows are given) and the Pythia projection on the GPU scenarios."""
    lines = []
    if rows is not None:
        lines.append("fitted per setting: alpha (s/round), link bandwidth (B/s), memory bandwidth (B/s), rel. RMSE")
        for (where, rate), f in fit_groups(rows, itemsize).items():
            if isinstance(f, str):
                lines.append(f"  {where} {rate or '-'}: not fitted: {f}")
            else:
                lines.append(f"  {where} {rate or '-'}: {f.alpha:.3g} {f.bandwidth:.3g} {f.memory_bandwidth:.3g} "
                             f"{f.rel_rmse:.2f}")  # fmt: skip
    lines.append("CERAR at its best c / exact ring, all-reduce time (model):")
    for key in ("pcie-node", "nvlink"):
        link = SCENARIOS[key]
        for N in (4, 8):
            cells = []
            for name in PYTHIA_PROJECTED:
                pr = projection(link, PYTHIA_PARAMS[name], N, itemsize)
                cells.append(f"{name} {pr['best'] / pr['ring']:.3f} (c={pr['best_c']})")
            lines.append(f"  {key} N={N}: " + ", ".join(cells))
    return "\n".join(lines) + "\n"


def cli_parser(description: str) -> argparse.ArgumentParser:
    """The options of every cost-model command: ``--csv`` (measured rows) and ``--itemsize``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--csv", default=None, help="measured rows (reports/data/allreduce.csv)")
    ap.add_argument("--itemsize", type=int, default=4, help="bytes per gradient value (default 4, fp32)")
    return ap


def cli_rows(ap: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> list[dict] | None:
    """The rows ``--csv`` names (None without it), after checking ``--itemsize``; a bad value, a missing
    file or missing columns end the command with status 2 and one line naming them."""
    if args.itemsize not in (1, 2, 4, 8):
        ap.error(f"--itemsize must be 1, 2, 4 or 8, got {args.itemsize}")
    if not args.csv:
        return None
    try:
        return read_csv(args.csv)
    except (FileNotFoundError, ValueError) as e:
        ap.exit(2, f"{name}: {e}\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = cli_parser("Fit the CERAR vs ring cost model and print its projection.")
    args = ap.parse_args(argv)
    rows = cli_rows(ap, args, "costmodel")
    sys.stdout.write(summary(rows, args.itemsize))
    return 0


if __name__ == "__main__":
    sys.exit(main())
