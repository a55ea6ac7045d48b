"""The GPU benchmark's report (reports/gpu_bench.md): where and how it was measured, then one table per section
from the rows recorded so far, and every row NOT RUN or FAILED with its reason. Rewritten after every row."""

from __future__ import annotations

import os


def _f(value, spec: str = ".2f", scale: float = 1.0) -> str:
    return "" if value is None else format(value * scale, spec)


def _graph(graph) -> str:
    return {True: "replayed", False: "eager"}.get(graph, "default")


def _pct(value) -> str:
    return "" if value is None else f"{100 * value:.1f} %"


def _rows(bench, section: str, status: str = "measured") -> list[dict]:
    return [r for r in bench.rows if r["section"] == section and r["status"] == status]


def write(bench, finished: bool = False) -> str:
    p = bench.provenance
    state = f"in {bench.elapsed():.0f} s" if finished else f"still running, {bench.elapsed():.0f} s so far"
    lines = [
        "# GPU benchmark",
        "",
        f"Made by `python -m scripts.bench.gpu {bench.command}` on {p.get('device')}, torch {p.get('torch')}, "
        f"CUDA {p.get('cuda')}, NCCL {p.get('nccl')}, Triton {p.get('triton')}, transformers {p.get('transformers')}; "
        f"the tree at {p.get('commit')}, seed {p.get('seed')}; {state} of a budget of {bench.budget_s:.0f} s. "
        f"Every row of `{os.path.relpath(bench.jsonl, bench.md.parent)}` carries the same provenance.",
        "",
    ]
    if not bench.cuda:
        lines += [
            "**A dry run on the CPU at toy sizes**: it runs the benchmark's machinery; its figures measure nothing "
            "about a GPU (no kernels, no MFU: a CPU has no known peak).",
            "",
        ]
    lines += [
        "Times are medians of timed repeats after warm-up: CUDA events on a GPU (the GPU's time from a call's first "
        "kernel to its last, gaps where it waited for the host included), the wall clock on the CPU.",
        "",
    ]
    lines += _trainer(bench) + _model_step(bench) + _arithmetic(bench) + _formats(bench)
    skipped = [r for r in bench.rows if r["status"] != "measured"]
    if skipped:
        lines += ["## Not measured", ""]
        for r in skipped:
            lines.append(f"- {r['section']}: {r['what']}: {r['status']} ({r.get('reason', '')})")
            if r.get("output_tail") or r.get("traceback"):
                lines += ["", "```", (r.get("output_tail") or r.get("traceback")).strip()[-1500:], "```", ""]
        lines.append("")
    return "\n".join(lines) + "\n"


def _trainer(bench) -> list[str]:
    rows = [r for r in bench.rows if r["section"] == "trainer" and "steps_logged" in r]
    if not rows:
        return []
    lines = [
        "## The trainer's MFU",
        "",
        "`train/main.py` through torchrun at world size 1 (the `nccl` aggregator: no CERAR code runs), its own "
        "`mfu` and `time/*` from metrics.jsonl: medians over the steps after the first warm-up steps, which are "
        "dropped (they compile, allocate and tune; the first step's seconds are shown). Launch s: the whole launch, "
        "start-up and compiling included. Targets: issue 52's, on one H100/H200-class GPU.",
        "",
        "| model | trainer.compile | micro-batch | seq | steps logged (dropped) | MFU | target | tokens/s | forward "
        "ms | backward ms | optimizer ms | step ms | first step s | launch s | peak GiB | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {str(r['compile']).lower()} | {r['micro_batch']} | {r['seq_len']} "
            f"| {r['steps_logged']} ({r['warmup_steps_dropped']}) | {_pct(r['mfu'])} | {_pct(r.get('target_mfu'))} "
            f"| {_f(r['tokens_per_s'], '.0f')} | {_f(r['time/forward'], '.1f', 1e3)} "
            f"| {_f(r['time/backward'], '.1f', 1e3)} | {_f(r['time/optimizer'], '.1f', 1e3)} "
            f"| {_f(r['time/step'], '.1f', 1e3)} | {_f(r['first_step_s'], '.1f')} | {_f(r.get('launch_s'), '.0f')} "
            f"| {_f(r['peak_gib'], '.1f')} "
            f"| {r['status']}{': ' + r['reason'] if r.get('reason') else ''}"
            f"{'; said: ' + ' / '.join(r['compile_said']) if r.get('compile_said') else ''} |"
        )
    return lines + [""]


