"""Asynchronous saves that fail: the next save after a handled failure works, a failure nobody waited for ends the
process with one line (never a traceback or an abort), and what a save cut by a lost worker left is removed by the
next save or load of that path. Real processes on a real full disk (a small tmpfs, so root) and real kills.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from workers import checkpoint_async as W

import phalanx as px
from support.forked_launch import start_cli
from support.procs import at_once, free_port, outcome, reap

SCRIPT = W.__file__


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    """A 64 KiB tmpfs: a checkpoint's files fit in part, then writes fail with ENOSPC, as on a full disk."""
    where = tmp_path_factory.mktemp("full")
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs as a full disk (CI runs as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"could not mount a tmpfs: {done.stderr.decode().strip()}")
    yield str(where)
    subprocess.run(["umount", "-l", str(where)], check=False)


def _full_disk_job(full: str, out) -> dict:
    port, procs = free_port(), []
    for rank in (0, 1):  # as torchrun starts them: real interpreters, whose exit is what is tested
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-u", SCRIPT, "full-disk", full, str(out / "other"), str(out)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        # a bound on a hang only (it waits for nothing): beside the module's two elastic jobs, two fresh
        # interpreters on a heavily loaded machine took more than 120 s
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        reap(*procs)
    return {"full": full, "out": out, "codes": [p.returncode for p in procs], "errs": [err for _, err in outs],
            "left": os.listdir(full)}


def _elastic_job(out, logs: str, *victim: str) -> dict:
    # The launcher forked from the tests' preloaded server, its workers from the same server (support.forked_launch):
    # what is tested is the saves a lost worker cuts, not how a launcher starts; a fresh launcher and its own fork
    # server cost about 4.5 CPU-s per job. (Each worker's writer is still a fresh interpreter, as in production.)
    argv = ["run", "-n", str(2 + len(victim)), "--elastic", "--min-workers", "1", SCRIPT, "elastic", str(out), *victim]
    launcher = start_cli(argv, logs)  # one thread at a time inside (forked_launch.STARTING)
    try:
        launcher.wait(480)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    stdout, stderr = launcher.communicate()
    return {"out": out, "proc": subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr)}


@pytest.fixture(scope="module")
def saves(tmp_path_factory, request) -> dict:
    """The three jobs of this module, started at once (threads), each read by its own test.

    Each job is its own processes on its own store; they mostly wait (for a writer process's torch import, a
    regroup, a worker's start-up), so one after the other they left the cores idle. The full-disk job runs only
    where its tmpfs can be mounted (its test skips otherwise).
    """
    jobs = {"lost-rank-0": lambda: _elastic_job(tmp_path_factory.mktemp("lost0"), tmp_path_factory.mktemp("logs0")),
            "lost-rank-2": lambda: _elastic_job(tmp_path_factory.mktemp("lost2"), tmp_path_factory.mktemp("logs2"),
                                                "2")}
    try:
        full = request.getfixturevalue("full_disk")
        jobs["full-disk"] = lambda: _full_disk_job(full, tmp_path_factory.mktemp("fulldisk"))
    except pytest.skip.Exception as skipped:  # its test raises it: skipped, as before
        jobs["full-disk"] = lambda why=skipped: why
    return at_once(jobs)


_outcome = outcome


@pytest.mark.multiproc
def test_a_handled_failure_does_not_fail_the_next_save_and_an_unwaited_one_ends_the_process_in_one_line(saves):
    job = _outcome(saves, "full-disk")
    tmp_path = job["out"]
    for rank, (code, err) in enumerate(zip(job["codes"], job["errs"], strict=True)):
        result = json.load(open(tmp_path / f"rank{rank}.json"))
        assert job["full"] in result["raised"]  # wait() raised the full disk's error, once...
        assert result["other_step"] == 2  # ...and the next save, to another disk, was written
        # the second failure, never waited for: one line at exit, status 1, no traceback, no abort (rc 134)
        assert code == 1, (rank, code, err[-3000:])
        said = [line for line in err.splitlines() if line.startswith("phalanx: error at exit: CheckpointError:")]
        assert len(said) == 1 and job["full"] in said[0], err[-3000:]
        assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    assert job["left"] == []  # both failed saves removed their temporaries


@pytest.mark.multiproc
def test_an_asynchronous_save_cut_by_a_lost_worker_leaves_nothing_after_the_next_save(saves):
    job = _outcome(saves, "lost-rank-0")
    proc, tmp_path = job["proc"], job["out"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    survivor = json.load(open(tmp_path / "worker1.json"))
    assert survivor["history"] == [["0"]]  # the worker started as rank 0 was lost...
    assert [n for n in survivor["left_after_training"] if ".tmp-" in n]  # ...half-way through the write
    assert survivor["left_after_save"] == ["ckpt"]  # the next save of that path went through and removed it
    assert "was not written" in proc.stderr  # the cut save is named in a warning, not raised as a stale error
    # the survivor's own writer, held half-way through the cut save's write, ended at the regroup (not left behind)
    assert survivor["held_writer_gone"] and not survivor["writer_kept"]
    assert px.read_checkpoint(tmp_path / "ckpt")["step"] == 99


@pytest.mark.multiproc
def test_an_abandoned_asynchronous_save_posts_nothing_where_the_next_generation_saves(saves):
    # Three workers, the one started as rank 2 killed half-way through an asynchronous save: rank 0 of the cut save
    # survives, and its save ends (its writer killed at the regroup) after the new generation formed. The new
    # generation counts its saves afresh, so its first save uses the cut save's key: rank 0's late "not written"
    # posted there was read by rank 1 as the new save's outcome (a stale CheckpointError, the job ended).
    job = _outcome(saves, "lost-rank-2")
    proc, tmp_path = job["proc"], job["out"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    survivors = {w: json.load(open(tmp_path / f"worker{w}.json")) for w in ("0", "1")}
    for survivor in survivors.values():
        assert survivor["history"] == [["2"]]
        assert survivor["raised"] == "", survivor["raised"]
        assert [n for n in survivor["left_after_save"] if n.startswith("ckpt")] == ["ckpt"]
    assert px.read_checkpoint(tmp_path / "ckpt")["step"] == 99


def test_a_load_removes_what_a_killed_save_left_beside_the_checkpoint(tmp_path):
    model = torch.nn.Linear(3, 2)
    ckpt = str(tmp_path / "ckpt")
    px.save_checkpoint(ckpt, model, step=4)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()  # a process that no longer exists: the writer of the temporary below, killed mid-save
    left = f"{ckpt}.tmp-{socket.gethostname()}-{gone.pid}-0123abcd"
    os.makedirs(left)
    open(os.path.join(left, "__0_0.distcp"), "wb").write(b"x" * 100)
    assert px.load_checkpoint(ckpt, model)["step"] == 4
    assert not glob.glob(f"{ckpt}.tmp-*")
