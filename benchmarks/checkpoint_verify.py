"""What verifying a checkpoint costs: saving and loading ~1 GB with and without the SHA-256 check.

A model of ``--layers`` square linear layers of ``--width`` (default 16 x 4096: 1.07 GB of
float32 weights, no optimizer) is saved and loaded in one process, ``--repeat`` times each
way, alternating:

* with the check (what phalanx does): the save hashes every data chunk as it writes it, and the
  small files, into the marker (SHA-256), the load hashes every byte it reads and compares before
  anything is applied;
* without it: the same calls with the hashing replaced by nothing (the save records sizes
  only, the load compares nothing), so the difference is the check alone.

    python benchmarks/checkpoint_verify.py [--width 4096] [--layers 16] [--repeat 3] [--dir DIR]

Prints the median seconds of each and the ratio with / without, for save and load, and what SHA-256 alone
takes over the same bytes in memory (the part of the check that does not depend on the disk).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

import phalanx as px
from phalanx import sealed
from phalanx.checkpoint import dcp


@contextmanager
def unchecked() -> Iterator[None]:
    """Saves record sizes only, loads compare nothing: the check taken out, everything else the same."""
    from phalanx.checkpoint import saver
    digest_files, matches, make_writer = dcp.digest_files, sealed._matches, saver._writer

    def sizes_only(directory: str, wanted: dict, known: dict | None = None) -> dict:
        def entry(name: str, chunks: list | None) -> dict:
            size = os.path.getsize(os.path.join(directory, name))
            if chunks is None:
                return {"size": size, "sha256": "0" * 64}
            return {"size": size, "chunks": [[o, n, "0" * 64] for o, n in sorted(set(chunks))]}
        return {name: entry(name, chunks) for name, chunks in wanted.items()}
    dcp.digest_files, sealed._matches = sizes_only, lambda data, digest: True
    # DCP's own writer: no chunk hashed as it is written (phalanx.checkpoint.hashing)
    saver._writer = lambda tmp: dcp._dcp().FileSystemWriter(tmp, sync_files=True)
    try:
        yield
    finally:
        dcp.digest_files, sealed._matches, saver._writer = digest_files, matches, make_writer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    root = tempfile.mkdtemp(prefix="px-verify-", dir=args.dir)
    times: dict[str, list[float]] = {k: [] for k in ("save", "save_unchecked", "load", "load_unchecked")}
    try:
        for _ in range(args.repeat):
            for checked in (True, False):
                path = os.path.join(root, "checked" if checked else "unchecked")
                with (unchecked() if not checked else _nothing()):
                    start = time.perf_counter()
                    px.save_checkpoint(path, model, step=1)
                    times["save" if checked else "save_unchecked"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    px.load_checkpoint(path, model)
                    times["load" if checked else "load_unchecked"].append(time.perf_counter() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    data = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().tobytes()
    start = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    alone = time.perf_counter() - start  # the floor of the check: one core hashing from memory
    print(f"checkpoint of {size / 1e9:.2f} GB ({args.layers} x Linear({args.width}, {args.width}), float32), "
          f"median of {args.repeat}, {os.cpu_count()} CPUs")
    for what in ("save", "load"):
        print(f"{what}: {med[what]:.2f} s with the check, {med[what + '_unchecked']:.2f} s without: "
              f"{med[what] / med[what + '_unchecked']:.2f}x")
    print(f"SHA-256 of the same bytes in memory, one thread: {alone:.2f} s ({size / 1e9 / alone:.2f} GB/s)")


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    main()
