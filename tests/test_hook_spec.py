"""CERAR between real processes held to the specification written out independently
(``tests/spec_reference.py``), not to ``cerar.simulate``, which drives the same ``CodedRingRank``
as ``cerar.all_reduce`` and so would share its mistakes:

- ``cerar.all_reduce`` in float32 with the default storage, on the chunked path every real gradient takes;
- the DDP communication hook, bucket by bucket;
- the trainer's overlap mode (the hook inside backward, as ``train/`` installs it);
- the last rank's exact sum under the closed-form constructions, against the sum itself;
- ranks that disagree on N, c, construction or eps: every rank stops at once, naming the field.

One launch of N processes serves the first, second, fourth and fifth (module fixture); the trainer gets
its own. Tolerances are the code's: kappa times the transport's unit roundoff times sqrt(c + L) + N
(``tests/test_spec_reference.py`` explains the factor).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import cerar
from cerar.ring.rounds import pipeline_chunks
from tests.distributed import run_workers
from tests.spec_reference import spec_all_reduce, spec_least_squares_decoders, spec_matrices

N = 4
FLOAT32_UNIT_ROUNDOFF = 2.0**-24
FLOAT64_UNIT_ROUNDOFF = 2.0**-53
AGREEMENT_TIMEOUT_S = 60.0  # a rank that waits this long for a disagreeing peer has not stopped "at once"

# (c, construction, eps, kappa_max) of every code the launch uses; built in the test process first so that
# the workers read the optimized ones from the suite's cache instead of each searching. The float32 checks
# use codes of moderate kappa, where the rounding allowed (kappa x 2^-24 x (sqrt(c + L) + N)) is 5e-5 to
# 2e-4: a decoder wrong by 0.1 % fails them; at the default kappa_max 1e4 it would be 5e-3.
CHUNKED_CODES = [(8, "optimized", None, 100.0), (12, "perturbation", 0.2, None)]
HOOK_CODES = [(8, "perturbation", 0.05, None), (8, "optimized", None, None)]
EXACT_LAST_CODES = [(8, "perturbation", 0.05, None), (6, "vandermonde", 0.3, None)]
DISAGREEMENTS = {  # field -> (what ranks 0, 2, 3 pass, what rank 1 passes), as make_code arguments
    "c": ((8, "perturbation", 0.05, None), (9, "perturbation", 0.05, None)),
    "construction": ((8, "perturbation", None, None), (8, "optimized", None, None)),
    "eps": ((8, "perturbation", 0.05, None), (8, "perturbation", 0.1, None)),
}
HOOK_BUCKET_CAP_MB = 0.002  # about 500 float32 values: the model's 1 105 gradients travel in several buckets


def tolerance(code: cerar.Code, dtype: torch.dtype) -> float:
    unit = FLOAT32_UNIT_ROUNDOFF if dtype == torch.float32 else FLOAT64_UNIT_ROUNDOFF
    return max(code.kappa, 1.0) * unit * (np.sqrt(code.c + code.L) + code.N)


def spec_code_matrices(code: cerar.Code) -> tuple[np.ndarray, np.ndarray]:
    """A_j and D_i rebuilt from the code's points by the spec (for the optimized construction, whichever
    of the spec's two decoders, polynomial or least-squares, the code chose)."""
    A, D = spec_matrices(code.points, code.N)
    if code.construction == "optimized":
        D = min([D, spec_least_squares_decoders(A, code.N)], key=lambda Dc: np.abs(code.D - Dc).max())
    return A, D


