"""The GPU acceptance check (scripts/checks/gpu/) runs end to end on the CPU (its dry run), covers
every section there (NOT RUN where a case needs CUDA or more devices, never PASS), and keeps a hang
or an abort inside the case's own process."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cerar
from scripts.checks.gpu import runner
from scripts.checks.gpu.cases import Case, Context, Needs, run_case
from scripts.checks.gpu.judge import judge_coded, judge_sum, resolve_device
from tests.distributed import _PRELOAD, run_workers, start_forkserver


@pytest.fixture(scope="module", autouse=True)
def tests_forkserver_first():
    """This module runs the GPU check's cases in this process (``run_case``), from the check's own context, whose
    preload is shorter than the tests': the first to start a process's one forkserver sets its preload for every
    later launch on this pytest worker, so the tests' starts first (tests/distributed.py ``start_forkserver``)."""
    start_forkserver()


def gpu_check(tmp_path, *extra, timeout=1500):
    out = tmp_path / "gpu.md"
    run = subprocess.run(
        [
            sys.executable,
            "scripts/checks/gpu_check.py",
            "--device",
            "cpu",
            "--small",
            "--repeats",
            "1",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        # the check's fused case switches the kernels on itself (traced, backend "eager", on the CPU): not the
        # suite's CERAR_FUSED=0 (tests/conftest.py)
        env={k: v for k, v in os.environ.items() if k != "CERAR_FUSED"},
    )
    return run, out.read_text() if out.exists() else ""


def rows(report: str, first_cells: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.split("|")[1:-1]] for line in report.splitlines() if line.startswith(first_cells)
    ]


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    run, report = gpu_check(tmp_path, "--skip", "training", "training_cerar")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    verdicts = ("PASS", "FAIL", "NOT RUN", "MEASURED")
    summary = {(r[0], r[1]): r for r in rows(report, "| ") if len(r) == 6 and r[2] in verdicts}
    ctx = Context("cpu", 2, 8, True, 1, False)
    every_case = {(s.SECTION, c.name): c for s in runner.SECTIONS for c in s.cases(ctx)}
    assert set(summary) == set(every_case)  # every section's every case is in the report
    for key, case in every_case.items():
        verdict, reason = summary[key][2], summary[key][5]
        if case.needs.cuda:
            assert (verdict, reason) == ("NOT RUN", "needs CUDA"), key
        elif case.needs.ranks > 2:
            assert verdict == "NOT RUN" and reason.startswith(f"needs {case.needs.ranks} GPUs"), key
    assert summary["arithmetic", "oracle"][2:4] == ["PASS", "0"] and summary["arithmetic", "tf32"][2] == "PASS"
    assert summary["throughput", "encode/decode rate"][2] == "MEASURED"
    assert summary["between ranks", "protocol, hook, stall"][2] == "PASS"
    oracle = {row[2]: row for row in rows(report, "| 4 |") if len(row) == 11}
    assert set(oracle) == {"exact", "vandermonde", "perturbation", "optimized"}  # every construction
    assert oracle["exact"][1] == "4" and "cannot be built at c=16" in oracle["exact"][10]
    for row in oracle.values():  # each judged by its own rounding bound, which the report states
        assert row[9] == "PASS" and float(row[7]) <= float(row[8]), row
    assert "Ran on 2 ranks, gloo, one per device" in report  # the protocol and hook between two real processes
    (stall,) = rows(report, "| 0 |")  # rank 0 survived rank 1's SIGSTOP through the trainer's exit path
    assert float(stall[1]) < 2.0 + 5.0 and stall[2] == "3" and float(stall[3]) < 10.0
    assert stall[4].startswith("error: collective 'cerar.all_reduce (gpu check stall)'") and "rank 1" in stall[4]
    assert "Device copy bandwidth" in report and "not measured (a CPU has no streams)" in report


