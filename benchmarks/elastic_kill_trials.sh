#!/usr/bin/env bash
# Repeated kill trials (a soak loop, not part of `make test`): 4 elastic workers, the worker started as rank 2 killed
# at step 4 (rank 0 is in a collective with its ring neighbours 1 and 3 only), --min-workers 3. A trial passes when
# the job exits 0. On the H100 machine (torch 2.11, 16 cores) this failed 10 of 10 times before the old group was
# garbage-collected at its destruction, 0 of 6 after.
#   benchmarks/elastic_kill_trials.sh [TRIALS]        (default 10; about 10-20 s a trial)
. "$(dirname "$0")/trials.sh"

trial() {
  timeout 150 "$PY" -c "import sys; from phalanx.cli import main; sys.exit(main())" run -n 4 --elastic \
    --min-workers 3 --heartbeat-timeout 20 tests/workers/elastic_policy.py --out "$(mktemp -d)" --kill 2@4 --epochs 1
}

trials "${1:-10}"
