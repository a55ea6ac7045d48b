# shellcheck shell=bash
# Sourced by the lab's run scripts (run_hierarchical_lab.sh, run_aggregators_lab.sh): `step NAME COMMAND...` runs
# the command with its output in $LOG, logging the uptime (load average) before and after, its exit status and
# its duration; a failed step adds one to $FAILED.
FAILED=${FAILED:-0}
step() {
  local name=$1; shift
  echo "=== $(date -Is) $name: uptime before: $(uptime)" | tee -a "$LOG"
  echo "\$ $*" >>"$LOG"
  local t0=$SECONDS
  "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $(date -Is) $name: rc=$rc in $((SECONDS - t0)) s; uptime after: $(uptime)" | tee -a "$LOG"
  [ $rc = 0 ] || FAILED=$((FAILED + 1))
}