def _model_step(bench) -> list[str]:
    rows = _rows(bench, "model_step")
    if not rows:
        return []
    lines = [
        "## The model step alone",
        "",
        "`train.model.build_model`, random tokens, forward, backward and `AdamW` step (bf16 autocast and the fused "
        "AdamW on a GPU), as `diag.py mfu` timed it on the H200: what the trainer's loop adds is the difference.",
        "",
        "| model | mode | micro-batch | seq | warm-up steps (s) | step ms | tokens/s | MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['micro_batch']} | {r['seq_len']} | {r['warmup_steps']} "
            f"({r['warmup_s']:.1f}) | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {_pct(r['mfu'])} |"
        )
    return lines + [""]


def _arithmetic(bench) -> list[str]:
    rows = [r for r in _rows(bench, "arithmetic") if "N" in r]  # (the Triton product's check is a line below)
    if not rows:
        return []
    lines = [
        "## CERAR's arithmetic (one rank, transfers as local copies)",
        "",
        "`scripts.checks.gpu.throughput.one_rank_arithmetic`: one call's L rounds. Products: torch's (cuBLAS) or the "
        "Triton kernel (`cerar.ring.products`). Kernels: CUDA activity under `torch.profiler` (the stand-in copies "
        "in brackets); aten ops: the top-level operations dispatched (the same on any device); busy: the union of "
        "the kernels' intervals; x copy: the call's time over a device copy of the same gradient; x bound: over the "
        "bytes the arithmetic and the stand-in's copies move, at the copy's bandwidth. Targets (issue 52): "
        "busy/wall >= 85 % and at most 2x the bound, at 64 MiB and above.",
        "",
        "| N | c | L | MiB | CUDA graph | products | kernels (copies) | aten ops | GPU busy ms | call ms | busy / call "
        "| copy ms | x copy | x bound | most GPU time (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        kernels = "" if r["kernels"] is None else f"{r['kernels']} ({r['copies']})"
        top = ", ".join(f"{name} {ms:.2f}" for name, ms in r["kernel_ms"][:3]) if r.get("kernel_ms") else (
            ", ".join(f"{name} x{n}" for name, n in r["top_kernels"][:3]))  # fmt: skip
        lines.append(
            f"| {r['N']} | {r['c']} | {r['L']} | {r['MiB']:g} | {_graph(r.get('graph'))} | "
            f"{r.get('products', 'torch')} | {kernels} | {r['aten_ops']} | {_f(r['busy_ms'])} "
            f"| {r['wall_ms']:.2f} | {_pct(r['busy_over_wall'])} | {r['copy_ms']:.3f} | {r['x_copy']:.1f} "
            f"| {_f(r.get('x_bound'))} | {top} |"
        )
    checks = [r["summary"] for r in bench.rows if r.get("section") == "arithmetic" and r.get("what") ==
              "the Triton product's check"]  # fmt: skip
    return lines + [""] + [f"`{line}`" for line in checks] + ([""] if checks else [])


def _formats(bench) -> list[str]:
    rows = _rows(bench, "formats")
    if not rows:
        return []
    lines = [
        "## The formats against a copy",
        "",
        "`cerar.formats`' public functions on float32 gradients whose blocks span magnitudes: eager "
        "(`fused.disable()`), and after `fused.enable` (the column *runs* says what did the work: an operation "
        "without a fused kernel runs eagerly in both). Targets (issue 52): <= 2 x a copy at 64 MiB and above.",
        "",
        "| operation | MiB | variant | runs | ms | x copy | GB/s of gradient | bytes equal to eager |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        equal = "" if r["bytes_equal_to_eager"] is None else str(r["bytes_equal_to_eager"])
        lines.append(
            f"| {r['operation']} | {r['MiB']:g} | {r['variant']} | {r['runs']} | {r['ms']:.3f} | {r['x_copy']:.2f} "
            f"| {r['gbps_of_gradient']:.0f} | {equal} |"
        )
    return lines + [""]
