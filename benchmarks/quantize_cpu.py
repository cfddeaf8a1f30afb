"""The CPU time of the 4-bit (or 8-bit) exchange's two hot calls, against another commit's, side by side in one run.

    python benchmarks/quantize_cpu.py --baseline HEAD~1
    python benchmarks/quantize_cpu.py --bits 8 --sizes 300000 --baseline <rev>

``Quantize.encode`` (one worker's message) and ``Quantize.sum_messages`` (the mean of 2 messages) run on the
critical path of every Streaming DiLoCo fragment and every 4-bit all-reduce; `benchmarks/step_split.py` counts
them as waiting. One thread, as each of this machine's 2 workers has one core. With ``--baseline`` the module at
that revision (``git show REV:src/phalanx/strategies/quantize.py``) is timed too, alternating with today's, and
both must send the same bytes and sum to the same bits. Prints the median of ``--repeats`` rounds.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def _module_at(rev: str):
    """``phalanx.strategies.quantize`` as it was at ``rev``, imported beside today's."""
    text = subprocess.run(["git", "show", f"{rev}:src/phalanx/strategies/quantize.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    # its relative imports name today's package: only this module's own code differs
    text = re.sub(r"^from \.\. import", "from phalanx import", text, flags=re.M)
    text = re.sub(r"^from \.\.(\w)", r"from phalanx.\1", text, flags=re.M)
    text = re.sub(r"^from \.(\w)", r"from phalanx.strategies.\1", text, flags=re.M)
    path = os.path.join(tempfile.mkdtemp(), "quantize_at_rev.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("quantize_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up while it is built
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main(argv: list[str] | None = None) -> int:
    import torch

    from phalanx.strategies import quantize

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--sizes", default="300000,1000000", help="values per message, comma-separated")
    p.add_argument("--baseline", default=None, help="a git revision to time beside today's code")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--calls", type=int, default=10, help="calls timed per round")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    versions = {"today": quantize}
    if args.baseline:
        versions[args.baseline] = _module_at(args.baseline)
    for n in (int(s) for s in args.sizes.split(",")):
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        codecs = {name: m.Quantize(args.bits, block=args.block) for name, m in versions.items()}
        messages = {name: c.encode(x) for name, c in codecs.items()}
        sums = {name: c.sum_messages([messages[name], messages[name]], n) for name, c in codecs.items()}
        first = next(iter(versions))
        for name in versions:  # the same bytes and bits, or the comparison means nothing
            assert torch.equal(messages[name], messages[first]) and torch.equal(sums[name], sums[first]), name
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in versions}
        for _ in range(args.repeats):
            for name, c in codecs.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    m = c.encode(x)
                middle = time.perf_counter()
                for _ in range(args.calls):
                    c.sum_messages([m, m], n)
                end = time.perf_counter()
                times[name][0].append((middle - start) / args.calls)
                times[name][1].append((end - middle) / args.calls)
        for name, (enc, tot) in times.items():
            print(f"{args.bits}-bit, {n:,} values, {name}: encode {statistics.median(enc) * 1e3:.2f} ms, "
                  f"sum of 2 messages {statistics.median(tot) * 1e3:.2f} ms (median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
