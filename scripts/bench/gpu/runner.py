"""The GPU benchmark's runner: the sections in order within a time budget, a progress line per row, and the
report rewritten after every row (``report.write``), so that a run cut short still says what it measured.

    python -m scripts.bench.gpu                                  # one GPU, <= 5 min: reports/gpu_bench.md
    python -m scripts.checks.gpu --bench                         # the same command
    python -m scripts.bench.gpu --device cpu --small --out /tmp/gpu_bench.md   # the dry run (tests/test_gpu_bench.py)

Each section (``STAGES``) checks the budget before each of its rows: a row whose estimated seconds no longer fit
is NOT RUN, with that reason, and the rest go on; a trainer launch gets twice its estimate (at most what is left)
as its deadline. A row that
raises is FAILED with the error, and the rest go on."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scripts.bench.gpu import arithmetic, formats, model_step, report, trainer_mfu
from scripts.bench.gpu.measure import ROOT, provenance

STAGES = (arithmetic, formats, trainer_mfu, model_step)
"""In the order they run; each module: SECTION, run(bench). The cheap sections first: they always fit."""
MEASURED, NOT_RUN, FAILED = "measured", "NOT RUN", "FAILED"
DEFAULT_BUDGET_S = 290.0  # within the 5 minutes on one GPU, start-up and the report included


@dataclass
class Bench:
    """One run: where, how large, the budget and what has been recorded."""

    device: torch.device
    small: bool
    budget_s: float
    seed: int
    md: Path
    jsonl: Path
    command: str
    started: float = field(default_factory=time.monotonic)
    rows: list[dict] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def say(self, text: str) -> None:
        """A progress line: a run cut short still says where it got."""
        print(f"[{self.elapsed():5.0f} s of {self.budget_s:.0f}] {text}", flush=True)

    def fits(self, section: str, what: str, estimate_s: float) -> bool:
        """Whether a row estimated at ``estimate_s`` seconds fits in what is left; if not, it is recorded NOT RUN."""
        if self.left() >= estimate_s:
            return True
        self.record(section, what, NOT_RUN, reason=f"the budget: {self.left():.0f} s left of {self.budget_s:.0f}, "
                    f"about {estimate_s:.0f} s needed")  # fmt: skip
        return False

    def record(self, section: str, what: str, status: str = MEASURED, **figures) -> dict:
        """A row: its section, what it measured, its status (and reason), its figures and the run's provenance;
        appended to the jsonl and the report rewritten."""
        row = {"section": section, "what": what, "status": status, **figures, **self.provenance}
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        self.md.write_text(report.write(self))
        note = f" ({figures['reason']})" if figures.get("reason") else ""
        self.say(f"{section}: {what}: {status}{note}{' ' + figures['summary'] if figures.get('summary') else ''}")
        return row


def run_stage(bench: Bench, stage) -> None:
    try:
        stage.run(bench)
    except Exception as error:  # one section's fault is its row, not the end of the run
        tail = traceback.format_exc()[-1500:]
        bench.record(stage.SECTION, "the section", FAILED, reason=f"{type(error).__name__}: {error}", traceback=tail)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The GPU benchmark: reports/gpu_bench.md and its jsonl")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the dry run)")
    parser.add_argument("--small", action="store_true", help="toy sizes: runs the machinery, measures nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu_bench.md")
    parser.add_argument("--data", type=Path, default=None, help="the jsonl (default: data/<out's stem>.jsonl beside)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--only", nargs="*", default=None, choices=[s.SECTION for s in STAGES])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible (use --device cpu --small for the dry run)")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        parser.error(f"--device must be cuda or cpu, got {args.device!r}")
    if not args.budget_s > 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    # one compile cache for the run and its launches (the trainer's compiled steps, the fused formats): what one
    # compiles, a later one with the same graph finds
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    jsonl = args.data or args.out.parent / "data" / f"{args.out.stem}.jsonl"
    for path in (args.out, jsonl):
        path.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("")
    command = " ".join(argv if argv is not None else sys.argv[1:])
    bench = Bench(device, args.small, args.budget_s, args.seed, args.out, jsonl, command)
    bench.provenance = provenance(device, args.seed)
    bench.say(f"GPU benchmark on {bench.provenance['device']}, torch {torch.__version__}; writing {args.out}")
    for stage in STAGES:
        if args.only is None or stage.SECTION in args.only:
            run_stage(bench, stage)
    args.out.write_text(report.write(bench, finished=True))
    bench.say(f"done: {len(bench.rows)} rows in {args.out} and {jsonl}")
    return 1 if any(r["status"] == FAILED for r in bench.rows) else 0
