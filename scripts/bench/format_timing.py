"""Every format's per-call arithmetic against a copy of the same float32 bytes on one device (issue 52).

    python -m scripts.bench.format_timing --device cuda --mib 64 256        # JSON lines on stdout
    python scripts/bench/bench_arithmetic.py --device cuda                   # the same, written to reports/

    from scripts.bench.format_timing import formats_against_copy            # what a GPU benchmark calls
    rows = formats_against_copy("cuda", mib=(64, 256))

Rows, per size: a copy (``y.copy_(x)``, 4 bytes read and 4 written per value), then the 8-bit format's quantize
(nearest and stochastic), dequantize and dequantize-and-add (``cerar.formats.int8_blocks``), the same of the 4-bit
format rotated (``cerar.formats.int4_blocks``) and the 16-bit wire's
encode and decode in float16 and bfloat16 (``cerar.formats.wire``), each in up to three variants: ``eager`` (the
reference), ``fused`` (the compiled kernel of ``cerar.formats.fused``, where it compiled and passed its check) and
``triton`` (the hand-written Triton kernel of ``cerar.formats.triton_kernels``, on a GPU, where it passed its check)
and ``chosen`` (what the formats run once ``fused.enable`` has picked the fastest per kernel: the path a collective
takes). Times: the median of ``reps`` calls after an untimed one, each between CUDA events on a GPU (device
time, launches included), the thread's CPU time elsewhere (``scripts.checks.gpu.arithmetic._timed``, the GPU
check's measure) (a dry run; ``reports/arithmetic.md`` is the CPU's
measurement). ``x_copy`` = time / the copy's; the target on a GPU is at most 2 for quantize, encode and decode
at 64 MiB and above (issue 52). Every fused and chosen row first writes the eager row's bytes (``same_bytes``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cerar.formats import fused, kernel_cases  # noqa: E402
from cerar.formats import int8_blocks as q8  # noqa: E402
from scripts.checks.gpu.arithmetic import _timed  # noqa: E402


def _cases(n: int, block: int, device: torch.device, x: torch.Tensor) -> list[tuple]:  # noqa: ARG001
    """(operation, {variant: fn}, outputs to compare or None) for every format at n values (``kernel_cases``):
    eager, every variant that passed ``fused.enable``'s check ("fused": compiled; "triton"), and "chosen" (the
    public function). The adds accumulate over the timed calls: their outputs are not compared (enable's check
    compared them)."""
    cases = []
    for case in kernel_cases.every_case(x, block):
        out = {v: case.fresh() for v in ("eager", "chosen", *fused.VARIANTS)}
        variants = {
            "eager": lambda c=case, o=out: c.eager(o["eager"]),
            "chosen": lambda c=case, o=out: c.public(o["chosen"]),
        }
        for variant, fn in fused.checked_variants(case.name, device, block).items():
            variants[variant] = lambda c=case, o=out, v=variant, fn=fn: c.run(fn, o[v])
        cases.append((case.what, variants, None if case.accumulates else out))
    return cases


def formats_against_copy(
    device="cuda",
    mib=(64, 256),
    reps: int = 20,
    *,
    with_fused: bool = True,
    backend: str = "inductor",
    block: int = q8.DEFAULT_BLOCK,
    sample_values: int = fused.SAMPLE_VALUES,
    say=print,
) -> dict:
    """Time every format against a copy on ``device`` at each size in ``mib`` (MiB of float32), after
    ``fused.enable`` (``with_fused``; ``backend`` as there: "eager" for a dry run on a CPU). Returns {"rows":
    [{"MiB", "operation", "variant", "ms", "x_copy", "same_bytes"}], "enable": the seconds each kernel took to
    compile, check and time, "choices": ``fused.choices()``}. ``sample_values``: ``enable``'s sample (smaller
    for a dry run); ``say``: where ``enable``'s lines go."""
    device = torch.device(device)
    seconds = {}
    if with_fused:
        fused.disable()
        seconds = fused.enable(device, block, say=say, backend=backend, sample_values=sample_values)

    def time_it(fn) -> float:  # the GPU check's measure: CUDA events on a GPU, CPU time elsewhere
        return _timed(fn, device, reps)

    rows = [row for size in mib for row in _rows_at(size, device, block, time_it)]
    return {"rows": rows, "enable": seconds, "choices": {"/".join(map(str, k)): v for k, v in fused.choices().items()}}


def _rows_at(size: float, device: torch.device, block: int, time_it) -> list[dict]:
    """The copy's row and every format's rows at ``size`` MiB of float32 (heavy-tailed values: decades apart)."""
    n = int(size * 2**20) // 4
    g = torch.Generator().manual_seed(0)
    spread = torch.exp(2 * torch.randn(-(-n // 64), generator=g)).repeat_interleave(64)[:n]
    x = (torch.randn(n, generator=g) * spread).to(device)
    y = torch.empty_like(x)
    copy_s = time_it(lambda: y.copy_(x))
    rows = [{"MiB": size, "operation": "copy", "variant": "-", "ms": 1e3 * copy_s, "x_copy": 1.0, "same_bytes": True}]
    for operation, variants, messages in _cases(n, block, device, x):
        for variant, fn in variants.items():
            fn()
            same = True if messages is None else fused._differing(messages["eager"], messages[variant]) == 0
            t = time_it(fn)
            rows.append({"MiB": size, "operation": operation, "variant": variant, "ms": 1e3 * t,
                         "x_copy": t / copy_s, "same_bytes": same})  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mib", type=float, nargs="+", default=[64.0, 256.0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-fused", action="store_true", help="eager rows only: nothing compiles")
    p.add_argument("--backend", default="inductor", help='torch.compile backend ("eager": a dry run)')
    args = p.parse_args(argv)
    result = formats_against_copy(args.device, args.mib, args.reps, with_fused=not args.no_fused,
                                  backend=args.backend, say=lambda line: print(line, file=sys.stderr))  # fmt: skip
    for row in result["rows"]:
        print(json.dumps(row))
    print(json.dumps({"enable_s": result["enable"], "choices": result["choices"]}))
    return 0 if all(r["same_bytes"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
