#!/usr/bin/env bash
# Time to quality on slow links (docs/performance.md, "Time to quality on slow links").
# Run as root (the shaped links are network namespaces + veth + tc tbf) on an otherwise idle machine:
#   benchmarks/quality.sh [OUT]            the whole grid: 2 tasks x 13 setups x {100mbit, 1gbit} x 3 repeats,
#                                          30 s of training per run, after the lr sweep (estimated ~2 h)
#   QUICK=1 benchmarks/quality.sh [OUT]    the same on 100mbit only, 10 s per run, a shorter sweep (estimated ~45 min)
# `--dry-run` added to either prints every run and the estimate without running anything.
set -uo pipefail  # a failed run is reported in its table; keep measuring the rest
cd "$(dirname "$0")/.."
OUT=${1:-results/quality}
PY=${PY:-.venv/bin/python}
if [ "${QUICK:-0}" = 1 ]; then
  exec $PY -m phalanx.bench.quality --tasks gpt,resnet20 --link 100mbit --repeats 3 --budget 10 \
       --sweep 0.5,1,2 --sweep-steps 20 --sweep-cap 4 --out "$OUT" ${EXTRA:-}
fi
exec $PY -m phalanx.bench.quality --tasks gpt,resnet20 --link 100mbit,1gbit --repeats 3 --budget 30 \
     --sweep 0.5,1,2 --sweep-steps 30 --sweep-cap 6 --out "$OUT" ${EXTRA:-}