def relative_errors(results: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """||result_i - reference_i|| / ||reference_i|| for every worker i (rows)."""
    return np.linalg.norm(results - reference, axis=1) / np.linalg.norm(reference, axis=1)


def chunked_length(c: int) -> int:
    """A d whose blocks travel as two chunks, and that c does not divide."""
    d = c * 2 * 2**16 + 5
    assert len(pipeline_chunks(-(-d // c))) == 2
    return d


def gradients(d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((N, d))


# ------------------------------------------------------------------------------------------ one launch


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def _hook_buckets(rank: int, c: int, construction: str, eps: float | None, steps: int) -> list[tuple]:
    """Every bucket DDP handed the CERAR hook on this rank, and what the hook made of it."""
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    from cerar.ddp import CerarHookState, cerar_hook

    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording_hook(state, bucket):
        given = bucket.buffer().clone()  # this rank's gradients, before any reduction
        return cerar_hook(state, bucket).then(lambda f: pairs.append((given, f.value().clone())) or f.value())

    model = DDP(_tiny_model(), bucket_cap_mb=HOOK_BUCKET_CAP_MB)
    model.register_comm_hook(CerarHookState(c=c, construction=construction, eps=eps, timeout=60), recording_hook)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(100 + rank))
    y = x[:, :1].sin() + 0.1 * x[:, 1:2]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return pairs


def _timed_call(tensor: torch.Tensor, *code_args) -> tuple[str, str, float]:
    """(exception type, message, seconds) of one all_reduce with this rank's code, make_code(*code_args)."""
    code = cerar.make_code(*code_args)
    start = time.monotonic()
    try:
        cerar.all_reduce(tensor, code, op="sum", timeout=AGREEMENT_TIMEOUT_S)
    except (cerar.CollectiveError, ValueError) as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return "none", "", time.monotonic() - start


def _launch_worker(rank, world_size, hook_steps):
    torch.set_num_threads(1)
    out: dict = {"chunked": {}, "exact_last": {}, "hook": {}, "disagree": {}}
    for c, construction, eps, kappa_max in CHUNKED_CODES:  # float32, the default storage (no storage argument)
        mine = torch.from_numpy(gradients(chunked_length(c), seed=c)[rank]).float()
        cerar.all_reduce(mine, cerar.make_code(world_size, c, construction, eps, kappa_max), timeout=120)
        out["chunked"][(c, construction)] = mine
    for c, construction, eps, _ in EXACT_LAST_CODES:
        for dtype in (torch.float64, torch.float32):
            mine = torch.from_numpy(gradients(1000, seed=3)[rank]).to(dtype)
            cerar.all_reduce(mine, cerar.make_code(world_size, c, construction, eps=eps), timeout=60)
            out["exact_last"][(c, construction, str(dtype))] = mine
    for c, construction, eps, _ in HOOK_CODES:
        out["hook"][(c, construction)] = _hook_buckets(rank, c, construction, eps, hook_steps)
    for field, (agreed, other) in DISAGREEMENTS.items():
        out["disagree"][field] = _timed_call(torch.ones(999), world_size, *(other if rank == 1 else agreed))
    # Last: a code for another N on rank 1. Should rank 1 stop alone, its peers would wait for it here.
    N_of_rank = world_size + 1 if rank == 1 else world_size
    out["disagree"]["N"] = _timed_call(torch.ones(999), N_of_rank, 8, "perturbation", 0.05)
    return out


@pytest.fixture(scope="module")
def launch():
    for code_args in {*CHUNKED_CODES, *HOOK_CODES, *EXACT_LAST_CODES, *sum(DISAGREEMENTS.values(), ())}:
        cerar.make_code(N, *code_args)  # optimized: searched once here, read from the cache there
    hook_steps = 3
    return run_workers(_launch_worker, N, args=(hook_steps,), timeout_s=300, group_timeout_s=120), hook_steps


@pytest.mark.quick
@pytest.mark.parametrize(("c", "construction", "eps", "kappa_max"), CHUNKED_CODES)
def test_float32_all_reduce_with_the_default_storage_computes_the_specs_protocol(
    launch, c, construction, eps, kappa_max
):
    results, _ = launch
    code = cerar.make_code(N, c, construction, eps, kappa_max)
    G = torch.from_numpy(gradients(chunked_length(c), seed=c)).float().double().numpy()
    reference = spec_all_reduce(G, *spec_code_matrices(code))
    got = np.stack([results[rank]["chunked"][(c, construction)].double().numpy() for rank in range(N)])
    errors = relative_errors(got, reference)
    assert errors.max() <= tolerance(code, torch.float32), (errors, tolerance(code, torch.float32))


@pytest.mark.quick
@pytest.mark.parametrize(("c", "construction", "eps", "kappa_max"), EXACT_LAST_CODES)
def test_the_last_rank_gets_the_exact_sum_and_the_others_do_not(launch, c, construction, eps, kappa_max):
    """The spec: "Worker N-1 is always exact; worker 0 errs most", for the closed forms, here between
    processes and against the sum itself; the others' error is the code's, far above rounding."""
    results, _ = launch
    code = cerar.make_code(N, c, construction, eps=eps)
    for dtype in (torch.float64, torch.float32):
        if construction == "vandermonde" and dtype == torch.float32:
            continue  # kappa ~ 1e8: float32 carries nothing
        G = torch.from_numpy(gradients(1000, seed=3)).to(dtype).double().numpy()
        exact = np.tile(G.sum(0), (N, 1))
        key = (c, construction, str(dtype))
        got = np.stack([results[rank]["exact_last"][key].double().numpy() for rank in range(N)])
        errors = relative_errors(got, exact)
        assert errors[N - 1] <= tolerance(code, dtype), (dtype, errors)
        assert errors[0] == errors.max() and errors[: N - 1].min() > 10 * tolerance(code, dtype), (dtype, errors)


@pytest.mark.quick
@pytest.mark.parametrize(("c", "construction", "eps", "kappa_max"), HOOK_CODES)
def test_ddp_hook_gives_every_bucket_the_specs_average(launch, c, construction, eps, kappa_max):
    results, steps = launch
    code = cerar.make_code(N, c, construction, eps=eps)
    A, D = spec_code_matrices(code)
    buckets = [results[rank]["hook"][(c, construction)] for rank in range(N)]
    assert len({len(b) for b in buckets}) == 1 and len(buckets[0]) >= 2 * steps - 1  # several buckets a step
    for k in range(len(buckets[0])):
        G = np.stack([buckets[rank][k][0].double().numpy() for rank in range(N)])
        reference = spec_all_reduce(G, A, D) / N
        got = np.stack([buckets[rank][k][1].double().numpy() for rank in range(N)])
        errors = relative_errors(got, reference)
        assert errors.max() <= tolerance(code, torch.float32), (k, errors)
        assert np.abs(got[0] - got[N - 1]).max() > 0  # approximate: the check had something to tell


@pytest.mark.quick
@pytest.mark.parametrize("field", [*DISAGREEMENTS, "N"])
def test_ranks_that_disagree_on_the_code_all_stop_at_once_naming_it(launch, field):
    results, _ = launch
    for rank in range(N):
        kind, message, seconds = results[rank]["disagree"][field]
        assert kind == "CollectiveError", (rank, kind, message)
        assert f"ranks disagree on {field} " in message, (rank, message)
        assert seconds < AGREEMENT_TIMEOUT_S / 4, (rank, seconds)  # not the round deadline: at once


# ------------------------------------------------------------------------------ the trainer's overlap mode


KAPPA_MAX_OVERLAP = 100.0  # aggregator=cerar's construction (optimized), conditioned for a tight float32 check


def _overlap_trainer_worker(rank, world_size, corpus, cache, run_dir, c):
    import cerar.ddp
    from tests.runs import composed
    from train.run import run

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = cerar.ddp.cerar_hook

    def recording_hook(state, bucket):  # what train/ installs, recorded
        given = bucket.buffer().clone()
        return hook(state, bucket).then(lambda f: pairs.append((given, f.value().clone())) or f.value())

    cerar.ddp.cerar_hook = recording_hook  # train.aggregation.aggregators imports it when it registers the hook
    overrides = [
        "model=tiny",
        "data=local",
        f"data.path={corpus}",
        f"data.cache_dir={cache}",
        "data.bpe_vocab_size=300",
        "data.seq_len=16",
        "trainer.micro_batch_size=2",
        "trainer.eval_batches=1",
        "trainer.eval_every=0",
        "trainer.max_steps=2",
        "trainer.bucket_cap_mb=0.25",  # several buckets a step
        "trainer.progress_bar=false",
        "trainer.overlap=true",
        "aggregator=cerar",
        f"c={c}",
        f"aggregator.kappa_max={KAPPA_MAX_OVERLAP}",
        "aggregator.equilibrate=false",  # the spec's protocol on the raw buckets (tests/test_equilibrate.py: scaled)
        "checkpoint.every=0",
        "wandb.mode=disabled",
    ]
    summary = run(composed(*overrides), Path(run_dir))
    return pairs, summary["overlap"], summary["aggregator"]


@pytest.mark.slow
def test_the_trainers_overlap_mode_gives_every_bucket_the_specs_average(tmp_path):
    world_size, c = 3, 8
    code = cerar.make_code(world_size, c, "optimized", kappa_max=KAPPA_MAX_OVERLAP)  # aggregator=cerar's, searched once
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = ["river", "stone", "light", "the", "and", "of", "north", "wind", "sings", "slowly", "over", "hills"]
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 600)))
    args = (str(corpus), str(tmp_path / "cache"), str(tmp_path / "run"), c)
    results = run_workers(_overlap_trainer_worker, world_size, args=args, timeout_s=400, group_timeout_s=120)
    assert all(overlap and name == "cerar" for _, overlap, name in results)
    A, D = spec_code_matrices(code)
    buckets = [pairs for pairs, _, _ in results]
    assert len({len(b) for b in buckets}) == 1 and len(buckets[0]) > 2  # two steps, more than one bucket a step
    for k in range(len(buckets[0])):
        G = np.stack([buckets[rank][k][0].double().numpy() for rank in range(world_size)])
        reference = spec_all_reduce(G, A, D) / world_size
        got = np.stack([buckets[rank][k][1].double().numpy() for rank in range(world_size)])
        errors = relative_errors(got, reference)
        assert errors.max() <= tolerance(code, torch.float32), (k, errors)
