"""What a copy-on-write snapshot costs, apart from DCP: the fork, and the page faults of the parent's next writes.

Allocates ``--tensors`` float32 tensors of ``--width`` × ``--width`` (default 72 × 2048²: 1.2 GB, the size of
benchmarks/checkpoint_blocking.py's state), forks a :class:`phalanx.checkpoint.snapshot.Snapshot` whose child
``memmove``s them into memory touched before, and at once ``add_(1)``s every tensor in the parent (as an optimizer
step does); then does the same pass again (no snapshot: the pages are the parent's alone) and one plain memcpy.

    python benchmarks/fork_cow.py [--tensors 72] [--width 2048] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from phalanx.checkpoint.snapshot import Snapshot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=72)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    src = [torch.randn(args.width, args.width) for _ in range(args.tensors)]
    dst = [torch.zeros_like(t) for t in src]
    moves = [(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size()) for d, s in zip(dst, src, strict=True)]
    print(f"{sum(t.numel() * 4 for t in src) / 2**30:.2f} GiB in {args.tensors} tensors; "
          f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}")
    for _ in range(args.repeat):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        snapshot = Snapshot(moves)
        fork = time.perf_counter() - started
        started = time.perf_counter()
        for t in src:
            t.add_(1)
        first = time.perf_counter() - started
        snapshot.wait("the measurement")
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        started = time.perf_counter()
        for t in src:
            t.add_(1)
        second = time.perf_counter() - started
        started = time.perf_counter()
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
        copy = time.perf_counter() - started
        print(f"fork {fork:.3f} s; first write pass after it {first:.3f} s ({faults:,} minor faults); "
              f"second pass {second:.3f} s; one memcpy {copy:.3f} s")


if __name__ == "__main__":
    main()
