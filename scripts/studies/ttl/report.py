"""The time-to-loss study's report, rebuilt from the CSV and the run folders alone: the arithmetic (ratios to nccl at
the same seed, nccl's seed band, time to nccl's loss), the tables, the choice per setting, the paper's claims, the
figures (validation loss against wall clock, one curve per aggregator).

Definitions (every ratio is taken seed by seed against nccl's run of the same seed and setting, then averaged over
the seeds where both ran):

- wall / nccl: ``wall_s`` (the loop, evaluations included) over nccl's; steps / nccl: ``steps_s`` likewise;
- gap: final validation loss / nccl's - 1 (positive: worse);
- nccl's seed band: (max - min) / mean of nccl's final validation losses over its seeds (two seeds or more); an
  aggregator ends inside it when its gap is at most the band at every seed (lower than nccl is inside);
- time to nccl's loss / nccl's time: ``time_to_target_s`` (wall seconds to the first evaluation at or below nccl's
  final validation loss at the same seed) over nccl's own (to its first evaluation at or below its final loss);
  never reached: no ratio, and the aggregator is not a choice.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import statistics
from pathlib import Path

from scripts.studies.ttl.launch import curve, read_metrics, read_rows
from scripts.studies.ttl.settings import (
    AGGREGATORS,
    MODELS,
    PAPER_SHARE,
    RATES_CSV,
    ROOT,
    Setting,
    parse_settings,
)

TARGET = 1.10
"""Issue 34: on the flat lab at tiny, auto reaches nccl's loss in at most 1.10x the time of the fastest fixed
aggregator that ends inside nccl's seed band."""
PROBE_CSV = ROOT / "reports" / "data" / "probe_under_load.csv"
LOAD_MIX = 1.5
"""A run whose load (the mean of its 1-minute load at start and end) is more than this many times nccl's at the
same seed, or less than its inverse, has its wall ratio marked: the ratio mixes the aggregator with the load."""


