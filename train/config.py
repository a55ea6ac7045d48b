"""The one typed configuration object of a training run, and its validation.

The dataclasses below are registered in Hydra's ConfigStore as the schema of `configs/config.yaml`,
so every YAML file and every command-line override is merged into typed fields: an unknown key
(a typo) or a value of the wrong type stops the run while Hydra composes the config, before any
process group exists. `validate()` adds the checks types cannot express (c >= 1, kappa_max >= 1,
a local data folder that exists, ...) and raises `ConfigError` with one message naming the field.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class UserError(Exception):
    """A problem with what the user asked for (config, run directory): reported as one line, no traceback."""


class ConfigError(UserError, ValueError):
    """An invalid configuration value; the message names the offending field."""


@dataclass
class ModelConfig:
    """A GPTNeoX architecture and the optimiser settings Pythia used for that size."""

    name: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_heads: int = MISSING
    intermediate_size: int | None = None  # None: 4 * hidden_size, as in Pythia
    vocab_size: int = 50304
    max_position_embeddings: int = 2048
    rotary_pct: float = 0.25
    rotary_emb_base: int = 10000
    use_parallel_residual: bool = True
    tie_word_embeddings: bool = False
    layer_norm_eps: float = 1e-5
    # initialisation, GPT-NeoX's names as in the released configs: small_init = normal(0, sqrt(2/(5 d))) for
    # embeddings and weight matrices; wang_init = normal(0, 2/(L sqrt(d))) for the residual-writing projections
    # (attention.dense, mlp.dense_4h_to_h); normal = HF's normal(0, 0.02). Biases 0, LayerNorm weight 1.
    init_method: str = "small_init"
    output_layer_init_method: str = "wang_init"
    # optimiser, as in EleutherAI's released models/<size>/pythia-<size>.yml: Adam betas 0.9/0.95, eps 1e-8,
    # weight decay 0.1 (the paper's table says 0.01, a typo: EleutherAI/pythia issue 132), clip 1.0,
    # 1% warmup, cosine to lr/10 (min_lr)
    lr: float = MISSING
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.01
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class DataConfig:
    """Where tokens come from. `kind` picks the loader: embedded, pile or local."""

    name: str = MISSING
    kind: str = MISSING  # embedded | pile | local
    seq_len: int = 128
    cache_dir: str = "${oc.env:CERAR_PYTHIA_CACHE,'~/.cache/cerar-pythia'}"
    # how long a rank waits for the cache lock's holder to show a sign of life (it rewrites the lock file every few
    # seconds while it builds) before it stops with one line naming the holder: a peer stopped while building
    cache_lock_timeout_s: float = 120.0
    # embedded / local: a byte-level BPE tokenizer trained on the training text on first use
    bpe_vocab_size: int = 8192
    val_fraction: float = 0.05  # the last documents (embedded/local) form the fixed validation split
    # local: a folder of .txt (one document per file) and .jsonl (one {"text": ...} per line) files
    path: str | None = None
    # pile: a Hugging Face dataset read with streaming
    dataset: str = "monology/pile-uncopyrighted"
    dataset_config: str | None = None
    data_files: str | None = None  # e.g. a local jsonl with dataset=json
    val_data_files: str | None = None  # with data_files: the files of the validation split
    train_split: str = "train"
    val_split: str = "validation"
    text_field: str = "text"
    tokenizer: str = "EleutherAI/gpt-neox-20b"  # a hub name or a local directory (pile only)
    val_docs: int = 200  # documents of the validation split kept as the fixed validation set


@dataclass
class LinksConfig:
    """aggregator=auto's declared links (every field null: measure them at start). Seconds per round and Gbit/s
    per direction of one link, per tier; GB/s at which the arithmetic streams; NICs per node (null: 1)."""

    intra_alpha_s: float | None = None
    intra_gbit_s: float | None = None
    inter_alpha_s: float | None = None
    inter_gbit_s: float | None = None
    memory_gbyte_s: float | None = None
    nics_per_node: int | None = None


@dataclass
class AggregatorConfig:
    """How gradients are summed across replicas.

    kind: nccl (torch.distributed.all_reduce on the job's backend: gloo on CPU, NCCL on GPU),
    ring (cerar's exact ring), cerar (coded approximate ring), powersgd, fp16, bf16; on nodes of several
    ranks, hier_cerar (cerar.hierarchical: exact inside each node, CERAR with a code for the nodes between
    them) and hier_ring (the same tiers with the exact ring between the nodes).
    int8 (cerar.int8.all_reduce: 8-bit messages, one float32 scale per `block` values, every rank the same
    result) and hier_int8 (exact inside each node, int8 between the nodes); int4 (cerar.int4.all_reduce: 4-bit
    messages, blocks rotated) and hier_int4 (8-bit or exact inside each node, int4 between the nodes).
    """

    name: str = MISSING
    kind: str = MISSING
    construction: str = "optimized"  # cerar: exact | vandermonde | perturbation | optimized (reports/fidelity.md)
    eps: float | None = None
    kappa_max: float | None = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2
    # c=auto (cerar, overlap=false; train/aggregation/auto_c.py): the c with the fewest bytes whose worst-rank error
    # on the
    # run's own gradients is at most error_budget x the SGD noise of the averaged gradient. Chosen at step
    # auto_warmup_steps (exact aggregation, c=N, until then), re-checked every auto_check_every steps (0: never),
    # moving only to smaller c. Candidates: auto_candidates, or null: every c in (N, 4N] that saves bytes and is
    # not beaten on bytes and predicted error by another. Errors are measured on about auto_sample_values values
    # of each rank's gradient per candidate (0: all of them). Default budget 0.01: reports/fidelity.md, auto_c.py.
    error_budget: float = 0.01
    auto_warmup_steps: int = 100
    auto_check_every: int = 100
    auto_candidates: list[int] | None = None
    auto_sample_values: int = 65536
    # hier_cerar / hier_ring: ranks per node (null: torchrun's LOCAL_WORLD_SIZE, i.e. --nproc_per_node); c is
    # for n = N / local_size nodes. On 2 nodes hier_cerar runs the exact ring between them (CERAR would send
    # the same d bytes per node and add its error) unless coded_on_two_nodes=true.
    local_size: int | None = None
    coded_on_two_nodes: bool = False
    # int8 / hier_int8 (cerar.int8.all_reduce, docs/int8.md): values per float32 scale of the 8-bit messages (>= 1);
    # 128: the scales cost 3% of the int8 payload, the messages 0.258 of float32's bytes
    block: int = 128
    # int4 / hier_int4 (cerar.int4, docs/int4.md): rotate each full block (random signs from the seed, Walsh-Hadamard)
    # before rounding to 4 bits (block a power of two); hier_int4's reduce-scatter inside a node: int8 or exact
    rotate: bool = True
    intra: str = "int8"
    # int8, hier_int8, int4, hier_int4 (and auto's candidates of those kinds, named *_ef): error feedback
    # (cerar.int4.feedback, docs/int4.md): each rank adds to what it sends what its last messages' rounding dropped;
    # the residuals (overlap: per DDP bucket) are checkpointed per rank. Judged per tensor over windows of
    # feedback_window consecutive steps (null: 10 steps under feedback, no windows without;
    # train/aggregation/feedback_window.py), which need trainer.measure_error_every 0, 1 or a multiple M of the
    # window (the window ending at each multiple of M measured, whole).
    error_feedback: bool = False
    feedback_window: int | None = None
    # cerar, ring, hier_cerar, hier_ring: the dtype their messages travel in (cerar.formats.wire; docs/cerar-16bit.md):
    # float32, or float16 / bfloat16: 16-bit messages (each with a power-of-two scale), float32 arithmetic.
    # With 16 bits, kappa_max null means cerar.default_kappa_max(transport), and the code must be admissible.
    transport: str = "float32"
    # cerar, hier_cerar (and aggregator=auto's CERAR candidates): scale each parameter tensor to a common root mean
    # square by powers of two agreed across ranks before coding, and back after (cerar.ring.equilibrate), so that each
    # tensor's error is relative to its own size: CERAR mixes the components of a column, and a tensor 100x smaller
    # than its column-mates otherwise takes 100x its share (issue 33). false: one scale for all, as before.
    equilibrate: bool = True
    # int8 / hier_int8 / 16-bit transport (and aggregator=auto, whose candidates use both): compile the fused
    # quantize and 16-bit encode kernels (cerar.formats.fused, docs/arithmetic.md) at start, before the process group,
    # and use them where they match the eager reference byte for byte; false, or CERAR_FUSED=0: the eager
    # arithmetic. Compiling takes seconds from inductor's cache, minutes the first time on a small CPU (said).
    fused: bool = True
    # auto (train/aggregation/auto_aggregator.py, docs/auto.md): the fastest candidate whose worst-rank error on the
    # run's own
    # gradients is at most error_budget x the noise, on the links measured at start (or declared in auto_links:
    # intra_alpha_s, intra_gbit_s, inter_alpha_s, inter_gbit_s, memory_gbyte_s, nics_per_node); warm-up, checks
    # and sample as c=auto's fields above. auto_aggregators: the candidate families to keep (null: all;
    # FAMILIES below), the exact ones always kept. auto_trials: how many fitting candidates (the
    # model's fastest) a decision times by their real call beside the exact one, auto_trial_calls timed calls
    # each (auto_trials 0: the model alone decides).
    auto_aggregators: list[str] | None = None
    auto_trials: int = 3
    auto_trial_calls: int = 2
    auto_links: LinksConfig = field(default_factory=lambda: LinksConfig())


@dataclass
class TrainerConfig:
    """The loop: steps, batch, precision, evaluation and the diagnostics of approximate aggregation."""

    max_steps: int = 300
    micro_batch_size: int = 8  # sequences per rank per micro-step
    # sequences per optimizer step over all ranks (Pythia: 1024). null: micro_batch_size x grad_accum x N.
    # When set, grad_accum is derived from it as global_batch_size / (micro_batch_size x N).
    global_batch_size: int | None = None
    grad_accum: int = 1  # micro-steps per optimizer step (derived when global_batch_size is set)
    overlap: bool | None = None  # None: false (the paper's measurement) unless the aggregator is hook-only
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16 | fp16 (autocast + loss scale)
    # fp16's dynamic loss scale, Pythia's (DeepSpeed) settings: start at 2^12, double after 1000 steps without
    # overflow, halve on overflow after `hysteresis` overflows, never below 1 (train/loss_scale.py)
    fp16_initial_scale_power: int = 12
    fp16_loss_scale_window: int = 1000
    fp16_hysteresis: int = 2
    fp16_min_loss_scale: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4  # micro-batches per rank in one evaluation
    log_every: int = 1
    drift_every: int = 10
    measure_error_every: int = 0
    resync_every: int = 0  # 0: never; k: every k steps broadcast parameters from rank N-1
    collective_timeout_s: float = 300.0
    progress_bar: bool = True
    # torch.compile of the model: None = on for CUDA, off elsewhere (engineer `trainer` implements it; this branch
    # has the field only, so that scripts/bench/gpu can pass trainer.compile=true|false)
    compile: bool | None = None
    # model FLOPs utilisation (`mfu` in metrics): the device's peak dense TFLOP/s at the run's precision.
    # null: looked up by GPU name (train/metrics.py KNOWN_PEAK_TFLOPS: A100, H100, H200, ...); none on CPU.
    peak_tflops: float | None = None
    bucket_cap_mb: float | None = None  # DDP bucket size, MiB (overlap=true); None: torch's 25, CERAR's own for cerar
    stop_after_step: int = 0  # >0: end this launch after that step, unfinished (simulates a preemption)
    # Fault injection, a testing/chaos tool only: at step k (>0) rank `inject_nonfinite_rank` turns one of its
    # gradients into inf before the non-finite check (tests/test_reliability.py, scripts/checks/chaos.py).
    inject_nonfinite_at_step: int = 0
    inject_nonfinite_rank: int = 0
    # torch.compile of the model (train/compiling.py, docs/training.md): null = on for CUDA, off on CPU. Each
    # transformer layer is compiled in place (one graph, reused by every layer; the checkpoint's keys are unchanged)
    # and the loss apart; compiled once before the first step, outside any collective, the ranks then waiting for each
    # other up to compile_timeout_s. A compile that fails leaves the model eager, said in one line.
    compile: bool | None = None
    # torch.compile's backend: inductor (fused kernels: Triton on a GPU, C++ on a CPU); eager or aot_eager trace
    # only (dynamo's graphs run torch's own operations, the eager numbers: the tests' way to exercise the path fast)
    compile_backend: str = "inductor"
    compile_timeout_s: float = 1800.0


@dataclass
class CheckpointConfig:
    every: int = 100  # 0: no periodic checkpoints
    keep: int = 2
    at_end: bool = True
    # how long the other ranks wait for rank N-1 to write a checkpoint: a large model's write can take far
    # longer than trainer.collective_timeout_s, which bounds every other wait
    write_timeout_s: float = 1800.0


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "cerar-pythia"
    entity: str | None = None
    group: str | None = None  # None: derived from model, data, aggregator, c and N
    tags: list[str] = field(default_factory=list)
    # the longest W&B's start (wandb.init) and close (finish: online, the upload) may take on rank 0; the other
    # ranks wait that long (+ T) at the barrier that follows each. Past it: one line naming W&B and its mode, exit 3
    start_timeout_s: float = 300.0
    close_timeout_s: float = 600.0


@dataclass
class TrainConfig:
    """The root config: `c` and `seed` at the top so that `c=16` works as an override."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    aggregator: AggregatorConfig = MISSING
    c: int | str = 16  # an integer, or "auto" (aggregator=cerar: the trainer chooses; aggregator.error_budget)
    seed: int = 1234
    resume: str = "auto"  # auto | true | false
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


AGGREGATOR_KINDS = ("nccl", "ring", "cerar", "powersgd", "fp16", "bf16", "hier_cerar", "hier_ring")
HIERARCHICAL_KINDS = ("hier_cerar", "hier_ring")
HIERARCHICAL_FIELDS = ("local_size", "coded_on_two_nodes")  # in a run's identity only for the hierarchical kinds
HOOK_ONLY_AGGREGATORS = ("powersgd",)
AUTO_C = "auto"  # c=auto: train/aggregation/auto_c.py
NOT_TRAINING_DATA_FIELDS = (("data", "cache_dir"), ("data", "cache_lock_timeout_s"))  # where and how long to wait
AUTO_C_FIELDS = ("error_budget", "auto_warmup_steps", "auto_check_every", "auto_candidates", "auto_sample_values")
CERAR_CONSTRUCTIONS = ("exact", "vandermonde", "perturbation", "optimized")
TRANSPORT_KINDS = ("ring", "cerar", "hier_cerar", "hier_ring")  # the aggregators that take aggregator.transport
TRANSPORT_DTYPES = ("float32", "float16", "bfloat16")  # cerar.formats.wire.TRANSPORTS
PRESET_TRANSPORTS = {"hier_fp16": "float16", "hier_bf16": "bfloat16"}  # presets whose name says their transport
DATA_KINDS = ("embedded", "pile", "local")
INIT_METHODS = ("small_init", "wang_init", "normal")  # GPT-NeoX's names (init_functions.py); train/model.py
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # trainer.compile_backend: torch.compile's, train/compiling.py

# The 8-bit all-reduce (cerar.int8.all_reduce, issue 25): int8 flat, hier_int8 on the two tiers (layout as hier_ring)
QUANTIZED_KINDS = ("int8", "hier_int8")
QUANTIZED_FIELDS = ("block",)  # in a run's identity only for the quantized kinds (older runs' identities unchanged)
AGGREGATOR_KINDS = (*AGGREGATOR_KINDS, *QUANTIZED_KINDS)
HIERARCHICAL_KINDS = (*HIERARCHICAL_KINDS, "hier_int8")

# The 4-bit all-reduce (cerar.int4, issue 54): int4 flat, hier_int4 on the two tiers (8 or 32 bits inside a node)
INT4_KINDS = ("int4", "hier_int4")
INT4_FIELDS = ("rotate", "intra")  # in a run's identity only for the 4-bit kinds (older runs' identities unchanged)
INT4_DEFAULTS = {"rotate": True, "intra": "int8"}  # AggregatorConfig's: aggregator=auto's identity names the others
INTRA_METHODS = ("exact", "int8")  # cerar.int4.two_tier.INTRA_METHODS
QUANTIZED_KINDS = (*QUANTIZED_KINDS, *INT4_KINDS)  # aggregator.block: values per scale of their messages too
AGGREGATOR_KINDS = (*AGGREGATOR_KINDS, *INT4_KINDS)
HIERARCHICAL_KINDS = (*HIERARCHICAL_KINDS, "hier_int4")
FEEDBACK_KINDS = ("int8", "hier_int8", "int4", "hier_int4")  # aggregator.error_feedback: each rank's own roundings
DEFAULT_FEEDBACK_WINDOW = 10
"""Steps per window under error feedback when `aggregator.feedback_window` is null: 1 / (1 - beta1) at Adam's 0.9
(train/aggregation/feedback_window.py)."""
NOT_TRAINING_AGGREGATOR_FIELDS = ("feedback_window",)  # what a run records of its aggregates, not what it trains

# aggregator=auto (issue 28): chooses among the others from measured noise and measured links
AUTO_KIND = "auto"
# in a run's identity only for aggregator=auto
FAMILIES = ("ring16", "int8", "cerar", "cerar16", "hier_ring16", "hier_int8", "hier_cerar", "hier_cerar16", "int4",
            "hier_int4")
"""What aggregator.auto_aggregators may keep: the cost model's names of aggregator=auto's candidate families
(train/aggregation/auto_choice.py builds them; the exact ones are always kept)."""

AUTO_FIELDS = ("auto_aggregators", "auto_links", "auto_trials", "auto_trial_calls")
EQUILIBRATE_KINDS = ("cerar", "hier_cerar", "auto")  # the aggregators aggregator.equilibrate acts on
AGGREGATOR_KINDS = (*AGGREGATOR_KINDS, AUTO_KIND)


def register_configs() -> None:
    """Make TrainConfig the schema of configs/config.yaml (its defaults list names `train_schema`)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(value: str, allowed: tuple[str, ...], name: str) -> None:
    _require(value in allowed, f"{name}={value!r} is not one of {', '.join(allowed)}")


def validate(cfg: DictConfig | TrainConfig, world_size: int | None = None) -> None:
    """Check what the types cannot; raise ConfigError naming the first bad field. No side effects."""
    m, d, a, t, ck = cfg.model, cfg.data, cfg.aggregator, cfg.trainer, cfg.checkpoint
    if isinstance(cfg.c, str):
        _require(cfg.c == AUTO_C, f"c={cfg.c!r} must be an integer >= 1 or auto")
    else:
        _require(cfg.c >= 1, f"c={cfg.c} must be >= 1 (the number of gradient components)")
    _one_of(normalise_resume(cfg.resume), ("auto", "true", "false"), "resume")
    # model
    _require(m.num_layers >= 1, f"model.num_layers={m.num_layers} must be >= 1")
    _require(
        m.hidden_size % m.num_heads == 0,
        f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads}",
    )
    for key in ("init_method", "output_layer_init_method"):
        _one_of(m[key], INIT_METHODS, f"model.{key}")
    _require(m.lr > 0, f"model.lr={m.lr} must be > 0")
    _require(0 <= m.warmup_fraction < 1, f"model.warmup_fraction={m.warmup_fraction} must be in [0, 1)")
    _require(0 <= m.min_lr_ratio <= 1, f"model.min_lr_ratio={m.min_lr_ratio} must be in [0, 1]")
    _require(m.grad_clip >= 0, f"model.grad_clip={m.grad_clip} must be >= 0 (0 disables clipping)")
    # data
    _one_of(d.kind, DATA_KINDS, "data.kind")
    _require(
        2 <= d.seq_len <= m.max_position_embeddings,
        f"data.seq_len={d.seq_len} must be in [2, model.max_position_embeddings={m.max_position_embeddings}]",
    )
    _require(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _require(d.cache_lock_timeout_s > 0, f"data.cache_lock_timeout_s={d.cache_lock_timeout_s} must be > 0")
    if d.kind in ("embedded", "local"):
        _require(
            256 < d.bpe_vocab_size <= m.vocab_size,
            f"data.bpe_vocab_size={d.bpe_vocab_size} must be in (256, model.vocab_size={m.vocab_size}]",
        )
    if d.kind == "local":
        _require(d.path is not None, "data.path is required for data=local (a folder of .txt/.jsonl files)")
        folder = Path(os.path.expanduser(d.path))
        _require(folder.is_dir(), f"data.path={d.path} is not an existing folder")
        _require(
            any(p.suffix in (".txt", ".jsonl") for p in folder.rglob("*")),
            f"data.path={d.path} holds no .txt or .jsonl files",
        )
    if d.kind == "pile":
        _require_zstandard_for(d)
    if d.kind == "pile" and d.dataset in ("json", "text", "csv", "parquet"):  # HF's loaders of local files
        for key in ("data_files", "val_data_files"):
            files = d[key]
            if files and "://" not in str(files):  # a local file or glob must match something
                _require(bool(glob.glob(os.path.expanduser(str(files)))), f"data.{key}={files} matches no file")
    # aggregator
    _one_of(a.kind, AGGREGATOR_KINDS, "aggregator.kind")
    if a.kind in ("cerar", "hier_cerar"):
        _one_of(a.construction, CERAR_CONSTRUCTIONS, "aggregator.construction")
        _require(
            a.kappa_max is None or a.kappa_max >= 1,
            f"aggregator.kappa_max={a.kappa_max} must be >= 1 (a condition number) or null",
        )
        _require(a.eps is None or 0 < a.eps < 1, f"aggregator.eps={a.eps} must lie in (0, 1) or be null")
    if a.kind in QUANTIZED_KINDS:
        _require(a.block >= 1, f"aggregator.block={a.block} must be >= 1 (values per scale of the 8-bit messages)")
    if a.kind in INT4_KINDS:
        _validate_int4(a)
    _validate_feedback(cfg)
    equilibrate = getattr(a, "equilibrate", True)
    _require(isinstance(equilibrate, bool), f"aggregator.equilibrate={equilibrate!r} must be true or false")
    _validate_transport(cfg)
    if cfg.c == AUTO_C:
        _validate_auto_c(cfg)
    if a.kind == AUTO_KIND:
        _validate_auto_aggregator(cfg)
    if a.kind == "powersgd":
        _require(a.powersgd_rank >= 1, f"aggregator.powersgd_rank={a.powersgd_rank} must be >= 1")
    if a.kind in HOOK_ONLY_AGGREGATORS:
        _require(
            t.overlap is not False,
            f"aggregator={a.name} is a DDP communication hook only; it needs trainer.overlap=true",
        )
    # trainer
    for key in ("max_steps", "micro_batch_size", "grad_accum", "eval_batches", "log_every"):
        _require(t[key] >= 1, f"trainer.{key}={t[key]} must be >= 1")
    for key in (
        "eval_every",
        "drift_every",
        "measure_error_every",
        "resync_every",
        "stop_after_step",
        "inject_nonfinite_at_step",
    ):
        _require(t[key] >= 0, f"trainer.{key}={t[key]} must be >= 0 (0 disables it)")
    if t.global_batch_size is not None:
        _require(t.global_batch_size >= 1, f"trainer.global_batch_size={t.global_batch_size} must be >= 1")
        if world_size is not None:
            derived_grad_accum(cfg, world_size)  # raises when the sizes do not divide
    _one_of(t.device, ("auto", "cpu", "cuda"), "trainer.device")
    _one_of(t.precision, ("auto", "fp32", "bf16", "fp16"), "trainer.precision")
    for key in ("fp16_loss_scale_window", "fp16_hysteresis"):
        _require(t[key] >= 1, f"trainer.{key}={t[key]} must be >= 1")
    _require(t.fp16_min_loss_scale > 0, f"trainer.fp16_min_loss_scale={t.fp16_min_loss_scale} must be > 0")
    if t.inject_nonfinite_at_step and world_size is not None:
        _require(
            0 <= t.inject_nonfinite_rank < world_size,
            f"trainer.inject_nonfinite_rank={t.inject_nonfinite_rank} must be a rank in [0, {world_size})",
        )
    _require(
        t.bucket_cap_mb is None or t.bucket_cap_mb > 0,
        f"trainer.bucket_cap_mb={t.bucket_cap_mb} must be > 0 (MiB) or null",
    )
    _require(t.collective_timeout_s > 0, f"trainer.collective_timeout_s={t.collective_timeout_s} must be > 0")
    _one_of(t.compile_backend, COMPILE_BACKENDS, "trainer.compile_backend")
    _require(t.compile_timeout_s > 0, f"trainer.compile_timeout_s={t.compile_timeout_s} must be > 0")
    _require(ck.every >= 0, f"checkpoint.every={ck.every} must be >= 0")
    _require(ck.keep >= 1, f"checkpoint.keep={ck.keep} must be >= 1")
    _require(ck.write_timeout_s > 0, f"checkpoint.write_timeout_s={ck.write_timeout_s} must be > 0")
    _one_of(cfg.wandb.mode, ("offline", "online", "disabled"), "wandb.mode")
    for key in ("start_timeout_s", "close_timeout_s"):
        _require(cfg.wandb[key] > 0, f"wandb.{key}={cfg.wandb[key]} must be > 0")
    if world_size is not None and a.kind == "cerar":
        _validate_cerar_code(cfg, world_size)
    if a.kind in HIERARCHICAL_KINDS:
        _validate_hierarchical(cfg, world_size)


def _require_zstandard_for(d) -> None:
    """The Pile ships as .jsonl.zst; `datasets` needs the zstandard package to read it."""
    files = f"{d.data_files or ''} {d.val_data_files or ''}"
    if ".zst" not in files and "pile" not in d.dataset.lower():
        return
    try:
        import zstandard  # noqa: F401
    except ImportError:
        what = f"data.data_files={d.data_files}" if ".zst" in files else f"data.dataset={d.dataset}"
        raise ConfigError(
            f"{what} is read from .zst files, which needs the zstandard package: pip install zstandard"
        ) from None


def _validate_int4(a, who: str = "") -> None:
    """aggregator.rotate needs a block that is a power of two (the fast transform); aggregator.intra one of
    INTRA_METHODS (hier_int4, and auto's hier_int4 candidate). `who`: the error's prefix (auto's candidates)."""
    _require(isinstance(a.rotate, bool), f"{who}aggregator.rotate={a.rotate!r} must be true or false")
    _require(
        not a.rotate or a.block & (a.block - 1) == 0,
        f"{who}aggregator.block={a.block} must be a power of two to be rotated (aggregator.rotate=false for another "
        "size)",
    )
    if a.kind in ("hier_int4", AUTO_KIND):
        _one_of(a.intra, INTRA_METHODS, f"{who}aggregator.intra")


def _validate_feedback(cfg) -> None:
    """aggregator.error_feedback: for the aggregators whose every rounding is a rank's own message (FEEDBACK_KINDS),
    flat or overlapped (their DDP hooks keep the residuals per bucket), and for aggregator=auto's candidates of those
    kinds; judged over windows of consecutive measured steps (aggregator.feedback_window >= 1)."""
    a, t = cfg.aggregator, cfg.trainer
    fed, window = getattr(a, "error_feedback", False), getattr(a, "feedback_window", None)
    _require(isinstance(fed, bool), f"aggregator.error_feedback={fed!r} must be true or false")
    _require(window is None or window >= 1, f"aggregator.feedback_window={window} must be >= 1 (steps) or null")
    if fed and a.kind == AUTO_KIND:  # its quantized candidates fed back (train/aggregation/auto_choice.py `fed`)
        keep = a.auto_aggregators
        _require(
            keep is None or bool(set(keep) & set(FEEDBACK_KINDS)),
            f"aggregator=auto aggregator.error_feedback=true feeds back its {', '.join(FEEDBACK_KINDS)} candidates; "
            f"aggregator.auto_aggregators={list(keep or [])} keeps none of them",
        )
    elif fed:
        _require(
            a.kind in FEEDBACK_KINDS,
            f"aggregator.error_feedback=true is built for {', '.join(FEEDBACK_KINDS)} and aggregator=auto's (each rank "
            f"keeps the residual of the messages it rounds itself); aggregator={a.name}'s error is not a rank's own "
            "rounding",
        )
    steps = feedback_window_steps(a)
    if steps is not None:
        every = t.measure_error_every
        _require(
            every in (0, 1) or (every > 0 and every % steps == 0),
            f"trainer.measure_error_every={every}: error feedback is judged over windows of {steps} consecutive "
            "steps (aggregator.feedback_window), so every step is measured (1), none (0), or, at a multiple M of "
            f"{steps}, the window that ends at each multiple of M (e.g. M = {10 * steps})",
        )


def feedback_window_steps(a) -> int | None:
    """Steps per window of aggregator config ``a`` (train/aggregation/feedback_window.py): aggregator.feedback_window,
    or DEFAULT_FEEDBACK_WINDOW under aggregator.error_feedback when it is null; None (no windows) without either."""
    window = getattr(a, "feedback_window", None)
    if window is None and getattr(a, "error_feedback", False):
        return DEFAULT_FEEDBACK_WINDOW
    return None if window is None else int(window)


def _validate_transport(cfg) -> None:
    """aggregator.transport: one of TRANSPORT_DTYPES, and other than float32 only where the aggregator takes it."""
    a = cfg.aggregator
    _one_of(a.transport, TRANSPORT_DTYPES, "aggregator.transport")
    _require(
        a.transport == "float32" or a.kind in TRANSPORT_KINDS,
        f"aggregator.transport={a.transport} is for {', '.join(TRANSPORT_KINDS)} (got aggregator={a.name}; "
        "aggregator=fp16 / bf16 are torch's 16-bit all-reduce)",
    )
    _require(
        a.transport == "float32" or cfg.c != AUTO_C,
        f"c=auto measures its candidates in float32 and does not model aggregator.transport={a.transport}'s "
        "rounding: set c (e.g. c=5 for 4 ranks; docs/cerar-16bit.md)",
    )


def code_kappa_max(a, transport: str | None = None) -> float | None:
    """The kappa_max the aggregator's codes are built with: aggregator.kappa_max, else (16-bit transport, eps
    unset) cerar.default_kappa_max(transport), else null (cerar's default). `transport`: aggregator.transport
    unless given (aggregator=auto's candidates each have their own)."""
    transport = a.transport if transport is None else transport
    if a.kappa_max is None and a.eps is None and transport != "float32":
        import cerar

        return cerar.default_kappa_max(transport)
    return a.kappa_max


def checked_code(a, N: int, c: int):
    """cerar.make_code for the aggregator, refused (ValueError) where its transport cannot carry it
    (cerar.ring.precision.check_admissible: the derived rule)."""
    import torch

    import cerar
    from cerar.ring.precision import check_admissible

    code = cerar.make_code(N, c, construction=a.construction, eps=a.eps, kappa_max=code_kappa_max(a))
    check_admissible(
        code, torch.float32, cerar.formats.wire.transport_dtype(a.transport), what=f"transport={a.transport}"
    )
    return code


def _validate_auto_c(cfg) -> None:
    """c=auto chooses among CERAR codes from the per-rank gradients before aggregation."""
    a = cfg.aggregator
    _require(a.kind == "cerar", f"c=auto chooses a CERAR code: it needs aggregator=cerar (got aggregator={a.name})")
    _require(
        not effective_overlap(cfg),
        "c=auto needs trainer.overlap=false (it measures the per-rank gradients before they are aggregated)",
    )
    _validate_schedule(a)
    if a.auto_candidates is not None:
        _require(len(a.auto_candidates) > 0, "aggregator.auto_candidates=[] is empty (null: the default candidates)")
        for c in a.auto_candidates:
            _require(c >= 1, f"aggregator.auto_candidates holds c={c}: every c must be >= 1")


def _validate_schedule(a) -> None:
    """The fields c=auto and aggregator=auto share: the budget, the warm-up, the checks and the sample."""
    _require(a.error_budget > 0, f"aggregator.error_budget={a.error_budget} must be > 0 (a fraction of the noise)")
    _require(a.auto_warmup_steps >= 1, f"aggregator.auto_warmup_steps={a.auto_warmup_steps} must be >= 1")
    for key in ("auto_check_every", "auto_sample_values"):
        _require(a[key] >= 0, f"aggregator.{key}={a[key]} must be >= 0")


def _validate_auto_aggregator(cfg) -> None:
    """aggregator=auto measures the per-rank gradients before aggregation; its declared links and families must
    be ones it knows."""
    a = cfg.aggregator
    _require(
        not effective_overlap(cfg),
        "aggregator=auto needs trainer.overlap=false (it measures the per-rank gradients before they are aggregated)",
    )
    _validate_schedule(a)
    _require(a.block >= 1, f"aggregator.block={a.block} must be >= 1 (values per scale of the 8-bit messages)")
    _require(a.transport == "float32", "aggregator=auto chooses each candidate's transport: leave aggregator.transport")
    if a.auto_aggregators is not None:
        for family in a.auto_aggregators:
            _require(
                family in FAMILIES, f"aggregator.auto_aggregators holds {family!r}: not one of {', '.join(FAMILIES)}"
            )
    if a.auto_aggregators is None or set(a.auto_aggregators) & set(INT4_KINDS):  # its 4-bit candidates' format
        _validate_int4(a, "aggregator=auto's 4-bit candidates: ")
    _require(a.auto_trials >= 0, f"aggregator.auto_trials={a.auto_trials} must be >= 0 (0: the cost model decides)")
    _require(a.auto_trial_calls >= 1, f"aggregator.auto_trial_calls={a.auto_trial_calls} must be >= 1")
    for key, value in a.auto_links.items():  # the schema rejects unknown keys
        _require(value is None or value > 0, f"aggregator.auto_links.{key}={value} must be > 0 (or null: measured)")


def _validate_cerar_code(cfg, world_size: int) -> None:
    """Let cerar judge (N, c, construction, eps, kappa_max) before any process group starts; for c=auto, every
    candidate (train/aggregation/auto_c.py)."""
    if world_size < 2:
        return  # a single process aggregates nothing

    a = cfg.aggregator
    if cfg.c == AUTO_C:
        from train.aggregation.auto_c import candidate_codes

        try:
            codes = candidate_codes(world_size, a.construction, a.eps, a.kappa_max, a.auto_candidates)
        except ValueError as err:
            raise ConfigError(f"aggregator={a.name} with N={world_size}, c=auto: {err}") from None
        _require(
            world_size < 3 or len(codes) > 1,
            f"aggregator={a.name} with N={world_size}, c=auto: no c in ({world_size}, {4 * world_size}] of "
            f"construction {a.construction!r} saves bytes within kappa_max (try aggregator.construction=optimized)",
        )
        return
    try:
        checked_code(a, world_size, cfg.c)
    except ValueError as err:
        raise ConfigError(f"aggregator={a.name} with N={world_size}, c={cfg.c}: {err}") from None


def node_layout(cfg, world_size: int, environ=None):
    """The cerar.hierarchical.NodeLayout of a hierarchical aggregator: world_size split into nodes of
    aggregator.local_size ranks, or of torchrun's LOCAL_WORLD_SIZE; one node for a world of one. Raises
    ConfigError when neither is known for a larger world (launched without torchrun and no override) or
    when the world does not divide into such nodes."""
    environ = os.environ if environ is None else environ
    a = cfg.aggregator
    unknown = a.local_size is None and "LOCAL_WORLD_SIZE" not in environ
    if unknown and world_size > 1:
        raise ConfigError(
            f"aggregator={a.name} needs the node layout: launch with torchrun (which sets LOCAL_WORLD_SIZE) "
            "or set aggregator.local_size"
        )
    from cerar.hierarchical import NodeLayout

    if unknown:
        return NodeLayout(1, 1)
    try:
        return NodeLayout.from_env(local_size=a.local_size, world_size=world_size, environ=environ)
    except ValueError as err:
        raise ConfigError(f"aggregator={a.name}: {err} (aggregator.local_size overrides it)") from None


def _validate_hierarchical(cfg, world_size: int | None) -> None:
    """aggregator.local_size, the nodes it makes of the world, and c for n = nodes, before any process group."""
    a = cfg.aggregator
    _require(a.local_size is None or a.local_size >= 1, f"aggregator.local_size={a.local_size} must be >= 1 or null")
    layout = None if world_size is None else node_layout(cfg, world_size)
    if layout is None or layout.nodes < 2 or a.kind != "hier_cerar":
        return  # the world is known once launched; one node aggregates exactly; hier_ring needs no code
    try:
        checked_code(a, layout.nodes, cfg.c)
    except ValueError as err:
        raise ConfigError(f"aggregator={a.name} with n={layout.nodes} nodes ({layout}), c={cfg.c}: {err}") from None


def derived_grad_accum(cfg, world_size: int) -> int:
    """Micro-steps per optimizer step: trainer.grad_accum, or global_batch_size / (micro_batch_size x N)."""
    t = cfg.trainer
    if t.global_batch_size is None:
        return int(t.grad_accum)
    per_micro_step = t.micro_batch_size * world_size
    _require(
        t.global_batch_size % per_micro_step == 0,
        f"trainer.global_batch_size={t.global_batch_size} is not a multiple of trainer.micro_batch_size="
        f"{t.micro_batch_size} x N={world_size} = {per_micro_step} sequences per micro-step",
    )
    grad_accum = t.global_batch_size // per_micro_step
    _require(
        t.grad_accum in (1, grad_accum),
        f"trainer.grad_accum={t.grad_accum} contradicts trainer.global_batch_size={t.global_batch_size} "
        f"(which gives {grad_accum} with micro_batch_size={t.micro_batch_size} and N={world_size}); set only one",
    )
    return grad_accum


TRAINING_TRAINER_FIELDS = (
    "max_steps",
    "micro_batch_size",
    "precision",
    "overlap",
    "resync_every",
    "fp16_initial_scale_power",
    "fp16_loss_scale_window",
    "fp16_hysteresis",
    "fp16_min_loss_scale",
)
"""The trainer fields that change what is trained (the rest only observe it, or say where it runs)."""


def training_identity(cfg, world_size: int) -> dict:
    """Every value that changes what a run trains, by dotted name: model, data (but its cache folder and lock wait),
    aggregator (its c=auto settings only when c=auto), c, seed, world size, and the trainer's batch, steps (the
    lr schedule spans them), precision, overlap and resync. The batch is recorded as it acts (global batch and
    grad_accum derived), so spelling the same batch another way is no change. A resumed run must match its
    checkpoints' identity."""

    def plain(node) -> dict:
        return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)

    identity: dict = {}
    chooses = cfg.aggregator.kind == AUTO_KIND  # aggregator=auto: its schedule's fields and every candidate's
    auto = cfg.c == AUTO_C or chooses
    for section in ("model", "data", "aggregator"):
        for key, value in plain(cfg[section]).items():
            auto_setting = section == "aggregator" and key in AUTO_C_FIELDS
            hierarchical_setting = section == "aggregator" and key in HIERARCHICAL_FIELDS
            if hierarchical_setting and cfg.aggregator.kind not in HIERARCHICAL_KINDS:
                continue  # absent from the identities of runs that do not use them (and of older runs)
            quantized_setting = section == "aggregator" and key in QUANTIZED_FIELDS
            if quantized_setting and cfg.aggregator.kind not in QUANTIZED_KINDS and not chooses:
                continue
            if section == "aggregator" and key in AUTO_FIELDS and not chooses:
                continue
            if section == "aggregator" and key in INT4_FIELDS and cfg.aggregator.kind not in INT4_KINDS:
                if not chooses or value == INT4_DEFAULTS[key]:
                    continue  # absent from the other kinds' identities (and from runs before issue 54); auto's
                    # only where its 4-bit candidates differ from the default (older auto runs' unchanged)
            elif section == "aggregator" and key == "intra" and cfg.aggregator.kind != "hier_int4":
                continue  # the flat int4 has no tier inside a node
            unfed = key == "error_feedback" and not value  # feedback only when on (older runs' identities unchanged)
            if section == "aggregator" and (key in NOT_TRAINING_AGGREGATOR_FIELDS or unfed):
                continue  # and its window only observes
            if section == "aggregator" and key == "transport" and value == "float32":
                continue  # the default: absent, as in the runs from before the field
            if section == "aggregator" and key == "equilibrate" and cfg.aggregator.kind not in EQUILIBRATE_KINDS:
                continue  # ignored by the aggregators that do not code: absent from their identities
            if (section, key) not in NOT_TRAINING_DATA_FIELDS and (auto or not auto_setting):
                identity[f"{section}.{key}"] = value
    # c as asked: "auto" stays "auto" whatever it has chosen (the choice is checkpointed and resumed)
    identity["c"], identity["seed"], identity["world_size"] = cfg.c if auto else int(cfg.c), int(cfg.seed), world_size
    trainer = plain(cfg.trainer)
    for key in TRAINING_TRAINER_FIELDS:
        identity[f"trainer.{key}"] = trainer[key]
    identity["trainer.overlap"] = effective_overlap(cfg)
    grad_accum = derived_grad_accum(cfg, world_size)
    identity["trainer.grad_accum"] = grad_accum
    identity["trainer.global_batch_size"] = cfg.trainer.micro_batch_size * grad_accum * world_size
    return identity


def identity_differences(recorded: dict, current: dict) -> list[str]:
    """'field old -> new' for each training value that differs (a field only one side knows included)."""
    missing = object()
    changes = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key, missing), current.get(key, missing)
        if old != new:
            changes.append(
                f"{key} {'(absent)' if old is missing else old!r} -> {'(absent)' if new is missing else new!r}"
            )
    return changes


def normalise_resume(value) -> str:
    """`resume=true` arrives as a bool or the string 'True'; keep one spelling."""
    return str(value).strip().lower()


def effective_overlap(cfg) -> bool:
    """overlap=null means: the paper's separate aggregation phase, unless the aggregator is hook-only."""
    if cfg.trainer.overlap is None:
        return cfg.aggregator.kind in HOOK_ONLY_AGGREGATORS
    return bool(cfg.trainer.overlap)


def effective_compile(cfg, device_type: str) -> bool:
    """trainer.compile=null means: compile on CUDA, where the fused kernels pay for the compile; stay eager on a CPU,
    where inductor's C++ build of the model takes minutes (train/compiling.py)."""
    if cfg.trainer.compile is None:
        return device_type == "cuda"
    return bool(cfg.trainer.compile)


def config_fingerprint(cfg: DictConfig) -> str:
    """SHA-256 of the resolved config: ranks exchange it at start to catch mismatched launches."""
    text = OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


CODE_TAG_ENV = "CERAR_PYTHIA_CODE_TAG"
"""An extra string mixed into the code fingerprint: tag a deployment, or (tests) make one rank differ."""


def code_fingerprint() -> str:
    """SHA-256 of the code a rank runs: cerar's protocol version, the package version and the sources of
    `cerar/` and `train/` (plus $CERAR_PYTHIA_CODE_TAG). Ranks compare it at start with the config hash."""
    import importlib.metadata

    import cerar

    digest = hashlib.sha256()
    try:
        version = importlib.metadata.version("cerar-pythia")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    digest.update(f"protocol={cerar.PROTOCOL_VERSION};version={version};".encode())
    digest.update(f"tag={os.environ.get(CODE_TAG_ENV, '')};".encode())
    root = Path(__file__).resolve().parents[1]
    for package in ("cerar", "train"):
        for source in sorted((root / package).rglob("*.py")):  # subpackages too (cerar/hierarchical)
            digest.update(f"{source.relative_to(root).as_posix()}:".encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()


def run_identity(cfg, world_size: int) -> tuple[str, str, list[str]]:
    """W&B run name, group and tags from model, data, aggregator, c and N."""
    agg = cfg.aggregator.name + (f"-c{cfg.c}" if cfg.aggregator.kind in ("cerar", "hier_cerar") else "")
    transport = cfg.aggregator.transport
    if transport != "float32" and PRESET_TRANSPORTS.get(cfg.aggregator.name) != transport:
        agg += f"-{transport}"  # 16-bit messages, where the preset's name does not say so
    name = f"{cfg.model.name}_{cfg.data.name}_{agg}_n{world_size}_s{cfg.seed}"
    group = cfg.wandb.group or f"{cfg.model.name}_{cfg.data.name}_n{world_size}"
    tags = [
        cfg.model.name,
        cfg.data.name,
        cfg.aggregator.name,
        f"c={cfg.c}",
        f"N={world_size}",
        *cfg.wandb.tags,
    ]
    return name, group, tags
