#!/usr/bin/env bash
# Issue 20's measurements in one run, on an otherwise idle machine, as root from the repository root:
#
#   scripts/bench/run_hierarchical_lab.sh              # the real thing: writes reports/ (see below)
#   SIZES=64 REPEATS=3 SEEDS=1 scripts/bench/run_hierarchical_lab.sh   # the issue's 64 MiB only, fewer repeats (~20 min)
#   scripts/bench/run_hierarchical_lab.sh --tiny DIR   # the same steps at toy sizes into DIR (a dry run: tens of minutes)
#
# 1. all-reduce, every aggregator side by side in one bench run (interleaved repeats): 4 hosts x 2 ranks, 200 Mbit/s
#    between hosts (one shared NIC per host), jumbo frames, 4/16/64 MiB: gloo's flat all_reduce, flat CERAR
#    (c = 4N = 32, optimized and perturbation), the exact hierarchy, hierarchical CERAR (c = 8, 16; optimized and
#    perturbation), the exact hierarchy on float16 messages and the 8-bit all-reduce, flat and two-tier (issue 25:
#    int8, hier_int8, B = 128) -> reports/data/hierarchical_lab.csv;
# 2. training, pythia-14m on the same lab shape at 100 Mbit/s, the same steps for nccl, the exact hierarchy and
#    hierarchical CERAR c = 16, seeds $SEEDS (default 1,2), settings interleaved -> reports/data/training_hierarchical.csv,
#    reports/training_hierarchical.md, reports/runs/training_hierarchical/;
# 3. reports and figures: reports/hierarchical_lab.md (targets met or missed), reports/costmodel.md (the two tiers
#    fitted on step 1's rows), reports/figures/ (scripts/reporting/make_figures.py rebuilds every figure).
#
# Every command's uptime (load average) before and after goes to the log (reports/logs/hierarchical_lab.log), and
# every CSV row carries the load before and after its own run.
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-1,2}
if [ "${1:-}" = "--tiny" ]; then
  [ -n "${2:-}" ] || { echo "usage: $0 [--tiny DIR]" >&2; exit 2; }
  OUT=$2
  SIZES=0.25,1 REPEATS=1 RATE_AR=200 RATE_TRAIN=100 MODEL=tiny STEPS=2 EVAL=2 SEEDS=1
else
  OUT=reports
  SIZES=${SIZES:-4,16,64} REPEATS=${REPEATS:-5} RATE_AR=200 RATE_TRAIN=100 MODEL=pythia-14m STEPS=12 EVAL=4
fi
[ "$(id -u)" = 0 ] || { echo "$0: the lab needs root (network namespaces and tc)" >&2; exit 2; }
mkdir -p "$OUT/data" "$OUT/logs" "$OUT/figures" "$OUT/runs"
LOG=$OUT/logs/hierarchical_lab.log
CSV=$OUT/data/hierarchical_lab.csv
T0=$SECONDS
FAILED=0
. scripts/bench/lab_step.sh  # step NAME COMMAND...

step "clean stale labs" $PY scripts/lab/netlab.py --cleanup
# the optimized codes, searched (or read from the shipped table) once here instead of by 8 ranks at once
step "codes" $PY -c "import cerar; [cerar.make_code(N, c, cons) for N, c in ((4, 8), (4, 16), (8, 32))
                     for cons in ('optimized', 'perturbation')]"
step "all-reduce, 4x2 hosts, ${RATE_AR} Mbit/s, jumbo frames" \
  $PY scripts/bench/bench_allreduce.py --lab --rate-mbit "$RATE_AR" --mtu 9000 --n 8 --ranks-per-host 2 \
  --sizes-mb "$SIZES" --aggregators nccl,cerar,hier_ring,hier_cerar,hier_ring16,int8,hier_int8 \
  --constructions optimized,perturbation --c-mult 4 --hier-c 8,16 --half-dtype float16 \
  --repeats "$REPEATS" --warmup 1 --timeout 3600 --csv "$CSV" --log-dir "${TMPDIR:-/tmp}/hierarchical_lab_ranks" --quiet
step "training, 4x2 hosts, ${RATE_TRAIN} Mbit/s, seeds $SEEDS" \
  $PY scripts/bench/compare_training.py --settings nccl,hier_ring,hier_cerar_c16 --seeds "$SEEDS" --n 8 \
  --ranks-per-host 2 --mtu 9000 --rate-mbit "$RATE_TRAIN" --model "$MODEL" --steps "$STEPS" --eval-every "$EVAL" \
  --micro-batch 4 --seq-len 128 --out "$OUT/runs/training_hierarchical" --csv "$OUT/data/training_hierarchical.csv" \
  --report "$OUT/training_hierarchical.md"
step "two-tier lab report" $PY scripts/reporting/hierarchical_report.py --csv "$CSV" --out "$OUT/hierarchical_lab.md" \
  --training-report "$OUT/training_hierarchical.md" --figures-dir "$OUT/figures"
step "cost model report" $PY scripts/reporting/costmodel_report.py --csv reports/data/allreduce.csv --two-tier-csv "$CSV" \
  --out "$OUT/costmodel.md" --figure "$OUT/figures/two_tier_choice.png"
if [ "$OUT" = reports ]; then
  step "figures" $PY scripts/reporting/make_figures.py
  step "figures (100 Mbit/s training)" $PY scripts/reporting/make_figures.py --only training \
    --runs-dir reports/runs/training_100mbit --prefix lab100_ --title "(lab 100 Mbit/s)"
else
  step "figures (two-tier training)" $PY scripts/reporting/make_figures.py --only training \
    --runs-dir "$OUT/runs/training_hierarchical" --prefix two_tier_ --title "(two-tier lab)" --out "$OUT/figures"
fi
echo "=== done in $((SECONDS - T0)) s, $FAILED step(s) failed; log: $LOG" | tee -a "$LOG"
[ $FAILED = 0 ]
