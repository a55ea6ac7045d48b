"""The aggregator a run's config names: `build_aggregator(cfg, world_size)`, every kind of
train/aggregation/aggregators.py and
aggregator=auto (train/aggregation/auto_aggregator.py), which itself builds the others as its candidates; so the builder
stands apart from both (the trainer's one entry into the family)."""

from __future__ import annotations

import torch

from cerar.formats.int4_blocks import DEFAULT_ROUNDING as INT4_ROUNDING
from cerar.formats.int8_blocks import DEFAULT_ROUNDING
from train.aggregation.aggregators import (
    Aggregator,
    AllReduceAggregator,
    CerarAggregator,
    HierarchicalAggregator,
    HierarchicalInt4Aggregator,
    HierarchicalQuantizedAggregator,
    Int4Aggregator,
    LowPrecisionAllReduce,
    PowerSGDAggregator,
    QuantizedAggregator,
)
from train.aggregation.auto_aggregator import AutoAggregator
from train.config import code_kappa_max, node_layout


def build_aggregator(cfg, world_size: int) -> Aggregator:
    """The aggregator named by cfg.aggregator (its kind), with c from the root config."""
    a, timeout = cfg.aggregator, float(cfg.trainer.collective_timeout_s)
    if a.kind == "nccl":
        return AllReduceAggregator(world_size, timeout)
    if a.kind in ("fp16", "bf16"):
        return LowPrecisionAllReduce(world_size, timeout, torch.float16 if a.kind == "fp16" else torch.bfloat16)
    if a.kind == "powersgd":
        return PowerSGDAggregator(world_size, timeout, a.powersgd_rank, a.powersgd_start_iter)
    if a.kind == "ring":
        return CerarAggregator(world_size, timeout, cfg.c, "exact", None, None, exact_ring=True, transport=a.transport)
    if a.kind == "cerar":
        # c=auto starts exact (c = N) until the trainer's first choice (train/aggregation/auto_c.py)
        c, construction = (world_size, "exact") if cfg.c == "auto" else (cfg.c, a.construction)
        return CerarAggregator(
            world_size, timeout, c, construction, a.eps, code_kappa_max(a), exact_ring=False, transport=a.transport,
            equilibrate=getattr(a, "equilibrate", True),
        )  # fmt: skip
    if a.kind in ("hier_cerar", "hier_ring"):
        layout = node_layout(cfg, world_size)
        exact_ring = a.kind == "hier_ring"
        return HierarchicalAggregator(
            world_size,
            timeout,
            layout,
            cfg.c,
            a.construction,
            a.eps,
            code_kappa_max(a),
            exact_ring,
            a.coded_on_two_nodes,
            transport=a.transport,
            equilibrate=getattr(a, "equilibrate", True),
        )
    if a.kind in ("int8", "hier_int8"):
        return build_quantized_aggregator(cfg, world_size)
    fed = bool(getattr(a, "error_feedback", False))
    if a.kind == "int4":
        return Int4Aggregator(world_size, timeout, int(a.block), bool(a.rotate), error_feedback=fed)
    if a.kind == "hier_int4":
        layout = node_layout(cfg, world_size)
        return HierarchicalInt4Aggregator(world_size, timeout, layout, int(a.block), bool(a.rotate), str(a.intra),
                                          error_feedback=fed)  # fmt: skip
    if a.kind == "auto":  # every candidate built now, on every rank; the links measured by Trainer (prepare)
        return AutoAggregator(cfg, world_size)
    raise ValueError(f"aggregator.kind={a.kind!r} is unknown")


def fused_kernels(a) -> tuple[str, ...]:
    """The `cerar.formats.fused` kernels aggregator config ``a`` calls, each format's encoder and decoders: the 8-bit
    format's (int8, hier_int8, hier_int4's 8-bit tier inside a node; stochastic rounding,
    `cerar.formats.int8_blocks.DEFAULT_ROUNDING`), the 4-bit format's (int4, hier_int4; its stochastic rounding) and
    the 16-bit wire's (a 16-bit transport); auto's candidates call all three. () when ``aggregator.fused`` is false or
    the aggregator uses none. Where a kernel has no fused form on the device (on a CPU every decoder and the 4-bit
    format: their kernels are Triton, for GPUs), ``enable`` passes it by at once and the eager path runs."""
    if not getattr(a, "fused", True):
        return ()
    eight = (f"quantize_{DEFAULT_ROUNDING}", "dequantize", "dequantize_add")
    four = (f"int4_quantize_{INT4_ROUNDING}", "int4_dequantize", "int4_dequantize_add")
    wire16 = ("wire_encode", "wire_decode")
    if a.kind in ("int8", "hier_int8"):
        return eight
    if a.kind == "int4" or (a.kind == "hier_int4" and a.intra != "int8"):
        return four
    if a.kind == "hier_int4":
        return eight + four
    if a.kind == "auto":
        return eight + four + wire16
    if a.kind in ("cerar", "ring", "hier_cerar", "hier_ring") and a.transport != "float32":
        return wire16
    return ()


def enable_fused(a, device, say_it: bool = True) -> dict[str, float]:
    """Compile and switch on `fused_kernels(a)` for ``device`` (`cerar.formats.fused.enable`, which says in one line
    what
    it compiles and how long that may take; ``say_it`` false: rank 0 says it for all); before the first
    collective, so no rank compiles inside one. A kernel left eager is logged at WARNING on every rank."""
    kernels = fused_kernels(a)
    if not kernels:
        return {}
    import cerar.formats.fused

    return cerar.formats.fused.enable(device, int(a.block), kernels, say=None if say_it else lambda line: None)


def build_quantized_aggregator(cfg, world_size: int) -> Aggregator:
    """aggregator=int8 or hier_int8 (the layout as for hier_ring: aggregator.local_size or LOCAL_WORLD_SIZE)."""
    a, timeout = cfg.aggregator, float(cfg.trainer.collective_timeout_s)
    fed = bool(getattr(a, "error_feedback", False))
    if a.kind == "int8":
        return QuantizedAggregator(world_size, timeout, int(a.block), error_feedback=fed)
    return HierarchicalQuantizedAggregator(world_size, timeout, node_layout(cfg, world_size), int(a.block),
                                           error_feedback=fed)  # fmt: skip
