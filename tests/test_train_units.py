"""Single-process pieces of the harness: checkpoints, LR schedule, data streams and loaders."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from train import checkpoint as ckpt
from train.config import register_configs
from train.data import (
    WindowStream,
    bpe_token_arrays,
    build_data,
    embedded_documents,
    local_documents,
    validation_batches,
)
from train.schedule import lr_multiplier

ROOT = Path(__file__).resolve().parents[1]
register_configs()

# ----------------------------------------------------------------------------- checkpoints


def _state(step: int) -> dict:
    return {"step": step, "weights": torch.full((4,), float(step))}


@pytest.mark.quick
def test_checkpoints_keep_the_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 3]
    state, path = ckpt.load_latest_checkpoint(tmp_path)
    assert state["step"] == 4 and path.name == "step-00000004.pt"
    assert not list(ckpt.checkpoint_dir(tmp_path).glob(".*tmp*"))  # no temporary files left behind


@pytest.mark.quick
@pytest.mark.parametrize("damage", ["flip", "truncate", "no_checksum"])
def test_damaged_latest_checkpoint_falls_back_to_previous(tmp_path, caplog, damage):
    for step in (5, 10):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=3)
    latest = ckpt.checkpoint_dir(tmp_path) / "step-00000010.pt"
    payload = bytearray(latest.read_bytes())
    if damage == "flip":
        payload[len(payload) // 2] ^= 0xFF
        latest.write_bytes(bytes(payload))
    elif damage == "truncate":
        latest.write_bytes(bytes(payload[: len(payload) // 3]))
    else:
        latest.with_name(latest.name + ".sha256").unlink()
    with caplog.at_level(logging.WARNING):
        state, path = ckpt.load_latest_checkpoint(tmp_path)
    assert state["step"] == 5 and torch.equal(state["weights"], torch.full((4,), 5.0))
    assert "step-00000010.pt is unusable" in caplog.text


@pytest.mark.quick
def test_no_checkpoint_and_discard(tmp_path):
    assert ckpt.load_latest_checkpoint(tmp_path) is None
    ckpt.save_checkpoint(tmp_path, 1, _state(1), keep=1)
    assert ckpt.discard_checkpoints(tmp_path) == 1
    assert ckpt.load_latest_checkpoint(tmp_path) is None


@pytest.mark.quick
def test_rng_states_round_trip():
    saved = ckpt.rng_states()
    first = (torch.rand(3), np.random.rand(3))
    ckpt.set_rng_states(saved)
    again = (torch.rand(3), np.random.rand(3))
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1])


class _RunsCodeWhenUnpickled:
    """A pickle that creates a file when loaded without weights_only: what a hostile checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.quick
def test_checkpoint_that_would_run_code_is_refused_and_the_previous_one_used(tmp_path, caplog):
    ckpt.save_checkpoint(tmp_path, 1, _state(1), keep=3)
    marker = tmp_path / "code-ran"
    ckpt.save_checkpoint(tmp_path, 2, {"step": 2, "payload": _RunsCodeWhenUnpickled(marker)}, keep=3)
    with caplog.at_level(logging.WARNING):
        state, path = ckpt.load_latest_checkpoint(tmp_path)
    assert not marker.exists()
    assert state["step"] == 1 and path.name == "step-00000001.pt"
    assert "step-00000002.pt is unusable" in caplog.text


@pytest.mark.quick
def test_old_checkpoints_numpy_rng_state_is_allow_listed(tmp_path):
    """Checkpoints written before the NumPy state was stored as plain Python held an ndarray."""
    np.random.seed(7)
    legacy = {"torch": torch.get_rng_state(), "python": __import__("random").getstate(), "numpy": np.random.get_state()}
    expected = np.random.rand(3)
    ckpt.save_checkpoint(tmp_path, 1, {"step": 1, "rng": legacy}, keep=1)
    state, _ = ckpt.load_latest_checkpoint(tmp_path)
    np.random.seed(0)
    ckpt.set_rng_states(state["rng"])
    assert np.array_equal(np.random.rand(3), expected)


