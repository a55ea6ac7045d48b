"""reports/costmodel.md's two-tier sections (issues 20 and 25): clusters of 8-GPU nodes on Ethernet, which
aggregator to use where (and its figure), the 8-bit hierarchy and hierarchical CERAR over fp16 messages."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cerar.planning.costmodel import (
    ETHERNET_GBIT,
    GPUS_PER_NODE,
    HBM_BANDWIDTH,
    HIER_C_MAX_MULT,
    INTRA_NODE_TIERS,
    NODE_COUNTS,
    PYTHIA_PARAMS,
    TCP_EFFICIENCY,
    TOKENS_PER_WORKER,
    ethernet_tier,
    fit_two_tier_groups,
    step_compute_seconds,
    two_tier_projection,
)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _sec(x: float) -> str:
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} us"


CLUSTER_SHAPES = (
    ("NVLink", 1, "NVLink inside, one NIC per node"),
    ("PCIe", 1, "PCIe inside, one NIC per node"),
    ("NVLink", GPUS_PER_NODE, "NVLink inside, one NIC per GPU (rails)"),
)
TWO_TIER_MODEL = "1.4b"


def _two_tier_cells(gbit: float, intra: str, nics: int, efficiency: float = TCP_EFFICIENCY) -> list[dict]:
    d = PYTHIA_PARAMS[TWO_TIER_MODEL]
    return [dict(two_tier_projection(d, INTRA_NODE_TIERS[intra], ethernet_tier(gbit, efficiency), n,
                                     nics_per_node=nics), nodes=n) for n in NODE_COUNTS]  # fmt: skip


def _lab_errors(rows: Sequence[dict]) -> dict[str, float]:
    """The worst relative error each hierarchical aggregator showed in the lab (the label: aggregator, c)."""
    worst: dict[str, float] = {}
    for r in rows:
        if r["aggregator"] in ("hier_ring", "hier_cerar", "hier_ring16") and r.get("rel_error") not in (None, ""):
            label = r["aggregator"] + (f" {r['construction']} c={r['c']}" if r["aggregator"] == "hier_cerar" else "")
            worst[label] = max(worst.get(label, 0.0), float(r["rel_error"]))
    return worst


def two_tier_section(rows: Sequence[dict] | None, csv_path: str | None = None, itemsize: int = 4) -> list[str]:
    """The two-tier model: its terms, its fit to the two-tier lab, its projection onto 8-GPU-node clusters."""
    L = ["## Two tiers: clusters of multi-GPU nodes (issue 20)", "",
         "`cerar.planning.costmodel.TwoTierCluster`: n nodes of G ranks; per all-reduce and rank, the tiers one after "
         "the other (as `cerar.hierarchical` runs them):", "",
         "    T = rounds_intra * alpha_intra + bytes_intra / bandwidth_intra",
         "      + rounds_inter * alpha_inter + bytes_inter_link / bandwidth_inter + bytes_moved / memory_bandwidth",
         "",
         "with s = ceil(d/G) the shard of one rail and bytes_inter_link what the busiest NIC carries (the G rails' "
         "bytes on one shared NIC; one rail's with a NIC per GPU):", "",
         "| aggregator | rounds inside / between | bytes sent inside per rank | bytes on the busiest NIC |",
         "| --- | --- | --- | --- |",
         "| `hier_ring` (exact hierarchy) | 2(G-1) / 2(n-1) | 2(G-1) s itemsize | G/NICs x 2(n-1) ceil(s/n) itemsize "
         "~ 2(n-1)/n d itemsize |",
         "| `hier_cerar` (code for n nodes) | 2(G-1) / c+n-2 | 2(G-1) s itemsize | G/NICs x (c+n-2) ceil(s/c) itemsize "
         "~ (1 + (n-2)/c) d itemsize |",
         "| `hier_ring16` (16-bit messages) | as `hier_ring` | half of `hier_ring`'s | half of `hier_ring`'s, "
         "plus 12 bytes per value of casts through memory |",
         "| flat ring over n G ranks (NCCL's ring) | - / 2(nG-1) | - | 2(nG-1)/(nG) d itemsize / NICs (a ring per "
         "NIC) |",
         "",
         "A flat ring's round waits for its slowest hop (the intra-node one can be it: PCIe with a fast "
         "network); the hierarchy runs its tiers one after the other, so where the node's links are not much "
         "faster than the network (PCIe with 100 GbE and more) a flat ring, which keeps both busy at once, "
         "beats it. Per node the coded rail sends (1 + (n-2)/c) d against the exact hierarchy's 2(n-1)/n d: "
         "it pays for c > n and n > 2, at most 1 - n/(2(n-1)) of the bytes. 16-bit messages send (n-1)/n d "
         "worth of fp32 bytes, less than any code at any c, and err less (below): **where 16-bit gradient "
         "messages are acceptable they beat hierarchical CERAR; the code pays against an fp32 exact hierarchy.**",
         ""]  # fmt: skip
    # ---- fit on the lab
    L += ["### Fitted on the two-tier lab", ""]
    fits = fit_two_tier_groups(rows or [], itemsize)
    if not fits:
        L += [f"No two-tier rows{f' in `{csv_path}`' if csv_path else ''} yet: `scripts/bench/run_hierarchical_lab.sh` "
              "measures them (4 hosts x 2 ranks, 200 Mbit/s between hosts, jumbo frames); the projection below "
              "uses the stated parameters only.", ""]  # fmt: skip
    else:
        L += [f"Source: `{csv_path}`. Relative least squares (all coefficients >= 0) of the five terms on the "
              "rows of every aggregator but gloo's own all_reduce (its algorithm is gloo's). Inside a lab host the "
              "tier is the kernel's loopback, so its alpha and bandwidth are this CPU's; between hosts, the "
              "fitted bandwidth over the shaped rate is the goodput TCP reached.", "",
              "| where | rate (Mbit/s) | rows | alpha inside | bandwidth inside | alpha between | bandwidth between "
              "| between / link rate | memory bandwidth | rel. RMSE (per aggregator) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for (where, rate), f in fits.items():
            if isinstance(f, str):
                L.append(f"| {where} | {rate or '-'} | - | not fitted: {f} | | | | | | |")
                continue
            bw = lambda beta: "inf" if beta == 0 else f"{1 / beta / 1e6:.1f} MB/s"  # noqa: E731
            link = "-" if rate in ("", None) or f.beta_inter == 0 else f"{8 / f.beta_inter / (float(rate) * 1e6):.2f}"
            per = ", ".join(f"{a} {v:.2f}" for a, v in f.rel_rmse_by_aggregator.items())
            mem = "inf" if f.gamma == 0 else f"{1 / f.gamma:.3g} B/s"
            L.append(f"| {where} | {rate or '-'} | {f.n_rows} | {_sec(f.alpha_intra)} | {bw(f.beta_intra)} | "
                     f"{_sec(f.alpha_inter)} | {bw(f.beta_inter)} | {link} | {mem} | "
                     f"{f.rel_rmse:.3f} ({per}) |")  # fmt: skip
        L.append("")
        for (where, rate), f in fits.items():
            if isinstance(f, str):
                continue
            L += [f"Residuals, {where} {rate} Mbit/s (model / measured - 1): "
                  + "; ".join(f"{label} {100 * r:+.1f} %" for label, r in f.residuals), ""]  # fmt: skip
    # ---- projection
    d = PYTHIA_PARAMS[TWO_TIER_MODEL]
    L += [f"### Projection: Pythia-{TWO_TIER_MODEL.upper()} on {GPUS_PER_NODE}-GPU nodes", "",
          f"One fp32 gradient all-reduce of d = {d:,} values ({d * itemsize / 1e9:.2f} GB) per step. Parameters "
          "(what NCCL reaches, not line rates):", ""]  # fmt: skip
    for key, tier in INTRA_NODE_TIERS.items():
        L.append(f"- inside a node, {key}: {tier.note}")
    L += [f"- between nodes, {'/'.join(f'{g}' for g in ETHERNET_GBIT)} GbE at {TCP_EFFICIENCY:.0%} of the line "
          "rate (NCCL over TCP sockets reaches 40-60 %: NVIDIA/nccl issues 450 and 209), alpha "
          f"{ethernet_tier(25).alpha * 1e6:g} us; one NIC per node, or one per GPU (rails)",
          f"- memory bandwidth for the arithmetic {HBM_BANDWIDTH:.2g} B/s (A100 HBM2); CERAR's c searched in "
          f"1..{HIER_C_MAX_MULT}n (`HIER_C_MAX_MULT`: beyond, the optimized codes err more than a few percent); on "
          "2 nodes `hier_cerar` runs the exact rail, as the library does", "",
          "Cells: the exact hierarchy's all-reduce time, then each other choice's time over it (below 1: "
          "faster; 16-bit messages on the faster of the two exact layouts, h: the hierarchy, f: the flat ring), "
          "and what to use: among fp32 messages only, and when 16-bit messages are acceptable.",
          ""]  # fmt: skip
    counts = {"cells": 0, "coded": 0, "half": 0, "fp32 coded": 0}
    not_paying = []
    for intra, nics, title in CLUSTER_SHAPES:
        L += [f"#### {title}", "",
              "| network | nodes | exact hierarchy | flat ring | hier CERAR (c) | 16-bit messages | fp32 only: use "
              "| use |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for gbit in ETHERNET_GBIT:
            for cell in _two_tier_cells(gbit, intra, nics):
                counts["cells"] += 1
                counts["coded"] += cell["coded_pays"]
                counts["half"] += cell["choice"] == "16-bit messages"
                counts["fp32 coded"] += cell["choice_fp32"] == "hierarchical CERAR"
                if cell["choice_fp32"] != "hierarchical CERAR":
                    not_paying.append((f"{title}, {gbit} GbE, {cell['nodes']} nodes", cell["choice_fp32"]))
                c = "-" if cell["hier_c"] is None else str(cell["hier_c"])
                L.append(f"| {gbit} GbE | {cell['nodes']} | {_sec(cell['hier_ring'])} | {cell['flat_ratio']:.2f} | "
                         f"{cell['cerar_ratio']:.2f} ({c}) | {cell['half_ratio']:.2f} {cell['half_layout'][0]} | "
                         f"{cell['choice_fp32']} | {cell['choice']} |")  # fmt: skip
        L.append("")
    two_node = [x for x, _ in not_paying if x.endswith(", 2 nodes")]
    beyond = [f"{x} ({choice})" for x, choice in not_paying if not x.endswith(", 2 nodes")]
    summary = (f"In these {counts['cells']} cells: hierarchical CERAR beats the exact hierarchy in {counts['coded']} "
               f"and is the fastest fp32 choice in {counts['fp32 coded']}; 16-bit messages beat every fp32 choice "
               f"in {counts['half']}. Nothing coded pays on 2 nodes ({len(two_node)} cells: the coded rail sends d "
               "per node, like the exact one)")  # fmt: skip
    if beyond:
        summary += (f", nor in {len(beyond)} more, where a faster exact choice exists: {'; '.join(beyond)}. There "
                    "the network is fast enough that the hierarchy's sequential tiers, or CERAR's extra rounds and "
                    "passes over the shard, cost more than its bytes save")  # fmt: skip
    L += [summary + ".", ""]
    # ---- accuracy beside speed
    errors = _lab_errors(rows or [])
    if errors:
        L += ["Errors measured in the lab (worst relative error against the float64 sum, Gaussian gradients): "
              + "; ".join(f"{k} {v:.1e}" for k, v in sorted(errors.items())) + ".", ""]  # fmt: skip
    # ---- sensitivity and the step
    L += ["Sensitivity: RDMA (RoCE) instead of TCP, 90 % of the line rate, NVLink inside, one NIC per node, "
          "hier CERAR / exact hierarchy at 4 / 16 / 64 nodes:", ""]  # fmt: skip
    for gbit in ETHERNET_GBIT:
        cells = {c["nodes"]: c for c in _two_tier_cells(gbit, "NVLink", 1, efficiency=0.9)}
        L.append(f"- {gbit} GbE: " + " / ".join(f"{cells[n]['cerar_ratio']:.2f}" for n in (4, 16, 64))
                 + f" (16-bit: {cells[16]['half_ratio']:.2f} at 16 nodes)")  # fmt: skip
    step = step_compute_seconds(d)
    ref = {c["nodes"]: c for c in _two_tier_cells(100, "NVLink", 1)}[8]
    saving = (ref["hier_ring"] - ref["hier_cerar"]) / (step + ref["hier_ring"])
    half_saving = (ref["hier_ring"] - ref["half"]) / (step + ref["hier_ring"])
    L += ["", f"The step: at {TOKENS_PER_WORKER:,} tokens per GPU a Pythia-1.4B step computes for {_sec(step)} "
          f"(312 TFLOP/s at 40 % MFU); on 8 nodes of NVLink GPUs with one 100 GbE NIC each the exact hierarchy "
          f"adds {_sec(ref['hier_ring'])} unoverlapped, hierarchical CERAR at c={ref['hier_c']} shortens the step "
          f"by {100 * saving:.1f} % and 16-bit messages by {100 * half_saving:.1f} %.", ""]  # fmt: skip
    return L


def two_tier_figure(path: Path) -> Path:
    """One figure to choose an aggregator: per cluster shape (rows) and network (columns), each choice's
    all-reduce time over the exact hierarchy's against the number of nodes (model, Pythia-1.4B)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(CLUSTER_SHAPES), len(ETHERNET_GBIT), figsize=(12, 10), sharex=True, sharey=True)
    for row, (intra, nics, title) in enumerate(CLUSTER_SHAPES):
        for col, gbit in enumerate(ETHERNET_GBIT):
            ax = axes[row][col]
            cells = _two_tier_cells(gbit, intra, nics)
            ns = [c["nodes"] for c in cells]
            ax.axhline(1.0, color="black", linewidth=1.2, label="exact hierarchy (fp32)")
            ax.plot(ns, [c["cerar_ratio"] for c in cells], marker="o", color="tab:blue",
                    label=f"hierarchical CERAR (best c <= {HIER_C_MAX_MULT}n)")  # fmt: skip
            ax.plot(ns, [c["half_ratio"] for c in cells], marker="s", color="tab:orange",
                    label="16-bit messages (faster exact layout)")  # fmt: skip
            ax.plot(ns, [c["int8_ratio"] for c in cells], marker="v", color="tab:green", label="8-bit hierarchy")
            ax.plot(ns, [min(c["flat_ratio"], 1.95) for c in cells], marker="^", color="gray",
                    linestyle="--", label="flat ring over all GPUs, fp32 (clipped at 1.95)")  # fmt: skip
            for c in cells:
                if c["hier_c"] is not None and c["nodes"] in (4, 64):
                    ax.annotate(f"c={c['hier_c']}", (c["nodes"], c["cerar_ratio"]), textcoords="offset points",
                                xytext=(0, -11), ha="center", fontsize=6, color="tab:blue")  # fmt: skip
            at8 = next(c for c in cells if c["nodes"] == 8)
            ax.text(0.97, 0.96, f"exact hierarchy at 8 nodes: {_sec(at8['hier_ring'])}", transform=ax.transAxes,
                    ha="right", va="top", fontsize=7)  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_ylim(0.2, 2.0)
            ax.grid(True, alpha=0.3)
            if row == 0:
                ax.set_title(f"{gbit} GbE between nodes ({TCP_EFFICIENCY:.0%} of line rate)", fontsize=9)
            if col == 0:
                ax.set_ylabel(f"{title}\ntime / exact hierarchy", fontsize=8)
            if row == len(CLUSTER_SHAPES) - 1:
                ax.set_xlabel("nodes (8 GPUs each)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, 0.035))
    fig.suptitle(f"Which all-reduce on 8-GPU nodes? Pythia-{TWO_TIER_MODEL.upper()} fp32 gradients, cost model "
                 "(lowest line is fastest)", fontsize=11)  # fmt: skip
    fig.text(0.5, 0.005, "16-bit messages send fewer bytes than any code and err less. Among fp32 messages, "
             "hierarchical CERAR beats the exact hierarchy from 3 nodes on, never on 2;\non PCIe nodes with fast "
             "networks, and with a 400 GbE NIC per GPU, a flat ring beats both (it keeps both tiers busy at once).",
             ha="center", fontsize=8)  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def int8_two_tier_section(rows: Sequence[dict] | None) -> list[str]:
    """Issue 25: the 8-bit hierarchy (``hier_int8``) in the two-tier model, beside the 16-bit messages, and
    the choice when 8-bit messages are acceptable; its errors in the lab when the rows hold some."""
    from cerar.planning.costmodel import (
        INT8_BLOCK,
        INT8_DEQUANTIZE_ADD_BYTES,
        INT8_DEQUANTIZE_BYTES,
        INT8_QUANTIZE_BYTES,
    )

    B = INT8_BLOCK
    L = ["### The 8-bit hierarchy (issue 25)", "",
         f"`hier_int8` (`cerar.int8.two_tier`): inside the node as `hier_ring` in fp32; on each rail the "
         f"8-bit all-reduce, 2(n-1) rounds of messages of s' = ceil(s/n) int8 values and a float32 scale per {B} "
         f"(s' + 4 ceil(s'/{B}) bytes), so the busiest NIC carries G/NICs x 2(n-1) (s' + 4 ceil(s'/{B})) bytes, "
         f"{(1 + 4 / B) / 4:.3f} of `hier_ring`'s; the arithmetic moves {INT8_QUANTIZE_BYTES} bytes per value "
         f"quantized, {INT8_DEQUANTIZE_ADD_BYTES} per value dequantized and added and {INT8_DEQUANTIZE_BYTES} per "
         "value dequantized (`INT8_*_BYTES`, measured on the dispatched operations in tests/test_quantized.py): "
         "per rail shard (n-1) (quantize + dequantize-add) + 1 quantize + n dequantize passes.", "",
         "Cells: the 8-bit hierarchy's time over the exact hierarchy's, the 16-bit messages' (as above), and what "
         "to use when 8-bit messages are acceptable too (ties to the wider messages, which err less).", ""]  # fmt: skip
    counts = {"cells": 0, "int8": 0}
    for intra, nics, title in CLUSTER_SHAPES:
        L += [f"#### {title}: with 8-bit messages", "", "| network | nodes | 8-bit hierarchy | 16-bit messages | use |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for gbit in ETHERNET_GBIT:
            for cell in _two_tier_cells(gbit, intra, nics):
                counts["cells"] += 1
                counts["int8"] += cell["choice_int8"] == "8-bit messages"
                L.append(f"| {gbit} GbE | {cell['nodes']} | {cell['int8_ratio']:.2f} | {cell['half_ratio']:.2f} "
                         f"{cell['half_layout'][0]} | {cell['choice_int8']} |")  # fmt: skip
        L.append("")
    L += [f"8-bit messages are the fastest choice in {counts['int8']} of these {counts['cells']} cells.", ""]
    worst: dict[str, float] = {}
    for r in rows or []:
        if r["aggregator"] in ("hier_int8", "int8") and r.get("rel_error") not in (None, ""):
            worst[r["aggregator"]] = max(worst.get(r["aggregator"], 0.0), float(r["rel_error"]))
    if worst:
        L += ["Errors of the 8-bit rows in the lab (worst relative error against the float64 sum, Gaussian "
              "gradients): " + "; ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())) + ".", ""]  # fmt: skip
    return L


def cerar16_two_tier_section() -> list[str]:
    """Issue 25: hierarchical CERAR over fp16 messages at c = 2n in the two-tier model, over the 16-bit exact
    hierarchy's time (the lab measured 0.845 at 4 x 2, 200 Mbit/s, against a byte bound of 0.83)."""
    L = ["### Hierarchical CERAR over fp16 messages (issue 25)", "",
         "`hier_cerar` with `transport=float16` at c = 2n: both tiers carry 2-byte values (per node between the "
         "nodes (1 + (n-2)/c) d of them against the 16-bit exact hierarchy's 2(n-1)/n d), the arithmetic stays "
         "float32 (its traffic at 4 bytes a value) plus the casts. Cells: its time over the 16-bit exact "
         "hierarchy's (n >= 3; on two nodes the rail is exact).", ""]  # fmt: skip
    pays = cells = 0
    for intra, nics, title in CLUSTER_SHAPES:
        L += [f"#### {title}: 16-bit messages", "", "| network | nodes | hier CERAR fp16 c=2n / fp16 exact hierarchy |",
              "| --- | --- | --- |"]  # fmt: skip
        for gbit in ETHERNET_GBIT:
            for cell in _two_tier_cells(gbit, intra, nics):
                if cell["cerar16_ratio_to_half"] is None:
                    continue
                cells += 1
                pays += cell["cerar16_ratio_to_half"] < 1
                L.append(f"| {gbit} GbE | {cell['nodes']} | {cell['cerar16_ratio_to_half']:.2f} |")
        L.append("")
    L += [
        f"Over 16-bit messages the code pays in {pays} of these {cells} cells; where 8-bit messages are "
        "acceptable the 8-bit hierarchy sends half its bytes or less for less error (docs/choosing.md).",
        "",
    ]
    return L


def _lab_commits(rows: Sequence[dict]) -> str:
    return ", ".join(sorted({(r.get("code_commit") or "?")[:7] for r in rows}))


def int4_two_tier_section(two_tier_rows: Sequence[dict] | None, int4_rows: Sequence[dict] | None,
                          int4_csv: str | None = None) -> list[str]:  # fmt: skip
    """Issue 54: the 4-bit hierarchy (``hier_int4``: 8-bit or exact sums inside a node, 4 bits on the rails) in the
    two-tier model beside the 8-bit one, and the model against the lab's 4-bit rows (``int4_csv``): once as fitted
    on the two-tier lab's other aggregators, once refitted with the 4-bit rows in."""
    from cerar.planning.costmodel import (
        INT4_BLOCK,
        TwoTierCluster,
        fit_two_tier,
        int4_value_bytes,
        is_two_tier_row,
        two_tier_row_features,
    )

    B = INT4_BLOCK
    value = int4_value_bytes(B, True, "stochastic")
    d = PYTHIA_PARAMS[TWO_TIER_MODEL]
    L = ["### The 4-bit hierarchy (issue 54)", "",
         f"`hier_int4` (`cerar.int4.two_tier`): the 8-bit reduce-scatter inside the node (or exact sums, "
         f"`hier_int4_exact` in the lab), on each rail the two-shot 4-bit all-reduce of `int4`: messages of "
         f"1/2 + 4/{B} bytes a value, {(0.5 + 4 / B) / 4:.3f} of float32's, rotated and stochastically rounded; the "
         f"eager format's traffic {value['quantize']:g} bytes per value quantized, {value['dequantize_add']:g} "
         f"dequantized and added, {value['dequantize']:g} dequantized (`int4_value_bytes`, counted on the "
         "dispatched operations in tests/test_costmodel_int4.py; the rotation's 7 stages are 84 of the quantizer's "
         "bytes). On GPUs the Triton kernels read and write each value once: these cells price the eager path, "
         "an upper bound there.", "",
         f"Cells: Pythia-{TWO_TIER_MODEL.upper()} (d = {d:,}), each aggregator's time over the exact hierarchy's "
         f"(`hier_ring`), memory at {HBM_BANDWIDTH / 1e12:g} TB/s.", ""]  # fmt: skip
    for intra, nics, title in CLUSTER_SHAPES:
        L += [f"#### {title}: with 4-bit messages between nodes", "",
              "| network | nodes | 4-bit hierarchy (8-bit inside) | 4-bit, exact inside | 8-bit hierarchy "
              "| flat 4-bit |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for gbit in ETHERNET_GBIT:
            for n in NODE_COUNTS:
                cluster = TwoTierCluster(n, GPUS_PER_NODE, INTRA_NODE_TIERS[intra], ethernet_tier(gbit), nics,
                                         HBM_BANDWIDTH)  # fmt: skip
                exact = cluster.time("hier_ring", d)
                cells = [cluster.time("hier_int4", d), cluster.time("hier_int4", d, intra="exact"),
                         cluster.time("hier_int8", d), cluster.time("int4", d)]  # fmt: skip
                L.append(f"| {gbit} GbE | {n} | " + " | ".join(f"{t / exact:.2f}" for t in cells) + " |")
        L.append("")
    lab = [r for r in int4_rows or [] if is_two_tier_row(r) and two_tier_row_features(r) is not None]
    latest = lab[-1].get("code_commit") if lab else None
    lab = [r for r in lab if r.get("code_commit") == latest]  # the rows of the code the model counts
    if not lab:
        return L
    L += [f"#### In the lab: the model against `{int4_csv or 'the 4-bit rows'}`", "",
          f"The two-tier rows of the file's latest tree ({_lab_commits(lab)}; the code of earlier trees may move other "
          "bytes than the model counts), each against the model's time for it: fitted on the two-tier lab's "
          "other rows (`reports/data/hierarchical_lab.csv`, the table above), and refitted on those rows and these "
          "together. Model over measured, less 1:", "",
          "| where | rate (Mbit/s) | aggregator | tree | measured | fitted without them | refitted with them |",
          "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    notes = []
    for key in sorted({(r["where"], r["rate_mbit"]) for r in lab}):
        mine = [r for r in lab if (r["where"], r["rate_mbit"]) == key]
        others = [r for r in two_tier_rows or [] if (r["where"], r["rate_mbit"]) == key]
        fits = {}
        for label, rows in (("without", others), ("with", [*others, *mine])):
            try:
                fits[label] = fit_two_tier(rows)
            except ValueError as e:
                notes.append(f"{key[0]} {key[1]} Mbit/s, {label} the 4-bit rows: not fitted ({e})")
        for r in mine:
            x = two_tier_row_features(r)[1]
            measured = float(r["seconds_median"])
            cells = [_pct(float(fits[k].coef @ x) / measured - 1) if k in fits else "-" for k in ("without", "with")]
            L.append(f"| {key[0]} | {key[1]} | {r['aggregator']} | {(r.get('code_commit') or '?')[:7]} | "
                     f"{_sec(measured)} | {cells[0]} | {cells[1]} |")  # fmt: skip
        for label, f in fits.items():
            mem = "no memory term (rounds and bytes alone)" if f.gamma == 0 else f"memory {1 / f.gamma / 1e9:.2f} GB/s"
            bw = "inf" if f.beta_inter == 0 else f"{1 / f.beta_inter / 1e6:.1f} MB/s"
            notes.append(f"{key[0]} {key[1]} Mbit/s fitted {label} the 4-bit rows: {mem}, between hosts {bw}")
    L += ["", "; ".join(notes) + ".", ""]
    return L
