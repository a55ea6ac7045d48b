"""The mutation check: puts named faults into a scratch copy of the tree, one at a time, and runs for each only
the tests that should catch it; fails naming every fault that survives (docs/testing.md).

    .venv/bin/python scripts/checks/mutation.py                  # every fault of scripts/checks/mutation_faults.py
    .venv/bin/python scripts/checks/mutation.py --quick          # the CI subset (faults marked quick = true)
    .venv/bin/python scripts/checks/mutation.py --only rail-float16 --only wrong-shard
    .venv/bin/python scripts/checks/mutation.py --list           # the faults, and nothing run

The faults are data (`mutation_faults.py`: file, exact original snippet, replacement, tests, why), so a new
module's faults are a few lines there. Before anything runs, every fault's original snippet must occur exactly
once in its file: a snippet that no longer matches fails the check at once, naming the fault (the list must not
rot silently). The working tree is never touched: the files git knows (tracked, and untracked but not ignored)
are copied to a temporary folder (one copy per --jobs, default 2: most of a fault's time is spent waiting on
worker processes, so two at a time overlap), each fault is applied to one copy, its tests run with that copy
first on the path (PYTHONPATH, inherited by the tests' worker processes), and the file is restored after.

Each fault's tests run as `python -m pytest <tests> -x -q -n 0 -p no:cacheprovider` (a fresh code cache per
run, so no fault leaves a poisoned cache behind) under PYTHONDONTWRITEBYTECODE=1 (no stale bytecode of a
mutated file); the training tests' token cache is built once and shared by the runs
($CERAR_PYTHIA_TEST_TOKEN_CACHE, tests/conftest.py). Outcome: "caught" when pytest reports failed tests
(exit status 1; the first failing test is named), "survived" when they all pass (0), "error" for anything
else (a test that cannot be collected, an interrupted run: that proves nothing, so it fails the check too),
"timeout" past --timeout (a hang the tests did not bound: a failure of the suite, so it fails the check).
With --baseline the union of the selected faults' tests first runs on the unmutated copy, and must pass.
Exit status 0 only when every fault was caught.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAULTS = Path(__file__).with_name("mutation_faults.py")
PYTEST = ["-x", "-q", "-n", "0", "-p", "no:cacheprovider", "--no-header", "-rfE"]  # -rfE: a failing fixture named


@dataclass
class Outcome:
    fault: object  # mutation_faults.Fault
    status: str  # caught | survived | error | timeout
    seconds: float
    detail: str  # the catching test, or why it proves nothing


def load_faults(path: Path = FAULTS) -> list:
    """``FAULTS`` of the fault list module at ``path``, checked: names unique, tests given, a real change."""
    spec = importlib.util.spec_from_file_location("mutation_faults", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    faults, names = list(module.FAULTS), set()
    for fault in faults:
        if fault.name in names:
            raise SystemExit(f"{path}: two faults are named {fault.name!r}")
        if not fault.tests or isinstance(fault.tests, str) or fault.original == fault.replacement:
            raise SystemExit(f"{path}: fault {fault.name!r} needs a tuple of tests and a replacement that differs")
        names.add(fault.name)
    return faults


def check_snippets(faults: list, root: Path) -> list[str]:
    """One line per fault whose original snippet does not occur exactly once in its file."""
    problems = []
    for fault in faults:
        path = root / fault.file
        if not path.is_file():
            problems.append(f"{fault.name}: {fault.file} does not exist")
            continue
        count = path.read_text().count(fault.original)
        if count != 1:
            problems.append(f"{fault.name}: its original snippet occurs {count} times in {fault.file}, not once")
    return problems


def scratch_copy(root: Path, into: Path) -> None:
    """The files git knows (tracked, and untracked not ignored) copied under `into`; .venv linked, not copied."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = root / name
        if not source.is_file() or source.is_symlink() and name == ".venv":
            continue
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    if (root / ".venv").exists():
        (into / ".venv").symlink_to((root / ".venv").resolve())


def pytest_args(tests) -> list[str]:
    """Node ids and "path -k expr" entries as pytest arguments (one -k per entry that has one)."""
    args = []
    for entry in tests:
        args += shlex.split(entry)
    return args