def _f(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def setting_of_row(r: dict) -> Setting:
    return Setting(r["links"], _f(r["rate_mbit"]), int(r["hosts"]), int(r["ranks_per_host"]), r["model"])


def group(rows: list[dict]) -> dict[Setting, list[dict]]:
    out: dict[Setting, list[dict]] = {}
    for r in rows:
        out.setdefault(setting_of_row(r), []).append(r)
    return out


def aggregate_seconds(folder: Path | None) -> float | None:
    """Mean time/aggregate over steps 2.. of a run folder (None without one): the aggregation phase alone, which
    the machine's load moves less than the compute phases (a CPU-bound aggregator's arithmetic still feels it)."""
    if folder is None:
        return None
    times = [float(r["time/aggregate"]) for r in read_metrics(folder) if r.get("step", 0) > 1 and "time/aggregate" in r]
    return statistics.mean(times) if times else None


def summarize(rows: list[dict], folder: Path | None = None) -> dict:
    """One setting's arithmetic (module docstring): nccl's band and, per aggregator, its per-seed ratios and their
    means (with ``folder``, the setting's run folders, also the aggregation seconds per step and their ratio).
    Returns {"band", "nccl_losses", "aggregators": {name: {...}}} in the setting's order."""
    by = {(r["aggregator"], r["seed"]): r for r in rows}
    nccl = {seed: r for (name, seed), r in by.items() if name == "nccl"}
    losses = [_f(r["final_val_loss"]) for r in nccl.values() if _f(r["final_val_loss"]) is not None]
    band = (max(losses) - min(losses)) / statistics.mean(losses) if len(losses) >= 2 else None
    names = list(dict.fromkeys(r["aggregator"] for r in rows))
    order = list(AGGREGATORS)
    names.sort(key=lambda n: order.index(n) if n in order else len(order))
    out = {}
    for name in names:
        seeds = sorted((seed for (n, seed) in by if n == name), key=int)
        per_seed = []
        for seed in seeds:
            r, base = by[(name, seed)], nccl.get(seed)
            one = {"seed": seed, "row": r, "wall": None, "steps": None, "gap": None, "ttt": None, "agg_ratio": None}
            one["agg_s"] = aggregate_seconds(folder / f"{name}_s{seed}" if folder else None)
            if base is not None:
                base_s = aggregate_seconds(folder / f"nccl_s{seed}" if folder else None)
                one["agg_ratio"] = one["agg_s"] / base_s if one["agg_s"] is not None and base_s else None
                one["wall"] = _ratio(r["wall_s"], base["wall_s"])
                one["steps"] = _ratio(r["steps_s"], base["steps_s"])
                one["gap"] = _ratio(r["final_val_loss"], base["final_val_loss"])
                one["gap"] = None if one["gap"] is None else one["gap"] - 1
                one["ttt"] = _ratio(r["time_to_target_s"], base["time_to_target_s"])
                one["load"] = _ratio(_load1(r), _load1(base))  # this run's load over nccl's, both at their start
            per_seed.append(one)
        gaps = [s["gap"] for s in per_seed]
        inside = None if band is None or any(g is None for g in gaps) else all(g <= band + 1e-12 for g in gaps)
        reached = all(s["ttt"] is not None for s in per_seed) and bool(per_seed)
        out[name] = {
            "seeds": per_seed, "wall": _mean(s["wall"] for s in per_seed), "steps": _mean(s["steps"] for s in per_seed),
            "gap": _mean(gaps), "ttt": _mean(s["ttt"] for s in per_seed) if reached else None, "inside": inside,
            "reached": reached, "share": _mean(_f(s["row"]["aggregate_share"]) for s in per_seed),
            "loss": _mean(_f(s["row"]["final_val_loss"]) for s in per_seed),
            "bytes": _mean(_f(s["row"]["bytes_per_step"]) for s in per_seed),
            "agg_s": _mean(s["agg_s"] for s in per_seed), "agg_ratio": _mean(s["agg_ratio"] for s in per_seed),
            "load": _mean(s.get("load") for s in per_seed),
            "chosen": "; ".join(dict.fromkeys(s["row"]["chosen"] for s in per_seed if s["row"]["chosen"])),
            "fallback": any(s["row"]["chosen"].startswith("fallback") for s in per_seed),
        }  # fmt: skip
    return {"band": band, "nccl_losses": losses, "aggregators": out}


def _load1(row: dict) -> float | None:
    """A row's 1-minute load at the run's start and end, averaged (None when not recorded)."""
    values = [_f(row[k].split()[0]) for k in ("load_before", "load_after") if row.get(k, "").strip()]
    return _mean(values)


def _ratio(a, b) -> float | None:
    a, b = _f(a), _f(b)
    return a / b if a is not None and b else None


def recommend(summary: dict) -> tuple[str | None, str]:
    """(the aggregator to take, why): the one that reaches nccl's loss soonest (mean of time to nccl's loss / nccl's
    time) among those ending inside nccl's seed band at every seed; auto counts as users get it (a fallback is
    its exact run). Without a band (one nccl seed) nothing is 'inside': the reason says so."""
    aggs = summary["aggregators"]
    if summary["band"] is None:
        return None, "nccl has one seed here: no seed band to judge a loss against yet"
    fits = {n: a for n, a in aggs.items() if a["inside"] and a["ttt"] is not None}
    if not fits:
        return None, "no aggregator both ended inside nccl's band and reached nccl's loss"
    best = min(fits, key=lambda n: fits[n]["ttt"])
    a = fits[best]
    others = sorted((n for n in fits if n != best), key=lambda n: fits[n]["ttt"])
    why = (f"reaches nccl's loss in {a['ttt']:.3f}x nccl's time (wall {a['wall']:.3f}x) and ends {_pct(a['gap'])} "
           f"from nccl, inside its {100 * summary['band']:.2f} % band")  # fmt: skip
    if others:
        n = others[0]
        why += f"; next: {n} at {fits[n]['ttt']:.3f}x"
    outside = [n for n, x in aggs.items() if x["inside"] is False]
    if outside:
        why += "; outside the band: " + ", ".join(f"{n} ({_pct(aggs[n]['gap'])})" for n in outside)
    return best, why


def auto_target(summary: dict, candidates: list[str] | None = None) -> str | None:
    """Issue 34's target on this setting: auto's time to nccl's loss against the fastest fixed aggregator inside the
    band (met when <= TARGET x), and whether every measured aggregator auto may choose ends inside the band."""
    aggs = summary["aggregators"]
    auto = aggs.get("auto")
    if auto is None:
        return None
    fixed = {n: a for n, a in aggs.items() if n != "auto" and a["inside"] and a["ttt"] is not None}
    if summary["band"] is None:
        return "not judged: nccl has one seed here (no band)"
    if not fixed:
        return "not judged: no fixed aggregator ended inside nccl's band"
    best = min(fixed, key=lambda n: fixed[n]["ttt"])
    if auto["ttt"] is None:
        verdict = f"MISSED: auto did not reach nccl's loss at every seed (fastest fixed inside the band: {best})"
    else:
        ratio = auto["ttt"] / fixed[best]["ttt"]
        verdict = (f"{'met' if ratio <= TARGET else 'MISSED'}: auto {auto['ttt']:.3f}x nccl's time against {best}'s "
                   f"{fixed[best]['ttt']:.3f}x: {ratio:.3f} (target <= {TARGET:.2f})")  # fmt: skip
    if auto["fallback"]:
        verdict += "; auto's probe fell back (exact throughout): counts against it"
    pool = [n for n in aggs if n != "auto" and (candidates is None or n in candidates)]
    out = [n for n in pool if aggs[n]["inside"] is False]
    verdict += ("; every measured aggregator auto may choose ends inside the band" if not out else
                "; outside the band, auto may choose: " + ", ".join(out))  # fmt: skip
    return verdict


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f} %"


