# ruff: noqa: E501  (snippets of code are quoted whole, however long their lines)
"""The faults ``scripts/checks/mutation.py`` puts into a scratch copy of the tree, one at a time (docs/testing.md).

Each ``Fault``: ``name`` (short, unique), ``file`` (from the repository root), ``original`` (an exact snippet that
must occur exactly once in the file, or the check fails at once naming the fault: the list must not rot),
``replacement``, ``tests`` (pytest node ids, or "path -k expr"; only these run, so name the tests that should
catch the fault), ``why`` (what the fault breaks); ``quick=True`` marks the CI subset (``--quick``: fast tests).
Adding one is a five-line edit: copy an entry, change file, original, replacement, tests and why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    why: str
    quick: bool = False


FAULTS = [
    # --- issue 27's table: faults the suite let through before it ---
    Fault(
        name="rail-float16",
        file="cerar/hierarchical/collective.py",
        original="        stats.inter_node = on_rail(mine)\n        rounds = _Rounds(ring, timer, wire)",
        replacement="        mine.copy_(mine.to(torch.float16))\n        stats.inter_node = on_rail(mine)\n        rounds = _Rounds(ring, timer, wire)",
        tests=("tests/test_hierarchical.py::test_two_nodes_of_two_ranks_hold_to_the_spec_on_the_node_sums[gloo]",),
        why="the rail silently rounds the node sums to float16 (2^-11) before its call (the coded rail, and every other)",
    ),
    Fault(
        name="rounding-bound-x100",
        file="cerar/precision.py",
        original="    return max(float(code.kappa), 1.0) * unit_roundoff(dtype) * (math.sqrt(code.c + code.L) + code.N)",
        replacement="    return 100 * max(float(code.kappa), 1.0) * unit_roundoff(dtype) * (math.sqrt(code.c + code.L) + code.N)",
        tests=("tests/test_precision.py -k rounding_bound",),
        why="every numerical bound taken from rounding_bound becomes 100 times looser",
        quick=True,
    ),
    Fault(
        name="default-budget-0.1",
        file="train/config.py",
        original="    error_budget: float = 0.01",
        replacement="    error_budget: float = 0.1",
        tests=("tests/test_auto_c.py::test_the_default_error_budget_is_0_01_everywhere_it_is_set",),
        why="c=auto's default budget ten times the studied 0.01 (README, reports/fidelity.md)",
        quick=True,
    ),
    Fault(
        name="choose-largest-c",
        file="train/auto_c.py",
        original="        return min(fits, key=lambda c: (bytes_by_c[c], error(c), c))",
        replacement="        return max(fits)",
        tests=("tests/test_auto_c.py::test_choose_c_takes_the_fewest_bytes_where_padding_makes_them_rise_with_c",),
        why="takes the largest c that fits, not the fewest bytes (padding at small d: c=15 sends fewer than c=16)",
        quick=True,
    ),
    Fault(
        name="recheck-ignores-budget",
        file="train/auto_c.py",
        original="        elif bound.get(before, math.inf) <= allowed:",
        replacement="        elif bound.get(before, math.inf) <= noise:",
        tests=("tests/test_auto_c.py::test_recheck_moves_to_a_smaller_c_on_every_rank_at_the_same_step",),
        why="a re-check keeps the code in use while its error is below the noise itself, not budget x noise",
    ),
    Fault(
        name="checkpoint-wait-a-year",
        file="train/loop.py",
        original="        wait_s = self.cfg.checkpoint.write_timeout_s  # how long the others wait for the write",
        replacement="        wait_s = 365 * 24 * 3600.0  # how long the others wait for the write",
        tests=("tests/test_reliability.py::test_a_stalled_checkpoint_writer_stops_the_others_within_write_timeout_s",),
        why="the other ranks wait a year for a stalled checkpoint writer",
    ),
    Fault(
        name="two-node-warning-never-said",
        file="cerar/hierarchical/inter_node.py",
        original='    elif coded and method == "exact ring":',
        replacement="    elif False:",
        tests=("tests/test_hierarchical.py::test_two_nodes_of_two_ranks_hold_to_the_spec_on_the_node_sums[gloo]",),
        why="two nodes silently run the exact rail instead of the code that was asked for",
    ),
    Fault(
        name="look-behind-poll-dropped",
        file="cerar/transport.py",
        original="            if self.posts % self.contract.look_behind == 0 and len(self.posted) > self.contract.look_behind:",
        replacement="            if False:",
        tests=("tests/test_host_lead.py",),
        why="under NCCL's contract the host never waits while posting: it runs every round ahead of the GPU",
    ),
    # --- more: numeric, protocol, c=auto and reliability code ---
    Fault(
        name="wrong-shard",
        file="cerar/hierarchical/intra_node.py",
        original="        rounds.issue(add, shards[(i - step - 2) % G])",
        replacement="        rounds.issue(add, shards[(i - step - 1) % G])",
        tests=("tests/test_hierarchical.py::test_two_nodes_of_two_ranks_hold_to_the_spec_on_the_node_sums[gloo]",),
        why="the reduce-scatter adds the incoming shard into the wrong shard",
    ),
    Fault(
        name="wrong-scale-avg",
        file="cerar/hierarchical/collective.py",
        original="            mine.div_(G)",
        replacement="            mine.div_(G + 1)",
        tests=("tests/test_hierarchical.py::test_two_nodes_of_two_ranks_hold_to_the_spec_on_the_node_sums[gloo]",),
        why="op=avg divides the node sums by G + 1, not G",
    ),
    Fault(
        name="off-by-one-round",
        file="cerar/rounds.py",
        original="        new, old = t + 1, t - self.N + 1  # rows outside 1..c are zero",
        replacement="        new, old = t + 1, t - self.N + 2  # rows outside 1..c are zero",
        tests=("tests/test_spec_reference.py -k test_every_ring_size_and_c_on_small_gradients",),
        why="a worker takes out its own contribution one round early: u_i(t - N + 2) instead of u_i(t - N + 1)",
        quick=True,
    ),
    Fault(
        name="wrong-rank-exact",
        file="cerar/closed_forms.py",
        original="    powers = points[None, :] ** (-(np.arange(N)[:, None] - 1.0))  # [N, c]: a^-(i-1)",
        replacement="    powers = points[None, :] ** (-(np.arange(N)[:, None] - 0.0))  # [N, c]: a^-(i-1)",
        tests=(
            "tests/test_spec_reference.py -k test_the_code_matrices_are_the_specs",
            "tests/test_codes.py -k each_worker_errs",
        ),
        why="D_i = F^-1 diag(a^-i) V_L: the decoders shift by one worker, so worker N-1 is no longer the exact one",
        quick=True,
    ),
    Fault(
        name="dropped-agreement-field",
        file="cerar/protocol.py",
        original='            "tensor length d": d,\n            "dtype": str(tensor.dtype),\n            "transport": transport_name(transport),\n        },',
        replacement='            "dtype": str(tensor.dtype),\n            "transport": transport_name(transport),\n        },',
        tests=("tests/test_protocol.py::test_bad_input_gets_a_clear_error_on_every_rank[gloo]",),
        why="ranks of different tensor lengths are no longer refused by name: with the same m they sum garbage",
        quick=True,
    ),
    Fault(
        name="stale-agreement-cache",
        file="cerar/checks.py",
        original="    key = _agreement_key(ring, tuple(fields.items()))",
        replacement="    key = _agreement_key(ring, ())",
        tests=("tests/test_protocol.py::test_bad_input_gets_a_clear_error_on_every_rank[gloo]",),
        why="the agreement cache ignores the fields: after one agreed call on a group, later disagreements pass",
        quick=True,
    ),
    Fault(
        name="wrong-dtype-on-the-wire",
        file="cerar/precision.py",
        original="    low = wire if wire in LOW_PRECISION else dtype if dtype in LOW_PRECISION else None",
        replacement="    low = wire if wire == torch.float16 else dtype if dtype == torch.float16 else None",
        tests=("tests/test_codes.py -k rejects_bad_gradients", "tests/test_wire_rounding.py -k admitted"),
        why="bfloat16 (8 bits of mantissa) is let onto the wire under a code whose kappa amplifies its rounding",
        quick=True,
    ),
    Fault(
        name="sampled-error-without-sigmas",
        file="train/auto_c.py",
        original="SIGMAS = 2.0\n",
        replacement="SIGMAS = 0.0\n",
        tests=("tests/test_auto_c.py::test_candidates_bytes_and_the_schedule",),
        why="c=auto compares a sampled error with the budget without its standard errors: a small sample errs to more error",
        quick=True,
    ),
    Fault(
        name="write-timeout-default",
        file="train/config.py",
        original="    write_timeout_s: float = 1800.0",
        replacement="    write_timeout_s: float = 60.0",
        tests=("tests/test_reliability.py::test_the_checkpoint_wait_defaults_to_1800_s_and_must_be_positive",),
        why="a large model's checkpoint write gets a minute, not the README's 1800 s",
        quick=True,
    ),
    Fault(
        name="write-timeout-zero-accepted",
        file="train/config.py",
        original="    _require(ck.write_timeout_s > 0,",
        replacement="    _require(ck.write_timeout_s >= 0,",
        tests=("tests/test_reliability.py::test_the_checkpoint_wait_defaults_to_1800_s_and_must_be_positive",),
        why="checkpoint.write_timeout_s=0 is accepted: every checkpoint barrier would fail at once",
        quick=True,
    ),
    Fault(
        name="sum-rounding-bound-too-loose",
        file="cerar/precision.py",
        original="    bound = ((N - 1) * math.sqrt(N) + 1) * unit_roundoff(dtype)",
        replacement="    bound = ((N - 1) * N + 1) * unit_roundoff(dtype)",
        tests=("tests/test_precision.py -k rounding_bound",),
        why="the exact sum's rounding bound grows with N^2, not N^1.5",
        quick=True,
    ),
    Fault(
        name="tf32-guard-dropped",
        file="cerar/simulate.py",
        original="    with torch.no_grad(), full_fp32_products(G.device):",
        replacement="    with torch.no_grad():",
        tests=("tests/test_tf32.py::test_the_guard_keeps_tf32_out_of_cerars_products_when_the_process_allows_it",),
        why="cerar.simulate's products run in TF32 when the process allows it: kappa x 2^-11 instead of 7e-4",
        quick=True,
    ),
    # --- issue 25's aggregators: the 8-bit all-reduce, 16-bit messages, the 16-bit rule; issue 26's refusal ---
    Fault(
        name="int8-wrong-peer",
        file="cerar/quantized.py",
        original="            rounds.issue(encode, to)",
        replacement="            rounds.issue(encode, frm)",
        tests=("tests/test_quantized.py -k test_flat_all_reduce_is_within_the_format_bound",),
        why="the 8-bit all-to-all sends rank `to` the shard quantized for rank `frm` (a wrong shard, every value counted)",
    ),
    Fault(
        name="int8-result-not-requantized-on-the-owner",
        file="cerar/quantized.py",
        original="            dequantize(messages[i], s, block, rows[i])  # the bytes every other rank decodes",
        replacement="            pass",
        tests=("tests/test_quantized.py -k test_flat_all_reduce_is_within_the_format_bound",),
        why="the owner keeps its unquantized reduced shard while the others decode the 8-bit one: replicas differ",
    ),
    Fault(
        name="wire-scale-not-undone",
        file="cerar/wire.py",
        original="        out.mul_(_power_of_two(-k))",
        replacement="        pass",
        tests=("tests/test_cerar_16bit.py -k scale_keeps_tiny",),
        why="16-bit messages arrive still multiplied by their power-of-two scale 2^k",
        quick=True,
    ),
    Fault(
        name="wire-transport-not-agreed",
        file="cerar/protocol.py",
        original='            "transport": transport_name(transport),',
        replacement="",
        tests=("tests/test_cerar_16bit.py::test_ranks_that_disagree_on_the_transport_are_refused_on_every_rank",),
        why="ranks that send float16 and float32 messages are not refused before the rounds",
    ),
    Fault(
        name="rule-uses-the-bound",
        file="cerar/precision.py",
        original="        per_kappa = expected_rounding(code, wire) / max(float(code.kappa), 1.0)",
        replacement="        per_kappa = rounding_bound(code, dtype, wire) / max(float(code.kappa), 1.0)",
        tests=("tests/test_wire_rounding.py",),
        why="the 16-bit rule judges the worst-case bound (15-20x the rounding) and refuses the codes with the least total error",
        quick=True,
    ),
    Fault(
        name="blocking-wait-let-through",
        file="train/distributed.py",
        original='        if value and value.lower() not in ("0", "false", "n", "no"):',
        replacement="        if False:",
        tests=("tests/test_nccl_contract.py -k blocking_wait",),
        why="TORCH_NCCL_BLOCKING_WAIT=1 (every wait a host round trip, works off the watchdog) is no longer refused",
        quick=True,
    ),
    # --- aggregator=auto (issue 28) ---
    Fault(
        name="auto-sample-piece-floor",
        file="train/auto_c.py",
        original="    M = -(-P // pieces)  # a piece: a CERAR component, an int8 shard",
        replacement="    M = P // pieces  # a piece: a CERAR component, an int8 shard",
        tests=(
            "tests/test_auto_aggregator.py::test_a_candidate_on_its_sample_returns_what_it_returns_on_the_whole_gradient",
        ),
        why="the sample cuts pieces at floor(P / pieces): its columns and blocks are not the call's, so its error is another",
    ),
    Fault(
        name="auto-sample-ignores-node-shards",
        file="train/auto_c.py",
        original="    P = -(-d // parts)  # a part: a node's shard (as_equal_shards)",
        replacement="    P, parts = d, 1  # a part: a node's shard (as_equal_shards)",
        tests=(
            "tests/test_auto_aggregator.py::test_a_candidate_on_its_sample_returns_what_it_returns_on_the_whole_gradient",
        ),
        why="the two-tier candidates are sampled as if flat: hier_int8's blocks straddle the node shards",
    ),
    Fault(
        name="auto-slowest-that-fits",
        file="train/auto_choice.py",
        original="        return min(fits, key=lambda name: (seconds[name], error(name), name))",
        replacement="        return min(fits, key=lambda name: (error(name), seconds[name], name))",
        tests=(
            "tests/test_auto_aggregator.py::test_the_fastest_that_fits_is_taken_and_only_more_accurate_ones_replace_it",
            "tests/test_auto_aggregator.py::test_prices_follow_the_links_so_the_choice_moves_where_they_differ",
        ),
        why="auto takes the most accurate candidate that fits, not the fastest",
        quick=True,
    ),
    Fault(
        name="ddp-rebuild-left-to-forward",
        file="train/loop.py",
        original="            finite = self._grads_finite_everywhere(None)\n            self._rebuild_ddp_buckets()\n",
        replacement="            finite = self._grads_finite_everywhere(None)\n",
        tests=("tests/test_stall_phases.py",),
        why="overlap: DDP's host-blocking bucket rebuild stays in step 2's forward, where a peer stalled in data holds it",
    ),
    Fault(
        name="nccl-aggregate-unbounded",
        file="train/aggregation.py",
        original="            await_work(dist.all_reduce(flat, async_op=True), self.timeout_s)  # the trainer's deadline, on NCCL too\n",
        replacement="            dist.all_reduce(flat)\n",
        tests=("tests/test_stall_phases.py",),
        why="aggregator=nccl's all-reduce waited on outside the deadline: on NCCL a stalled peer leaves it to the watchdog",
    ),
    Fault(
        name="resync-unbounded",
        file="train/loop.py",
        original=(
            "        bounded(\n"
            '            f"resync broadcast from rank {self.reference_rank}",\n'
            "            lambda: dist.broadcast(theta, src=self.reference_rank, async_op=True),\n"
            "        )\n"
        ),
        replacement="        dist.broadcast(theta, src=self.reference_rank)\n",
        tests=("tests/test_stall_phases.py",),
        why="the resync's broadcast read outside the deadline: a stalled reference replica leaves it to the watchdog",
    ),
    # --- the host watchdog (issue 36) ---
    Fault(
        name="host-watchdog-disabled",
        file="train/watchdog.py",
        original="    dog = HostWatchdog(deadlines, rank)\n    dog.start()\n",
        replacement="    dog = HostWatchdog(deadlines, rank)\n",
        tests=("tests/test_host_watchdog.py", "tests/test_stall_phases.py"),
        why="no host watchdog: a survivor held inside a split or a first connect hangs, DDP's constructor SIGABRTs",
    ),
    Fault(
        name="host-watchdog-deadline-ignored",
        file="train/watchdog.py",
        original="            left = since + deadline - time.monotonic()\n",
        replacement="            left = since + 365 * 24 * 3600.0 - time.monotonic()\n",
        tests=("tests/test_host_watchdog.py", "tests/test_stall_phases.py"),
        why="the host watchdog waits a year, whatever the phase's deadline: the start-up stalls hang or SIGABRT",
    ),
    Fault(
        name="host-watchdog-wrong-phase",
        file="train/distributed.py",
        original='    _progress["phase"] = phase\n    watchdog.enter_phase(phase)\n',
        replacement='    _progress["phase"] = phase\n',
        tests=("tests/test_host_watchdog.py", "tests/test_stall_phases.py"),
        why="the host watchdog is not told the phase: its line names the phase the run started in, not the stalled one",
    ),
    Fault(
        name="ddp-buffers-broadcast-each-forward",
        file="train/run.py",
        original="        **no_forward_buffer_sync(),\n",
        replacement="",
        tests=("tests/test_stall_phases.py",),
        why="overlap: every forward broadcasts the rotary buffers, a collective outside the trainer's deadline",
    ),
    Fault(
        name="auto-trials-ignored",
        file="train/auto_choice.py",
        original="            self.choice = min(short, key=lambda name: (timed[name], pool[name], name))",
        replacement="            pass",
        tests=(
            "tests/test_auto_aggregator.py::test_the_model_ranks_and_the_timed_calls_decide",
            "tests/test_auto_aggregator.py::test_every_rank_measures_and_decides_from_the_same_numbers",
        ),
        why="the candidates are timed and the timings ignored: the model's fastest is taken even where it is slow",
        quick=True,
    ),
    Fault(
        name="auto-trial-own-clock",
        file="train/auto_aggregator.py",
        original='        bounded("aggregator=auto: trial timings all_reduce",',
        replacement='        if False: bounded("aggregator=auto: trial timings all_reduce",',
        tests=("tests/test_auto_aggregator.py::test_every_rank_measures_and_decides_from_the_same_numbers",),
        why="each rank ranks its own clock's timings: ranks may choose different aggregators",
    ),
    Fault(
        name="auto-excluded-forgotten",
        file="train/auto_choice.py",
        original="            self.excluded.append(before)\n",
        replacement="",
        tests=(
            "tests/test_auto_aggregator.py::test_the_fastest_that_fits_is_taken_and_only_more_accurate_ones_replace_it",
        ),
        why="a choice that exceeded the budget is not excluded: later checks measure it again and may return to it",
        quick=True,
    ),
    Fault(
        name="auto-probe-without-bytes",
        file="cerar/link_probe.py",
        original="    if not beta > 0:\n        raise LinkProbeError",
        replacement="    if False:\n        raise LinkProbeError",
        tests=("tests/test_auto_aggregator.py -k describes_no_link",),
        why="timings with no bandwidth term are taken as an infinitely fast link instead of refused",
        quick=True,
    ),
    Fault(
        name="auto-local-timings",
        file="train/auto_aggregator.py",
        original="            lambda: dist.all_reduce(both, dist.ReduceOp.MAX, async_op=True))  # fmt: skip",
        replacement="            lambda: dist.barrier(async_op=True))  # fmt: skip",
        tests=("tests/test_auto_aggregator.py::test_every_rank_measures_and_decides_from_the_same_numbers",),
        why="each rank prices the candidates from its own timings: ranks may choose differently",
    ),
    Fault(
        name="tensor-noise-doubled",
        file="train/tensor_errors.py",
        original="    return (spread.cpu() / (N * (N - 1))).sqrt()",
        replacement="    return 2 * (spread.cpu() / (N * (N - 1))).sqrt()",
        tests=("tests/test_tensor_errors.py -k hides", "tests/test_auto_c.py -k first_choice"),
        why="each tensor's noise is read twice its size: twice the error is let through, per tensor",
        quick=True,
    ),
    Fault(
        name="tensor-sample-by-count-only",
        file="train/tensor_errors.py",
        original="            share[lo:hi] = torch.maximum(share[lo:hi], (by_size + 1 / U[t]) / 2)",
        replacement="            share[lo:hi] = torch.maximum(share[lo:hi], 1 / U[t])",
        tests=("tests/test_tensor_errors.py -k covers",),
        why="the autos' sample draws units uniformly: the heavy columns that cancel across ranks are missed",
        quick=True,
    ),
    Fault(
        name="auto-nan-read-as-exceeds",
        file="train/auto_choice.py",
        original="        if not all(math.isfinite(v) for pair in measured.values() for v in pair):",
        replacement="        if False:",
        tests=("tests/test_auto_aggregator.py -k fastest_that_fits",),
        why="a nan at a check excludes the choice for the rest of the run instead of checking again",
        quick=True,
    ),
]
