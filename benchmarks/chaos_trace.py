"""Where a chaos soak's workers left the one-process oracle: each ``--digest`` event against the oracle's replay.

    python benchmarks/chaos.py --out OUT --period 2 --kills 30 --aim 0 --size tiny --digest
    python benchmarks/chaos_trace.py OUT            # the digests that differ from the oracle, then the final figure
    python benchmarks/chaos_trace.py OUT --all      # every digest

The job (``tests/workers/chaos_job.py --digest``) writes, after every commit, regroup, grow and join,
the length and hash of the record it keeps (``record.steps``, rolled back with the commits) and 4
random projections of its parameters and of AdamW's two moments, with AdamW's step count. This
replays the final record (rank 0's ``OUT/final.pt``) in one process and compares each digest whose
record is a prefix of the final one with the replay at that length: the first worker, phase and
generation whose state differs from the oracle with the same record is where some state did not
follow the record. A digest off the final record (a branch rolled back later) is listed as such.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the job lives with the tests (see benchmarks/chaos.py)
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

from workers import chaos_job  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the soak's --out folder (run with --digest)")
    p.add_argument("--all", action="store_true", help="list every digest, not only those that differ")
    p.add_argument("--tolerance", type=float, default=1e-8)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    final = torch.load(os.path.join(a.out, "final.pt"), weights_only=False)
    events = []
    for path in glob.glob(os.path.join(a.out, "events", "*.jsonl")):
        events += [json.loads(line) for line in open(path) if line.strip()]
    digests = sorted((e for e in events if e["ev"] == "digest"), key=lambda e: e["t"])
    record = final["record"]
    net, data = chaos_job.model(final["size"]), chaos_job.dataset(final["size"])
    opt = chaos_job.optimizer(net)
    want = {0: chaos_job.fingerprint(net, opt, [])}
    for i, (_epoch, _world, ids) in enumerate(record):
        x, y, _ = data[torch.tensor(ids)]
        opt.zero_grad()
        chaos_job.loss_fn(net, x, y).backward()
        opt.step()
        want[i + 1] = chaos_job.fingerprint(net, opt, record[:i + 1])
    bad = 0
    for d in digests:
        w = want.get(d["n"])
        where = f"{d['t']:.2f} worker {d['id']:>4} {d['where']:8} gen {d['gen']} step {d['step']} n {d['n']}"
        if w is None or w["rh"] != d["rh"]:
            if a.all:
                print(f"{where}: off the final record (rolled back later)")
            continue
        diff = {k: max((abs(x - y) for x, y in zip(w[k], d[k])), default=0.0) for k in ("p", "m", "v")}
        off = max(diff.values()) > a.tolerance or w["st"] != d["st"]
        bad += off
        if off or a.all:
            print(f"{where}: params {diff['p']:.1e} exp_avg {diff['m']:.1e} exp_avg_sq {diff['v']:.1e} "
                  f"adam step {d['st']} (oracle {w['st']}){'  <<< differs' if off else ''}")
    got, ref = final["params"], [t.detach() for t in net.parameters()]
    print(f"{len(digests)} digests, {bad} differ from the oracle; final model vs the oracle: max abs diff "
          f"{max(float((x - y).abs().max()) for x, y in zip(got, ref)):.2e} over {len(record)} steps")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