def _span(xs: list[float]) -> str:
    """'0.825' for one value (or equal ones), '0.825..0.983' for several."""
    return f"{min(xs):.3f}" if min(xs) == max(xs) else f"{min(xs):.3f}..{max(xs):.3f}"


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f} MB"


def _x(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# --------------------------------------------------------------------------------------------- the figures


def figure(setting: Setting, summary: dict, runs: Path, path: Path) -> bool:
    """Validation loss against wall clock for one setting, one colour per aggregator (its seeds dashed after the
    first), nccl's final loss at seed 1 dotted. False when no run folder holds a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    drawn = False
    colours = plt.get_cmap("tab10")
    for i, (name, agg) in enumerate(summary["aggregators"].items()):
        for j, one in enumerate(agg["seeds"]):
            points = curve(read_metrics(runs / setting.key / f"{name}_s{one['seed']}"))
            if not points:
                continue
            t, loss = zip(*points, strict=True)
            ax.plot(t, loss, color=colours(i % 10), linestyle="-" if j == 0 else "--", linewidth=1.2,
                    label=name if j == 0 else None)  # fmt: skip
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    if any(len(agg["seeds"]) > 1 for agg in summary["aggregators"].values()):
        ax.plot([], [], color="black", linestyle="--", linewidth=1.2, label="(dashed: its later seeds)")
    if summary["nccl_losses"]:
        ax.axhline(summary["nccl_losses"][0], color="grey", linestyle=":", linewidth=1, label="nccl's final (seed 1)")
    ax.set_xlabel("wall clock, s (the loop, evaluations included)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{setting.describe()}: validation loss against wall clock")
    ax.set_ylim(top=min(ax.get_ylim()[1], max(summary["nccl_losses"] or [10]) + 2.5))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def figures(csv_path: Path, runs: Path, out: Path) -> list[Path]:
    """Every setting's figure (``time_to_loss_<setting>.png``) from the CSV and run folders: what
    ``scripts/reporting/make_figures.py`` rebuilds, the same files ``write_report`` links."""
    written = []
    for setting, srows in group(read_rows(csv_path)).items():
        path = out / f"time_to_loss_{setting.key}.png"
        if figure(setting, summarize(srows, runs / setting.key), runs, path):
            written.append(path)
    return written


# --------------------------------------------------------------------------------------------- the text


def _rel(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _by_model(cerar: list) -> str:
    """CERAR c=16's training time / nccl per kind of link, model by model (with nccl's aggregation share there, since
    the lab's rate is chosen per model), where a kind of link has two models or more."""
    kinds: dict[str, list[str]] = {}
    for setting, a, _ in cerar:
        if a["wall"] is not None:
            share = a.get("nccl_share")
            kinds.setdefault(setting.links, []).append(
                f"{setting.model} {_x(a['wall'])}" + (f" (nccl's share {share:.2f})" if share is not None else "")
            )
    compared = [f"{links}: {', '.join(models)}" for links, models in kinds.items() if len(models) > 1]
    if not compared:
        return "needs two models on one kind of link; measured: " + ", ".join(sorted({s.model for s, _, _ in cerar}))
    return "; ".join(compared)


def rates_section(rows: list[dict]) -> list[str]:
    if not RATES_CSV.exists():
        return []
    with open(RATES_CSV, newline="") as f:
        rates = list(csv.DictReader(f))
    if not rates:
        return []
    used = sorted({r["rate_mbit"] for r in rows if r["links"].startswith("lab")})
    lines = ["", "## The lab's rate", "",
             f"nccl's aggregation share of a step, flat lab, `--calibrate` (`{_rel(RATES_CSV)}`; mean over steps "
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
             f"`scripts/studies/probe_under_load.py` (`{_rel(PROBE_CSV)}`): auto's probe and fit (`measure_links`, "
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


def same_code(commits: list[str]) -> str:
    """Whether the commits the rows name trained the same code (cerar/, train/, configs/ alike), as a sentence; ''
    for one commit."""
    import subprocess

    if len(commits) < 2:
        return ""
    for other in commits[1:]:
        rc = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", commits[0], other, "--", "cerar", "train",
                             "configs"], capture_output=True).returncode  # fmt: skip
        if rc == 1:
            return f" Commits {commits[0]} and {other} differ in cerar/, train/ or configs/: compare rows with care."
        if rc != 0:
            return f" (Could not compare the code of {commits[0]} and {other}.)"
    return f" Their cerar/, train/ and configs/ are identical (`git diff {commits[0]} {commits[-1]}`): one code."


