#!/usr/bin/env bash
# The long-horizon fidelity study behind reports/fidelity.md (issue: does CERAR train like exact all-reduce?).
# Usage (from the repo root): scripts/studies/run_fidelity.sh A|B|C|D [OUT]   (halves run side by side on a 2-core box)
# A and B are the first session's halves; they stopped for lack of session time after five runs, and C and D
# are the settings they had not reached (run side by side in the next session). E measures the drift of the resync
# run before each resync (the loop measured it right after the resync until then, so it read 0): the same run as
# C's first, stopped after 1000 of its 3000 steps for machine time; it retraces that run's trajectory exactly.
# N=4 ranks of model=tiny on the embedded corpus, 3000 optimizer steps per run, same data order and seed per
# setting; validation loss every 100 steps, drift and aggregation error (with the SGD noise beside it) every 50.
# Each half is one train/sweep.py launch (one process group, runs one after another); the load average before
# and after is logged to reports/logs/fidelity_runs.log.
# G, H and I rerun the study on the grown embedded corpus (v2: the World English Bible added, 1.79 M training
# tokens, so 3000 steps read it 1.7 times instead of 3.8): three launches side by side, the settings that decide
# the default first (nccl and optimized c=16 with two seeds, perturbation c=16, resync), the rest after. J is
# c=8 optimized, started in G's place once G's two nccl runs had ended (the gaps on v2 were larger than on v1, so
# c = 2N mattered more than fp16); G, H and I were stopped after their first two runs for session time.
# K and L are the aggregators study (issue 25: every aggregator a user would weigh): 1,500 steps each (schedule
# of 1,500), the same shape and corpus v2; K the settings that existed when it started (nccl two seeds, the fp16
# ring, CERAR fp32 c=auto), L the new aggregators (the 8-bit all-reduce, CERAR over fp16 messages at c = N+1 = 5
# and c = 2N = 8). L's first launch ran int8 and was stopped when CERAR fp16's default kappa_max moved from the
# rounding bound's 20 to the measured balance's 64; L now runs the two CERAR fp16 settings.
# M is aggregator=auto (issue 28) at the same shape and seed as K's nccl_s1: its same-seed gap against nccl's band.
# T and U are the per-tensor study (issue 33: each aggregator's error against each parameter tensor's own noise,
# logged every 50 steps as tensor/<name>): 1,500 steps at K's shape; T the aggregators auto may choose as they were
# before the per-tensor fixes, run from a checkout of that tree (PYTHONPATH=<checkout> scripts/studies/... T, from
# the checkout's root), U and W the same after them (two launches side by side), with aggregator=auto and bf16,
# and V nccl's two seeds (the exact all-reduce, unchanged by the fixes).
# X is the per-tensor study at pythia-14m (issue 33: its untied 50,304-row embeddings and output layer beside small
# biases and norm gains), after the fixes, at the horizon the CPU allows: 300 steps (error, noise and drift every
# 25, validation every 50), every aggregator auto may choose and auto, nccl's two seeds. X was stopped by hand after
# its sixth run; ONLY="cerar_c8_optimized_s1 nccl_s2" ran the last two.
set -u
cd "$(dirname "$0")/../.."
half=${1:?usage: scripts/studies/run_fidelity.sh A|B|...|M|T|U|V|W|X [OUT]}
case "$half" in
G | H | I | J) OUT=${2:-reports/runs/fidelity-corpus-v2} ;;
K | L | M) OUT=${2:-reports/runs/aggregators-1500} ;;
T) OUT=${2:-reports/runs/tensors-1500/before} ;;
U | V | W) OUT=${2:-reports/runs/tensors-1500/after} ;;
X) OUT=${2:-reports/runs/tensors-pythia-14m/after} ;;
*) OUT=${2:-reports/runs/fidelity} ;;
esac
LOG=reports/logs/fidelity_runs.log
STEPS=3000
case "$half" in K | L | M | T | U | V | W) STEPS=1500 ;; esac
MODEL=tiny EVAL=100 MEASURE=50
[ "$half" = X ] && { MODEL=pythia-14m STEPS=300 EVAL=50 MEASURE=25; }
COMMON=(model=$MODEL data=embedded data.seq_len=64 trainer.micro_batch_size=4 trainer.max_steps=$STEPS
  trainer.eval_every=$EVAL trainer.eval_batches=16 trainer.drift_every=$MEASURE trainer.measure_error_every=$MEASURE
  trainer.log_every=10 trainer.progress_bar=false checkpoint.every=0 wandb.mode=disabled
  trainer.collective_timeout_s=3600)
# The long collective timeout changes no result: it lets scripts/studies/pause_runs.sh freeze these runs (SIGSTOP) for the
# minutes a timing benchmark needs the machine to itself, without a pending collective expiring meanwhile.
case "$half" in
A) RUNS=("nccl_s1: aggregator=nccl seed=1"
    "cerar_c16_optimized_s1: aggregator=cerar_optimized c=16 seed=1"
    "nccl_s2: aggregator=nccl seed=2"
    "cerar_c16_optimized_resync50_s1: aggregator=cerar_optimized c=16 trainer.resync_every=50 seed=1"
    "cerar_c8_optimized_s1: aggregator=cerar_optimized c=8 seed=1"
    "fp16_s1: aggregator=fp16 seed=1") ;;
