#!/usr/bin/env bash
# The all-reduce measurements behind reports/README.md, in the order they were run.
# Usage (root, from the repo root): scripts/bench/run_allreduce_sweeps.sh PHASE...
#   PHASE: targets lab loopback loopback256 passes hierarchical hierarchical-rails
# The hierarchical phases (issue 20: 4 hosts x 2 ranks) write reports/data/hierarchical_lab.csv instead, so the
# one-rank-per-host figures never mix with them; scripts/bench/run_hierarchical_lab.sh runs the first with training.
# Each bench command and the load average before/after it are logged to reports/logs/allreduce_runs.log.
set -u
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
LOG=reports/logs/allreduce_runs.log
CSV=reports/data/allreduce.csv
run() {
  echo "=== $(date -Is) load before: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$LOG"
  echo "\$ $PY scripts/bench/bench_allreduce.py $* --csv ${RUN_CSV:-$CSV} --quiet" >>"$LOG"
  local t0=$SECONDS
  $PY scripts/bench/bench_allreduce.py "$@" --csv "${RUN_CSV:-$CSV}" --quiet >>"$LOG" 2>&1
  echo "=== rc=$? in $((SECONDS - t0)) s; load after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$LOG"
}
for phase in "$@"; do
  case "$phase" in
  targets)  # the issue's two targets, side by side, >= 5 interleaved repeats
    run --lab --rate-mbit 200 --n 4 --sizes-mb 64 --c-mult 4 --constructions perturbation,optimized --repeats 5 --warmup 1
    run --lab --rate-mbit 200 --n 8 --sizes-mb 64 --c-mult 4 --constructions perturbation,optimized --repeats 5 --warmup 1
    ;;
  lab)  # low and high rates, N=4; 256 MB at one rate; N=8 at 200 Mbit/s, c in {8,16,32}
    run --lab --rate-mbit 100,400,5000 --n 4 --sizes-mb 1,16,64 --c-mult 1,2,4 --constructions perturbation,optimized --repeats 3 --warmup 1
    run --lab --rate-mbit 400 --n 4 --sizes-mb 256 --c-mult 4 --constructions perturbation --repeats 2 --warmup 1
    run --lab --rate-mbit 200 --n 8 --sizes-mb 64 --c-mult 1,2,4 --constructions perturbation --repeats 3 --warmup 1
    run --lab --rate-mbit 400 --n 2 --sizes-mb 64 --c-mult 1,2,4 --constructions vandermonde,perturbation,optimized --repeats 3 --warmup 1
    ;;
  loopback)
    run --n 2,4,8 --sizes-mb 1,16,64 --c-mult 1,2,4 --constructions vandermonde,perturbation,optimized --repeats 3 --warmup 1
    ;;
  loopback256)  # not run in the committed data (time budget)
    run --n 4 --sizes-mb 256 --c-mult 4 --constructions perturbation --repeats 2 --warmup 1
    ;;
  passes)  # fewer passes (the arithmetic off the critical path): before and after, back to back per setting
    # "before" is the library at BEFORE (the last commit before the new arithmetic), imported from a worktree
    # by the same bench script; each invocation measures its own all_reduce baseline side by side.
    BEFORE=db37ec034d6d
    BEFORE_DIR=${BEFORE_DIR:-/tmp/cerar-before-$BEFORE}
    [ -d "$BEFORE_DIR" ] || git worktree add --detach "$BEFORE_DIR" "$BEFORE" >/dev/null
    LOOP=(--n 4 --sizes-mb 64 --c-mult 4 --constructions optimized --aggregators nccl,cerar --repeats 5 --warmup 1)
    run "${LOOP[@]}" --code-dir "$BEFORE_DIR"
    run "${LOOP[@]}" --storages spec,messages
    for mtu in 1500 9000; do
      for N in 4 8; do
        LAB=(--lab --rate-mbit 200 --n $N --mtu $mtu --sizes-mb 64 --c-mult 4 --constructions optimized --repeats 5 --warmup 1)
        run "${LAB[@]}" --code-dir "$BEFORE_DIR"
        run "${LAB[@]}" --storages spec,messages
      done
    done
    ;;
  hierarchical)  # every aggregator side by side on 4 hosts x 2 ranks, one shared NIC per host, jumbo frames
    HIER=(--lab --rate-mbit 200 --mtu 9000 --n 8 --ranks-per-host 2 --sizes-mb 4,16,64
          --aggregators nccl,cerar,hier_ring,hier_cerar,hier_ring16 --constructions optimized,perturbation
          --c-mult 4 --hier-c 8,16 --repeats 5 --warmup 1 --timeout 3600)
    RUN_CSV=reports/data/hierarchical_lab.csv run "${HIER[@]}"
    ;;
  hierarchical-rails)  # the same with one NIC per rank (a rail each), 64 MiB
    RAILS=(--lab --rails --rate-mbit 200 --mtu 9000 --n 8 --ranks-per-host 2 --sizes-mb 64
           --aggregators nccl,hier_ring,hier_cerar,hier_ring16 --constructions optimized --hier-c 8,16
           --repeats 5 --warmup 1 --timeout 3600)
    RUN_CSV=reports/data/hierarchical_lab.csv run "${RAILS[@]}"
    ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
