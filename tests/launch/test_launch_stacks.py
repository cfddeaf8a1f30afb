"""Where a stuck job is stuck, as a user sees it: a real `phalanx run` whose rank 0 spins in a Python loop while rank 1
waits for it in the gradients' all-reduce.

One job serves the three checks (a job costs seconds of torch imports on 2 cores): `phalanx stacks` prints every
rank's stack, naming the line each is stuck on; a request without the job's secret gets nothing; and the launcher's
watchdog prints the same blocks on its own before anything is killed (both workers still alive), and the job's last
lines point at them. The workers step for a few of the watchdog's polls before they get stuck, so it has measured
a step time and its bound is its floor (FLOOR_S, 5 s: launch/stacks.py) rather than its cap, half the collective
timeout: the test waits 5 s for the stacks, not 20. Had it measured nothing (a starved launcher), the cap still holds.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch.distributed as dist

from phalanx.cli import main
from phalanx.errors import StacksRefused
from phalanx.group import stacks
from phalanx.launch.stacks import POLL_S, jobs_dir, register_job, running_jobs
from support.forked_launch import start_cli
from support.paths import TESTS
from support.wait import exited, until

WORKER = os.path.join(TESTS, "workers", "stacks.py")


def _line(tag: str) -> int:
    with open(WORKER) as f:
        return next(i for i, text in enumerate(f, 1) if f"# {tag}:" in text)


def _block(text: str, rank: int) -> str:
    """The block of ``rank`` in printed stacks (from its ``----- rank N (`` header to the next header)."""
    head = f"----- rank {rank} ("
    assert head in text, text[-4000:]
    return text.split(head, 1)[1].split("\n-----", 1)[0].split("phalanx: stacks: end", 1)[0]


def _names_the_lines(text: str) -> None:
    spin, blocked = _line("SPIN"), _line("BLOCKED")
    assert f'File "{WORKER}", line {spin} in spin' in _block(text, 0), text[-4000:]
    assert f'File "{WORKER}", line {blocked} in step' in _block(text, 1), text[-4000:]
    assert "(MainThread)" in _block(text, 0) and "phalanx-stacks" not in text  # named threads; not the dumper's own


# The stuck job's one bound: --timeout, the collective timeout that ends rank 1's all-reduce. The launcher's
# watchdog prints the stacks at its floor once it has measured a step time (the workers step for WARM_S, four of
# its polls, first), at half of --timeout at the most (its cap, launch/run.py); the rest is the margin for
# everything else this test does while the job is stuck; each wait below is derived from it. (At 16 s the job ended
# under load before a `phalanx stacks` subprocess had imported torch.)
STUCK_S = 40.0
WARM_S = 4 * POLL_S


@pytest.mark.multiproc
def test_a_stuck_job_shows_where_each_rank_is_stuck_before_anything_is_killed(tmp_path, monkeypatch, capsys):
    marks, tmp = tmp_path / "marks", tmp_path / "tmp"
    marks.mkdir()
    tmp.mkdir()
    # the launcher forked from this process's preloaded server (its workers still spawned fresh by torch's agent):
    # the test is about the stuck job, not the launcher's process start; a jobs folder of its own (TMPDIR), where
    # `phalanx stacks` finds this job alone
    proc = start_cli(["run", "-n", "2", "--timeout", str(STUCK_S), WORKER, str(marks), str(WARM_S)], str(tmp_path),
                     env={"TMPDIR": str(tmp)})
    # the same folder for `phalanx stacks` run in this process (once the fork server's socket is made: its path in
    # the temporary folder must stay short)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))

    def printed() -> str:  # the launcher's stderr so far: its lines and the workers'
        try:
            return open(proc.paths[1]).read()
        except FileNotFoundError:  # not opened yet by the launcher
            return ""

    try:
        until(lambda: all((marks / f"pid-{r}").exists() for r in (0, 1)), timeout=180, procs=[proc],
              what="both ranks stuck", detail=lambda: printed()[-3000:])
        stuck = time.monotonic()
        pids = [int((marks / f"pid-{r}").read_text()) for r in (0, 1)]

        # `phalanx stacks` finds the one job of this user here and prints every rank, naming each one's line (run
        # in this process: an interpreter importing torch on a loaded machine would spend the job's bound)
        capsys.readouterr()
        assert main(["stacks", "--timeout", str(STUCK_S / 4)]) == 0, capsys.readouterr().err[-3000:]
        _names_the_lines(capsys.readouterr().out)

        # without the secret: refused at once, and a forged request is answered by nobody
        note = json.loads((tmp / f"phalanx-jobs-{os.getuid()}" / f"{proc.pid}.json").read_text())
        store = dist.TCPStore(note["host"], note["port"], is_master=False, wait_for_workers=False)
        with pytest.raises(StacksRefused):
            stacks.request_stacks(store, "not-the-job-secret", timeout_s=1)
        store.append(stacks.key("asks"), json.dumps({"nonce": "forged", "mac": "0" * 64}) + "\n")
        store.add(stacks.key("asked"), 1)
        with open(note["secret_file"]) as f:  # asked after the forged one
            got = stacks.request_stacks(store, f.read().strip(), timeout_s=STUCK_S / 4)
        assert sorted(got) == ["0", "1"] and all(got.values()), got
        assert not any(store.check([stacks.key("answer", "forged", w)]) for w in ("0", "1"))

        # the watchdog's blocks, printed while both workers still run: at FLOOR_S (STUCK_S / 2 at the most), before
        # the job's bound
        until(lambda: "phalanx: stacks: end" in printed(), timeout=max(1.0, STUCK_S - (time.monotonic() - stuck)),
              procs=[proc], what="the watchdog's stacks", detail=lambda: printed()[-3000:])
        for pid in pids:
            os.kill(pid, 0)  # raises if it was killed (or ended) before the stacks were printed
        text = printed()
        before = text.split("phalanx: stacks: the group has completed no step", 1)[0]
        assert "killed" not in before and "stopped all workers" not in before, text[-4000:]
        _names_the_lines(text.split("phalanx: stacks: the group has completed no step", 1)[1])
    finally:
        (marks / "release").touch()
    assert exited(proc, timeout=120, what="the job after its release") == 0, printed()[-4000:]
    text = printed()
    if os.environ.get("STACKS_OUT"):
        open(os.environ["STACKS_OUT"], "w").write(text)
    last = [ln for ln in text.splitlines() if ln.startswith("phalanx: the group stalled")]
    assert len(last) == 1 and "1 time(s)" in last[0] and "under 'phalanx: stacks:'" in last[0], text[-3000:]


def test_phalanx_stacks_without_a_job_or_with_bad_flags_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this test's own jobs folder
    assert main(["stacks"]) == 1
    assert capsys.readouterr().err.startswith("phalanx: error: no phalanx job of yours runs on this host")
    assert main(["stacks", "--timeout", "0"]) == 2 and "--timeout 0; expected a positive" in capsys.readouterr().err
    assert main(["stacks", "--rdzv-endpoint", "nohost"]) == 2
    assert "--rdzv-endpoint nohost; expected HOST:PORT" in capsys.readouterr().err
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("PHALANX_SECRET", "s")
    assert main(["stacks", "--rdzv-endpoint", f"127.0.0.1:{port}"]) == 1
    assert capsys.readouterr().err == f"phalanx: error: no job answers at 127.0.0.1:{port} (Connection refused); " \
        "check the address, and that the job is still running\n"


def test_phalanx_stacks_finds_the_jobs_running_here_and_forgets_the_ended(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    mine = register_job("127.0.0.1", 1234, None, "a.py")
    with open(os.path.join(jobs_dir(), f"{ended.pid}.json"), "w") as f:
        json.dump({"pid": ended.pid, "host": "127.0.0.1", "port": 99, "script": "old.py"}, f)
    assert [j["port"] for j in running_jobs()] == [1234]
    assert not os.path.exists(os.path.join(jobs_dir(), f"{ended.pid}.json"))  # an ended launcher's note is removed
    assert oct(os.stat(jobs_dir()).st_mode & 0o777) == "0o700" and oct(os.stat(mine).st_mode & 0o777) == "0o600"
    with open(os.path.join(jobs_dir(), "again.json"), "w") as f:  # a second job of ours, here
        json.dump({"pid": os.getpid(), "host": "127.0.0.1", "port": 5678, "script": "b.py"}, f)
    assert main(["stacks"]) == 2
    said = capsys.readouterr().err
    assert "with 2 jobs running here" in said and "127.0.0.1:1234 (a.py" in said and "--rdzv-endpoint" in said
