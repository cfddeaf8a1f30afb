"""The elastic tests' job: ``phalanx run --elastic`` on tests/workers/elastic.py, its one-process oracle, and the
checks every recovery test shares."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import torch

from support.paths import TESTS
from workers import elastic as worker

WORKER = os.path.join(TESTS, "workers", "elastic.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]


def launch(tmp_path, *flags: str, n: int = 3, timeout: float = 120) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [*CLI, "run", "-n", str(n), "--elastic", *flags[:flags.index("--") if "--" in flags else len(flags)],
           WORKER, "--out", str(tmp_path), *flags[flags.index("--") + 1 if "--" in flags else len(flags):]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    return proc, results


oracle = worker.oracle  # one process on the same global batches


def check_recovered(tmp_path, proc, results, victim: str, at: int, commit: int = 3) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed = json.load(open(tmp_path / "killed.json"))
    survivors = sorted(set("012") - {victim})
    assert sorted(results) == survivors
    for wid, r in results.items():  # the same processes went on: one start each, same pid at the end
        starts = glob.glob(str(tmp_path / f"start{wid}-*.json"))
        assert [os.path.basename(s) for s in starts] == [f"start{wid}-{r['pid']}.json"]
        assert r["world_size"] == 2 and [h["left"] for h in r["history"]] == [[victim]]
    record = results[survivors[0]]["record"]
    assert all(r["record"] == record for r in results.values())
    # every sample exactly once per epoch, in the epoch's shuffled order, re-split over the survivors
    for epoch in (0, 1):
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    worlds = [w for _, w, _ in record]
    rolled_back_to = results[survivors[0]]["history"][0]["step"]
    assert rolled_back_to == commit  # commit_every 3: the survivors took step 4, failed at 5, and redo 4
    assert results[survivors[0]]["history"][0]["redone_steps"] == at - 1 - commit
    assert worlds == [3] * rolled_back_to + [2] * (len(worlds) - rolled_back_to)
    # the oracle: the same world sizes at the same steps, uninterrupted
    for r in results.values():
        for got, want in zip(r["params"], oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    seconds = min(r["first_step_after_recovery"] for r in results.values()) - killed["time"]
    assert seconds < 30  # generous: the suite runs on loaded machines; see benchmarks/elastic.py for figures
    return {"kill_to_first_step_s": seconds}


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its (killed) parent never reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
