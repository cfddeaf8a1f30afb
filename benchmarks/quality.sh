#!/usr/bin/env bash
# Time to quality on slow links (docs/performance.md, "Time to quality on slow links").
# Run as root (the shaped links are network namespaces + veth + tc tbf) on an otherwise idle machine:
#   benchmarks/quality.sh [OUT]     2 tasks x {15 setups at 100 Mbit/s, 7 at 1 Gbit/s, 3 at 10 Mbit/s} x 3 repeats,
#                                   each run trained for its task's budget_steps x one worker's compute step
#                                   (measured at the start; 14 s at ~85 ms a GPT step), at the learning rates of the
#                                   committed sweep (src/phalanx/bench/quality/lrs.json); 44 min on a fast day, about
#                                   115 min on a day the step takes 150 ms (the plan line prints the estimate)
# EXTRA=--dry-run prints every run and the estimate without running anything; EXTRA="--sweep 0.5,1,2" redoes the
# lr sweep first (about 15 more minutes). TASKS=gpt-large adds (or, alone, runs) the 12.4M-parameter GPT, whose
# target is provisional (see its `why`); LINKS overrides the links. Progress goes to stderr, one line per finished
# run; OUT/quality.json is rewritten after every run and OUT/quality.md every 8 runs (plots at the end), so a late
# stop still leaves tables. Each table reports time to target / the compute-only bound (DDP's steps to target x one
# worker's compute step). torchft's DiLoCo and Streaming DiLoCo join as peers (lighthouse in rank 0's namespace)
# when the python that runs this can import torchft: benchmarks/torchft/setup.sh, then
# PY=benchmarks/torchft/.venv-torchft/bin/python benchmarks/quality.sh OUT (about 50 minutes instead of 44).
set -uo pipefail  # a failed run is reported in its table; keep measuring the rest
cd "$(dirname "$0")/.."
OUT=${1:-results/quality}
PY=${PY:-.venv/bin/python}
exec $PY -m phalanx.bench.quality --tasks "${TASKS:-gpt,resnet20}" --link "${LINKS:-10mbit,100mbit,1gbit}" \
  --repeats 3 --out "$OUT" ${EXTRA:-}