def _tiny_model_and_optimizer(seed: int):
    from train.model import build_model
    from train.schedule import build_scheduler

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        m = compose(config_name="config", overrides=["model=tiny", "model.vocab_size=300"]).model
    torch.manual_seed(seed)
    model = build_model(m)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    return model, optimizer, build_scheduler(optimizer, m, 100)


def _one_step(model, optimizer, scheduler) -> None:
    batch = torch.randint(0, 300, (2, 9))
    model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def test_resume_restores_a_gpu_written_checkpoint_onto_the_device_the_run_names(tmp_path):
    """The file says nothing about where it is restored: it loads to CPU (RNG states as CPU ByteTensors, a
    CUDA RNG entry from a GPU machine ignored here) and model and optimizer state are copied onto the run's
    device; the resumed run then takes the same step as the uninterrupted one."""
    model, optimizer, scheduler = _tiny_model_and_optimizer(seed=1)
    _one_step(model, optimizer, scheduler)
    rng = ckpt.rng_states()
    rng["cuda"] = [torch.get_rng_state()]  # what a one-GPU machine adds
    state = {
        "step": 1,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "ranks": [{"rng": rng}],
    }
    ckpt.save_checkpoint(tmp_path, 1, state, keep=1)
    _one_step(model, optimizer, scheduler)  # the uninterrupted run's step 2
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}

    loaded, _ = ckpt.load_latest_checkpoint(tmp_path)
    tensors = [loaded["ranks"][0]["rng"]["torch"], *loaded["model"].values()]
    assert all(t.device.type == "cpu" for t in tensors)
    assert loaded["ranks"][0]["rng"]["torch"].dtype == torch.uint8
    device = torch.device("cpu")  # the run's own device, chosen by the run, not by the file
    fresh, fresh_optimizer, fresh_scheduler = _tiny_model_and_optimizer(seed=2)
    fresh.to(device)
    fresh.load_state_dict(loaded["model"])
    fresh_optimizer.load_state_dict(loaded["optimizer"])
    fresh_scheduler.load_state_dict(loaded["scheduler"])
    ckpt.set_rng_states(loaded["ranks"][0]["rng"])
    _one_step(fresh, fresh_optimizer, fresh_scheduler)
    for name, param in fresh.named_parameters():
        assert param.device == device
        assert torch.equal(param.detach(), expected[name]), name


# ----------------------------------------------------------------------------- schedule


@pytest.mark.quick
def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    steps = 1000
    values = [lr_multiplier(s, steps, 0.01, 0.1) for s in range(steps)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)  # 10 warmup steps
    assert all(b <= a + 1e-12 for a, b in zip(values[10:], values[11:], strict=False))
    assert lr_multiplier(steps, steps, 0.01, 0.1) == pytest.approx(0.1)
    assert values[-1] > 0.1


# ----------------------------------------------------------------------------- data


@pytest.mark.quick
def test_window_stream_shards_are_disjoint_and_resumable():
    tokens = np.arange(10_000, dtype=np.uint16)
    streams = [WindowStream(tokens, 16, rank, 2, seed=7) for rank in range(2)]
    firsts = [s.next_batch(8)[:, 0].tolist() for s in streams]
    assert not set(firsts[0]) & set(firsts[1])
    batch = streams[0].next_batch(4)
    assert torch.equal(batch[:, 1:], batch[:, :-1] + 1)  # contiguous windows of seq_len + 1 tokens
    state = streams[0].state_dict()
    expected = [streams[0].next_batch(50) for _ in range(30)]  # crosses epoch boundaries
    resumed = WindowStream(tokens, 16, 0, 2, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(e, resumed.next_batch(50)) for e in expected)


@pytest.mark.quick
def test_validation_batches_are_fixed_and_split_across_ranks():
    tokens = np.arange(2_000, dtype=np.uint16)
    a = validation_batches(tokens, 16, 4, 2, rank=0, world_size=2)
    b = validation_batches(tokens, 16, 4, 2, rank=1, world_size=2)
    assert len(a) == 2 and a[0].shape == (4, 17)
    assert not set(torch.cat(a)[:, 0].tolist()) & set(torch.cat(b)[:, 0].tolist())
    assert torch.equal(torch.cat(a), torch.cat(validation_batches(tokens, 16, 4, 2, rank=0, world_size=2)))
    # 16 of the 124 windows, spread over the split: a few batches see every source of a corpus
    starts = sorted(torch.cat(a + b)[:, 0].tolist())
    assert starts[0] == 0 and starts[-1] >= 1_800 and max(np.diff(starts)) <= 8 * 16


