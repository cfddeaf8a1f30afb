"""Elastic training: overhead with no failure, kill -> first step, steps redone per failure.

    python benchmarks/elastic.py [--trials 3] [--epochs 20]

Runs tests/workers/elastic.py (a small MLP on 64 samples) under `phalanx run -n 3`,
with and without `--elastic`, then with `--elastic` and one worker killed mid-epoch
(rank 0 and rank 1 in turn). Prints medians. Take figures on an idle machine only.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "elastic.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]


def run(flags: list[str], worker_args: list[str]) -> tuple[dict, dict | None]:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([*CLI, "run", "-n", "3", *flags, WORKER, "--out", out, *worker_args], check=True,
                       capture_output=True, text=True)
        results = [json.load(open(p)) for p in glob.glob(os.path.join(out, "worker*.json"))]
        killed = os.path.join(out, "killed.json")
        return results[0], (json.load(open(killed)) if os.path.exists(killed) else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20)
    a = p.parse_args()
    common = ["--epochs", str(a.epochs), "--commit-every", "10"]
    plain = [run([], common)[0] for _ in range(a.trials)]
    elastic = [run(["--elastic"], common)[0] for _ in range(a.trials)]
    step = lambda rs: statistics.median(r["train_seconds"] / r["steps"] for r in rs)  # noqa: E731
    print(f"step time, no failure: plain {step(plain) * 1e3:.2f} ms, --elastic {step(elastic) * 1e3:.2f} ms "
          f"({(step(elastic) / step(plain) - 1) * 100:+.1f}%)")
    for victim in ("0", "1"):
        recov, redone = [], []
        for _ in range(a.trials):
            r, killed = run(["--elastic", "--min-workers", "2"], [*common, "--kill", f"{victim}@15"])
            recov.append(r["first_step_after_recovery"] - killed["time"])
            redone.append(r["history"][0]["redone_steps"])
        print(f"kill rank {victim} at step 15 (commit every 10): kill -> first step "
              f"{statistics.median(recov):.2f} s, steps redone {statistics.median(redone):g}")


if __name__ == "__main__":
    main()
