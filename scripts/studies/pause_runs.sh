#!/usr/bin/env bash
# Freeze (stop) or resume (cont) every background training launch of train/sweep.py, so that a timing
# benchmark can have the machine to itself without losing the long runs (scripts/studies/run_fidelity.sh gives them a
# collective timeout long enough to survive the pause). Usage: scripts/studies/pause_runs.sh stop|cont
set -u
sig=${1:?usage: scripts/studies/pause_runs.sh stop|cont}
case "$sig" in stop) s=STOP ;; cont) s=CONT ;; *) echo "usage: $0 stop|cont" >&2; exit 2 ;; esac
pids=$(pgrep -f "train/sweep.py" || true)
[ -z "$pids" ] && { echo "pause_runs: no train/sweep.py process"; exit 0; }
kill -s "$s" $pids
echo "pause_runs: SIG$s to $(echo $pids | wc -w) processes at $(date -Is); load: $(cut -d' ' -f1-3 /proc/loadavg)"