def _cfg(**data):
    """The composed root config with data.* overrides and a small batch."""
    overrides = [f"data={data.pop('kind')}", "trainer.micro_batch_size=2", "trainer.eval_batches=2"]
    overrides += [f"data.{k}={v}" for k, v in data.items()]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_embedded_corpus_is_real_english_with_a_fixed_split(cache_dir):
    train, val = embedded_documents()
    assert len(train) > 1_400 and 50 <= len(val) < len(train) // 10
    text = " ".join(train)
    assert "alphabet" in text and " the " in text and "[[" not in text  # Wikipedia, markup dropped
    # the World English Bible, a chapter per document, Genesis trains and Revelation's end validates
    assert "In the beginning God created the heavens and the earth." in text and "God's Spirit" in text
    assert not any(w in text for w in ("1001001", " 1. In the"))  # the readers' edition: no verse numbers
    assert val[-1].endswith("Come, Lord Jesus. The grace of the Lord Jesus be with all the saints. Amen.")
    assert "Come, Lord Jesus" not in text
    assert sum(map(len, train)) > 6_500_000  # was 2.9 MB before the Bible: 3,000 study steps read it 3.8 times
    cfg = _cfg(kind="embedded", cache_dir=str(cache_dir), seq_len=32)
    bundle = build_data(cfg, rank=0, world_size=2)
    assert bundle.vocab_size <= 8192 and bundle.train.num_windows > 50_000
    assert bundle.train.next_batch(2).shape == (2, 33)
    cached = sorted(p.name for p in next(p for p in cache_dir.glob("embedded-*") if p.is_dir()).iterdir())
    assert cached == ["tokenizer.json", "train.npy", "val.npy"]


@pytest.mark.quick
def test_local_folder_of_txt_and_jsonl(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "cat", "sleeps", "on", "mat"]
    rng = np.random.default_rng(0)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 400)))
    with open(corpus / "more.jsonl", "w") as f:
        for _ in range(6):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 400))}) + "\n")
    train, val = local_documents(str(corpus), "text", 0.2)
    assert len(train) + len(val) == 12 and len(val) >= 2
    cfg = _cfg(
        name="local",
        kind="local",
        path=str(corpus),
        cache_dir=str(tmp_path / "cache"),
        seq_len=16,
        bpe_vocab_size=300,
        val_fraction=0.2,
    )
    bundle = build_data(cfg, rank=1, world_size=2)
    assert bundle.vocab_size <= 300 and bundle.train.next_batch(3).shape == (3, 17)
    assert bundle.val_batches and bundle.val_batches[0].shape[1] == 17


def _corpus(folder: Path, docs: int = 4, words: int = 300) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    vocabulary = ["alpha", "beta", "gamma", "delta", "the", "and", "of", "river", "stone", "light"]
    for i in range(docs):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(vocabulary, words)))
    return folder


