#!/usr/bin/env bash
# Run a test selection beside two busy loops (`python -c 'while True: pass'` twice: load about 4 on 2 cores), the
# condition every multi-process test must pass in (issue 37 item 6); prints pytest's summary and the load seen.
#
#   benchmarks/busy_loops.sh                                   # the multi-process packages, two files at a time
#   benchmarks/busy_loops.sh tests/launch/test_launch_stacks.py -x   # any pytest arguments: a selection
#
# The loops are this script's own children and end with it (trap), however pytest ends.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p .run/tmp .run/home
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TMPDIR="$PWD/.run/tmp" HOME="$PWD/.run/home"
loops=()
trap 'kill "${loops[@]}" 2>/dev/null || true' EXIT
for _ in 1 2; do
    "$PY" -c 'while True: pass' &
    loops+=($!)
done
echo "busy loops: ${loops[*]}; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ $# -eq 0 ]; then
    set -- -n 2 --dist loadfile tests/elastic tests/launch tests/group tests/sharding tests/checkpoint tests/ps \
        tests/stream tests/test_core_multiproc.py
fi
status=0
"$PY" -m pytest -q -p no:cacheprovider -rfE "$@" || status=$?
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
exit $status
