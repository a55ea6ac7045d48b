#!/usr/bin/env python3
"""Every aggregator on one plane: bytes a rank sends per call against the worst rank's aggregation error.

Run under torchrun (N ranks on gloo):

    .venv/bin/torchrun --standalone --nproc_per_node=4 scripts/bench/aggregator_plane.py

The model (model=tiny on the embedded corpus, as in scripts/studies/run_fidelity.sh) trains with exact
all-reduce; every `--every` steps each rank's real gradient g_r is averaged by every flat aggregator
(nccl, ring, fp16, bf16, CERAR per construction and c, the 8-bit int8 at block sizes 64, 128, 256 and
hier_int8 on nodes of 2 ranks, the exact ring and CERAR over float16/bfloat16 messages, the 16-bit exact
hierarchy on nodes of 2 ranks, the 4-bit int4 rotated or not and hier_int4 with 8-bit or exact sums inside a
node) from the same starting point, and the result
is compared with the exact mean g_bar: error = max over ranks of ||g_hat_r - g_bar|| / ||g_bar||, and per
parameter tensor, as Adam sees it (train/aggregation/tensor_errors.py): each tensor's error against its own SGD noise,
rho_t = ||g_hat_r,t - g_bar_t|| / sigma_t, worst rank.
PowerSGD exists only as a DDP hook with error feedback, so it is measured in a second pass that
trains with it, comparing the hook's result with an exact all-reduce of the same step's gradients.
Bytes are what the aggregator reports having sent for the whole gradient (d values).

``--only LABEL,...`` measures a subset (issue 54's 4-bit rows: ``--only nccl,int8_b128,hier_int8_g2,int4_b128,
int4_b128_unrotated,hier_int4_g2,hier_int4_g2_exact_inside --csv reports/data/aggregator_plane_int4.csv``).

Writes ``reports/data/aggregator_plane.csv`` (one row per aggregator; `tensor_error_to_noise_*` its worst tensor's
rho, `worst_tensor` which) and ``reports/data/aggregator_plane_tensors.csv`` (one row per aggregator and tensor:
rho_t's median and max over the measured steps); ``scripts/reporting/make_figures.py --only fidelity`` draws them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COMMON = ["model=tiny", "data=embedded", "data.seq_len=64", "trainer.micro_batch_size=4", "wandb.mode=disabled"]
FLAT_SETTINGS = [  # (label, overrides)
    ("nccl", ["aggregator=nccl"]),
    ("ring", ["aggregator=ring"]),
    ("fp16", ["aggregator=fp16"]),
    ("bf16", ["aggregator=bf16"]),
    *[
        (f"cerar_{construction}_c{c}", [f"aggregator=cerar_{construction}", f"c={c}"])
        for construction in ("perturbation", "optimized")
        for c in (8, 16, 32)
    ],
    ("cerar_exact_c4", ["aggregator=cerar", "aggregator.construction=exact", "c=4"]),
]
# issue 25: the 8-bit all-reduce (cerar.int8.all_reduce) at three block sizes, and on two tiers of 2 ranks per node
FLAT_SETTINGS += [
    *[(f"int8_b{block}", ["aggregator=int8", f"aggregator.block={block}"]) for block in (64, 128, 256)],
    ("hier_int8_g2", ["aggregator=hier_int8", "aggregator.local_size=2"]),
]
# issue 25: 16-bit messages with float32 arithmetic (cerar.formats.wire): the exact ring, CERAR at c = N+1, N+2, 2N
# and 4N on
# N=4 (codes the 16-bit rule refuses are skipped and named), and the 16-bit exact hierarchy on nodes of 2 ranks
FLAT_SETTINGS += [
    *[
        (f"ring_{t}", ["aggregator=ring", f"aggregator.transport={dtype}"])
        for t, dtype in (("fp16", "float16"), ("bf16", "bfloat16"))
    ],
    *[
        (f"cerar_{t}_c{c}", ["aggregator=cerar", f"aggregator.transport={dtype}", f"c={c}"])
        for t, dtype in (("fp16", "float16"), ("bf16", "bfloat16"))
        for c in (5, 6, 8, 16)
    ],
    *[(f"{kind}_g2", [f"aggregator={kind}", "aggregator.local_size=2"]) for kind in ("hier_fp16", "hier_bf16")],
]
# issue 54: the 4-bit all-reduce (cerar.int4): rotated (its default) and not, stochastic (default) and nearest, and
# two tiers of 2 ranks per node with 8-bit or exact sums inside a node and 4 bits between nodes
FLAT_SETTINGS += [
    ("int4_b128", ["aggregator=int4"]),
    ("int4_b128_unrotated", ["aggregator=int4", "aggregator.rotate=false"]),
    ("hier_int4_g2", ["aggregator=hier_int4", "aggregator.local_size=2"]),
    ("hier_int4_g2_exact_inside", ["aggregator=hier_int4", "aggregator.local_size=2", "aggregator.intra=exact"]),
]
COLUMNS = ["aggregator", "bytes_per_call", "bytes_ratio_to_fp32_ring", "error_median", "error_max", "calls",
           "tensor_error_to_noise_median", "tensor_error_to_noise_max", "worst_tensor"]  # fmt: skip
TENSOR_COLUMNS = ["aggregator", "tensor", "values", "error_to_noise_median", "error_to_noise_max"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose("config", overrides=COMMON + overrides)


def worst_error(aggregated: torch.Tensor, exact: torch.Tensor) -> float:
    error = ((aggregated - exact).norm() / exact.norm()).double().reshape(1)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return float(error)


def tensor_ratios(local: torch.Tensor, aggregated: torch.Tensor, exact: torch.Tensor, layout) -> dict[str, float]:
    """Each parameter tensor's error against its own noise, worst rank (train/aggregation/tensor_errors.py)."""
    from train.aggregation.tensor_errors import per_tensor_figures

    figures = per_tensor_figures(local, aggregated, exact, layout)
    return {name: figures[f"tensor/{name}"] for name in layout.names}


