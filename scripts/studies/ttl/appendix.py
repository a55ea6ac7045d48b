"""The time-to-loss report's closing sections, each from its own data: the lab's rate (``--calibrate``'s rows),
aggregator=auto's link probe under load (``scripts/studies/probe_under_load.py``'s rows), and what the settings not
yet measured would cost on this machine (from the runs measured at the next smaller model)."""

from __future__ import annotations

import csv
import functools
import statistics
from pathlib import Path

from scripts.studies.ttl.rows import number as _f
from scripts.studies.ttl.settings import MODELS, PAPER_SHARE, RATES_CSV, ROOT, STEPS

PROBE_CSV = ROOT / "reports" / "data" / "probe_under_load.csv"


def rel(p: Path) -> str:
    """A path as the report names it: from the repository's root where it is inside it."""
    p = Path(p).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _x(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def rates_section(rows: list[dict]) -> list[str]:
    if not RATES_CSV.exists():
        return []
    with open(RATES_CSV, newline="") as f:
        rates = list(csv.DictReader(f))
    if not rates:
        return []
    used = sorted({r["rate_mbit"] for r in rows if r["links"].startswith("lab")})
    lines = ["", "## The lab's rate", "",
             f"nccl's aggregation share of a step, flat lab, `--calibrate` (`{rel(RATES_CSV)}`; mean over steps "
             "2.. of time/aggregate / time/step). The paper's PCIe setting: -17 % training time from -47 % "
             f"all-reduce time means the all-reduce was at least {PAPER_SHARE:.0%} of a step; the rate whose "
             "share is closest is the study's.", "",
             "| rate Mbit/s | model | steps | nccl's share | aggregate s | step s | load before -> after | commit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rates:
        lines.append(f"| {r['rate_mbit']} | {r['model']} | {r['steps']} | {r['aggregate_share']} | "
                     f"{r['aggregate_s']} | {r['step_s']} | {r['load_before']} -> {r['load_after']} | "
                     f"{r['commit']} |")  # fmt: skip
    closest = []
    for model in dict.fromkeys(r["model"] for r in rates):  # per model: the share moves with the step's compute
        best = min(
            (r for r in rates if r["model"] == model), key=lambda r: abs(float(r["aggregate_share"]) - PAPER_SHARE)
        )
        closest.append(f"{model}: {best['rate_mbit']} Mbit/s ({best['aggregate_share']})")
    lines += ["", f"Closest to {PAPER_SHARE:.2f}, per model: {'; '.join(closest)}; the lab rows here ran at "
              f"{', '.join(used) or '-'} Mbit/s. The share moves with the load (the ranks' compute slows, the link "
              "does not): each row's own share is in the tables."]  # fmt: skip
    return lines


def probe_section() -> list[str]:
    if not PROBE_CSV.exists():
        return []
    with open(PROBE_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        where = f"{r['where']} ({r['rate_mbit']} Mbit/s)" if r.get("rate_mbit") else r["where"]
        by.setdefault((r["code_commit"], where, r["load_ranks"]), []).append(r)
    lines = ["", "## aggregator=auto's link probe under load", "",
             f"`scripts/studies/probe_under_load.py` (`{rel(PROBE_CSV)}`): auto's probe and fit (`measure_links`, "
             "`cluster_from_timings`) on 4 ranks beside a second training run (model=tiny on loopback), with the code "
             "before the robust probe and after it.", "",
             "| code | where | load ranks beside | probes | refused (auto exact) | fit RMS median | max "
             "| probe s median (max) | 1-min load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for (commit, where, load), rs in by.items():
        rms = [_f(r["rel_rmse"]) for r in rs if _f(r["rel_rmse"]) is not None]
        loads = [_f(r["load_before"]) for r in rs if _f(r["load_before"]) is not None]
        refused = sum(1 for r in rs if r["fit"] != "ok")
        seconds = [_f(r["probe_s"]) for r in rs if _f(r["probe_s"]) is not None]
        lines.append(f"| {commit} | {where} | {load} | {len(rs)} | {refused} | "
                     f"{_x(statistics.median(rms)) if rms else '-'} | {_x(max(rms)) if rms else '-'} | "
                     f"{_x(statistics.median(seconds), 1)} ({_x(max(seconds), 1)}) | "
                     f"{_x(min(loads), 1)}..{_x(max(loads), 1)} |")  # fmt: skip
    return lines


@functools.cache
def model_parameters(model: str) -> int:
    """The parameter count of ``model`` (configs/model/), from its GPTNeoX config on the meta device: no memory.
    Cached: a report asks for each model once per unmeasured setting."""
    import torch
    from hydra import compose, initialize_config_dir
    from transformers import GPTNeoXForCausalLM

    from train.config import register_configs
    from train.model import count_parameters, gpt_neox_config

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        m = compose(config_name="config", overrides=[f"model={model}"]).model
    with torch.device("meta"):
        return count_parameters(GPTNeoXForCausalLM(gpt_neox_config(m)))


def unmeasured_cost(rows: list[dict], missing: list[str]) -> str:
    """For each unmeasured ``links:model``, what the same runs would cost on this machine: the runs measured on
    the same links at the next smaller model of the study, at its plans' horizon (``STEPS``; a longer run is not
    one of the same runs), their wall seconds summed and scaled by the ratio of the two models' parameters (from
    pythia-14m up a step's compute and bytes grow about with it; not from tiny, whose steps are mostly fixed
    costs: on loopback pythia-14m's nccl runs took 2.4x tiny's for 12x the parameters). No estimate where that
    model was not measured there."""
    parts = []
    for key in missing:
        links, model = key.split(":")
        position = MODELS.index(model)
        base = MODELS[position - 1] if position > 1 else None
        horizon = str(STEPS.get(base))  # the plans' horizon: a longer run (--plan long) is not "the same runs"
        measured = [r for r in rows if r["links"] == links and r["model"] == base and r["steps"] == horizon]
        if not measured:
            continue
        ratio = model_parameters(model) / model_parameters(base)
        hours = sum(float(r["wall_s"]) for r in measured) / 3600
        parts.append(
            f"{key} ({model_parameters(model) / 1e6:.1f} M parameters, {ratio:.1f}x {base}'s): the "
            f"{len(measured)} runs measured at {base} there took {hours:.1f} h, the same at {model} about "
            f"{hours * ratio:.1f} h"
        )
    if not parts:
        return ""
    return " What the unmeasured settings would cost on this 2-core machine: " + "; ".join(parts) + "."


