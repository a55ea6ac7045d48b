"""The trainer's step at the GPU's speed, held to it on the CPU: the model compiled (trainer.compile) without changing
what it trains or what its checkpoints hold, AdamW's fused kernels on CUDA with checkpoints that move between
implementations, attention that needs no mask, and one host read per step, counted by a dispatch mode.

Compiling with inductor builds C++ on a CPU (50 s for the tiny model at a load of 8 here): the tests compile with
dynamo's ``eager`` backend (the graphs traced and run with torch's own operations: the eager numbers, in seconds),
which exercises everything the trainer does around the compile; one slow test compiles with inductor.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.runs import composed, in_process_trainer
from train import compiling, distributed
from train.metrics import parameter_sha256

# train.model (transformers' GPTNeoX, dynamo) is imported in the tests that use it: seconds per pytest process at
# collection otherwise, also for runs that select none of these tests

# ----------------------------------------------------------------------------- AdamW's kernels


@pytest.mark.quick
def test_adamw_is_fused_on_cuda_and_foreach_elsewhere():
    from train.model import adamw_implementation, build_model, build_optimizer

    assert adamw_implementation("cuda") == {"fused": True}
    assert adamw_implementation(torch.device("cuda", 3)) == {"fused": True}
    assert adamw_implementation("cpu") == {"foreach": True}
    m = composed("model=tiny").model
    optimizer = build_optimizer(build_model(m), m, "cpu")
    assert [(g["foreach"], g["fused"]) for g in optimizer.param_groups] == [(True, None), (True, None)]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [m.weight_decay, 0.0]  # matrices only
    assert optimizer.defaults["betas"] == (m.adam_beta1, m.adam_beta2) and optimizer.defaults["eps"] == m.adam_eps


def _stepped(implementation: dict, steps: int, seed: int = 0):
    """The tiny model and its AdamW (``implementation``: its kernels) after ``steps`` steps on seeded batches."""
    from train.model import build_model

    m = composed("model=tiny").model
    torch.manual_seed(seed)
    model = build_model(m)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **implementation)
    batches = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = torch.randint(0, 300, (2, 9), generator=batches)
        model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


@pytest.mark.quick
def test_a_checkpoint_keeps_the_loading_runs_adamw_kernels():
    """A GPU's checkpoint (fused) resumed on a CPU (foreach), and the other way: the loading run keeps its own kernels
    (load_state_dict alone would take the writer's), the moments and step counts arrive unchanged, and each step
    count lives where its kernel reads it (fused: beside the parameter; foreach: on the host)."""
    from train.model import load_optimizer_state

    _, fused = _stepped({"fused": True}, steps=2)  # torch's fused AdamW runs on the CPU too: the GPU's kernel choice
    _, foreach = _stepped({"foreach": True}, steps=0, seed=1)
    load_optimizer_state(foreach, fused.state_dict())
    assert [(g["foreach"], g["fused"]) for g in foreach.param_groups] == [(True, None)]
    back = _stepped({"fused": True}, steps=0, seed=2)[1]
    load_optimizer_state(back, foreach.state_dict())
    assert [(g["foreach"], g["fused"]) for g in back.param_groups] == [(None, True)]
    for p_fused, p_foreach, p_back in zip(*(o.param_groups[0]["params"] for o in (fused, foreach, back)), strict=True):
        a, b, c = fused.state[p_fused], foreach.state[p_foreach], back.state[p_back]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key]), key
        assert b["step"].dtype == c["step"].dtype == torch.float32
        assert b["step"].device.type == "cpu" and c["step"].device == p_back.device


def test_a_resumed_adamw_continues_as_the_uninterrupted_one():
    """The state the loader restores is all AdamW needs: one more step from it equals one more step of the original."""
    from train.model import load_optimizer_state

    model, optimizer = _stepped({"foreach": True}, steps=2)
    written = io.BytesIO()  # as a checkpoint holds them: copies (load_state_dict keeps the tensors it is given)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, written)
    written.seek(0)
    saved = torch.load(written, weights_only=True)
    state, saved = saved["model"], saved["optimizer"]
    fresh, fresh_optimizer = _stepped({"foreach": True}, steps=0, seed=5)
    fresh.load_state_dict(state)
    load_optimizer_state(fresh_optimizer, saved)
    for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
        batch = torch.arange(18).reshape(2, 9) % 300
        m(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss.backward()
        o.step()
    assert parameter_sha256(model) == parameter_sha256(fresh)


# ----------------------------------------------------------------------------- attention


class HostReads(TorchDispatchMode):
    """Counts what a step asks of the host, by the operations torch dispatches (on every device, the CPU included):

    - ``scalar``: ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``): a blocking read;
    - ``copy``: a blocking copy to the CPU that keeps the dtype (``t.to("cpu")``; autocast's casts change it);
    - ``staged``: the same, non-blocking (into pinned memory on CUDA; read later after an event).

    Each is tallied under the step and phase the loop is in (train.distributed's progress)."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = None
        if func is torch.ops.aten._local_scalar_dense.default:
            kind = "scalar"
        elif func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
            to_host = torch.device(kwargs["device"]).type == "cpu"
            if to_host and (kwargs.get("dtype") or args[0].dtype) == args[0].dtype:
                kind = "staged" if kwargs.get("non_blocking") else "copy"
        if kind is not None:
            self.seen[(distributed._progress["step"], kind)] += 1
        return func(*args, **kwargs)

    def at(self, step: int) -> dict:
        return {kind: self.seen[(step, kind)] for kind in ("scalar", "copy", "staged")}


def _tiny(seed: int = 0):
    from train.model import build_model

    torch.manual_seed(seed)
    return build_model(composed("model=tiny").model)


@pytest.mark.quick
def test_the_model_attends_causally_with_the_logits_of_hfs_sdpa_and_no_host_read():
    """HF's own mask preparation reads a device value every forward (its packed-sequence check: a sync on a GPU); the
    model's attention (train.model.attend_whole_windows) builds no mask and gives HF's SDPA logits bit for bit."""
    from train.model import WINDOW_ATTENTION

    model, reference = _tiny(), _tiny()
    assert model.config._attn_implementation == WINDOW_ATTENTION
    reference.set_attn_implementation("sdpa")
    batch = torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(3))
    with HostReads() as reads:
        logits = model(input_ids=batch).logits
    assert reads.seen == Counter()
    with HostReads() as reads:
        assert torch.equal(logits, reference(input_ids=batch).logits)
    assert reads.seen[(distributed._progress["step"], "scalar")] >= 1  # what the window attention spares


def test_compiled_layers_call_sdpa_causal_with_no_mask_and_keep_the_checkpoint_keys():
    """What dynamo traces of the compiled model (a recording backend): one graph for both layers, whose SDPA call is
    causal with no mask (flash attention on a GPU; a whole-model graph gets an explicit mask from HF under dynamo),
    and the loss apart; the compiled model's state_dict and parameters are the eager model's."""
    model = _tiny()
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    graphs = []

    def recording(gm, inputs):
        graphs.append([node for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    loss = compiling.compile_model(model, recording)
    assert compiling.is_compiled(model)
    batch = torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(3))
    loss(model(input_ids=batch[:, :-1]).logits, batch[:, 1:]).backward()
    attention = [n for graph in graphs for n in graph if "scaled_dot_product_attention" in str(n.target)]
    assert len(graphs) == 2 and len(attention) == 1  # the layers' graph (reused by the second layer), the loss's
    assert attention[0].kwargs["attn_mask"] is None and attention[0].kwargs["is_causal"] is True
    assert any("cross_entropy" in str(n.target) for n in graphs[1])
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    compiling.uncompile_model(model)
    assert not compiling.is_compiled(model)


# ----------------------------------------------------------------------------- the trainer, in this process


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small local corpus and its tokenizer cache, shared by this module's trainers."""
    folder = tmp_path_factory.mktemp("compiled-step")
    (folder / "corpus").mkdir()
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "the", "and", "of", "river", "stone", "light"]
    for i in range(6):
        (folder / "corpus" / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 300)))
    return folder