@pytest.mark.quick
def test_malformed_jsonl_line_is_refused_naming_file_and_line(tmp_path):
    from train.data import DataError

    corpus = _corpus(tmp_path / "corpus")
    (corpus / "notes.jsonl").write_text('{"text": "fine"}\n\n{"text": "broken\n{"text": "fine again"}\n')
    with pytest.raises(DataError, match=r"notes\.jsonl line 3: not valid JSON \(Unterminated string"):
        local_documents(str(corpus), "text", 0.2)
    (corpus / "notes.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"notes\.jsonl line 2: not an object with a string field 'text'"):
        local_documents(str(corpus), "text", 0.2)


@pytest.mark.quick
def test_undecodable_bytes_are_replaced_with_a_warning_and_empty_files_skipped(tmp_path, caplog):
    corpus = _corpus(tmp_path / "corpus", docs=2)
    (corpus / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    (corpus / "latin1.jsonl").write_bytes(b'{"text": "na\xefve"}\n')
    (corpus / "empty.txt").write_text("")
    (corpus / "blank.txt").write_text("  \n\t\n")
    with caplog.at_level(logging.WARNING):
        train, val = local_documents(str(corpus), "text", 0.2)
    docs = train + val
    assert len(docs) == 4  # 2 documents, the two latin-1 files; the empty and blank files are skipped
    assert "caf\ufffd au lait" in docs and "na\ufffdve" in docs
    assert "latin1.txt: bytes that are not UTF-8 (first at byte 3)" in caplog.text
    assert "latin1.jsonl: bytes that are not UTF-8" in caplog.text


@pytest.mark.quick
def test_corpus_too_small_for_one_validation_window_is_refused(tmp_path):
    from train.data import DataError, prepare_data

    corpus = _corpus(tmp_path / "corpus", docs=6, words=40)
    local = {"kind": "local", "path": str(corpus), "cache_dir": str(tmp_path / "cache"), "bpe_vocab_size": 300}
    with pytest.raises(DataError, match=r"the validation split has \d+ tokens, fewer than one window of data.seq_len"):
        prepare_data(_cfg(**local, seq_len=512), world_size=2)
    prepare_data(_cfg(**local, seq_len=8), world_size=2)  # the same corpus feeds shorter windows


@pytest.mark.quick
def test_pile_needs_zstandard(monkeypatch):
    from train.config import ConfigError, validate

    cfg = _cfg(kind="pile")
    validate(cfg)  # installed (requirements.txt)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as on a machine without it
    with pytest.raises(ConfigError, match="data.dataset=monology/pile-uncopyrighted is read from .zst files"):
        validate(cfg)
    validate(_cfg(kind="pile", dataset="json", data_files=str(ROOT / "README.md")))  # plain json needs nothing


def test_pile_loader_streams_a_local_jsonl_with_a_local_tokenizer(tmp_path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    docs = [f"Document number {i} says hello to the streaming loader. " * 20 for i in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:30]))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[30:]))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(
        tmp_path / "tok"
    )
    cfg = _cfg(
        name="pile",
        kind="pile",
        dataset="json",
        data_files=str(tmp_path / "train.jsonl"),
        val_data_files=str(tmp_path / "val.jsonl"),
        tokenizer=str(tmp_path / "tok"),
        seq_len=32,
        val_docs=5,
    )
    bundle = build_data(cfg, rank=0, world_size=2)
    assert bundle.vocab_size <= 400 and bundle.val_batches[0].shape == (2, 33)
    bundle.train.next_batch(2)
    state = json.loads(json.dumps(bundle.train.state_dict()))
    expected = [bundle.train.next_batch(2) for _ in range(5)]
    again = build_data(cfg, rank=0, world_size=2).train
    again.load_state_dict(state)
    assert all(torch.equal(e, again.next_batch(2)) for e in expected)


@pytest.mark.quick
def test_bpe_cache_is_built_once(tmp_path):
    calls = []

    def docs():
        calls.append(1)
        return ["alpha beta gamma delta " * 50] * 4, ["alpha beta " * 50]

    first = bpe_token_arrays(tmp_path, "unit", 300, docs)
    second = bpe_token_arrays(tmp_path, "unit", 300, docs)
    assert len(calls) == 1 and np.array_equal(first[0], second[0]) and first[2] == second[2]


LOCK_S, LOCK_SLACK_S = 1.0, 2.0  # data.cache_lock_timeout_s here; the waiter's last pause (0.5 s) and a loaded host


def _unit_docs():
    return ["alpha beta gamma delta " * 50] * 4, ["alpha beta " * 50]


@pytest.mark.quick
@pytest.mark.timeout(30)
def test_a_silent_holder_of_the_cache_lock_ends_the_waiter_within_its_timeout(tmp_path):
    """Another process holds the cache's lock and sleeps (it never rewrites the lock file, as a holder stopped with
    SIGSTOP would not): the waiter stops with one CacheLockError naming the lock file and its setting once the file
    has been silent for data.cache_lock_timeout_s, not before, and builds nothing. Before, it waited in flock for
    ever."""
    import subprocess

    from train.data import CacheLockError

    lock = tmp_path / "unit-bpe300-v1.lock"  # the lock of bpe_token_arrays(tmp_path, "unit", 300, ...)
    hold = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
    hold += "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(CacheLockError) as raised:
            bpe_token_arrays(tmp_path, "unit", 300, pytest.fail, lock_timeout_s=LOCK_S)
        waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert LOCK_S <= waited <= LOCK_S + LOCK_SLACK_S, waited
    message = str(raised.value)
    assert f"the token cache's lock {lock} is held by a process that did not name itself" in message, message
    assert f"data.cache_lock_timeout_s={LOCK_S:g}" in message and "\n" not in message, message
    assert not (tmp_path / "unit-bpe300-v1").exists()