def exact_mean(local: torch.Tensor) -> torch.Tensor:
    exact = local.clone()
    dist.all_reduce(exact)
    return exact.div_(dist.get_world_size())


def flat_gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def measure_flat(steps: int, every: int, only=None) -> tuple[dict[str, list], dict[str, int]]:
    """Train with exact all-reduce; every `every` steps run every flat aggregator on the same gradients."""
    from train.aggregation.build import build_aggregator
    from train.aggregation.tensor_errors import TensorLayout
    from train.data import build_data
    from train.loop import lm_loss
    from train.model import build_model

    N, rank = dist.get_world_size(), dist.get_rank()
    cfg = compose([])
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    layout = TensorLayout.of(model.named_parameters())
    data = build_data(cfg, rank, N)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.model.lr, weight_decay=cfg.model.weight_decay)
    aggregators = []
    for label, overrides in [(label, o) for label, o in FLAT_SETTINGS if not only or label in only]:
        try:
            aggregator = build_aggregator(compose(overrides), N)
        except ValueError as err:  # a code that cannot meet kappa_max at this (N, c): not on the plane
            if rank == 0:
                print(f"aggregator_plane: skipped {label}: {err}", flush=True)
            continue
        aggregator.use_tensors(list(layout.sizes))  # as the trainer tells every aggregator its tensors
        aggregators.append((label, aggregator))
    results: dict[str, list] = {label: [] for label, _ in aggregators}
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=False)
        lm_loss(model, data.train.next_batch(cfg.trainer.micro_batch_size)).backward()
        local = flat_gradient(model)
        exact = exact_mean(local)
        if step % every == 0:
            for label, aggregator in aggregators:
                aggregated = local.clone()
                sent = aggregator.aggregate(aggregated)
                results[label].append((sent, worst_error(aggregated, exact), tensor_ratios(local, aggregated, exact,
                                                                                           layout)))  # fmt: skip
        offset = 0
        for p in model.parameters():
            p.grad.copy_(exact[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
    return results, dict(zip(layout.names, layout.sizes, strict=True))


def measure_powersgd(steps: int, every: int) -> list:
    """Train under torch's PowerSGD hook; every `every` steps compare its result with the exact mean."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from train.aggregation.tensor_errors import TensorLayout
    from train.data import build_data
    from train.loop import lm_loss
    from train.model import build_model

    N, rank = dist.get_world_size(), dist.get_rank()
    cfg = compose(["aggregator=powersgd"])
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    numel = sum(p.numel() for p in model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=numel * 4 / 2**20 + 1)  # one bucket
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=cfg.aggregator.powersgd_rank,
        start_powerSGD_iter=cfg.aggregator.powersgd_start_iter,
    )
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    layout = TensorLayout.of(model.named_parameters())
    data = build_data(cfg, rank, N)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.model.lr, weight_decay=cfg.model.weight_decay)
    compressed = sum((p.shape[0] + p[0].numel()) * cfg.aggregator.powersgd_rank if p.dim() >= 2 else p.numel()
                     for p in model.parameters())  # fmt: skip
    results = []
    for step in range(1, steps + 1):
        batch = data.train.next_batch(cfg.trainer.micro_batch_size)
        exact = None
        if step % every == 0 and step > cfg.aggregator.powersgd_start_iter:
            optimizer.zero_grad(set_to_none=False)
            with ddp.no_sync():
                lm_loss(ddp, batch).backward()
            exact = exact_mean(flat_gradient(model))
        local = None
        if exact is not None:
            local = flat_gradient(model).clone()
        optimizer.zero_grad(set_to_none=False)
        lm_loss(ddp, batch).backward()
        if exact is not None:
            # P and Q factors of every matrix (rank r) plus the vectors, all-reduced: ring bytes of that many floats
            aggregated = flat_gradient(model)
            results.append((2 * (N - 1) * compressed * 4 // N, worst_error(aggregated, exact),
                            tensor_ratios(local, aggregated, exact, layout)))  # fmt: skip
        optimizer.step()
    return results


def write_csvs(results: dict[str, list], sizes: dict[str, int], path: Path, tensors_path: Path) -> None:
    """The plane (one row per aggregator) and its tensors (one row per aggregator and tensor)."""
    fp32_ring = results["ring" if "ring" in results else "nccl"][0][0]  # the same bytes: 2 (N - 1) / N d float32
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f, open(tensors_path, "w", newline="") as g:
        writer, per_tensor = csv.writer(f), csv.writer(g)
        writer.writerow(COLUMNS)
        per_tensor.writerow(TENSOR_COLUMNS)
        for label, calls in results.items():
            sent = statistics.median(s for s, _, _ in calls)
            errors = [e for _, e, _ in calls]
            worst = [max(ratios.values()) for _, _, ratios in calls]
            names = list(calls[0][2])
            by_tensor = {name: [ratios[name] for _, _, ratios in calls] for name in names}
            top = max(names, key=lambda name: max(by_tensor[name]))
            writer.writerow([label, sent, f"{sent / fp32_ring:.4f}", f"{statistics.median(errors):.4g}",
                             f"{max(errors):.4g}", len(calls), f"{statistics.median(worst):.4g}",
                             f"{max(worst):.4g}", top])  # fmt: skip
            for name in names:
                rho = by_tensor[name]
                per_tensor.writerow([label, name, sizes[name], f"{statistics.median(rho):.4g}", f"{max(rho):.4g}"])
    print(f"wrote {path} and {tensors_path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--csv", type=Path, default=ROOT / "reports" / "data" / "aggregator_plane.csv")
    ap.add_argument("--only", default="", help="comma-separated labels: measure only these (PowerSGD's pass skipped)")
    args = ap.parse_args(argv)
    only = [label for label in args.only.split(",") if label]
    if only and not {"ring", "nccl"} & set(only):
        ap.error("--only: include ring or nccl (the bytes ratio's reference)")
    unknown = sorted(set(only) - {label for label, _ in FLAT_SETTINGS})
    if unknown:
        ap.error(f"--only: unknown labels {unknown}; the labels are {[label for label, _ in FLAT_SETTINGS]}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dist.init_process_group("gloo")
    try:
        results, sizes = measure_flat(args.steps, args.every, only)
        if not only:
            results["powersgd"] = measure_powersgd(args.steps, args.every)
        if dist.get_rank() == 0:
            write_csvs(results, sizes, args.csv, args.csv.with_name(args.csv.stem + "_tensors.csv"))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
