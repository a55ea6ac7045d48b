"""Section "trainer": ``train/main.py`` through torchrun at world size 1, one launch per model size and
``trainer.compile`` setting, bf16, sequence 2048, the micro-batches of the H200 run (pythia-160m 16, 410m 8 then 16,
1b 8; ``../shared/device-runs/h200-2026-12-04/``), about 25 steps, no checkpoint, one validation batch at the end,
``wandb.mode=disabled`` (the device image has no wandb; the trainer imports it only for the other modes).

Read from the run's own metrics.jsonl: ``mfu`` (the trainer's: tokens/s x model FLOPs per token over the GPU's
peak, ``train.metrics``), ``tokens_per_s`` and the ``time/*`` phases, as medians over the steps after the first
``WARMUP_STEPS`` (dropped: the first steps compile, allocate and tune; the row says how many were dropped and
what the first step took). A launch that outlives twice its estimate or the budget is killed, and its row keeps
the steps it logged.

``trainer.compile=true|false`` is passed where the tree's TrainerConfig has the field; whether the tree's trainer
compiles at all is read from its source (``trainer_compiles``): where it does not, the compiled rows are NOT RUN
(saying so) and every size runs eagerly instead."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

from scripts.bench.gpu.measure import ROOT

SECTION = "trainer"
SEQ_LEN = 2048
# model, micro-batch, steps, compile, estimated seconds on an H200: start-up ~15 s, the compile warm-up (the plain
# 160m step compiled in 26 s there, and compiling grows with the layers: 12, 24 and 16), the steps (0.12, 0.30 and
# 0.27 s eager). A launch may take twice its estimate (at least LAUNCH_FLOOR_S) before it is killed.
PLAN = [
    ("pythia-160m", 16, 25, True, 50),
    ("pythia-1b", 8, 20, True, 60),
    ("pythia-410m", 16, 20, True, 90),  # 8 reached 44.5 % (target 45) in 25.7 GiB on the H200: 16 fills it better
    ("pythia-160m", 16, 25, False, 25),
]
EAGER_INSTEAD = {"pythia-1b": 30, "pythia-410m": 30}  # eager estimates, where the trainer cannot compile
LAUNCH_FLOOR_S = 60.0
SMALL_PLAN = [("tiny", 2, 6, False, 20)]
WARMUP_STEPS = 5
SMALL_WARMUP_STEPS = 2
TARGET_MFU = {"pythia-160m": 0.38, "pythia-410m": 0.45, "pythia-1b": 0.50}  # issue 52's, on one H100/H200-class GPU
PHASES = ("time/data", "time/forward", "time/backward", "time/aggregate", "time/optimizer", "time/step")
RESERVE_S = 5.0  # of the budget, kept for the report after a launch


def trainer_has_compile_field() -> bool:
    from train.config import TrainerConfig

    return "compile" in TrainerConfig.__dataclass_fields__


def trainer_compiles() -> bool:
    """Whether the tree's trainer compiles its model: a ``compile`` field in TrainerConfig and ``torch.compile``
    (called, or handed on: ``torch.compile`` anywhere but a comment) in train/'s source."""
    if not trainer_has_compile_field():
        return False
    for path in (ROOT / "train").rglob("*.py"):
        code = (line.split("#", 1)[0] for line in path.read_text(errors="replace").splitlines())
        if any("torch.compile" in line for line in code):
            return True
    return False


def overrides(model: str, micro: int, steps: int, compile_: bool, small: bool, seed: int, run_dir: Path) -> list:
    device = "cpu" if small else "cuda"
    out = [
        f"model={model}",
        f"data.seq_len={64 if small else SEQ_LEN}",
        f"trainer.micro_batch_size={micro}",
        f"trainer.max_steps={steps}",
        f"trainer.precision={'fp32' if small else 'bf16'}",
        f"trainer.device={device}",
        f"trainer.eval_every={steps}",
        "trainer.eval_batches=1",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        "checkpoint.every=0",
        "checkpoint.at_end=false",
        "wandb.mode=disabled",
        "resume=false",
        f"seed={seed}",
        f"hydra.run.dir={run_dir}",
    ]
    if trainer_has_compile_field():
        out.append(f"trainer.compile={'true' if compile_ else 'false'}")
    return out