@pytest.mark.slow
def test_gpu_check_training_section_kills_and_resumes_to_the_same_parameters_on_the_cpu(tmp_path):
    skip = [runner.key(s) for s in runner.SECTIONS if runner.key(s) != "training"]
    run, report = gpu_check(tmp_path, "--skip", *skip, timeout=1200)
    training = rows(report, "| fp32 |")
    assert training and training[0][-1] == "PASS", report[-3000:]
    assert training[0][3] == training[0][4]  # param_sha256 of the uninterrupted and the killed + resumed run


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: nothing to refuse")
def test_gpu_check_refuses_cuda_without_a_device():
    run = subprocess.run([sys.executable, "scripts/checks/gpu_check.py"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "no CUDA device" in run.stderr


@pytest.mark.quick
def test_cuda_resolves_to_the_current_device_with_its_index():
    """``torch.cuda.set_device(torch.device("cuda"))`` raises ValueError: the check must name an index."""
    assert resolve_device("cuda", 3) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", 3) == torch.device("cuda", 1)
    assert resolve_device("cpu", None) == torch.device("cpu")
    with pytest.raises(ValueError, match="index"):
        resolve_device("cuda", None)


@pytest.mark.quick
def test_a_coded_result_is_judged_against_the_exact_sum_within_the_codes_own_bound():
    """The exact-arithmetic results from the spec's reference pass; the exact sum (what a broken
    transport that skipped the code would give), and a result moved by ten times the rounding
    bound, fail; the exact ring's result is held to the rounding of a sum of N values."""
    from tests.spec_reference import spec_all_reduce, spec_matrices

    N, d = 3, 500
    code = cerar.make_code(N, 2 * N, "perturbation", eps=0.05)
    G = torch.randn(N, d, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = torch.from_numpy(spec_all_reduce(G.numpy(), *spec_matrices(code.points, N)))
    judged = judge_coded(reference, G, code, torch.float32)
    assert judged["ok"] and judged["deviation"] <= 1e-9 and judged["truncation"] > 1e-3
    assert not judge_coded(G.sum(0).expand(N, -1), G, code, torch.float32)["ok"]
    direction = torch.randn(N, d, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    moved = reference + 10 * judged["bound"] * G.norm() * direction / direction.norm(dim=1, keepdim=True)
    assert not judge_coded(moved, G, code, torch.float32)["ok"]
    assert judge_coded(reference / N, G, code, torch.float32, scale=1 / N)["ok"]  # op="avg"
    assert judge_sum(G.float().sum(0).expand(N, -1), G, torch.float32)["ok"]
    assert not judge_sum(reference, G, torch.float32)["ok"]


@pytest.mark.quick
def test_a_case_runs_only_where_the_machine_can_prove_it():
    """One GPU: the cases that need two or more ranks are NOT RUN, naming the GPUs needed and had;
    --quick leaves out the sections it does not list; the CPU runs nothing that needs CUDA."""
    one_gpu = runner.plan(Context("cuda", 1, 8, False, 5, False), [])
    reasons = {(s.SECTION, c.name): r for s, entries in one_gpu for c, r in entries}
    assert reasons["NCCL self-loop", "rounds"] is None and reasons["hook, delayed producer", "delayed producer"] is None
    assert reasons["between ranks", "protocol, hook, stall"] == "needs 2 GPUs (one rank per GPU; this machine has 1)"
    assert reasons["hierarchical", "2 x 2"] == "needs 4 GPUs (one rank per GPU; this machine has 1)"
    assert reasons["training with CERAR", "cerar vs nccl"].startswith("needs 2 GPUs")
    eight = {(s.SECTION, c.name): r for s, e in runner.plan(Context("cuda", 8, 2, False, 5, False), []) for c, r in e}
    assert eight["hierarchical", "2 x 2"] == "needs 4 GPUs (one rank per GPU; this machine has 8, --ranks 2)"
    quick = runner.plan(Context("cuda", 8, 8, False, 5, True), [])
    ran = {s.SECTION for s, entries in quick for _, r in entries if r is None}
    assert ran == {"NCCL self-loop", "arithmetic", "throughput", "hook, delayed producer"}
    cpu = runner.plan(Context("cpu", 2, 8, True, 1, False), [])
    assert all(r == "needs CUDA" for _, entries in cpu for c, r in entries if c.needs.cuda)


def hangs(out):  # noqa: ARG001
    time.sleep(600)


def aborts(out):
    Path(out).write_text('{"status": "PASS"}')
    os.abort()


def test_a_hang_or_an_abort_stays_in_its_case_and_is_recorded(tmp_path):
    """A case that hangs is killed at its deadline and fails, saying so; one that aborts after writing
    a passing result still fails on its exit status (-6: SIGABRT, 134 in a shell)."""
    hung = run_case(Case("test", "hang", "tests.test_gpu_check:hangs", deadline_s=1.0), tmp_path)
    # killed at its deadline, not left to its 600 s sleep: the seconds also count the child's start (a spawned
    # interpreter importing torch: over 20 s at a load of 30 on 2 cores), so the bound is far from both
    assert hung.status == "FAIL" and "deadline" in hung.reason and 1.0 <= hung.seconds < 300
    aborted = run_case(Case("test", "abort", "tests.test_gpu_check:aborts", needs=Needs()), tmp_path)
    assert aborted.status == "FAIL" and aborted.exit == -6 and aborted.reason == "exit status -6, expected 0"


def passes(out):  # noqa: ARG001
    return {"status": "PASS"}


def _preloaded(rank, world_size):  # noqa: ARG001  run_workers passes them
    from tests.distributed import preloaded_here

    return preloaded_here()


def test_a_launch_after_a_gpu_check_case_forks_from_the_tests_forkserver(tmp_path):
    """A GPU check case run in this process (its context's shorter preload: torch and cerar), then a rank
    launched as the other modules launch theirs: the rank finds the tests' whole preload imported, since this
    module starts the tests' forkserver before any case (``tests_forkserver_first``). Without that, the case would
    start it with its own preload, and each later rank on this worker would import transformers and train/ again
    (about 3 s of a core each)."""
    assert run_case(Case("test", "passes", "tests.test_gpu_check:passes", needs=Needs()), tmp_path).status == "PASS"
    (modules,) = run_workers(_preloaded, 1)
    assert modules == _PRELOAD, sorted(set(_PRELOAD) - set(modules))


def writes_half_a_result(out):
    Path(out).write_text('{"status": "PA')  # as a process killed while writing it leaves it
    os._exit(0)


def judge_raises(value, code, seconds, log, ended_at):  # noqa: ARG001
    raise KeyError("raised_after_s")


def test_an_unreadable_result_or_a_failing_judge_fails_its_case_and_the_run_goes_on(tmp_path):
    """A result file cut short, or a judge that raises, is that case's FAIL with the reason, not the end of the
    report."""
    cut = run_case(Case("test", "cut", "tests.test_gpu_check:writes_half_a_result", needs=Needs()), tmp_path)
    assert cut.status == "FAIL" and "could not be read" in cut.reason and "JSONDecodeError" in cut.reason
    judged = run_case(
        Case("test", "judge", "tests.test_gpu_check:aborts", needs=Needs(), judge="tests.test_gpu_check:judge_raises"),
        tmp_path,
    )
    assert judged.status == "FAIL" and judged.reason.startswith("the judge raised KeyError")


@pytest.mark.quick
def test_the_self_loop_judges_fail_what_the_gpu_could_show_wrong():
    """The NCCL self-loop's judges, which only a GPU feeds, tell the contract from its failures: a timed wait
    that returned or raised early, a next batch that did not fail at once (a healthy group queues it behind the
    held kernel, and its own timed wait blocks), a SIGABRT that torch's watchdog did not announce."""
    from scripts.checks.gpu import selfloop

    held = {"timeout_s": 1.0, "held_s": selfloop.HELD_S}
    aborted = {**held, "raised": "DistBackendError: ...", "blocked_s": 1.1, "next_batch": "DistBackendError: aborted"}
    assert selfloop.judge_wait_timeout({**aborted, "next_batch_s": 0.01}, 0, 30.0, "", 0.0)[0] == "PASS"
    slow_abort = {**aborted, "blocked_s": selfloop.HELD_S + 0.5, "next_batch_s": 0.01}
    verdict, reason = selfloop.judge_wait_timeout(slow_abort, -6, 90.0, "", 0.0)
    assert verdict == "PASS" and "the abort waited for the 20 s kernel" in reason
    healthy_group = {**aborted, "next_batch": "DistBackendError: Work timed out", "next_batch_s": 5.0}
    assert selfloop.judge_wait_timeout(healthy_group, 0, 30.0, "", 0.0)[0] == "FAIL"
    early = {**aborted, "blocked_s": 0.2, "next_batch_s": 0.01}
    assert selfloop.judge_wait_timeout(early, 0, 9.0, "", 0.0)[0] == "FAIL"
    returned = {**aborted, "raised": "returned", "next_batch_s": 0.01}
    assert selfloop.judge_wait_timeout(returned, 0, 30.0, "", 0.0)[0] == "FAIL"
    said = "[PG ID 0 PG GUID 0 Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, ...)"
    assert selfloop.judge_watchdog(None, -6, 25.0, said, 0.0)[0] == "PASS"
    assert selfloop.judge_watchdog(None, -6, 25.0, "terminate called without an active exception", 0.0)[0] == "FAIL"
    assert selfloop.judge_watchdog(None, 0, 70.0, said, 0.0)[0] == "FAIL"


def _held_stream_worker(rank, N, c, d):  # noqa: ARG001
    """One rank of ``cerar.all_reduce`` under NCCL's emulated contract, its device queue (the emulated stream)
    held from the first post on, as the self-loop's rounds case holds the GPU behind a long kernel. Counted: the
    posts handed to the queue and not yet run (the host's lead), the posts issued when the protocol's first poll
    began, and whether that poll found its round not yet run (so that it blocks). The hold ends 0.2 s into the
    first poll (30 s at the latest: a protocol that never polls still ends, and fails the test)."""
    import threading

    from cerar.ring import transport

    queue = transport.transport_contract().device_queue
    hold, lock = threading.Event(), threading.Lock()
    seen = {"posts": 0, "ahead": 0, "most_ahead": 0, "at_first_poll": None, "first_poll_blocks": None}
    submit = queue.submit

    def counting_submit(fn, *args):
        if getattr(fn, "__name__", "") != "_post":
            return submit(fn, *args)
        with lock:
            if seen["posts"] == 0:
                submit(lambda: hold.wait(30))  # the kernel the device is held behind
            seen["posts"] += 1
            seen["ahead"] += 1
            seen["most_ahead"] = max(seen["most_ahead"], seen["ahead"])

        def started(*a):
            with lock:
                seen["ahead"] -= 1
            return fn(*a)

        return submit(started, *args)

    queue.submit = counting_submit
    poll = transport._Rounds._await

    def first_poll(self, handle, what):
        if seen["at_first_poll"] is None:
            seen["at_first_poll"], seen["first_poll_blocks"] = seen["posts"], not handle.done()
            threading.Timer(0.2, hold.set).start()
        return poll(self, handle, what)

    transport._Rounds._await = first_poll
    code = cerar.make_code(N, c, "perturbation", eps=0.5)
    cerar.all_reduce(torch.randn(d, generator=torch.Generator().manual_seed(rank)), code, timeout=60)
    return seen


def test_the_self_loops_lead_bound_is_what_the_rounds_give_under_nccls_contract():
    """``selfloop.lead_bound``'s derivation held to the rounds themselves: with the device held from the first
    post on (the emulated stream), the host issues exactly 2 x LOOK_BEHIND_POSTS posts before the protocol's
    first poll, which blocks (its round has not run), and over the whole call it is never further ahead than
    that. The self-loop case on a GPU wants this lead, no less: an H200 showed 1 on a fresh communicator and 8
    with only the connection warmed (../shared/device-runs/h200-2026-12-04/)."""
    from cerar.ring.transport import LOOK_BEHIND_POSTS
    from scripts.checks.gpu.selfloop import lead_bound

    N, c = 2, 30  # L = c + N - 2 = 30 rounds of one chunk: past the first two windows
    code = cerar.make_code(N, c, "perturbation", eps=0.5)
    assert code.L == 30 > 2 * LOOK_BEHIND_POSTS + LOOK_BEHIND_POSTS
    bound = lead_bound(LOOK_BEHIND_POSTS)
    for rank, seen in enumerate(run_workers(_held_stream_worker, N, args=(c, c * 1000 + 5), contract="nccl")):
        assert seen["posts"] == code.L, (rank, seen)
        assert seen["at_first_poll"] == bound and seen["first_poll_blocks"], (rank, seen)
        assert seen["most_ahead"] == bound, (rank, seen)


def fails_silently(out):  # noqa: ARG001
    return {"status": "FAIL"}


def launches_and_fails(out):  # noqa: ARG001
    from scripts.checks.gpu.cases import launched

    run = subprocess.run(
        [sys.executable, "-c", "import sys; print('the run said this'); sys.exit('and died of that')"],
        capture_output=True,
        text=True,
    )
    outputs = launched({}, "a run", run.returncode, run.stdout + run.stderr)
    return {"status": "FAIL", "reason": "its run exited 1", "outputs": outputs}


def test_no_fail_is_without_its_reason_and_a_failed_cases_runs_speak_in_the_report(tmp_path):
    """A case that returns FAIL with no reason (the H200's "fused" did: its rows said the bytes differed, its
    reason and log were empty) is given one that says so; a case's launched runs' output is in its log and,
    with the FAIL, in the report."""
    from scripts.checks.gpu.report import failure

    silent = run_case(Case("test", "silent", "tests.test_gpu_check:fails_silently"), tmp_path)
    assert silent.status == "FAIL" and "without a reason" in silent.reason and "status" in silent.reason
    assert "(the case's log is empty: it printed nothing)" in "\n".join(failure(silent))
    spoken = run_case(Case("test", "spoken", "tests.test_gpu_check:launches_and_fails"), tmp_path)
    assert spoken.reason == "its run exited 1" and "the run said this" in spoken.log
    text = "\n".join(failure(spoken))
    assert "launched a run (exit status 1)" in text and "the run said this" in text and "and died of that" in text


@pytest.mark.quick
def test_the_training_launches_keep_the_pythonpath_they_were_given(tmp_path, monkeypatch):
    """Packages installed outside the interpreter's site-packages (``pip install --target /tmp/site``, then
    ``PYTHONPATH=/tmp/site``: the device image has no Hydra) stay importable in the launched runs, behind the
    repository's root; the H200's training runs exited 1 with PYTHONPATH replaced by the root."""
    from scripts.checks.gpu import training
    from scripts.checks.gpu.cases import ROOT

    site = tmp_path / "site"
    site.mkdir()
    (site / "only_in_the_site.py").write_text("HERE = True\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    env = training._env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(site)]
    probe = "import only_in_the_site, scripts.checks.gpu; print(only_in_the_site.HERE)"  # the root's namespace too
    run = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr
    assert training.python_path(tmp_path / "callback").split(os.pathsep) == [str(tmp_path / "callback"), str(ROOT),
                                                                            str(site)]  # fmt: skip


SESSION_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; print('worker up', flush=True); time.sleep(600)"],
                         start_new_session=True)  # as torchrun starts its workers: out of the launch's group
print("agent up", child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.quick
def test_a_launch_past_its_deadline_is_killed_with_the_workers_in_sessions_of_their_own():
    """torchrun's workers run in sessions of their own: killing the launch's process group leaves them alive,
    holding the output pipe, and reading the output then waits for ever (a benchmark's trainer launch hung so,
    its worker orphaned in the rendezvous). ``_finish`` ends the launch and everything below it, at its
    deadline, and returns its output so far."""
    from scripts.checks.gpu.training import _finish

    process = subprocess.Popen([sys.executable, "-c", SESSION_CHILD], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    started = time.monotonic()
    code, output = _finish(process, 3.0)
    seconds = time.monotonic() - started
    worker = int(output.split("agent up", 1)[1].split()[0]) if "agent up" in output else None
    time.sleep(0.2)
    alive = worker is not None and Path(f"/proc/{worker}").exists()
    alive = alive and "Z" not in Path(f"/proc/{worker}/stat").read_text().split()[2]
    if alive:  # the test's own leftover, not the next test's
        os.kill(worker, 9)
    assert code == -9 and seconds < 20 and "worker up" in output, (code, seconds, output)
    assert worker is not None and not alive
