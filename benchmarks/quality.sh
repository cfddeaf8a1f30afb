#!/usr/bin/env bash
# Time to quality on slow links (docs/performance.md §7). Run as root (the shaped links are network namespaces +
# veth + tc tbf) on an otherwise idle machine:
#   benchmarks/quality.sh [OUT] [PART ...]      PART: gpt, resnet20, gpt-large (default: all three, in that order)
#     OUT/gpt        the GPT: DDP, DDP+PowerSGD, streamed local SGD (H = 4, 4-bit; and with the inner momentum
#                    averaged too, -moments), Streaming DiLoCo 4-bit (the
#                    paper's H = 50 and Nesterov; and H = 64 with plain averaging as the outer step, -avg-h64) and
#                    torchft's DiLoCo / Streaming DiLoCo (also -avg) on 100 Mbit/s; DDP and the streamed setups on
#                    10 Mbit/s; DDP on 1 Gbit/s.
#     OUT/resnet20   ResNet-20: DDP, the 4-bit quantised all-reduce, streamed local SGD (4-bit fragments, SGD
#                    inner steps at DDP's lr, H = 4), Streaming DiLoCo 4-bit at H = 64 (-avg-h64) and torchft's
#                    Streaming DiLoCo on 100 Mbit/s; streamed local SGD and torchft's on 10 Mbit/s (there DDP's step
#                    is over 10x its compute, and the 4-bit all-reduce's 2x; -avg-h64 does not reach ResNet-20's
#                    target in the budget on any link); DDP on 1 Gbit/s.
#     OUT/gpt-large  the 4.8M-parameter GPT, 4 sequences a worker, 360 steps: DDP and phalanx's Streaming DiLoCo
#                    -avg-h64 on 100 Mbit/s; it and torchft's -avg on 10 Mbit/s, where torchft's float32 fragments
#                    no longer hide behind 5 inner steps (a DDP step there is ~15 s); DDP on 1 Gbit/s. About 46
#                    minutes, 37 without torchft (an evaluation of this model costs ~1.5 s).
# Each part stays inside the 45-minute budget of one benchmark run (gpt-large with torchft: about 46 minutes); the
# slow link gets fewer setups (above).
# A part measured in two invocations (its links) is merged into OUT/PART by --from-json.
# torchft's setups run when this python can import torchft (benchmarks/torchft/setup.sh, then
# PY=benchmarks/torchft/.venv-torchft/bin/python benchmarks/quality.sh OUT); otherwise they are left out.
# FULL=1 runs instead every setup on every link for the GPT and ResNet-20 (about 115 minutes on a day the GPT step
# takes 150 ms). EXTRA=--dry-run prints each plan and its estimate at today's measured speed without running.
# Each run trains for its task's budget_steps x one worker's compute step, measured alone when the invocation
# starts; the compute-only bound takes the step of the compute-only runs (two workers side by side, no exchange,
# on the middle link of each part);
# OUT/*/quality.json is rewritten after every run, OUT/*/quality.md every 8 runs (plots at the end).
set -uo pipefail  # a failed run is reported in its table; keep measuring the rest
cd "$(dirname "$0")/.."
OUT=${1:-results/quality}
shift $(( $# > 0 ? 1 : 0 ))
PARTS=${*:-gpt resnet20 gpt-large}
PY=${PY:-.venv/bin/python}
Q="$PY -m benchmarks.quality --repeats 3"
if [ -n "${FULL:-}" ]; then
  exec $Q --tasks gpt,resnet20 --link 10mbit,100mbit,1gbit --out "$OUT" ${EXTRA:-}
fi
TFT="" TFT_DILOCO="" TFT_AVG=""
if $PY -c "import torchft" 2>/dev/null; then
  TFT=",torchft-streaming-diloco" TFT_DILOCO=",torchft-diloco" TFT_AVG=",torchft-streaming-diloco-avg"
fi

merge() {  # merge() PART: OUT/PART/{fast,slow} into OUT/PART
  if [ -z "${EXTRA:-}" ]; then
    $PY -m benchmarks.quality --from-json "$OUT/$1/fast/quality.json,$OUT/$1/slow/quality.json" --out "$OUT/$1"
  fi
}

for part in $PARTS; do
  case $part in
    gpt)
      $Q --tasks gpt --evals 24 --link 10mbit,100mbit,1gbit --fast-setups ddp \
        --setups "compute-only,ddp,ddp-powersgd,streaming-local-sgd-4bit,streaming-local-sgd-4bit-moments\
,streaming-diloco-4bit,streaming-diloco-4bit-avg-h64$TFT_DILOCO$TFT$TFT_AVG" \
        --out "$OUT/gpt" ${EXTRA:-} ;;
    resnet20)
      $Q --tasks resnet20 --evals 16 --link 100mbit,1gbit --fast-setups ddp \
        --setups "compute-only,ddp,allreduce-4bit,streaming-local-sgd-4bit,streaming-diloco-4bit-avg-h64$TFT" \
        --out "$OUT/resnet20/fast" ${EXTRA:-}
      $Q --tasks resnet20 --evals 16 --link 10mbit \
        --setups "streaming-local-sgd-4bit$TFT" \
        --out "$OUT/resnet20/slow" ${EXTRA:-}
      merge resnet20 ;;
    gpt-large)
      $Q --tasks gpt-large --evals 16 --link 100mbit,1gbit --fast-setups ddp \
        --setups "compute-only,ddp,streaming-diloco-4bit-avg-h64" --out "$OUT/gpt-large/fast" ${EXTRA:-}
      $Q --tasks gpt-large --evals 16 --link 10mbit --setups "streaming-diloco-4bit-avg-h64$TFT_AVG" \
        --out "$OUT/gpt-large/slow" ${EXTRA:-}
      merge gpt-large ;;
    *) echo "benchmarks/quality.sh: part '$part'; expected gpt, resnet20 or gpt-large" >&2; exit 2 ;;
  esac
done