@pytest.mark.quick
@pytest.mark.timeout(60)
def test_a_live_holder_of_the_cache_lock_keeps_its_waiter_past_the_timeout(tmp_path):
    """A holder that builds for three times the waiter's timeout (LOCK_S) but beats (rewrites the lock file every
    LOCK_S / 4) keeps the waiter: it gets the holder's cache when the build ends, and builds nothing itself. A
    deadline counted from the start of the wait, not from the holder's last sign of life, would end it at LOCK_S."""
    import threading

    building = threading.Event()

    def slow_docs():
        building.set()
        time.sleep(3 * LOCK_S)
        return _unit_docs()

    holder = threading.Thread(target=bpe_token_arrays, args=(tmp_path, "unit", 300, slow_docs, LOCK_S))
    holder.start()  # flock conflicts between two opens of the file, in one process too
    try:
        assert building.wait(30)
        started = time.monotonic()
        tokens, _, vocab = bpe_token_arrays(tmp_path, "unit", 300, pytest.fail, lock_timeout_s=LOCK_S)
        waited = time.monotonic() - started
    finally:
        holder.join()
    assert waited >= 2 * LOCK_S, waited  # past its own timeout, for the holder's build
    assert len(tokens) > 0 and vocab <= 300


@pytest.mark.quick
def test_the_holder_of_the_cache_lock_names_itself_before_its_work_starts(tmp_path, monkeypatch):
    """The holder writes who it is into the lock file before the work under the lock starts, not only from its
    heartbeat thread: a holder stopped at once (the pre-flight's peer SIGSTOPped as its build began, under load)
    otherwise left the file empty, and its waiter said "a process that did not name itself" (seen on a suite run
    at -n 4, 2026-12-04). The heartbeat thread is held back here, so only the holder's own write can name it."""
    import os
    import threading

    from train import data

    class Unstarted(threading.Thread):
        def start(self):  # the heartbeat never runs
            pass

        def join(self, timeout=None):
            pass

    monkeypatch.setattr(data.threading, "Thread", Unstarted)
    lock = tmp_path / "entry.lock"
    with data._file_lock(lock, 1.0):
        words = lock.read_text()
    assert words.startswith(f"pid {os.getpid()} on host ") and "; beat 0" in words, words


# ----------------------------------------------------------------------------- the step


@pytest.mark.quick
def test_non_finite_gradients_skip_the_step(tmp_path):
    """A NaN gradient is caught before aggregation; the step is skipped and counted, the next one runs.
    (A small local corpus: the step does not depend on the text, and it needs no embedded token cache.)"""
    from tests.runs import in_process_trainer

    corpus = _corpus(tmp_path / "corpus", docs=6)
    with in_process_trainer(corpus, tmp_path / "cache", tmp_path, "trainer.max_steps=10") as trainer:
        model = trainer.model
        before = [p.detach().clone() for p in model.parameters()]
        handle = next(model.parameters()).register_hook(lambda g: g * float("nan"))
        record = trainer.train_step()
        handle.remove()
        assert record["skipped_steps"] == 1 and trainer.state.step == 1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert trainer.scheduler.last_epoch == 0  # the schedule did not advance either
        record = trainer.train_step()
        assert record["skipped_steps"] == 1 and trainer.scheduler.last_epoch == 1
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# ----------------------------------------------------------------------------- fp16 loss scale


class DeepSpeedDynamicLossScaler:
    """DeepSpeed's rule (deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale with
    consecutive_hysteresis=False), transcribed as the reference; min scale clamps instead of raising."""

    def __init__(self, init_scale, scale_window, delayed_shift, min_scale):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = 2.0, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


