#!/usr/bin/env bash
# One lease of a lent GPU in ONE device call: the GPU check (--quick), the GPU benchmark, then, time permitting,
# the check's training section; each under `timeout`, the whole within GPU_LEASE_TOTAL_S (540 s: a device call
# may run 600 s, and the lease's 15 minutes include the machine's start). What comes back is in $OUT (5 files):
#   lease.log                 every step's output, its exit status and seconds, the machine and the versions
#   gpu.md                    python -m scripts.checks.gpu --quick (written after every case: a cut run says what it saw)
#   gpu_bench.md, data/gpu_bench.jsonl   python -m scripts.bench.gpu (rewritten after every row)
#   gpu-training.md           the training section (bf16, fp16, bf16 overlapped: kill-and-resume), if its time is left
#
# Run from the repository's root on the device machine (docs/gpus.md, "One lease"):
#   CERAR_BENCH_COMMIT=<hash> bash scripts/checks/gpu_lease.sh
# carrying .whl (hydra-core, omegaconf, antlr4 wheels: the device image has no Hydra) and .cache/cerar-pythia (the
# embedded corpus's token cache: the image has no gensim/pythonbible to build it). Build that cache here with
#   bash scripts/checks/gpu_lease.sh --prepare
# The CPU dry form of the whole script (every GPU step as its --device cpu --small dry run):
#   OUT=/tmp/lease GPU_LEASE_DRY=1 bash scripts/checks/gpu_lease.sh
set -u
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
export CERAR_PYTHIA_CACHE=${CERAR_PYTHIA_CACHE:-$ROOT/.cache/cerar-pythia}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ROOT/.cache/inductor}

if [ "${1:-}" = "--prepare" ]; then  # here, before the lease: the token cache the trainer reads (train/data.py)
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "
from pathlib import Path
from train.data import EMBEDDED_KEY, bpe_token_arrays, embedded_documents
from train.config import DataConfig
train, val, vocab = bpe_token_arrays(Path('$CERAR_PYTHIA_CACHE'), EMBEDDED_KEY, DataConfig.bpe_vocab_size, embedded_documents)
print(f'token cache in $CERAR_PYTHIA_CACHE: {train.size} training and {val.size} validation tokens, vocabulary {vocab}')
" || exit 1
  ls .whl/*.whl >/dev/null 2>&1 || echo "note: no .whl/ here: copy the hydra-core, omegaconf and antlr4 wheels into .whl/"
  echo "carry: .whl .cache/cerar-pythia"
  exit 0
fi

OUT=${OUT:?set OUT to the folder that comes back}
mkdir -p "$OUT"
LOG=$OUT/lease.log
TOTAL=${GPU_LEASE_TOTAL_S:-540}
START=$(date +%s)
left() { echo $((TOTAL - ($(date +%s) - START))); }
say() { echo "[$(($(date +%s) - START)) s of $TOTAL] $*" | tee -a "$LOG"; }
if [ -n "${GPU_LEASE_DRY:-}" ]; then DEVICE=(--device cpu --small); else DEVICE=(); fi

# Hydra, OmegaConf, antlr4 from the carried wheels where the interpreter lacks them, kept on PYTHONPATH
if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    say "no Hydra and no .whl/ wheels: the check's self-loop and training cases and the trainer's rows will fail"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
  echo "commit ${CERAR_BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}; PYTHONPATH=$PYTHONPATH; CERAR_PYTHIA_CACHE=$CERAR_PYTHIA_CACHE"
  ls "$CERAR_PYTHIA_CACHE" 2>/dev/null || echo "no token cache at $CERAR_PYTHIA_CACHE: the trainer will try to build it"
} >>"$LOG" 2>&1
FAILED=()

step() {  # step NAME SECONDS command...: the command under timeout, its output into the log
  local name=$1 limit=$2
  shift 2
  say "$name: start (limit ${limit} s)"
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  say "$name: exit status $rc after $(($(date +%s) - t0)) s$([ $rc = 124 ] && echo ' (its timeout)')"
  [ $rc = 0 ] || FAILED+=("$name ($rc)")
}

# 1. the check, --quick (about 105 s on an H200: the NCCL self-loop, the arithmetic, the throughput, the hook)
step "check --quick" 200 "$PY" -m scripts.checks.gpu --quick ${DEVICE[@]+"${DEVICE[@]}"} --out "$OUT/gpu.md"
# 2. NCCL's point-to-point captured in a CUDA graph and replayed (docs/gpus.md, "CUDA graphs and NCCL's
#    point-to-point"): CERAR's rounds on the one-rank self-loop, every replay held to the spec's protocol
step "captured self-loop" 90 "$PY" -c "import json; from scripts.checks.gpu.throughput import captured_selfloop
r = captured_selfloop(); print('captured self-loop:', json.dumps(r)); raise SystemExit(r['status'] not in ('PASS', 'NOT RUN'))"
# 3. the benchmark, in what is left but the report's seconds (the training section runs only where time is left:
#    the benchmark's rows are what a lease exists for); its own budget ends it before the timeout
BENCH=$(($(left) - ${GPU_LEASE_TRAINING_S:-15}))
[ $BENCH -gt 300 ] && BENCH=300
if [ $BENCH -ge 60 ]; then
  step "bench" $((BENCH + 20)) "$PY" -m scripts.bench.gpu ${DEVICE[@]+"${DEVICE[@]}"} --budget-s "$BENCH" --out "$OUT/gpu_bench.md"
else
  say "bench: NOT RUN ($(left) s left)"
  FAILED+=("bench (not run)")
fi
# 4. the training section (three kill-and-resume cases, about 120 s on an H200: 80 s for two), if it fits
if [ "$(left)" -ge 140 ]; then
  step "check: training" $(($(left) - 5)) "$PY" -m scripts.checks.gpu ${DEVICE[@]+"${DEVICE[@]}"} \
    --skip selfloop arithmetic throughput hook_delayed between_ranks training_cerar hierarchical \
    --out "$OUT/gpu-training.md"
else
  say "check: training: NOT RUN ($(left) s left)"
fi
say "done: ${#FAILED[@]} step(s) did not pass: ${FAILED[*]:-none}"
[ ${#FAILED[@]} = 0 ]