def probe_fits(folder: Path, summary: dict) -> str:
    """What auto's link probe measured in each of the setting's auto runs (its summary.json): the fit per tier and
    the load the run started at, or its fallback."""
    parts = []
    for one in (summary["aggregators"].get("auto") or {}).get("seeds", []):
        auto = load_json(folder / f"auto_s{one['seed']}" / "summary.json").get("auto") or {}
        tiers = (auto.get("links") or {}).get("tiers") or {}
        fit = "; ".join(f"{tier} {8 * f['bandwidth_bytes_s'] / 1e6:.0f} Mbit/s, {f['rel_rmse']:.0%} RMS"
                        for tier, f in tiers.items())  # fmt: skip
        load = one["row"]["load_before"].split()[0] if one["row"]["load_before"] else "?"
        what = f"fell back ({auto['fallback']})" if auto.get("fallback") else f"fitted {fit or 'declared links'}"
        parts.append(f"seed {one['seed']}: {what} at load {load}")
    return " Auto's link probe, " + "; ".join(parts) + "." if parts else ""


def _shape(folder: Path) -> str:
    """The shape the setting's runs trained at, as ", micro-batch M of S tokens per rank" (their summaries;
    settings.MICRO_BATCH and SEQ_LEN), or "" where no run has a summary."""
    shapes = set()
    for summary in sorted(folder.glob("*/summary.json")):
        s = json.loads(summary.read_text())
        if "micro_batch_size" in s and "seq_len" in s:
            shapes.add((int(s["micro_batch_size"]), int(s["seq_len"])))
    return "".join(f", micro-batch {m} of {t} tokens per rank" for m, t in sorted(shapes))


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
    the same links at the next smaller model of the study, their wall seconds summed and scaled by the ratio of
    the two models' parameters (from pythia-14m up a step's compute and bytes grow about with it; not from tiny,
    whose steps are mostly fixed costs: on loopback pythia-14m's nccl runs took 2.4x tiny's for 12x the
    parameters). No estimate where that model was not measured there."""
    parts = []
    for key in missing:
        links, model = key.split(":")
        position = MODELS.index(model)
        base = MODELS[position - 1] if position > 1 else None
        measured = [r for r in rows if r["links"] == links and r["model"] == base]
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


def write_report(csv_path: Path, runs: Path, path: Path, figures: Path) -> str:
    """Rebuild the report and its figures from ``csv_path`` and the run folders under ``runs``; returns the text."""
    rows = read_rows(csv_path)
    settings = group(rows)
    planned = parse_settings("all", 1.0)
    measured_kinds = {(s.links, s.model) for s in settings}
    missing = [f"{s.links}:{s.model}" for s in planned if (s.links, s.model) not in measured_kinds]
    commits = sorted({r["commit"] for r in rows})
    lines = [
        "# Time to nccl's loss: every aggregator, slow and fast links (issue 34)",
        "",
        f"Generated by `.venv/bin/python scripts/studies/time_to_loss.py --report` from `{_rel(csv_path)}` "
        f"({len(rows)} runs, code of commit(s) {', '.join(commits) or '-'}) and the run folders under "
        f"`{_rel(runs)}`. Each run: one `train/main.py` launch, the setting's aggregators one after another, order "
        "rotated by seed, the load average (1/5/15 min) recorded before and after each. Ratios are to nccl at the "
        "same seed; the definitions are in `scripts/studies/ttl/report.py`." + same_code(commits),
    ]  # fmt: skip
    if missing:
        lines += ["", f"**Status: a pilot.** Measured: {', '.join(s.describe() for s in settings) or 'nothing yet'}. "
                  f"Still to run: {', '.join(missing)}; and on the measured settings, every aggregator of issue 34's "
                  "list not in the tables below. Full study: `sudo nohup .venv/bin/python "
                  "scripts/studies/time_to_loss.py --settings all --seeds 1,2 > /tmp/time_to_loss.log 2>&1 &` "
                  "(resumable)." + unmeasured_cost(rows, missing)]  # fmt: skip
    choices, cerar = [], []
    for setting, srows in settings.items():
        summary = summarize(srows, runs / setting.key)
        band = summary["band"]
        lines += ["", f"## {setting.describe()}", ""]
        seeds = sorted({r["seed"] for r in srows}, key=int)
        steps = sorted({r["steps"] for r in srows})
        lines.append(f"Seeds {', '.join(seeds)}; {', '.join(steps)} steps{_shape(runs / setting.key)}. nccl's "
                     "final validation loss: "
                     f"{', '.join(f'{x:.4f}' for x in summary['nccl_losses']) or '-'}; its seed band "
                     f"{'-' if band is None else f'{100 * band:.2f} %'}.")  # fmt: skip
        lines += ["", "| aggregator | seeds | chose | training time / nccl (wall) | steps / nccl | final val loss "
                  "| gap to nccl | inside nccl's band | time to nccl's loss / nccl's time | aggregate share "
                  "| aggregate s/step (/ nccl) | bytes/step | load (1 min) before -> after |",
                  "|" + " --- |" * 13]  # fmt: skip
        for name, a in summary["aggregators"].items():
            loads = ", ".join(f"{s['row']['load_before'].split()[0]} -> {s['row']['load_after'].split()[0]}"
                              for s in a["seeds"] if s["row"]["load_before"])  # fmt: skip
            inside = {None: "-", True: "yes", False: "**no**"}[a["inside"]]
            ttt = _x(a["ttt"]) if a["reached"] else "never (at some seed)"
            wall = _x(a["wall"]) + (f" (at {a['load']:.1f}x nccl's load)" if a["load"] and not
                                    1 / LOAD_MIX < a["load"] < LOAD_MIX else "")  # fmt: skip
            lines.append(f"| {name} | {len(a['seeds'])} | {a['chosen'] or '-'} | {wall} | {_x(a['steps'])} | "
                         f"{_x(a['loss'], 4)} | {_pct(a['gap'])} | {inside} | {ttt} | {_x(a['share'], 3)} | "
                         f"{_x(a['agg_s'])} ({_x(a['agg_ratio'])}) | {_mb(a['bytes'])} | {loads} |")  # fmt: skip
        lines += ["", "The wall includes the evaluations. Once a run's replicas may differ (CERAR's codes; "
                  "`c=auto` and `aggregator=auto` only once they choose one) each rank evaluates the whole "
                  "validation set, N times the work of ranks that split it (docs/training.md, "
                  "`eval/each_replica`): a coded run's wall ratio is above its steps ratio by that much."]  # fmt: skip
        loads = [_f(r[k].split()[0]) for r in srows for k in ("load_before", "load_after") if r[k].strip()]
        if loads and min(loads) > 0 and max(loads) > 1.5 * min(loads):
            lines += ["", f"The 1-minute load ran from {min(loads):.1f} to {max(loads):.1f} across these runs (2 "
                      "cores, shared): a ratio between runs at different loads mixes the aggregator with the load; "
                      "the order rotated by seed evens it out only over several seeds."]  # fmt: skip
            nccl_runs = [s["row"] for s in summary["aggregators"].get("nccl", {}).get("seeds", [])]
            if len(nccl_runs) >= 2:
                walls = [_f(r["wall_s"]) for r in nccl_runs]
                each = ", ".join(f"{w:.0f} s at load {r['load_before'].split()[0]} -> {r['load_after'].split()[0]}"
                                 for w, r in zip(walls, nccl_runs, strict=True))  # fmt: skip
                lines[-1] += (
                    f" nccl's own runs, the same job but for the seed: {each}, {max(walls) / min(walls):.2f}x apart."
                )
        best, why = recommend(summary)
        choices.append((setting, best, why))
        target = auto_target(summary)
        if target:
            lines += ["", f"Issue 34's target for auto here: {target}." + probe_fits(runs / setting.key, summary)]
        if "cerar_c16" in summary["aggregators"]:
            nccl_share = summary["aggregators"].get("nccl", {}).get("share")
            cerar.append((setting, {**summary["aggregators"]["cerar_c16"], "nccl_share": nccl_share}, band))
        name = f"time_to_loss_{setting.key}.png"
        if figure(setting, summary, runs, figures / name):
            lines += ["", f"![validation loss against wall clock]({_rel(figures / name).replace('reports/', '')})"]
    lines += ["", "## Which aggregator to take", ""]
    for setting, best, why in choices:
        lines.append(f"- {setting.describe()}: **{best or 'not decided'}**: {why}.")
    lines += ["", "## The paper's claims", ""]
    if cerar:
        lines += ["CERAR c=16 (the paper's setting), measured on every setting it ran:", "",
                  "| setting | training time / nccl | gap to nccl | nccl's band | time to nccl's loss / nccl's |",
                  "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for setting, a, band in cerar:
            lines.append(
                f"| {setting.describe()} | {_x(a['wall'])} | {_pct(a['gap'])} | "
                f"{'-' if band is None else f'{100 * band:.2f} %'} | {_x(a['ttt']) if a['reached'] else 'never'} |"
            )
        slow = [a["wall"] for s, a, _ in cerar if s.links != "loopback" and a["wall"] is not None]
        fast = [a["wall"] for s, a, _ in cerar if s.links == "loopback" and a["wall"] is not None]
        lines += [
            "",
            "- *Faster on slow links* (the paper: about 17 % at identical loss): "
            + (f"training time {_span(slow)}x nccl's in the lab." if slow else "not measured yet."),
        ]
        lines.append("- *Slower on fast links* (NVLink; here unshaped loopback): "
                     + (f"{_span(fast)}x nccl's." if fast else "not measured yet."))  # fmt: skip
        lines.append("- *The gap narrows with model size*: " + _by_model(cerar) + ".")
    else:
        lines.append("CERAR c=16 not measured yet.")
    lines += rates_section(rows)
    lines += probe_section()
    lines += ["", "## Rebuilding", "", "    .venv/bin/python scripts/studies/time_to_loss.py --report", ""]
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
