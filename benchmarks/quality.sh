#!/usr/bin/env bash
# Time to quality on slow links (docs/performance.md §7). Run as root (the shaped links are network namespaces +
# veth + tc tbf) on an otherwise idle machine:
#   benchmarks/quality.sh [OUT]    §7's runs, 3 repeats each, about 50 minutes at a 199 ms GPT compute step:
#     OUT/gpt       the GPT: DDP, DDP+PowerSGD, Streaming DiLoCo 4-bit and torchft's DiLoCo / Streaming DiLoCo on
#                   100 Mbit/s; DDP and the two Streaming DiLoCo setups on 10 Mbit/s; DDP on 1 Gbit/s (the bound)
#     OUT/resnet20  ResNet-20: DDP, DiLoCo, Streaming DiLoCo 4-bit, torchft's Streaming DiLoCo on 100 Mbit/s; DDP on
#                   1 Gbit/s
# torchft's setups run when this python can import torchft (benchmarks/torchft/setup.sh, then
# PY=benchmarks/torchft/.venv-torchft/bin/python benchmarks/quality.sh OUT); otherwise they are left out.
# FULL=1 runs instead every setup on every link for both tasks (about 115 minutes on a day the GPT step takes
# 150 ms). EXTRA=--dry-run prints each plan and its estimate at today's measured speed without running anything.
# Each run trains for its task's budget_steps x one worker's compute step, measured when the invocation starts;
# OUT/*/quality.json is rewritten after every run, OUT/*/quality.md every 8 runs (plots at the end).
set -uo pipefail  # a failed run is reported in its table; keep measuring the rest
cd "$(dirname "$0")/.."
OUT=${1:-results/quality}
PY=${PY:-.venv/bin/python}
Q="$PY -m phalanx.bench.quality --repeats 3"
if [ -n "${FULL:-}" ]; then
  exec $Q --tasks gpt,resnet20 --link 10mbit,100mbit,1gbit --out "$OUT" ${EXTRA:-}
fi
TFT=""
if $PY -c "import torchft" 2>/dev/null; then TFT=",torchft-streaming-diloco"; fi
TFT_DILOCO=""
if [ -n "$TFT" ]; then TFT_DILOCO=",torchft-diloco"; fi
$Q --tasks gpt --evals 24 --link 10mbit,100mbit,1gbit --fast-setups ddp \
  --setups "ddp,ddp-powersgd,streaming-diloco-4bit$TFT_DILOCO$TFT" --out "$OUT/gpt" ${EXTRA:-}
$Q --tasks resnet20 --evals 16 --link 100mbit,1gbit --fast-setups ddp \
  --setups "ddp,diloco,streaming-diloco-4bit$TFT" --out "$OUT/resnet20" ${EXTRA:-}
