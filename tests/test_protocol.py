"""CERAR and the exact ring between real processes (gloo), against the single-process oracle.

Every test that runs the protocol, the ring or the hook runs under both point-to-point contracts
(``tests.nccl_emulation``): gloo's own, and NCCL's emulated on gloo (one work per batch whose wait
bounds nothing on the host), so code that holds only on gloo fails here on a CPU machine."""

import os
import resource
import signal
import time

import pytest
import torch
import torch.distributed as dist

import cerar
from cerar.ring.precision import rounding_bound, sum_rounding_bound
from tests.distributed import WorkerError, run_workers
from tests.nccl_emulation import CONTRACTS, transport_log


@pytest.fixture(params=CONTRACTS)
def contract(request):
    """The point-to-point contract the test runs under: gloo's, or NCCL's emulated on gloo."""
    return request.param


def gradients(N: int, d: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Every worker's gradient, identical in every process: row i belongs to rank i."""
    return torch.randn(N, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def code_for(N: int, c: int) -> cerar.Code:
    return cerar.make_code(N, c, "exact") if c <= N else cerar.make_code(N, c, "perturbation", eps=0.05)


def close(result: torch.Tensor, expected: torch.Tensor, G: torch.Tensor, bound: float) -> bool:
    """Whether ``result`` lies within ``bound`` x ||G||_F of ``expected``: the bounds come from
    ``cerar.ring.precision`` (kappa times the dtype's rounding), so that they hold whichever BLAS kernel
    (AVX2, AVX-512) rounded each side; two correct computations differ by at most the sum of theirs."""
    return (result.double() - expected.double()).norm().item() <= bound * G.double().norm().item()


CASES_D = (1001, 3)  # odd d, and d < c for the larger c


def cases(N):
    return [(c, d) for c in (1, N, 2 * N + 1) for d in CASES_D]


# --- results equal the oracle ---------------------------------------------------------------------


def _all_cases_worker(rank, N):
    out = []
    for k, (c, d) in enumerate(cases(N)):
        G = gradients(N, d, seed=k)
        mine = G[rank].clone()
        stats = cerar.all_reduce(mine, code_for(N, c))
        reference = G[rank].clone()
        dist.all_reduce(reference)
        before = transport_log()["bytes_isend"]
        ring = G[rank].clone()
        ring_stats = cerar.ring_all_reduce(ring)
        ring_measured = transport_log()["bytes_isend"] - before
        out.append((mine, stats, reference, ring, ring_stats, ring_measured))
    return out, transport_log()["bytes_isend"]


@pytest.mark.parametrize("N", [2, 3, 4, 5])
def test_every_rank_gets_what_the_oracle_computes_and_exact_codes_match_dist_all_reduce(N, contract):
    results = run_workers(_all_cases_worker, N, contract=contract)
    for rank in range(N):  # the bytes cerar reports are the bytes handed to isend, measured beside it
        per_case, measured = results[rank]
        assert sum(stats.bytes_sent + ring_stats.bytes_sent for _, stats, _, _, ring_stats, _ in per_case) == measured
        assert all(ring_stats.bytes_sent == ring_measured for *_, ring_stats, ring_measured in per_case)
    for k, (c, d) in enumerate(cases(N)):
        code = code_for(N, c)
        G = gradients(N, d, seed=k)
        expected = cerar.simulate(G, code)
        coded, summed = rounding_bound(code, torch.float32), sum_rounding_bound(N, torch.float32)
        for rank in range(N):
            mine, stats, reference, ring, ring_stats, _ = results[rank][0][k]
            assert close(mine, expected[rank], G, 2 * coded), (c, d, rank)
            if code.is_exact:
                assert close(mine, reference, G, coded + summed), (c, d, rank)
            assert close(ring, reference, G, 2 * summed), (d, rank)
            # the measured bytes are the rate table's, exactly
            assert stats.rounds == c + N - 2
            assert stats.bytes_sent == stats.bytes_received == (c + N - 2) * -(-d // c) * 4
            assert ring_stats.rounds == 2 * (N - 1)
            assert ring_stats.bytes_sent == 2 * (N - 1) * -(-d // N) * 4


def _pipelined_worker(rank, N, c, d):
    G = gradients(N, d, seed=7)
    mine = G[rank].clone()
    cerar.all_reduce(mine, cerar.make_code(N, c, "perturbation", eps=0.05))
    return mine


def test_large_blocks_travel_in_pipelined_chunks_with_the_same_result(contract):
    from cerar.ring.rounds import pipeline_chunks

    N, c = 3, 7
    d = c * 2 * 2**16 + 5  # m just over two chunks' worth, and d not a multiple of c
    assert len(pipeline_chunks(-(-d // c))) == 2
    code, G = cerar.make_code(N, c, "perturbation", eps=0.05), gradients(N, d, seed=7)
    expected = cerar.simulate(G, code)
    for rank, mine in enumerate(run_workers(_pipelined_worker, N, args=(c, d), contract=contract)):
        assert close(mine, expected[rank], G, 2 * rounding_bound(code, torch.float32))


def _shapes_worker(rank, N):
    code = cerar.make_code(N, 8, "perturbation", eps=0.05)
    G = gradients(N, 6 * 7, seed=1, dtype=torch.float64)
    matrix = G[rank].clone().view(6, 7).t()  # non-contiguous, two-dimensional
    cerar.all_reduce(matrix, code, op="avg")
    ring = G[rank].clone().view(6, 7).t()
    cerar.ring_all_reduce(ring, op="avg")
    return matrix.clone(), ring, matrix.is_contiguous()


def test_any_shape_and_contiguity_in_place_with_averaging_in_float64(contract):
    N = 3
    results = run_workers(_shapes_worker, N, contract=contract)
    G = gradients(N, 42, seed=1, dtype=torch.float64)
    logical = torch.stack([g.view(6, 7).t().reshape(-1) for g in G])  # elements in the tensor's own order
    code = cerar.make_code(N, 8, "perturbation", eps=0.05)
    expected = cerar.simulate(logical, code) / N
    for rank, (matrix, ring, contiguous) in enumerate(results):
        assert not contiguous and matrix.shape == (7, 6)
        assert close(matrix.reshape(-1), expected[rank], logical / N, 2 * rounding_bound(code, torch.float64))
        assert close(ring.reshape(-1), logical.mean(0), logical / N, sum_rounding_bound(N, torch.float64))


# --- memory ---------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_worker(rank, N, c, d):
    code = cerar.make_code(N, c, "perturbation", eps=0.2)
    warmup = torch.ones(4 * c)
    cerar.all_reduce(warmup, code)  # connections and caches, before measuring
    tensor = torch.randn(d, generator=torch.Generator().manual_seed(rank))
    before = max(_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    stats = cerar.all_reduce(tensor, code)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak - before, stats.peak_extra_bytes


def test_working_memory_is_the_specs_one_plus_N_over_c_times_d():
    N, c, d = 4, 16, 16 * 2**20  # 64 MiB of float32 per rank
    m = d // c
    bound = (1 + N / c) * d * 4
    for measured, accounted in run_workers(_memory_worker, N, args=(c, d), timeout_s=300):
        assert accounted <= bound
        assert accounted == (c + N) * m * 4  # U_i and N message blocks: the injection rides on the round's product
        assert measured <= bound + 8 * 2**20  # what the process really grew by (RSS), with 8 MiB slack


# --- DDP communication hook -----------------------------------------------------------------------


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


HOOKS = {
    "exact code": dict(c=3, construction="exact"),
    "exact ring": dict(exact_ring=True),
    "c > N": dict(c=8, construction="perturbation", eps=0.05),
}
BUCKET_CAP_MB = 0.002  # about 500 float32 values: the model's 1 105 gradients travel in several buckets


class _Captured:
    """A CERAR hook state with a record of every bucket DDP handed over and what the hook made of it."""

    def __init__(self, state):
        self.state, self.inputs, self.results = state, [], []


def _capturing_hook(captured: _Captured, bucket):
    from cerar.ddp import cerar_hook

    captured.inputs.append(bucket.buffer().clone())  # this rank's gradients, before any reduction

    def keep(future):
        captured.results.append(future.value().clone())
        return future.value()

    return cerar_hook(captured.state, bucket).then(keep)


def _ddp_worker(rank, N, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    from cerar.ddp import CerarHookState

    torch.set_num_threads(1)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(100 + rank))
    y = x[:, :1].sin() + 0.1 * x[:, 1:2]
    runs = {}
    # DDP's own all-reduce, the reference, on a gloo group: under NCCL's contract (emulated) the reducer would copy
    # each bucket on the CPU before its transfer lands, where a GPU orders that copy after it (tests/nccl_emulation.py)
    reference_group = dist.new_group(backend="gloo")
    for name in ("default", *HOOKS):
        group = reference_group if name == "default" else None
        model = DDP(_tiny_model(), bucket_cap_mb=BUCKET_CAP_MB, process_group=group)
        captured = None
        if name != "default":
            captured = _Captured(CerarHookState(**HOOKS[name], timeout=30))
            model.register_comm_hook(captured, _capturing_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        record = (captured.inputs, captured.results, len(captured.state.last_stats)) if captured else None
        runs[name] = (params, losses, record)
    return runs, dist.group.WORLD.group_name, transport_log()["groups"]


def test_ddp_communication_hook_gives_every_bucket_the_oracles_average(contract):
    """Every bucket's result on every rank is what the single-process oracle makes of the ranks'
    buckets (their mean for the exact ring); exact codes and the exact ring end where DDP's own
    all-reduce does; the hook's messages never travel on DDP's group."""
    N, steps = 3, 6
    results = run_workers(_ddp_worker, N, args=(steps,), contract=contract, timeout_s=600)
    for name, options in HOOKS.items():
        inputs = [results[rank][0][name][2][0] for rank in range(N)]
        outputs = [results[rank][0][name][2][1] for rank in range(N)]
        buckets = len(inputs[0])
        assert buckets >= 2 * steps - 1, (name, buckets)  # two buckets a step (one in the first, before DDP rebuilds)
        assert all(len(inputs[r]) == len(outputs[r]) == buckets for r in range(N))
        for k in range(buckets):
            G = torch.stack([inputs[r][k] for r in range(N)])
            if options.get("exact_ring"):
                expected, tolerance = G.double().mean(0).expand(N, -1), sum_rounding_bound(N, torch.float32)
            else:
                code = cerar.make_code(N, options["c"], options["construction"], eps=options.get("eps"))
                expected = cerar.simulate(G, code) / N
                # The hook folds 1/N into its last product, the oracle divides afterwards: float32 rounding
                # in a different order on each side, amplified by up to kappa through the decoding.
                tolerance = 2 * rounding_bound(code, torch.float32)
            for r in range(N):
                assert close(outputs[r][k], expected[r], G / N, tolerance), (name, k, r)
        if name == "c > N":  # approximate: the ranks' results differ, so the oracle check had something to tell
            assert (outputs[0][0] - outputs[N - 1][0]).abs().max() > 0
    for runs, world, groups in results:
        default = runs["default"][0]
        assert (runs["exact code"][0] - default).abs().max() <= 1e-5
        assert (runs["exact ring"][0] - default).abs().max() <= 1e-5
        assert runs["exact code"][2][2] >= 2 * steps - 1  # the hook reduced every bucket of every step
        assert world not in groups and groups  # CERAR's batches went on its own group


def _register_as_the_trainer_does_worker(rank, N):
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    from cerar.ddp import CerarHookState, cerar_hook

    model = DDP(_tiny_model())
    model.register_comm_hook(CerarHookState(c=1, construction="exact"), cerar_hook)  # DDP checks the signature
    model(torch.ones(4, 16)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_hook_registers_on_ddp_as_it_is_and_returns_the_gradient():
    (grads,) = run_workers(_register_as_the_trainer_does_worker, 1)
    model = _tiny_model()
    model(torch.ones(4, 16)).sum().backward()
    assert all(torch.allclose(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


def test_the_default_bucket_size_keeps_cerars_messages_as_large_as_the_rings_at_ddps_default():
    from cerar.ddp import default_bucket_cap_mb

    assert default_bucket_cap_mb(8, 16) == 50.0  # 50 MiB / 16 per round = 25 MiB / 8 per ring step
    assert default_bucket_cap_mb(4, 16) == 100.0
    assert default_bucket_cap_mb(8, 4) == 25.0  # never below DDP's default
    with pytest.raises(ValueError, match="positive"):
        default_bucket_cap_mb(0, 16)


# --- failures: no hang, a clear error -------------------------------------------------------------


def _failing_peer_worker(rank, N, victim, how, timeout_s):
    code = cerar.make_code(N, 2 * N, "perturbation", eps=0.05)
    tensor = torch.ones(4096)
    cerar.all_reduce(tensor, code, timeout=timeout_s)  # everyone is connected and agreed
    if rank == victim:
        if how == "dies":
            os._exit(17)
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        cerar.all_reduce(tensor, code, timeout=timeout_s)
    except cerar.CollectiveError as error:
        return str(error), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("how", ["dies", "stops"])
def test_a_peer_that_dies_or_stops_mid_collective_makes_every_other_rank_raise_within_the_timeout(how, contract):
    """Under NCCL's contract Work.wait(timeout) bounds nothing on the host: the round's deadline
    must, and it must fire well before the group's own timeout (60 s here, NCCL's watchdog)."""
    N, victim, timeout_s = 3, 1, 3.0
    survivors = [r for r in range(N) if r != victim]
    results = run_workers(
        _failing_peer_worker, N, args=(victim, how, timeout_s), expect=survivors, timeout_s=90, contract=contract
    )
    for rank in survivors:
        message, seconds = results[rank]
        assert "cerar.all_reduce" in message and "round" in message, message
        assert "rank" in message
        assert seconds <= 10 * timeout_s < 60  # the round deadline, not the group's own 60 s timeout, ended it
    # the rank that waits on the victim directly names it
    assert f"rank {victim}" in results[(victim + 1) % N][0]


# --- bad input ------------------------------------------------------------------------------------


def _bad_input_worker(rank, N):
    messages = {}
    code = cerar.make_code(N, 8, "perturbation", eps=0.05)
    for name, call in {
        "integer tensor": lambda: cerar.all_reduce(torch.ones(10, dtype=torch.int32), code),
        "code for another N": lambda: cerar.all_reduce(torch.ones(10), cerar.make_code(N + 1, 8)),
        "bad op": lambda: cerar.all_reduce(torch.ones(10), code, op="max"),
        "ring integer tensor": lambda: cerar.ring_all_reduce(torch.ones(10, dtype=torch.int64)),
    }.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    try:  # ranks disagree on the length: every rank must refuse, none may hang
        cerar.all_reduce(torch.ones(100 + rank), code, timeout=20)
        messages["mismatched shapes"] = "no error"
    except cerar.CollectiveError as error:
        messages["mismatched shapes"] = str(error)
    return messages


def test_bad_input_gets_a_clear_error_on_every_rank(contract):
    N = 3
    for messages in run_workers(_bad_input_worker, N, contract=contract):
        assert "floating point" in messages["integer tensor"]
        assert f"N={N + 1}" in messages["code for another N"] and f"{N} ranks" in messages["code for another N"]
        assert "op must be one of" in messages["bad op"]
        assert "floating point" in messages["ring integer tensor"]
        assert "disagree on tensor length d" in messages["mismatched shapes"]


def test_calls_without_a_process_group_are_refused():
    with pytest.raises(cerar.CollectiveError, match="not initialised"):
        cerar.all_reduce(torch.ones(8), cerar.make_code(2, 2))


def test_worker_errors_are_reported_with_their_traceback():
    with pytest.raises(WorkerError, match="ZeroDivisionError"):
        run_workers(_raising_worker, 2)


def _raising_worker(rank, N):
    return 1 / 0