def trainer_of(corpus, run_dir, *overrides: str, fused: bool = False, overlap: bool = False):
    """tests/runs.py's in-process trainer of the tiny model on this module's corpus."""
    return in_process_trainer(corpus / "corpus", corpus / "cache", run_dir, *overrides, fused=fused, overlap=overlap)


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


EAGER_COMPILE = ("trainer.compile=true", "trainer.compile_backend=eager")


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "overlap"])
def test_compiling_changes_nothing_the_run_trains(corpus, tmp_path, overlap):
    """With dynamo's eager backend a compiled run takes the eager run's arithmetic, so any difference would be the
    trainer's own: the compile before the first step reads no data and draws no random number, its gradients are
    dropped (overlap: DDP would add them into step 1's), and the compiled backward still adds into the flat
    gradient's views (flat) or hands DDP's hook its buckets (overlap)."""
    runs = {}
    for name, overrides in (("eager", ()), ("compiled", EAGER_COMPILE)):
        with trainer_of(corpus, tmp_path / name, "trainer.max_steps=3", *overrides, overlap=overlap) as trainer:
            assert trainer.compile == (name == "compiled")
            trainer.fit()
            assert compiling.is_compiled(trainer.model) == (name == "compiled")
            if not overlap:
                views = zip(trainer.params, trainer.grads.views, strict=True)
                assert all(p.grad.data_ptr() == v.data_ptr() for p, v in views)  # the flat gradient's views, still
            runs[name] = (parameter_sha256(trainer.model), _losses(tmp_path / name), trainer.data.train.state_dict())
    assert runs["compiled"] == runs["eager"]
    first = [json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0]) for name in runs]
    assert [("time/compile" in line) for line in first] == [False, True]  # the compile's seconds, logged once
    assert first[1]["time/compile"] == trainer.compile_seconds > 0


