"""How evenly each parameter-server placement policy spreads the reference models' bytes.

Run ``python -m phalanx.bench.placement --models resnet50,mlp,digits_cnn --servers 2,3,4``
for the table in docs/parameter-server.md.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..ps.placement import GreedyBytes, RoundRobin, imbalance, server_bytes, specs
from .models import build


def placement_table(models: Sequence[str] = ("resnet50", "mlp"), servers: Sequence[int] = (2, 3, 4)) -> str:
    """Bytes imbalance (max/mean) of round-robin and greedy placement on the reference models."""
    rows = ["| model | tensors | servers | round_robin | greedy_bytes | greedy pieces |", "|---|---|---|---|---|---|"]
    for name in models:
        tensors = specs([(n, p) for n, p in build(name)[0].named_parameters() if p.requires_grad])
        for s in servers:
            rr, gb = RoundRobin().place(tensors, s), GreedyBytes().place(tensors, s)
            rows.append(f"| {name} | {len(tensors)} | {s} | {imbalance(server_bytes(rr, s)):.3f} "
                        f"| {imbalance(server_bytes(gb, s)):.3f} | {len(gb)} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m phalanx.bench.placement", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,mlp", help="comma list from phalanx.bench.models.ZOO")
    p.add_argument("--servers", default="2,3,4", help="comma list of server counts")
    args = p.parse_args(argv)
    print(placement_table(args.models.split(","), [int(n) for n in args.servers.split(",")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
