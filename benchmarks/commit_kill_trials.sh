#!/usr/bin/env bash
# Repeated commit-window kills (a soak loop, not part of `make test`): 3 elastic workers, the worker started as
# rank 0 exits inside the commit of step 3 (odd trials) or step 6 (even trials), while it captures its state.
# A trial passes when the job exits 0, the two survivors roll back to that commit, train every sample once per
# epoch and end equal to the one-process oracle (tests/elastic/test_elastic_commit.py checks all of it).
#   benchmarks/commit_kill_trials.sh [TRIALS]        (default 20; about 20-60 s a trial)
. "$(dirname "$0")/trials.sh"

at() { echo $(( $1 % 2 == 1 ? 3 : 6 )); }
name() { echo " (commit of step $(at "$1"))"; }
trial() {
  timeout 300 "$PY" -m pytest tests/elastic/test_elastic_commit.py -q -p no:cacheprovider \
    -k "rank_0_killed_inside and $(at "$1")"
}

trials "${1:-20}"
