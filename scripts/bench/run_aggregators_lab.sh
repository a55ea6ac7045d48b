#!/usr/bin/env bash
# Issue 25's lab rows in one go, on an otherwise idle machine, as root from the repository root:
#
#   scripts/bench/run_aggregators_lab.sh            # writes reports/data/hierarchical_lab.csv rows and the report
#
# 64 MiB, 200 Mbit/s between hosts, jumbo frames, every aggregator of a run side by side (interleaved repeats):
# 1. flat, 4 hosts x 1 rank: gloo's all_reduce, cerar's exact ring, the 8-bit all-reduce, CERAR over fp16 messages at
#    c = 2N = 8 (the fp16 default kappa_max);
# 2. two tiers, 4 hosts x 2 ranks: gloo's flat all_reduce, the exact hierarchy, the fp16 exact hierarchy (hier_ring16),
#    the 8-bit hierarchy and its flat counterpart, hierarchical CERAR over fp16 messages at c = 2n = 8;
# 3. reports/hierarchical_lab.md rebuilt (issue 25's targets: the 8-bit hierarchy <= 0.30x gloo's flat all_reduce,
#    hierarchical CERAR over fp16 at c = 2n <= 0.90x the fp16 exact hierarchy).
# Each command's uptime before and after goes to reports/logs/hierarchical_lab.log; every row carries its load.
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
REPEATS=${REPEATS:-3}
[ "$(id -u)" = 0 ] || { echo "$0: the lab needs root (network namespaces and tc)" >&2; exit 2; }
LOG=reports/logs/hierarchical_lab.log
CSV=reports/data/hierarchical_lab.csv
FAILED=0
. scripts/bench/lab_step.sh  # step NAME COMMAND...
COMMON=(--lab --rate-mbit 200 --mtu 9000 --sizes-mb 64 --repeats "$REPEATS" --warmup 1 --timeout 3600 --csv "$CSV"
  --cerar-transport float16 --constructions optimized --quiet)
step "clean stale labs" $PY scripts/lab/netlab.py --cleanup
step "codes" $PY -c "import cerar; [cerar.make_code(n, 8, 'optimized', kappa_max=cerar.default_kappa_max('float16'))
                     for n in (4,)]"
step "aggregators, flat 4 hosts, 200 Mbit/s, jumbo frames" \
  $PY scripts/bench/bench_allreduce.py "${COMMON[@]}" --n 4 --aggregators nccl,ring,int8,cerar --c-mult 2
step "aggregators, 4x2 hosts, 200 Mbit/s, jumbo frames" \
  $PY scripts/bench/bench_allreduce.py "${COMMON[@]}" --n 8 --ranks-per-host 2 \
  --aggregators nccl,hier_ring,hier_ring16,int8,hier_int8,hier_cerar --hier-c 8 --half-dtype float16
step "report" $PY scripts/reporting/hierarchical_report.py
echo "=== done, $FAILED step(s) failed; log: $LOG"
[ "$FAILED" = 0 ]