@pytest.mark.quick
def test_fp16_loss_scale_follows_deepspeed_with_hysteresis_and_minimum():
    from train.loss_scale import PythiaLossScaler

    def make():
        param = torch.nn.Parameter(torch.zeros(3))
        return param, torch.optim.SGD([param], lr=0.1)

    rng = np.random.default_rng(0)
    # bursts of overflows (down to the minimum scale) and clean stretches (growth after the window)
    overflows = [bool(x) for x in rng.random(400) < np.repeat(rng.choice([0.02, 0.9], 20), 20)]
    reference = DeepSpeedDynamicLossScaler(init_scale=2.0**4, scale_window=5, delayed_shift=2, min_scale=1.0)
    scaler = PythiaLossScaler("cpu", init_scale=2.0**4, window=5, hysteresis=2, min_scale=1.0)
    param, optimizer = make()
    seen = set()
    for i, overflow in enumerate(overflows):
        if i == 200:  # a checkpoint round trip in the middle changes nothing
            state = scaler.state_dict()
            scaler = PythiaLossScaler("cpu", init_scale=2.0**4, window=5, hysteresis=2, min_scale=1.0)
            scaler.load_state_dict(state)
            param, optimizer = make()
        scaler.scale((param * torch.full((3,), float("inf") if overflow else 1.0)).sum()).backward()
        before = param.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        reference.update_scale(overflow)
        assert scaler.get_scale() == reference.cur_scale, i
        assert torch.equal(param.detach(), before) == overflow  # an overflow skips the step
        seen.add(scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
    assert {1.0, 2.0**4, 2.0**5} <= seen  # the minimum was reached and the scale grew past its start


@pytest.mark.quick
def test_fp16_scaler_defaults_are_pythias():
    from train.config import TrainerConfig
    from train.loss_scale import build_loss_scaler

    scaler = build_loss_scaler(TrainerConfig(), torch.device("cpu"))
    # released configs: "initial_scale_power": 12, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1
    assert (scaler.get_scale(), scaler.window, scaler.hysteresis, scaler.min_scale) == (4096.0, 1000, 2, 1.0)


# ----------------------------------------------------------------------------- step metrics


@pytest.mark.parametrize("name", ["tiny", "pythia-14m"])
def test_model_flops_per_token_match_torchs_flop_counter(name):
    """MFU's numerator: the FLOPs torch's FlopCounterMode counts in one forward and backward pass of the
    built model (eager attention, so the score and value matmuls are counted too), per token."""
    from torch.utils.flop_counter import FlopCounterMode

    from train.metrics import model_flops_per_token
    from train.model import build_model

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        m = compose(config_name="config", overrides=[f"model={name}"]).model
    model = build_model(m)
    model.set_attn_implementation("eager")
    batch, seq_len = 2, 48
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 256, (batch, seq_len))).logits.float().sum().backward()
    assert model_flops_per_token(m, seq_len) == pytest.approx(counter.get_total_flops() / (batch * seq_len), rel=1e-3)


@pytest.mark.quick
def test_peak_flops_from_config_or_known_gpus():
    from train.metrics import KNOWN_PEAK_TFLOPS, peak_flops_per_device

    cfg = _cfg(kind="embedded")
    assert peak_flops_per_device(cfg, torch.device("cpu")) is None  # no known peak: no mfu logged
    cfg.trainer.peak_tflops = 2.5
    assert peak_flops_per_device(cfg, torch.device("cpu")) == 2.5e12
    # data sheets: A100 312 bf16 / 19.5 fp32; H100 SXM 989 / 67; the PCIe H100 matched before the SXM one
    assert KNOWN_PEAK_TFLOPS["A100"] == (312.0, 19.5) and KNOWN_PEAK_TFLOPS["H100"] == (989.0, 67.0)
    names = list(KNOWN_PEAK_TFLOPS)
    assert names.index("H100 PCIe") < names.index("H100") and names.index("A10G") < names.index("A10")
    # issue 52's targets are MFU against 989 (H200 SXM, bf16 dense); the NVL card's own rate is matched first
    assert KNOWN_PEAK_TFLOPS["H200"] == (989.0, 67.0) and names.index("H200 NVL") < names.index("H200")
    for fragment, tflops in (("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 80GB HBM3", 989.0)):
        first = next(f for f in KNOWN_PEAK_TFLOPS if f in fragment)
        assert KNOWN_PEAK_TFLOPS[first][0] == tflops, fragment


