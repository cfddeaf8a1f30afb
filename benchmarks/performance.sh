#!/usr/bin/env bash
# The measurements behind docs/performance.md, in the order they were taken.
# Run on an otherwise idle machine (root is needed for the 100mbit link):  benchmarks/performance.sh [OUT]
# The GPU and many-core measurements (section 5 of docs/performance.md) are benchmarks/gpu.sh OUTDIR.
set -uo pipefail  # a failed configuration is reported in its table; keep measuring the rest
cd "$(dirname "$0")/.."
OUT=${1:-results}
BENCH=${BENCH:-.venv/bin/phalanx bench}

# 1. Core (issue 2): plain loop 1x1 and 1x2 threads, phalanx 1 worker, torch DDP 2, phalanx AllReduce 2; side by side.
$BENCH --models resnet20,mlp --workers 1,2 --strategies allreduce,ddp --threads 2 --repeats 3 --out "$OUT/core"

# 2. The scaling sweep (issue 5): three models, four setups, loopback and a 100 Mbit/s link.
$BENCH --models mlp,resnet20,resnet56 --workers 1,2 --strategies allreduce,ddp,local-sgd,powersgd \
       --link loopback,100mbit --out "$OUT/sweep"

# 3. Strategies, compressors and parameter servers on the MLP (issues 3 and 4): throughput and bytes on loopback
#    and on the 100 Mbit/s link, per-server load, and time to 0.95 test accuracy (digits CNN) on the link.
$BENCH --models mlp --workers 2 --warmup 3 --steps 16 --link loopback,100mbit --time-to-accuracy \
       --strategies 'allreduce,ddp,ddp-fp16,ddp-powersgd,fp16,topk,powersgd,local-sgd,diloco[every=8],easgd,downpour,ps-sync' \
       --out "$OUT/link"

# 4. Tuning phalanx AllReduce against torch DDP (2 workers): the same DDP reducer with phalanx's settings (fitted
#    bucket, gradient_as_bucket_view, no buffer broadcast) but without phalanx's Python comm hook; static_graph;
#    DDP's 25 MB bucket.
PXDDP='gradient_as_bucket_view=True,broadcast_buffers=False'
$BENCH --models resnet20 --workers 2 --repeats 3 --out "$OUT/tuning-resnet20" \
       --strategies "allreduce,ddp,ddp[bucket_mb=1,$PXDDP],ddp[bucket_mb=1,$PXDDP,static_graph=True],allreduce[bucket_mb=25]"
$BENCH --models mlp --workers 2 --repeats 3 --out "$OUT/tuning-mlp" \
       --strategies "allreduce,ddp,ddp[bucket_mb=4.78,$PXDDP],ddp[bucket_mb=25,$PXDDP],allreduce[bucket_mb=25],allreduce[bucket_mb=1]"