@pytest.mark.quick
def test_compile_defaults_to_cuda_only():
    from train.config import effective_compile

    cfg = composed()
    assert cfg.trainer.compile is None and cfg.trainer.compile_backend == "inductor"
    assert effective_compile(cfg, "cuda") and not effective_compile(cfg, "cpu")
    cfg.trainer.compile = True
    assert effective_compile(cfg, "cpu")
    cfg.trainer.compile = False
    assert not effective_compile(cfg, "cuda")


def _failing(gm, inputs):
    raise RuntimeError("no compiler here\nsecond line of the error")


def test_a_compile_that_fails_leaves_the_model_eager_in_one_line(corpus, tmp_path, caplog):
    torch._dynamo.reset()
    torch._dynamo.register_backend(_failing, name="failing_for_the_test")
    with trainer_of(corpus, tmp_path / "eager", "trainer.max_steps=2") as trainer:
        trainer.fit()
        expected = parameter_sha256(trainer.model)
    overrides = ("trainer.max_steps=2", "trainer.compile=true", "trainer.compile_backend=failing_for_the_test")
    with trainer_of(corpus, tmp_path / "fallback", *overrides) as trainer, caplog.at_level(logging.INFO):
        trainer.fit()
        assert not compiling.is_compiled(trainer.model) and trainer.loss is compiling.next_token_loss
        assert parameter_sha256(trainer.model) == expected
    said = [r for r in caplog.records if r.getMessage().startswith(compiling.NOTICE_PREFIX)]
    assert [r.levelno for r in said] == [logging.INFO, logging.WARNING]  # the notice, then the fallback's line
    assert "compiling the model for cpu" in said[0].getMessage()
    assert said[1].getMessage().endswith("runs the model eagerly, compiling failed: no compiler here")