# ----------------------------------------------------------------------------- the run's logger (W&B)

LOGGER_S, LOGGER_SLACK_S = 1.0, 2.0  # wandb.start_timeout_s / close_timeout_s here; a loaded host


def _logger_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _held_past_its_deadline(call, release) -> str:
    """``call()``, whose W&B call is held until ``release`` is set, must raise LoggerError at its deadline (LOGGER_S),
    not before, and within LOGGER_SLACK_S after: its message. ``release`` is set after, whatever happened."""
    from train.metrics import LoggerError

    started = time.monotonic()
    try:
        with pytest.raises(LoggerError) as raised:
            call()
        waited = time.monotonic() - started
    finally:
        release.set()
    assert LOGGER_S <= waited <= LOGGER_S + LOGGER_SLACK_S, waited
    return str(raised.value)


@pytest.mark.quick
@pytest.mark.timeout(60)
def test_a_w_and_b_start_past_its_deadline_ends_with_one_line_naming_it_and_its_mode(tmp_path, monkeypatch):
    """wandb.init held past wandb.start_timeout_s (here by a network that never answers): RunLogger stops waiting at
    the deadline, not before, with one LoggerError naming W&B, its mode and the setting. Before, nothing bounded it."""
    import threading

    import wandb

    from train.metrics import RunLogger

    answer = threading.Event()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: answer.wait(20))
    cfg = _logger_cfg("wandb.mode=offline", f"wandb.start_timeout_s={LOGGER_S}")
    message = _held_past_its_deadline(lambda: RunLogger(cfg, tmp_path, 2, True, 0), release=answer)
    assert message.startswith("W&B (wandb.mode=offline), the run's logger, did not start within 1s "), message
    assert "(wandb.start_timeout_s)" in message and "\n" not in message, message


@pytest.mark.timeout(120)
def test_a_w_and_b_close_past_its_deadline_ends_with_one_line_naming_its_files(tmp_path, monkeypatch):
    """A real offline W&B run whose finish (online: the upload) is held past wandb.close_timeout_s: close() stops
    waiting at the deadline with one LoggerError naming W&B, its mode, the setting and the files to sync later."""
    import threading

    import wandb

    from train.metrics import RunLogger

    cfg = _logger_cfg("wandb.mode=offline", f"wandb.close_timeout_s={LOGGER_S}")
    logger = RunLogger(cfg, tmp_path, world_size=2, is_main=True, resumed_step=0)
    run, finish, uploaded, finished = logger.wandb_run, wandb.Run.finish, threading.Event(), threading.Event()

    def slow_finish(self, *args, **kwargs):
        uploaded.wait(20)
        try:
            return finish(self, *args, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(wandb.Run, "finish", slow_finish)
    message = _held_past_its_deadline(logger.close, release=uploaded)
    assert message.startswith("W&B (wandb.mode=offline), the run's logger, did not close within 1s "), message
    assert f"`wandb sync {tmp_path / 'wandb'}/*run-*-{run.id}`" in message and "\n" not in message, message
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run.id}"))) == 1  # what that command uploads
    assert finished.wait(60)  # the finish left behind, let go, ends the run


@pytest.mark.quick
@pytest.mark.timeout(60)
def test_a_w_and_b_online_start_without_a_key_ends_with_one_line_naming_it(tmp_path, monkeypatch):
    """W&B online with no key (no WANDB_API_KEY, no ~/.netrc): W&B's own refusal, as one LoggerError naming W&B, its
    mode and what to check."""
    from train.metrics import LoggerError, RunLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(LoggerError) as raised:
        RunLogger(_logger_cfg("wandb.mode=online"), tmp_path / "run", world_size=2, is_main=True, resumed_step=0)
    message = str(raised.value)
    assert message.startswith("W&B (wandb.mode=online), the run's logger, failed to start (online: "), message
    assert "`wandb login`" in message and "UsageError: No API key configured" in message, message
