#!/usr/bin/env bash
# The batch-scaling study of issue 19: does CERAR's loss gap grow with the batch, and what does c=auto choose?
# Usage (from the repo root): scripts/studies/run_batch_scaling.sh HALF [OUT]      (HALF: A B C D, or T to time)
#
# The long-horizon study (reports/fidelity.md, scripts/studies/run_fidelity.sh G-J) ran every setting at 16 sequences of
# 64 tokens per step. Here the same setup (N=4 ranks on gloo, model=tiny, corpus v2, Pythia's recipe, the same
# seeds) runs at larger global batches, the number of sequences and the sequence length varied separately so that
# the unit of the gradient noise is measured, not assumed. Shapes, sequences x tokens (tokens per step):
#   16x64 (1,024: the study's)   64x64 (4,096)   256x64 (16,384)   16x256 (4,096)   16x1024 (16,384)
# Each shape runs nccl (seeds 1 and 2: the seed band), optimized c=16, optimized c=16 with resync every 50 steps,
# optimized c=8 and c=auto (aggregator.error_budget default; first choice and re-checks every STEPS/10 steps), all
# at seed 1 but nccl's second, in this order of priority: nccl_s1, c=16, nccl_s2, c=auto, c=16 resync, c=8.
# The batch comes from trainer.global_batch_size; micro-batches hold at most 1,024 tokens per rank (accumulation
# does the rest), and the validation set is 16,384 tokens in every shape (the study's), spread over the split.
# Steps: every shape runs STEPS optimizer steps (default 300; the lr schedule spans them), so gaps compare at equal
# steps; the study measured how the gap grows with steps at the smallest batch (optimized c=16, same seed: +0.06 to
# +0.15 % at step 300, +0.29 % at 500, +0.71 % at 3,000, with nccl's seeds 0.1-0.6 % apart along the way), so at
# 300 steps a batch that multiplies the gap by 3 or more shows outside the band, and a smaller effect does not.
# Evaluation every STEPS/10 steps; aggregation error, noise and drift every 50.
#
# Cost (timed with half T once, 20 steps per shape, on this 2-core machine while other jobs ran, load average
# 15-23, so inflated if anything): seconds per step 0.34 (nccl) / 0.43 (c=auto) at 16x64, 1.1 at 64x64, 4.6-7.1
# at 256x64, 1.2 at 16x256, 5.5-6.0 at 16x1024; a c=auto check 0.13-0.5 s. At STEPS=300, six runs per shape:
#   A 256x64 ~3.0 h   B 16x1024 ~3.0 h   C 16x64 ~0.3 h   D 64x64 + 16x256 ~1.2 h   (machine time; two halves side
# by side share the 2 cores, so the wall time of the two is their sum). ~6 hours: A and B side by side, then C
# (~6.3 h); D in another session. STEPS=250 fits all four in ~6.2 h.
#
# Halves (one train/sweep.py launch each, runs one after another; run two side by side on a 2-core box):
#   A  the 16x sequences shape (256x64)          B  the 16x sequence-length shape (16x1024)
#   C  the study's shape at STEPS (16x64)        D  the 4x shapes (64x64, 16x256)
#   T  timing probe: 20 steps of every shape with nccl and with c=auto checking every 5 steps, all under
#      /tmp/batch-scaling-timing (run data and log): each shape's seconds per step (time/step in metrics.jsonl)
#      and c=auto's check cost (time/auto_c).
# Run data: OUT/<shape>/<setting>_s<seed>/ (default OUT reports/runs/batch-scaling); scripts/reporting/fidelity_report.py
# --batch-scaling-dir builds the report's section from it. The load average before and after each half goes to
# reports/logs/batch_scaling_runs.log.
set -u
cd "$(dirname "$0")/../.."
half=${1:?usage: scripts/studies/run_batch_scaling.sh A|B|C|D|T [OUT]}
OUT=${2:-reports/runs/batch-scaling}
STEPS=${STEPS:-300}
EVAL_EVERY=$((STEPS / 10))
[[ $half == T ]] && STEPS=20 EVAL_EVERY=100 # timing: evaluate once, at the end
LOG=${LOG:-reports/logs/batch_scaling_runs.log}
[[ $half == T ]] && LOG=/tmp/batch-scaling-timing/timing.log
COMMON=(model=tiny data=embedded trainer.max_steps="$STEPS" trainer.eval_every="$EVAL_EVERY"
  trainer.drift_every=50 trainer.measure_error_every=50 trainer.log_every=10 trainer.progress_bar=false
  checkpoint.every=0 wandb.mode=disabled trainer.collective_timeout_s=3600)
AUTO="aggregator.auto_warmup_steps=$EVAL_EVERY aggregator.auto_check_every=$EVAL_EVERY"
SETTINGS=("nccl_s1: aggregator=nccl seed=1"
  "cerar_c16_optimized_s1: aggregator=cerar_optimized c=16 seed=1"
  "nccl_s2: aggregator=nccl seed=2"
  "cerar_auto_s1: aggregator=cerar_optimized c=auto seed=1 $AUTO"
  "cerar_c16_optimized_resync50_s1: aggregator=cerar_optimized c=16 trainer.resync_every=50 seed=1"
  "cerar_c8_optimized_s1: aggregator=cerar_optimized c=8 seed=1")

shape_overrides() { # sequences seq_len -> the overrides of that batch shape (N=4)
  local sequences=$1 seq_len=$2 per_rank micro
  per_rank=$((sequences / 4))
  micro=$((1024 / seq_len))
  ((micro < 1)) && micro=1
  ((micro > per_rank)) && micro=$per_rank
  echo "data.seq_len=$seq_len trainer.global_batch_size=$sequences trainer.micro_batch_size=$micro" \
    "trainer.eval_batches=$((16384 / (seq_len * micro * 4)))"
}

launch() { # tag out-dir shape-overrides run...
  local tag=$1 out=$2 shape=$3
  shift 3
  mkdir -p "$(dirname "$LOG")" "$out"
  echo "=== $(date -Is) half $half $tag start (STEPS=$STEPS); load: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$LOG"
  # shellcheck disable=SC2086  # the shape's overrides are words
  OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false .venv/bin/torchrun --standalone --nproc_per_node=4 \
    train/sweep.py "$out" "$@" -- "${COMMON[@]}" $shape >>"$LOG.$half" 2>&1
  echo "=== $(date -Is) half $half $tag rc=$? ; load: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$LOG"
}

run_shape() { # sequences seq_len
  launch "${1}x$2" "$OUT/batch${1}x$2" "$(shape_overrides "$1" "$2")" "${SETTINGS[@]}"
}

case "$half" in
A) run_shape 256 64 ;;
B) run_shape 16 1024 ;;
C) run_shape 16 64 ;;
D) run_shape 64 64 && run_shape 16 256 ;;
T)
  for shape in "16 64" "64 64" "256 64" "16 256" "16 1024"; do
    read -r sequences seq_len <<<"$shape"
    launch "timing ${sequences}x$seq_len" "/tmp/batch-scaling-timing/batch${sequences}x$seq_len" \
      "$(shape_overrides "$sequences" "$seq_len") trainer.log_every=1" \
      "nccl_s1: aggregator=nccl seed=1" \
      "cerar_auto_s1: aggregator=cerar_optimized c=auto seed=1 aggregator.auto_warmup_steps=5 aggregator.auto_check_every=5"
  done
  ;;
*)
  echo "unknown half $half (A B C D, or T)" >&2
  exit 2
  ;;
esac
