"""The GPU check's runner: picks the cases the machine can run, runs each in a process of its own
(``cases.run_case``), and writes the report (``report.write``).

    python -m scripts.checks.gpu --quick          # self-loop, arithmetic, throughput, hook: one GPU, < 5 min
    python -m scripts.checks.gpu                  # every section: one rank per GPU, up to --ranks (8); < 10 min
    python -m scripts.checks.gpu --device cpu --small --out /tmp/gpu.md   # the dry run on the CPU
    python -m scripts.checks.gpu --bench          # the GPU benchmark instead (scripts/bench/gpu): <= 5 min

(``python scripts/checks/gpu_check.py`` is the same command.) A case that needs CUDA or more GPUs
than the machine has is NOT RUN, with the reason; nothing NOT RUN is ever PASS."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from scripts.checks.gpu import (
    arithmetic,
    between_ranks,
    hierarchical,
    hook_delayed,
    report,
    selfloop,
    throughput,
    training,
    training_cerar,
)
from scripts.checks.gpu.cases import DRY_RUN_RANKS, FAIL, Context, Result, not_run, run_case
from scripts.checks.gpu.judge import resolve_device

SECTIONS = (selfloop, arithmetic, throughput, hook_delayed, between_ranks, training, training_cerar, hierarchical)
"""In the order they run and are reported; each module: SECTION, QUICK, EXPECTED_S, cases(ctx), report(results)."""


def key(section) -> str:
    """A section's name for ``--skip``: its module's (selfloop, arithmetic, throughput, hook_delayed,
    between_ranks, training, training_cerar, hierarchical)."""
    return section.__name__.rsplit(".", 1)[-1]


def skip_reason(case, ctx: Context) -> str | None:
    """Why ``case`` cannot prove anything on this machine, or None."""
    if case.needs.cuda and ctx.device != "cuda":
        return "needs CUDA"
    if case.needs.ranks > ctx.world:
        have = f"this machine has {ctx.devices}" if ctx.device == "cuda" else f"the dry run has {ctx.devices}"
        if ctx.ranks < ctx.devices:
            have += f", --ranks {ctx.ranks}"
        return f"needs {case.needs.ranks} GPUs ({'one rank per GPU' if ctx.device == 'cuda' else 'ranks'}; {have})"
    return None


def plan(ctx: Context, skip: list[str]) -> list[tuple[object, list]]:
    """Every section with its cases, each with the reason it will not run (or None)."""
    out = []
    for section in SECTIONS:
        entries = []
        for case in section.cases(ctx):
            reason = skip_reason(case, ctx)
            if reason is None and key(section) in skip:
                reason = "skipped (--skip)"
            if reason is None and ctx.quick and not section.QUICK:
                reason = "not in --quick"
            entries.append((case, reason))
        out.append((section, entries))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--bench" in argv:  # the benchmark, not the check: scripts/bench/gpu (its own options follow)
        from scripts.bench.gpu.runner import main as bench

        return bench([a for a in argv if a != "--bench"])
    parser = argparse.ArgumentParser(description="CERAR's CUDA/NCCL acceptance check, written to reports/gpu.md")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the dry run)")
    parser.add_argument("--ranks", type=int, default=8, help="ranks wanted between processes (default 8)")
    parser.add_argument("--small", action="store_true", help="small sizes: a quick check of the script itself")
    parser.add_argument("--quick", action="store_true", help="only the self-loop, arithmetic, throughput and hook")
    parser.add_argument("--out", type=Path, default=Path("reports/gpu.md"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", nargs="*", default=[], choices=[key(s) for s in SECTIONS])
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu for a dry run)")
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    resolve_device(args.device, 0 if torch.cuda.is_available() else None)
    device = torch.device(args.device).type
    devices = torch.cuda.device_count() if device == "cuda" else DRY_RUN_RANKS  # no CUDA context in this process
    ctx = Context(device, devices, args.ranks, args.small, args.repeats, args.quick)
    planned = plan(ctx, args.skip)
    expected = sum(s.EXPECTED_S for s, entries in planned if any(reason is None for _, reason in entries))
    print(f"expected on H200s: about {expected / 60:.1f} min ({ctx.world} rank(s))", flush=True)
    started = time.monotonic()
    sections = []
    command = " ".join(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        for section, entries in planned:
            results: list[Result] = []
            for case, reason in entries:
                result = not_run(case, reason) if reason else run_case(case, Path(workdir))
                print(f"[{time.monotonic() - started:5.0f} s] {section.SECTION} / {case.name}: {result.status}"
                      f"{' (' + result.reason + ')' if result.reason else ''}", flush=True)  # fmt: skip
                results.append(result)
                # the report so far after every case: a check cut short (a lease's timeout) still says what it saw
                so_far = [*sections, (section, results)]
                args.out.write_text(report.write(so_far, ctx, command, time.monotonic() - started, partial=True))
            sections.append((section, results))
    text = report.write(sections, ctx, command, time.monotonic() - started)
    args.out.write_text(text)
    print(text)
    return 1 if any(r.status == FAIL for _, results in sections for r in results) else 0
