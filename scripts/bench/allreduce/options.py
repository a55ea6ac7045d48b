"""bench_allreduce's columns, aggregators and command line: what a row holds and what a run may ask for."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CSV_COLUMNS = [
    "where", "rate_mbit", "aggregator", "construction", "N", "c", "bytes",
    "seconds_median", "seconds_min", "seconds_max", "repeats",
]  # fmt: skip
EXTRA_COLUMNS = [
    "seconds_p25", "seconds_p75", "warmup", "backend", "itemsize", "bytes_sent", "bytes_received",
    "rounds", "byte_bound_seconds", "achieved_mbit", "seconds_encode", "seconds_comm", "seconds_decode",
    "peak_extra_bytes", "rel_error", "eps", "kappa", "run_id", "timestamp", "host", "torch",
    "storage", "code_commit", "load_before", "pipeline_chunks", "cpu_seconds", "cpu_system_seconds", "mtu", "cpus",
    "hosts", "ranks_per_host", "rails", "inter_node_method", "bytes_sent_intra", "bytes_sent_inter", "rounds_intra",
    "rounds_inter", "seconds_intra", "seconds_inter", "nic_tx_bytes", "nic_tx_bytes_link_max", "half_dtype",
    "load_after",
]  # fmt: skip
AGGREGATORS = ("nccl", "ring", "cerar", "hier_ring", "hier_cerar", "hier_ring16")
HIERARCHICAL = ("hier_ring", "hier_cerar", "hier_ring16")
# issue 25: the 8-bit all-reduce (cerar.int8.all_reduce): int8 flat, hier_int8 on the two tiers (int8 on the rails)
AGGREGATORS = (*AGGREGATORS, "int8", "hier_int8")
HIERARCHICAL = (*HIERARCHICAL, "hier_int8")
# issue 54: the 4-bit all-reduce (cerar.int4): int4 flat, hier_int4 (8-bit sums inside a host) and hier_int4_exact
# (exact sums inside), 4 bits on the rails; rotated, stochastic, B = --int8-block
AGGREGATORS = (*AGGREGATORS, "int4", "hier_int4", "hier_int4_exact")
HIERARCHICAL = (*HIERARCHICAL, "hier_int4", "hier_int4_exact")
EXTRA_COLUMNS = [*EXTRA_COLUMNS, "int8_block", "transport", "fused"]  # issue 35: the compiled kernels on
EXTRA_COLUMNS = [*EXTRA_COLUMNS, "nic_tcp_retransmitted_segments"]  # in the lab: counted again in nic_tx_bytes*
DEFAULT_CSV = ROOT / "reports" / "data" / "allreduce.csv"
DEFAULT_FIGURES = ROOT / "reports" / "figures"
ITEMSIZE = 4  # float32


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _floats(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from e
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {s!r}")
    return vals


def _strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--n", type=_ints, default=[2, 4, 8], help="world sizes, e.g. 2,4,8")
    ap.add_argument("--sizes-mb", type=_floats, default=[1, 4, 16, 64, 256],
                    help="tensor sizes in MiB (float32), e.g. 1,16,256")  # fmt: skip
    ap.add_argument("--aggregators", type=_strs, default=["nccl", "ring", "cerar"],
                    help=f"subset of {','.join(AGGREGATORS)}")  # fmt: skip
    ap.add_argument("--constructions", type=_strs, default=None,
                    help="CERAR constructions (default: all of cerar.CONSTRUCTIONS)")  # fmt: skip
    ap.add_argument("--c-mult", type=_ints, default=[1, 2, 4], help="c = k*N for k in this list")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks per host G (LOCAL_WORLD_SIZE; N must be a multiple): two tiers when > 1")  # fmt: skip
    ap.add_argument("--rails", action="store_true", help="lab: one NIC per local rank instead of one per host")
    ap.add_argument("--hier-c", type=_ints, default=None,
                    help="hier_cerar: c values, e.g. 8,16 (default: --c-mult times the number of hosts)")  # fmt: skip
    ap.add_argument("--half-dtype", choices=["float16", "bfloat16"], default="float16",
                    help="hier_ring16: the 16-bit message type (default float16, as torch's fp16 hook)")  # fmt: skip
    ap.add_argument("--int8-block", type=int, default=128,
                    help="int8/hier_int8/int4/hier_int4: values per float32 scale")  # fmt: skip
    ap.add_argument("--cerar-transport", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="cerar/hier_cerar: the dtype their messages travel in (cerar.formats.wire; 16 bits: kappa_max "
                         "defaults to cerar.default_kappa_max of it), recorded in the transport column")  # fmt: skip
    ap.add_argument("--storages", type=_strs, default=None,
                    help="CERAR storage choices, e.g. spec,messages (default: the library's default)")  # fmt: skip
    ap.add_argument("--pipeline-chunks", type=_ints, default=None,
                    help="CERAR: most messages a round's block is cut into (cerar.ring.rounds.PIPELINE_MAX_CHUNKS), "
                         "e.g. 2,4 (default: the library's)")  # fmt: skip
    ap.add_argument(
        "--fused",
        action="store_true",
        help="every rank switches on cerar.formats.fused's compiled kernels (the 8-bit quantizer, the "
        "16-bit wire's encode) before anything is timed, as the trainer does; torch.compile: minutes "
        "the first time on a small CPU, seconds from $TORCHINDUCTOR_CACHE_DIR",
    )
    ap.add_argument("--code-dir", type=Path, default=None,
                    help="import cerar from this checkout (before/after comparisons); default: this one")  # fmt: skip
    ap.add_argument("--eps", type=float, default=None, help="code eps (default: the construction's)")
    ap.add_argument("--kappa-max", type=float, default=None, help="code kappa_max (default: the library's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lab", action="store_true", help="run in a netlab lab (root) instead of loopback")
    ap.add_argument("--rate-mbit", type=_floats, default=[200.0], help="lab link rates, e.g. 100,400,2000")
    ap.add_argument("--mtu", type=int, default=1500, help="lab link MTU (9000: jumbo frames)")
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--figures", action="store_true", help="draw figures from the CSV after the run")
    ap.add_argument("--figures-only", action="store_true", help="only (re)draw figures from --csv")
    ap.add_argument("--figures-dir", type=Path, default=DEFAULT_FIGURES)
    ap.add_argument("--timeout", type=float, default=1800.0, help="wall-clock limit per (N, rate) run")
    ap.add_argument("--collective-timeout", type=float, default=300.0, help="limit per collective (s)")
    ap.add_argument("--log-dir", type=Path, default=None, help="keep rank logs here")
    ap.add_argument("--quiet", action="store_true")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--where", default="loopback", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    return ap


def _label(r: dict) -> str:
    if r["aggregator"] == "hier_ring16":
        return f"hier_ring16 {r.get('half_dtype') or ''}".strip()
    if r["aggregator"] not in ("cerar", "hier_cerar"):
        return r["aggregator"]
    storage, chunks = r.get("storage") or "", str(r.get("pipeline_chunks") or "")
    transport = r.get("transport") or ""
    return (f"{r['aggregator']} {r['construction']} c={r['c']}"
            + (f" {transport}" if transport not in ("", "float32") else "")
            + (f" {storage}" if storage not in ("", "-", "spec") else "")
            + (f" chunks={chunks}" if chunks not in ("", "2") else ""))  # fmt: skip
