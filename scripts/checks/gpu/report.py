"""The GPU check's report (reports/gpu.md): one table of every case's verdict with its exit status
and seconds, what the run proved and what it could not (each section's ``PROVES``), then each
section's figures and the log of every case that failed."""

from __future__ import annotations

import platform

import torch

from scripts.checks.gpu.cases import FAIL, MEASURED, NOT_RUN, PASS, Context, exit_text


def write(sections, ctx: Context, command: str, seconds: float, partial: bool = False) -> str:
    """The report of ``sections`` (each with its results so far); ``partial``: the check is still running, and the
    report says so (written after every case, so that a check cut short leaves what it saw)."""
    if ctx.device == "cuda":
        name = torch.cuda.get_device_name(0)
        made = (
            f"{ctx.devices} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
        )
    else:
        made = (
            f"{platform.processor() or 'cpu'}, torch {torch.__version__} (a dry run: {ctx.devices} gloo processes "
            "stand for devices; every case that needs CUDA is NOT RUN)"
        )
    lines = [
        "# CERAR on GPUs: acceptance check",
        "",
        f"Made by `python -m scripts.checks.gpu {command}` on {made}, in {seconds:.0f} s. Each case ran in a process "
        "of its own, bounded by its deadline; multi-rank cases on "
        f"{ctx.world} rank(s), one per device.",
        "",
        *(
            ["**Partial**: written while the check was still running; the cases after the last row below had not "
             "run (or the check was cut short there).", ""]
            if partial
            else []
        ),  # fmt: skip
        "| section | case | result | exit status | seconds | reason |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for section, results in sections:
        for r in results:
            seconds_text = f"{r.seconds:.1f}" if r.status != NOT_RUN else ""
            lines.append(
                f"| {section.SECTION} | {r.case.name} | {r.status} | {exit_text(r.exit)} | {seconds_text} "
                f"| {r.reason} |"
            )
    lines += ["", "What this run proved, and what it did not:", ""]
    for section, results in sections:
        for r in results:
            text = section.PROVES.get(r.case.name, r.case.name)
            if r.status in (PASS, MEASURED):
                lines.append(f"- {text} ({r.status})")
            elif r.status == NOT_RUN:
                lines.append(f"- NOT RUN ({r.reason}): {text}")
            else:
                lines.append(f"- FAILED: {text} ({r.reason})")
    for section, results in sections:
        lines += ["", f"## {section.SECTION}", "", (section.__doc__ or "").split("\n\n")[0].replace("\n", " "), ""]
        lines += [f"Expected on an H200: about {section.EXPECTED_S} s{' (in --quick)' if section.QUICK else ''}.", ""]
        if all(r.status == NOT_RUN for r in results):
            lines += [f"NOT RUN: {results[0].reason}." if results else "NOT RUN.", ""]
            continue
        lines += section.report(results)
        for r in results:
            if r.status == FAIL:
                lines += failure(r)
    return "\n".join(lines) + "\n"


def failure(r) -> list[str]:
    """A FAIL's reason, the end of its case's log (said when empty), and the output of every run the case
    launched (``cases.launched``)."""
    log = r.log[-3000:].strip()
    lines = [f"{r.case.name}: FAIL ({r.reason}); its log:", ""]
    lines += ["```", log, "```", ""] if log else ["(the case's log is empty: it printed nothing)", ""]
    for label, tail in ((r.value or {}).get("outputs") or {}).items():
        lines += [f"{r.case.name}, launched {label}, the end of its output:", "", "```", tail.strip(), "```", ""]
    return lines
