"""scripts/bench/compare_auto.py: the fixed runs it sets beside aggregator=auto are auto's own candidates.

The comparison means something only if each fixed run aggregates exactly as the candidate auto measured and
timed: the same kind, c, message dtype and code. Every candidate of a two-tier layout (flat and hierarchical,
over float32 and float16 messages) is turned into its fixed run's overrides, composed and validated as
train/main.py would, and the aggregator that config builds is compared with the one auto builds.
"""

from __future__ import annotations

from tests.runs import composed


def test_each_fixed_run_is_the_candidate_auto_measured():
    from scripts.bench.compare_auto import candidate_overrides
    from train.aggregation.auto_choice import candidates
    from train.config import code_kappa_max, validate

    N, nodes, G = 6, 3, 2  # n >= 3 nodes: the two-tier CERAR candidates too
    auto = composed("aggregator=auto", "model=tiny")
    pool = candidates(N, nodes, G, auto.aggregator)
    assert {cand.kind for cand in pool.values()} >= {"nccl", "fp16", "bf16", "int8", "cerar", "hier_ring",
                                                     "hier_int8", "hier_cerar"}  # fmt: skip
    for name, cand in pool.items():
        cfg = composed(*candidate_overrides(cand), "model=tiny", f"aggregator.local_size={G}")
        validate(cfg, world_size=N)
        a = cfg.aggregator
        assert a.kind == cand.kind, name
        assert a.transport == cand.transport, name
        if cand.c is not None:
            assert cfg.c == cand.c, name
        if cand.kind in ("cerar", "hier_cerar"):  # the same code: the same kappa budget on the same wire
            assert code_kappa_max(a, a.transport) == code_kappa_max(auto.aggregator, cand.transport), name
