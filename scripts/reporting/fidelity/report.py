"""reports/fidelity.md's generated part: the loss tables, the projection to Pythia's batch and the text, from the
summaries of ``fidelity.runs``."""

from __future__ import annotations

import csv
import math
import re
import statistics
from pathlib import Path

from scripts.reporting.fidelity.batch_scaling import (
    noise_from_ratio,
    noise_unit,
    sequences_where_error_equals_noise,
    tokens_was_the_unit,
)
from scripts.reporting.fidelity.plane import dominance
from scripts.reporting.fidelity.runs import (
    DRIFT_STEPS,
    HORIZON,
    PYTHIA_BATCH_TOKENS,
    PYTHIA_SEQ_LEN,
    PYTHIA_SEQUENCES,
    _f,
    batch_size,
    drift_growth,
)


def pythia_projection(rows: list[dict], sequences: int, seq_len: int, batch_rows: list[dict]) -> list[str]:
    """The paragraph that projects this study's noise to Pythia's batch in the unit the batch-scaling study measured,
    and says whether the earlier per-token projection held; without those runs it says that nothing is projected."""
    tokens = sequences * seq_len
    nccl = next((r["noise_median"] for r in rows if r["setting"] == "nccl" and r["noise_median"]), None)
    per_token = nccl * math.sqrt(tokens / PYTHIA_BATCH_TOKENS) if nccl else None
    text = (
        f"An earlier version of this report scaled the logged noise by 1/sqrt(tokens per step): from {nccl:.3g} "
        f"at {sequences} x {seq_len} ({tokens:,} tokens) to {per_token:.3g} at Pythia's {PYTHIA_SEQUENCES} x "
        f"{PYTHIA_SEQ_LEN} ({PYTHIA_BATCH_TOKENS:,} tokens). "
        if nccl
        else ""
    )
    unit = noise_unit(batch_rows)
    if not batch_rows:
        return [
            text + "The batch-scaling runs are absent, so the noise is not projected to Pythia's batch here: whether "
            "it falls with tokens or with sequences per step is what those runs measure, and it is not assumed."
        ]
    if unit is None or unit["r_pythia"] is None:
        return [
            text + "The batch-scaling runs do not yet give nccl's noise at shapes that vary both the number of "
            "sequences and the sequence length, so the noise is not projected to Pythia's batch yet."
        ]
    a, b = unit["sequences_exponent"], unit["seq_len_exponent"]
    nccl_rows = {(r["sequences"], r["seq_len"]): r for r in batch_rows if r["setting"] == "nccl" and r["noise_median"]}
    base = nccl_rows.get(unit["base"])
    text += (
        "The batch-scaling study (section below) measured the unit instead: r = nu/sqrt(1 - nu^2), the noise over "
        f"the signal, falls as sequences^-{a:.2f} x seq_len^-{b:.2f}."
    )
    if base is not None:
        checks = [
            f"{s} x {t}: {base['noise_median'] * math.sqrt(base['tokens_per_step'] / (s * t)):.3g} per token, "
            f"{r['noise_median']:.3g} measured"
            for (s, t), r in sorted(nccl_rows.items(), key=lambda kv: (kv[0][0] * kv[0][1], kv[0][0]))
            if (s, t) != unit["base"]
        ]
        text += f" From nccl's noise {base['noise_median']:.3g} at {unit['base'][0]} x {unit['base'][1]}: " + (
            "; ".join(checks) + "."
        )
    if tokens_was_the_unit(unit):
        text += (
            f" b = {b:.2f} is nearer 0.5 than 0: tokens are the unit, and the per-token projection held in its unit "
            "(though it scaled nu, which saturates, rather than r)."
        )
    else:
        text += (
            f" b = {b:.2f} is nearer 0 than 0.5: longer sequences do not lower the noise as more sequences do, so "
            "tokens are not the unit and the per-token projection did not hold."
        )
    nu_pythia = noise_from_ratio(unit["r_pythia"])
    text += (
        f" In the measured unit Pythia's noise is nu = {nu_pythia:.3g} (r = {unit['r_pythia']:.3g})"
        + (f", {nu_pythia / per_token:.3g}x the per-token figure" if per_token else "")
        + "; the last two columns use it."
    )
    return [text]


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def loss_table(rows: list[dict]) -> list[str]:
    """The final-validation-loss table: one line per setting, gaps to nccl, train beside validation."""
    out = [
        "| setting | seeds | steps | val loss (ref. replica) | seed spread | gap to nccl | gap, same seed | "
        "worst replica | train loss (last 200 steps) | val - train | separates from nccl at step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        gap = "-" if r["gap_to_nccl_pct"] is None else f"{r['gap_to_nccl_pct']:+.2f} %"
        paired = "-" if r["paired_gap_pct"] is None else f"{r['paired_gap_pct']:+.2f} %"
        sep = "never" if r["separates_at"] is None and r["setting"] != "nccl" else _f(r["separates_at"], "d")
        out.append(
            f"| {r['setting']} | {r['seeds']} | {r['steps']} | {r['val_loss']:.4f} | {r['val_spread']} | {gap} | "
            f"{paired} | {_f(r['val_loss_worst_replica'])} | {r['train_loss_last200']:.4f} | "
            f"{r['val_loss'] - r['train_loss_last200']:+.4f} | {sep} |"
        )
    return out


def render(
    rows: list[dict],
    settings: dict[str, list[dict]],
    lab: dict[str, float],
    log_lines: list[str],
    plane: list[dict],
    grown_rows: list[dict] | None = None,
    batch_rows: list[dict] | None = None,
) -> str:
    """The report below the hand-written findings; `batch_rows` (the batch-scaling study's) give the unit in which
    the noise is projected to Pythia's batch, and without them it is not projected."""
    batch, batch_tokens = batch_size(settings)
    seq_len = batch_tokens // batch
    out = [
        "# Does CERAR train like exact all-reduce over a long run?",
        "",
        "Generated by `scripts/reporting/fidelity_report.py` from the run folders under `reports/runs/fidelity/` "
        "(written by `scripts/studies/run_fidelity.sh`, halves A-F); figures by "
        "`scripts/reporting/make_figures.py --only fidelity`.",
        "",
        f"Setup: model=tiny (GPTNeoX, 2 layers, hidden 64, Pythia init and recipe), data=embedded, N=4 ranks on gloo "
        f"(this 2-core machine, loopback), {batch} sequences x {seq_len} tokens = {batch_tokens} tokens per optimizer "
        f"step, {HORIZON} steps, the same seed (model init and data order) for every setting of a seed. "
        "Validation loss every 100 steps on a fixed set of 256 windows; drift, aggregation error and gradient "
        "noise every 50 steps. `val_loss` is the reference replica's (rank N-1: exact under CERAR, the one "
        "checkpoints keep and resync broadcasts) on the whole validation set; the worst replica's is beside it.",
        "",
        "## Final validation loss per setting",
        "",
        *loss_table(rows),
        "",
        "Gap to nccl: the setting's mean over its seeds against nccl's mean; gap, same seed: against nccl at the same "
        "seed (same initial weights and data order), averaged over the seeds both ran. "
        "Separation: the first evaluation from which the setting's mean validation loss stays outside nccl's seed "
        "band (min..max of its seeds) until the end.",
    ]
    if grown_rows:
        out += [
            "",
            "### The same runs on the grown corpus (embedded v2)",
            "",
            "The study above read the embedded corpus v1 (the gensim text alone). Version 2 adds the World English "
            "Bible (`configs/data/embedded.yaml`) and spreads the evaluated windows over the whole "
            "validation split "
            "(v1 evaluated its first windows); `scripts/studies/run_fidelity.sh G|H|I|J` reran these settings "
            "on it with "
            "everything else the same (run data under `reports/runs/fidelity-corpus-v2/`, figure "
            "`fidelity_corpus_v2_val_loss_vs_step.png`). Losses of the two corpora are not comparable; gaps are.",
            "",
            *loss_table(grown_rows),
        ]
    out += [
        "",
        "## Drift, aggregation error and SGD noise",
        "",
        "Drift is measured against the reference replica: `max_abs` = max |theta_r - theta_ref|, `rel_l2` = "
        "||theta_r - theta_ref|| / ||theta_ref||, worst rank, at the last measurement. Error: the worst rank's "
        "||g_hat - g_bar|| / ||g_bar|| (median over the run). Noise: the estimated relative standard deviation of "
        "the averaged gradient g_bar itself, from the spread of the 4 per-rank gradients (median after the first "
        f"{HORIZON // 10} steps).",
        "",
        *pythia_projection(rows, batch, seq_len, batch_rows or []),
        "",
        "| setting | drift max_abs | drift rel_l2 | error (median) | noise (median) | error / noise | "
        f"error / noise at Pythia's batch | sequences of {PYTHIA_SEQ_LEN} tokens per step where error = noise |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    unit = noise_unit(batch_rows or [])
    pythia_noise = noise_from_ratio(unit["r_pythia"]) if unit and unit["r_pythia"] is not None else None
    for r in rows:
        if re.search(r"resync\d+$", r["setting"]) and not r["drift_rel_l2"]:
            r["drift_max_abs"] = r["drift_rel_l2"] = math.nan  # measured after the resync: see below
        error, noise = r["rel_error_median"], r["noise_median"]
        ratio = "-" if not (error and noise) else f"{error / noise:.3g}"
        at_pythia = "-" if not (error and pythia_noise) else f"{error / pythia_noise:.3g}"
        if error is not None and error <= 1e-6:
            meet = "never (exact)"
        elif error and pythia_noise:
            sequences = sequences_where_error_equals_noise(error, unit)
            meet = "never (noise does not fall with sequences)" if sequences is None else f"{sequences:,.0f}"
        else:
            meet = "-"
        out.append(
            f"| {r['setting']} | {r['drift_max_abs']:.3g} | {r['drift_rel_l2']:.3g} | {_f(error, '.3g')} | "
            f"{_f(noise, '.3g')} | {ratio} | {at_pythia} | {meet} |"
        )
    growth = drift_growth(settings)
    if growth:
        out += [
            "",
            "nan: a resync run whose drift was measured right after each resync (it read 0); its drift comes from "
            "the `_drift` run below, the same run (bit-identical validation losses) with drift measured before "
            "each resync, stopped after 1000 steps.",
            "",
            "### Drift as the steps go, with and without resync (seed 1)",
            "",
            "With resync, each value is the most the replicas parted in the 50 steps since the last resync.",
            "",
            "| setting | " + " | ".join(f"rel_l2 @{k}" for k in DRIFT_STEPS) + " | max_abs @1000 | max_abs @3000 |",
            "|" + " --- |" * (len(DRIFT_STEPS) + 3),
            *(
                f"| {g['setting']} | " + " | ".join(_f(v, ".3g") for v in g["rel_l2"])
                + f" | {_f(g['max_abs'][DRIFT_STEPS.index(1000)], '.3g')} | {_f(g['max_abs'][-1], '.3g')} |"
                for g in growth
            ),
        ]  # fmt: skip
    resynced = [name for name in settings if re.search(r"resync(\d+)$", name)]
    for name in resynced:
        k = int(re.search(r"resync(\d+)", name)[1])
        run = settings[name][0]
        bytes_per_step = statistics.median(r["bytes_sent"] for r in run["metrics"] if r.get("bytes_sent"))
        d = run["summary"].get("parameters")
        if d:
            out += [
                "",
                f"Resync cost ({name}): a broadcast of the d = {d:,} parameters every {k} steps, in which each rank "
                f"sends at most d values: {4 * d / k:,.0f} bytes per step amortised, "
                f"{100 * 4 * d / k / bytes_per_step:.1f} % on top of the {bytes_per_step:,.0f} bytes CERAR sends "
                "per step.",
            ]
    if plane:
        out += [
            "",
            "## Bytes against error: where CERAR stands",
            "",
            "`scripts/bench/aggregator_plane.py` (N=4, real gradients of the same model, every aggregator "
            "from the same "
            "gradients; figure `aggregator_plane.png`). Bytes are per call for the whole gradient, relative to the "
            "fp32 ring all-reduce's 2(N-1)/N d values; error is the worst rank's, median over the calls.",
            "",
            "| aggregator | bytes / fp32 ring | worst-rank error (median) | max |",
            "| --- | --- | --- | --- |",
            *(
                f"| {r['aggregator']} | {r['ratio']:.3f} | {r['error']:.3g} | {float(r['error_max']):.3g} |"
                for r in sorted(plane, key=lambda r: r["ratio"])
            ),
            "",
            "CERAR's bytes are (1 + (N-2)/c) d against the ring's 2(N-1)/N d: the ratio N(c+N-2)/(2c(N-1)) falls "
            "towards N/(2(N-1)) as c grows but never reaches it (2/3 at N=4, 4/7 at N=8, always above 1/2), and the "
            "error grows with c (more perturbation levels per kappa budget).",
            "",
            *dominance(plane),
        ]
    out += ["", "## Time to nccl's final validation loss", ""]
    out += [
        "Steps to reach nccl's mean final validation loss in this study, times the seconds per step measured in the "
        "100 Mbit/s lab (`reports/training_100mbit.md`: pythia-14m, N=4, one rank per lab host). Settings without a "
        "lab measurement are marked; they are not estimated.",
        "",
        "| setting | steps to nccl's final loss | lab s/step | estimated time s |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lab_key = "nccl" if r["setting"] == "nccl" else "cerar_c16" if r["setting"].startswith("cerar_c16_") else None
        seconds = lab.get(lab_key) if lab_key else None
        steps = r["steps_to_nccl_final"]
        estimate = "-" if seconds is None or steps is None else f"{steps * seconds:,.0f}"
        reached = "not reached" if steps is None else f"{steps:.0f}"
        if steps is not None and r["seeds_reaching_nccl_final"] < len(r["seeds"].split(",")):
            reached += f" ({r['seeds_reaching_nccl_final']} of {len(r['seeds'].split(','))} seeds; the others do not)"
        out.append(f"| {r['setting']} | {reached} | {_f(seconds, '.2f')} | {estimate} |")
    if log_lines:
        out += ["", "## Runs and load", "", "```", *log_lines, "```"]
    return "\n".join(out) + "\n"