B) RUNS=("cerar_c16_perturbation_s1: aggregator=cerar_perturbation c=16 seed=1"
    "cerar_c16_optimized_s2: aggregator=cerar_optimized c=16 seed=2"
    "cerar_c8_perturbation_s1: aggregator=cerar_perturbation c=8 seed=1"
    "powersgd_s1: aggregator=powersgd seed=1") ;;
C) RUNS=("cerar_c16_optimized_resync50_s1: aggregator=cerar_optimized c=16 trainer.resync_every=50 seed=1"
    "cerar_c8_optimized_s1: aggregator=cerar_optimized c=8 seed=1"
    "fp16_s1: aggregator=fp16 seed=1") ;;
D) RUNS=("cerar_c8_perturbation_s1: aggregator=cerar_perturbation c=8 seed=1"
    "powersgd_s1: aggregator=powersgd seed=1") ;;
E) RUNS=("cerar_c16_optimized_resync50_drift_s1: aggregator=cerar_optimized c=16 trainer.resync_every=50 seed=1 \
    trainer.stop_after_step=1000") ;;  # the schedule stays that of max_steps=3000
F) RUNS=("fp16_s1: aggregator=fp16 seed=1") ;;  # C's last run, started beside it to finish in the session
G) RUNS=("nccl_s1: aggregator=nccl seed=1"
    "nccl_s2: aggregator=nccl seed=2"
    "fp16_s1: aggregator=fp16 seed=1") ;;
H) RUNS=("cerar_c16_optimized_s1: aggregator=cerar_optimized c=16 seed=1"
    "cerar_c16_optimized_s2: aggregator=cerar_optimized c=16 seed=2"
    "powersgd_s1: aggregator=powersgd seed=1") ;;
I) RUNS=("cerar_c16_perturbation_s1: aggregator=cerar_perturbation c=16 seed=1"
    "cerar_c16_optimized_resync50_s1: aggregator=cerar_optimized c=16 trainer.resync_every=50 seed=1"
    "cerar_c8_optimized_s1: aggregator=cerar_optimized c=8 seed=1"
    "cerar_c8_perturbation_s1: aggregator=cerar_perturbation c=8 seed=1") ;;
J) RUNS=("cerar_c8_optimized_s1: aggregator=cerar_optimized c=8 seed=1") ;;
K) RUNS=("nccl_s1: aggregator=nccl seed=1"
    "cerar_auto_s1: aggregator=cerar c=auto seed=1"
    "fp16_s1: aggregator=fp16 seed=1"
    "nccl_s2: aggregator=nccl seed=2") ;;
L) RUNS=("cerar_fp16_c5_s1: aggregator=cerar aggregator.transport=float16 c=5 seed=1"
    "cerar_fp16_c8_s1: aggregator=cerar aggregator.transport=float16 c=8 seed=1") ;;
M) RUNS=("auto_s1: aggregator=auto seed=1") ;;
T) RUNS=("fp16_s1: aggregator=fp16 seed=1"
    "int8_s1: aggregator=int8 seed=1"
    "cerar_c8_optimized_s1: aggregator=cerar_optimized c=8 seed=1"
    "cerar_fp16_c5_s1: aggregator=cerar aggregator.transport=float16 c=5 seed=1") ;;
U) RUNS=("fp16_s1: aggregator=fp16 seed=1"
    "int8_s1: aggregator=int8 seed=1"
    "auto_s1: aggregator=auto seed=1") ;;
V) RUNS=("nccl_s1: aggregator=nccl seed=1"
    "nccl_s2: aggregator=nccl seed=2") ;;
W) RUNS=("cerar_c8_optimized_s1: aggregator=cerar_optimized c=8 seed=1"
    "cerar_fp16_c5_s1: aggregator=cerar aggregator.transport=float16 c=5 seed=1"
    "bf16_s1: aggregator=bf16 seed=1") ;;
X) RUNS=("nccl_s1: aggregator=nccl seed=1"
    "fp16_s1: aggregator=fp16 seed=1"
    "int8_s1: aggregator=int8 seed=1"
    "cerar_fp16_c5_s1: aggregator=cerar aggregator.transport=float16 c=5 seed=1"
    "auto_s1: aggregator=auto seed=1"
    "bf16_s1: aggregator=bf16 seed=1"
    "cerar_c8_optimized_s1: aggregator=cerar_optimized c=8 seed=1"
    "nccl_s2: aggregator=nccl seed=2") ;;
*) echo "unknown half $half (A to M, T to X)" >&2; exit 2 ;;
esac
# ONLY="label1 label2" runs just those of the half's runs (to finish a half that was stopped by hand).
if [ -n "${ONLY:-}" ]; then
  KEEP=()
  for run in "${RUNS[@]}"; do
    for label in $ONLY; do [ "${run%%:*}" = "$label" ] && KEEP+=("$run"); done
  done
  [ ${#KEEP[@]} -gt 0 ] || { echo "ONLY=$ONLY names none of half $half's runs" >&2; exit 2; }
  RUNS=("${KEEP[@]}")
fi
mkdir -p "$(dirname "$LOG")" "$OUT"
echo "=== $(date -Is) half $half start; load: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$LOG"
OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false .venv/bin/torchrun --standalone --nproc_per_node=4 \
  train/sweep.py "$OUT" "${RUNS[@]}" -- "${COMMON[@]}" >>"$LOG.$half" 2>&1
echo "=== $(date -Is) half $half rc=$? ; load: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$LOG"