class _Counting:
    """A dynamo backend that counts the graphs it is given and runs them as traced (dynamo's eager)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, inputs):
        self.graphs += 1
        return gm.forward


def test_every_compile_happens_before_the_first_step_and_evaluation_compiles_nothing(corpus, tmp_path):
    """Dynamo is given two graphs, the layers' and the loss's, both before step 1 (trainer.compile's phase); the
    steps recompile nothing (their shapes never change) and neither do the evaluations, which run eagerly: a graph
    compiled there would hold this rank while its peers wait T in the evaluation's collective."""
    counting = _Counting()
    torch._dynamo.reset()
    torch._dynamo.register_backend(counting, name="counting_for_the_test")
    overrides = ("trainer.max_steps=3", "trainer.eval_every=1", "trainer.compile=true",
                 "trainer.compile_backend=counting_for_the_test")  # fmt: skip
    with trainer_of(corpus, tmp_path, *overrides) as trainer:
        trainer.compile_before_first_step()
        assert counting.graphs == 2 and trainer.state.step == 0
        trainer.fit()
        assert trainer.state.step == 3 and trainer.state.last_val_loss is not None
    assert counting.graphs == 2


@pytest.mark.quick
def test_deterministic_runs_get_inductors_deterministic_mode():
    """The GPU check's resume case runs with torch.use_deterministic_algorithms(True): its compiled kernels must not
    depend on timings taken in the process (inductor's deterministic mode skips that benchmarking)."""
    import torch._inductor.config as inductor

    before = (torch.are_deterministic_algorithms_enabled(), inductor.deterministic)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        inductor.deterministic = False
        compiling.compile_model(_tiny(), "eager")
        assert inductor.deterministic
    finally:
        torch.use_deterministic_algorithms(before[0])
        inductor.deterministic = before[1]


def test_resume_across_compile_on_and_off_ends_where_the_uninterrupted_run_does(corpus, tmp_path):
    """A checkpoint written by a compiled run holds the eager model's keys (nn.Module.compile in place: no _orig_mod.)
    and resumes without compiling to the uninterrupted compiled run's parameters, and the other way round."""
    from train.model import build_model

    with trainer_of(corpus, tmp_path / "full", "trainer.max_steps=4", *EAGER_COMPILE) as trainer:
        trainer.fit()
        uninterrupted = parameter_sha256(trainer.model)
    for first, then in ((EAGER_COMPILE, ()), ((), EAGER_COMPILE)):
        with trainer_of(corpus, tmp_path / "a", "trainer.max_steps=4", "trainer.stop_after_step=2", *first) as t:
            t.fit()
            state = t.checkpoint_state()
            keys = [n for n, _ in t.model.named_parameters()]
        assert list(state["model"]) == list(build_model(composed("model=tiny").model).state_dict())
        assert set(keys) <= set(state["model"])
        with trainer_of(corpus, tmp_path / "b", "trainer.max_steps=4", *then) as t:
            t.restore(state)
            t.fit()
            assert t.state.step == 4 and parameter_sha256(t.model) == uninterrupted


# ----------------------------------------------------------------------------- host reads per step


@pytest.mark.parametrize(
    ("precision", "compiled"),
    [pytest.param("fp32", False, marks=pytest.mark.quick), ("fp32", True), ("bf16", False), ("bf16", True)],
    ids=["fp32-eager", "fp32-compiled", "bf16-eager", "bf16-compiled"],
)
def test_a_step_reads_the_host_once(corpus, tmp_path, precision, compiled):
    """Per step, logged every step, with the AdamW a GPU run uses (fused): one blocking read, the non-finite flag with
    the train loss (it decides the optimizer step), and one non-blocking copy, grad_norm's, that the next step's log
    line reads after an event. No ``.item()``: not in the forward (HF's mask check), not in the optimizer (foreach
    AdamW reads its step counts on the host), not in the log line (its values come from the host copies)."""
    overrides = ["trainer.max_steps=5", "trainer.eval_every=0", f"trainer.precision={precision}"]
    compile_overrides = EAGER_COMPILE if compiled else ()
    with trainer_of(corpus, tmp_path, *overrides, *compile_overrides, fused=True) as trainer, HostReads() as reads:
        trainer.fit()
    for step in range(1, 5):  # the last step evaluates: its own reads
        assert reads.at(step) == {"scalar": 0, "copy": 1, "staged": 1}, (step, reads.seen)
    assert len(_losses(tmp_path)) == 5


def test_fp16_adds_the_loss_scalers_three_reads(corpus, tmp_path):
    """fp16's loss scale (train/loss_scale.py) reads its overflow flag and its scale on the host in update(), and the
    loop reads the scale for amp/scale: three more per step (docs/training.md)."""
    overrides = ["trainer.max_steps=4", "trainer.eval_every=0", "trainer.precision=fp16"]
    with trainer_of(corpus, tmp_path, *overrides, fused=True) as trainer, HostReads() as reads:
        trainer.fit()
    for step in range(1, 4):
        assert (reads.at(step)["scalar"], reads.at(step)["copy"]) == (3, 1), (step, reads.seen)


class _WhenLogged:
    """A logger that keeps, for each line, the step the loop was in when it wrote it and whether that step's forward
    and backward had run (its timer's host clock: the CPU's)."""

    def __init__(self, trainer):
        self.trainer, self.lines = trainer, []

    def log(self, record):
        seconds = self.trainer.timer.seconds
        self.lines.append((record["step"], distributed._progress["step"], seconds["backward"] > 0))


def test_a_steps_log_line_is_written_while_the_next_step_runs(corpus, tmp_path):
    """A line with no evaluation is written once the next step's forward and backward are queued (on a GPU its
    kernels then run while the host writes), or before a checkpoint, or at the end; an evaluating line at once."""
    overrides = ["trainer.max_steps=6", "trainer.eval_every=3", "checkpoint.every=5"]
    with trainer_of(corpus, tmp_path, *overrides) as trainer:
        trainer.logger = _WhenLogged(trainer)
        trainer.fit()
    assert trainer.logger.lines == [
        (1, 2, True),
        (2, 3, True),
        (3, 3, True),  # evaluates: written at once, after its own step
        (4, 5, True),
        (5, 5, True),  # before the checkpoint of step 5
        (6, 6, True),  # the last step evaluates
    ]


# ----------------------------------------------------------------------------- inductor, once


@pytest.mark.slow
def test_inductor_compiles_the_tiny_model_and_resumes_bit_for_bit(corpus, tmp_path):
    """The real compile (inductor's C++ on this CPU): the model trains, and a run stopped after step 2 and resumed in a
    fresh trainer (same process: the compiled kernels are reused) ends with the uninterrupted run's parameters.
    Cost: one inductor build of the layers' and the loss's forward and backward, about 50 s at a load of 8 on the
    2-core machine, seconds once inductor's cache holds it."""
    torch._dynamo.reset()
    started = time.perf_counter()
    with trainer_of(corpus, tmp_path / "full", "trainer.max_steps=4", "trainer.compile=true") as trainer:
        trainer.fit()
        assert compiling.is_compiled(trainer.model)
        uninterrupted = parameter_sha256(trainer.model)
    compiled_s = time.perf_counter() - started
    stopped = ("trainer.max_steps=4", "trainer.stop_after_step=2", "trainer.compile=true")
    with trainer_of(corpus, tmp_path / "a", *stopped) as t:
        t.fit()
        state = t.checkpoint_state()
    with trainer_of(corpus, tmp_path / "b", "trainer.max_steps=4", "trainer.compile=true") as t:
        t.restore(state)
        t.fit()
        assert compiling.is_compiled(t.model) and parameter_sha256(t.model) == uninterrupted
    losses = _losses(tmp_path / "full")
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    print(f"inductor: first run {compiled_s:.0f} s")
