# Sourced by the soak loops (commit_kill_trials.sh, elastic_kill_trials.sh; not part of `make test`): it moves to the
# repository root and puts src/ on PYTHONPATH; `trials N` runs the caller's `trial I` for I in 1..N, each with its
# output in its own log, prints one line per trial (named by the caller's `name I`, if it defines one) and how many
# failed, and returns non-zero when any did.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

name() { :; }

trials() {
  local n=$1 fails=0 i log
  for i in $(seq 1 "$n"); do
    log=$(mktemp)
    if trial "$i" > "$log" 2>&1; then
      echo "trial $i$(name "$i"): ok"
    else
      fails=$((fails + 1)); echo "trial $i$(name "$i"): FAILED (log: $log)"; tail -3 "$log"
    fi
  done
  echo "failed $fails of $n"
  [ "$fails" -eq 0 ]
}
