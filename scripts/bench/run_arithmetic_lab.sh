#!/usr/bin/env bash
# Issue 35's lab rows, before and after the arithmetic was rewritten (fewer passes, fused kernels), on an otherwise
# idle machine, as root from the repository root:
#
#   BEFORE=/path/to/a/checkout/of/d7a2d26^ scripts/bench/run_arithmetic_lab.sh
#
# (`git worktree add --detach /tmp/before35 d7a2d26^` makes one; remove it after.) Each code runs the same
# bench_allreduce.py commands one after the other, every aggregator of a run side by side with gloo's all_reduce:
#
# 1. 4 hosts x 2 ranks, 200 Mbit/s between hosts, jumbo frames, 64 MiB: gloo's flat all_reduce, the exact hierarchy
#    (float32 and float16 messages), the 8-bit all-reduce flat and two-tier, hierarchical CERAR c = 8 over float16
#    messages -> reports/data/hierarchical_lab.csv;
# 2. loopback, 4 ranks, 64 MiB (the fast links, the NVLink analogue): gloo's all_reduce, int8, CERAR c = 8 over
#    float32 and over float16 messages -> reports/data/hierarchical_lab.csv (where = loopback);
#
# for three codes: BEFORE (eager, six-pass quantizer), this checkout eager, this checkout with --fused (the compiled
# kernels on in every rank before timing, as the trainer does). Then reports/hierarchical_lab.md is rebuilt.
# Every step's uptime before and after goes to reports/logs/arithmetic_lab.log; every row has its load.
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
[ "$(id -u)" = 0 ] || { echo "$0: the lab needs root (network namespaces and tc)" >&2; exit 2; }
[ -n "${BEFORE:-}" ] && [ -f "$BEFORE/cerar/__init__.py" ] || { echo "$0: BEFORE=<checkout> is required" >&2; exit 2; }
LOG=reports/logs/arithmetic_lab.log
CSV=reports/data/hierarchical_lab.csv
FAILED=0
. scripts/bench/lab_step.sh  # step NAME COMMAND...

COMMON=(--sizes-mb 64 --repeats 3 --warmup 1 --timeout 3600 --csv "$CSV" --constructions optimized --quiet)
LAB=(--lab --rate-mbit 200 --mtu 9000 --n 8 --ranks-per-host 2 --cerar-transport float16 --hier-c 8
     --half-dtype float16 --aggregators nccl,hier_ring,hier_ring16,int8,hier_int8,hier_cerar)
LOOP=(--n 4 --c-mult 2 --aggregators nccl,int8,cerar)

step "clean stale labs" $PY scripts/lab/netlab.py --cleanup
for code in before eager fused; do
  case $code in
    before) WHICH=(--code-dir "$BEFORE") ;;
    eager) WHICH=() ;;
    fused) WHICH=(--fused) ;;
  esac
  step "4x2 hosts, 200 Mbit/s, $code" $PY scripts/bench/bench_allreduce.py "${COMMON[@]}" "${LAB[@]}" "${WHICH[@]}"
  step "loopback, 4 ranks, float32 CERAR, $code" $PY scripts/bench/bench_allreduce.py "${COMMON[@]}" "${LOOP[@]}" \
    "${WHICH[@]}"
  step "loopback, 4 ranks, float16 CERAR, $code" $PY scripts/bench/bench_allreduce.py "${COMMON[@]}" --n 4 \
    --c-mult 2 --aggregators nccl,cerar --cerar-transport float16 "${WHICH[@]}"
done
step "two-tier lab report" $PY scripts/reporting/hierarchical_report.py
echo "run_arithmetic_lab: $FAILED step(s) failed; log: $LOG"
exit $((FAILED > 0))
