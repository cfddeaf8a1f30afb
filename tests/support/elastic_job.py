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


def held(out) -> list[str]:
    """The ids of the workers that stopped at ``--hold-at`` (their ``held<id>`` markers): the job waits there.

    Example:
        >>> # until(lambda: len(held(tmp_path)) == 2, timeout=90, what="both workers held")
    """
    return sorted(os.path.basename(p)[4:] for p in glob.glob(os.path.join(str(out), "held*")))


def release(out) -> None:
    """Let the workers held at ``--hold-at`` go on (the file they wait for).

    Example:
        >>> # release(tmp_path)
    """
    open(os.path.join(str(out), "release"), "w").close()


def check_each_epoch_whole(record: list, epochs: int = 2) -> None:
    """Every sample exactly once per epoch, in the epoch's shuffled order, however the group changed.

    Example:
        >>> # check_each_epoch_whole(results["0"]["record"])
    """
    for epoch in range(epochs):
        ids = [i for row in record if row[0] == epoch for i in row[2]]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()


def check_oracle(results: dict, want: list) -> None:
    """Every worker's final parameters are the one-process oracle's ``want``.

    Example:
        >>> # check_oracle(results, oracle(record))
    """
    for r in results.values():
        for got, param in zip(r["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), param, rtol=1e-5, atol=1e-6)


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
    check_each_epoch_whole(record)  # re-split over the survivors
    worlds = [w for _, w, _ in record]
    rolled_back_to = results[survivors[0]]["history"][0]["step"]
    assert rolled_back_to == commit  # commit_every 3: the survivors took step 4, failed at 5, and redo 4
    assert results[survivors[0]]["history"][0]["redone_steps"] == at - 1 - commit
    assert worlds == [3] * rolled_back_to + [2] * (len(worlds) - rolled_back_to)
    check_oracle(results, oracle(record))  # the same world sizes at the same steps, uninterrupted
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