def summarize(records: list[dict], warmup: int) -> dict:
    """Medians over the logged steps after the first ``warmup`` of ``mfu``, ``tokens_per_s`` and the phases
    (seconds), the largest ``memory/peak_gib``, and what the first step took."""
    steps = [r for r in records if "step" in r and "time/step" in r]
    measured = steps[warmup:]

    def median(key):
        values = [r[key] for r in measured if r.get(key) is not None]
        return statistics.median(values) if values else None

    peaks = [r["memory/peak_gib"] for r in steps if r.get("memory/peak_gib") is not None]
    return {
        "steps_logged": len(steps),
        "steps_measured": len(measured),
        "warmup_steps_dropped": min(warmup, len(steps)),
        "first_step_s": steps[0]["time/step"] if steps else None,
        "mfu": median("mfu"),
        "tokens_per_s": median("tokens_per_s"),
        **{key: median(key) for key in PHASES},
        "peak_gib": max(peaks) if peaks else None,
    }


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut short by a kill
            records.append(json.loads(line))
    return records


def launch(bench, model: str, micro: int, steps: int, compile_: bool, workdir: Path, estimate_s: float) -> None:
    from scripts.checks.gpu.training import _env, _finish, _launch

    mode = "compiled" if compile_ else "eager"
    what = f"train/main.py {model}, micro-batch {micro}, seq {64 if bench.small else SEQ_LEN}, {steps} steps, {mode}"
    run_dir = workdir / f"{model}-{mode}"
    warmup = SMALL_WARMUP_STEPS if bench.small else WARMUP_STEPS
    # on a GPU at most twice the estimate; the CPU's dry run, whose seconds say only how busy the cores are, gets
    # what is left of its budget
    cap = bench.left() if bench.small else max(2 * estimate_s, LAUNCH_FLOOR_S)
    deadline = max(min(bench.left() - RESERVE_S, cap), 1.0)
    started = time.monotonic()
    code, output = _finish(_launch(overrides(model, micro, steps, compile_, bench.small, bench.seed, run_dir), _env()),
                           deadline)  # fmt: skip
    launch_s = time.monotonic() - started
    summary = summarize(_records(run_dir / "metrics.jsonl"), warmup)
    said = [line.strip()[:200] for line in output.splitlines() if "compil" in line.lower()][:3]
    killed = code == -9
    ok = code == 0 and summary["steps_measured"] > 0
    status = "measured" if ok or (killed and summary["steps_measured"] > 0) else "FAILED"
    reason = ""
    if killed:
        reason = f"killed at its deadline ({deadline:.0f} s) after {summary['steps_logged']} of {steps} steps"
    elif code != 0:
        reason = f"exited {code}"
    elif not ok:
        reason = f"logged {summary['steps_logged']} steps, none after the {warmup} warm-up steps"
    mfu = summary["mfu"]
    bench.record(
        SECTION,
        what,
        status,
        reason=reason,
        model=model,
        micro_batch=micro,
        seq_len=64 if bench.small else SEQ_LEN,
        steps=steps,
        compile=compile_,
        exit=code,
        launch_s=launch_s,
        **summary,
        target_mfu=TARGET_MFU.get(model),
        compile_said=said,
        output_tail=output[-2000:] if status != "measured" or killed else "",
        summary=(f"mfu {100 * mfu:.1f} %, " if mfu is not None else "")
        + (f"{summary['tokens_per_s']:.0f} tokens/s" if summary["tokens_per_s"] else "no steps measured"),
    )


def run(bench) -> None:
    import tempfile

    compiles = trainer_compiles()
    plan = SMALL_PLAN if bench.small else PLAN
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as workdir:
        for model, micro, steps, compile_, estimate in plan:
            mode = "compiled" if compile_ else "eager"
            if compile_ and not compiles:
                bench.record(SECTION, f"train/main.py {model}, {mode}", "NOT RUN", model=model, compile=True,
                             reason="this tree's trainer does not compile (no trainer.compile field, or train/ never "
                             "calls torch.compile)")  # fmt: skip
                if model not in EAGER_INSTEAD:
                    continue
                compile_, estimate = False, EAGER_INSTEAD[model]
                mode = "eager"
            if bench.fits(SECTION, f"train/main.py {model}, {mode}", estimate):
                launch(bench, model, micro, steps, compile_, Path(workdir), estimate)
