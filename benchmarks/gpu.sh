#!/usr/bin/env bash
# The GPU and many-core measurements behind docs/performance.md, on a machine with one GPU and many cores:
#   benchmarks/gpu.sh OUTDIR [tests] [gpu] [sweep] [periodic]   (default: all four; about 15 minutes on 1 H100 + 16 cores)
#  tests: the GPU-marked tests (prefetch, AMP under every strategy, 2 workers sharing the GPU over gloo against
#         1 process with the doubled batch, exact resume on GPU workers, NCCL group of one);
#  gpu:   phalanx 1 worker vs the plain loop on ResNet-50, ResNet-20 and a small GPT, fp32 and bf16 autocast,
#         input pre-staged / pageable / pinned / prefetched on a side stream   -> OUTDIR/gpu/gpu.md, gpu.json;
#  sweep: CPU scaling on 1, 2, 4, 8, 16 worker processes (gloo), ResNet-20 and the MLP, phalanx AllReduce vs
#         torch DDP, 1 process x N threads                                      -> OUTDIR/sweep/bench.md, ...
#  periodic: local SGD and PowerSGD at 8 and 16 workers, where all-reduce stops scaling -> OUTDIR/sweep-periodic/
# It uses the machine's own torch (phalanx from this checkout via PYTHONPATH). A machine without network can
# bring pyzmq/redis-py as wheels: put them in $WHEELS (default .whl/) and they are installed into a temp dir.
set -uo pipefail  # a failed part is reported; keep measuring the rest
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu.sh OUTDIR [tests] [gpu] [sweep] [periodic]}
shift
PARTS=${*:-tests gpu sweep periodic}
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! $PY -c "import zmq, redis" 2>/dev/null && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d)
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:$SITE"
fi
status=0
for part in $PARTS; do
  echo "== $part: $(date -u +%T)"
  case $part in
    tests)
      $PY -m pytest tests/test_gpu.py tests/data/test_prefetch.py -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/gpu-tests.log" || status=1 ;;
    gpu)
      $PY -m benchmarks.gpu --out "$OUT/gpu" || status=1 ;;
    sweep)
      # CPU only: the GPU is hidden so every worker process is a CPU worker on gloo, one thread each.
      CUDA_VISIBLE_DEVICES= $PY -c 'import sys; from phalanx.cli import main; sys.exit(main())' bench \
          --models resnet20,mlp --workers 1,2,4,8,16 --strategies allreduce,ddp --threads 2,4,8,16 \
          --warmup 3 --steps 16 --no-progress --out "$OUT/sweep" || status=1 ;;
    periodic)
      CUDA_VISIBLE_DEVICES= $PY -c 'import sys; from phalanx.cli import main; sys.exit(main())' bench \
          --models resnet20,mlp --workers 1,8,16 --strategies local-sgd,powersgd --threads 1 \
          --warmup 3 --steps 16 --no-progress --out "$OUT/sweep-periodic" || status=1 ;;
    *) echo "unknown part $part (expected tests, gpu, sweep or periodic)"; status=2 ;;
  esac
done
echo "== done: $(date -u +%T)"
exit $status