def run_tests(tree: Path, tests, timeout_s: float) -> tuple[int | None, str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    env["CERAR_PYTHIA_TEST_TOKEN_CACHE"] = str(tree.parent / "token-cache")  # built once (under its file lock)
    command = [sys.executable, "-m", "pytest", *PYTEST, *pytest_args(tests)]
    start = time.monotonic()
    # a session of its own, so that a run past the timeout is ended with every process it started
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output or "", time.monotonic() - start
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, output, time.monotonic() - start


def first_failure(output: str) -> str:
    match = re.search(r"^FAILED (\S+)", output, re.MULTILINE) or re.search(r"^ERROR (\S+)", output, re.MULTILINE)
    return match.group(1) if match else "(a failing test; see the output)"


def try_fault(fault, tree: Path, timeout_s: float, verbose: bool) -> Outcome:
    path = tree / fault.file
    original_text = path.read_text()
    path.write_text(original_text.replace(fault.original, fault.replacement, 1))
    try:
        code, output, seconds = run_tests(tree, fault.tests, timeout_s)
    finally:
        path.write_text(original_text)
    if verbose or code not in (0, 1):
        print(output[-4000:], file=sys.stderr)
    if code == 1:
        return Outcome(fault, "caught", seconds, first_failure(output))
    if code == 0:
        return Outcome(fault, "survived", seconds, "every test passed")
    if code is None:
        return Outcome(fault, "timeout", seconds, f"no result within {timeout_s:.0f} s: the tests did not bound it")
    return Outcome(fault, "error", seconds, f"pytest exit status {code}: collection or usage error, proves nothing")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=Path, default=FAULTS, help="the fault list (default: %(default)s)")
    parser.add_argument("--only", action="append", default=[], help="run this fault (repeatable)")
    parser.add_argument("--quick", action="store_true", help="only the faults marked quick (the CI subset)")
    parser.add_argument("--list", action="store_true", help="list the faults and run nothing")
    parser.add_argument("--baseline", action="store_true", help="first run every selected test on the unmutated copy")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per fault (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="print each run's pytest output")
    parser.add_argument("--jobs", type=int, default=2, help="faults tried at once, each in its own copy (default: 2)")
    args = parser.parse_args(argv)

    faults = load_faults(args.faults)
    problems = check_snippets(faults, ROOT)  # every fault, selected or not: the whole list must stay current
    if problems:
        print("mutation check: fault list out of date:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    unknown = set(args.only) - {f.name for f in faults}
    if unknown:
        print(f"mutation check: no fault named {sorted(unknown)}", file=sys.stderr)
        return 2
    selected = [f for f in faults if (not args.only or f.name in args.only) and (f.quick or not args.quick)]
    missing = [f for f in selected if f.needs and importlib.util.find_spec(f.needs) is None]
    for f in missing:  # its tests skip without the module: trying it would prove nothing
        print(f"not tried  {f.name}: its tests need {f.needs}, which is not installed here", flush=True)
    selected = [f for f in selected if f not in missing]
    if args.list:
        for f in faults:
            print(f"{f.name:32} {'quick ' if f.quick else '      '}{f.file}: {f.why}")
        return 0

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cerar-mutation-") as scratch:
        trees: queue.SimpleQueue = queue.SimpleQueue()  # one copy per job: a fault is applied to one copy only
        for k in range(max(1, args.jobs)):
            scratch_copy(ROOT, Path(scratch) / f"tree-{k}")
            trees.put(Path(scratch) / f"tree-{k}")
        tree = Path(scratch) / "tree-0"
        if args.baseline:
            union = list(dict.fromkeys(t for f in selected for t in f.tests))
            code, output, seconds = run_tests(tree, union, args.timeout * 2)
            print(f"baseline: {len(union)} test selections on the unmutated copy: exit {code} in {seconds:.0f} s")
            if code != 0:
                print(output[-4000:], file=sys.stderr)
                print("mutation check: the tests fail without any fault; nothing can be concluded", file=sys.stderr)
                return 2

        def attempt(fault) -> Outcome:
            tree = trees.get()
            try:
                outcome = try_fault(fault, tree, args.timeout, args.verbose)
            finally:
                trees.put(tree)
            print(f"{outcome.status:8} {outcome.seconds:6.1f} s  {fault.name}: {outcome.detail}", flush=True)
            return outcome

        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            outcomes = list(pool.map(attempt, selected))
    failed = [o for o in outcomes if o.status != "caught"]
    caught = len(outcomes) - len(failed)
    print(f"\nmutation check: {caught} of {len(outcomes)} faults caught in {time.monotonic() - start:.0f} s")
    for o in failed:
        print(f"  NOT CAUGHT ({o.status}): {o.fault.name} in {o.fault.file}: {o.fault.why}; {o.detail}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
