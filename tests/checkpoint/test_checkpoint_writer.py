"""The asynchronous save's writer process (phalanx.checkpoint.writer), killed for real with SIGKILL half-way through
a write: the writer alone (its worker's wait raises a CheckpointError, the previous checkpoint stays, the next save
starts another writer), then the worker (its writer ends with it, and what the cut save left is passed over).
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import torch
from workers import checkpoint_writer as W

import phalanx as px
from phalanx.group.orphan import launcher_gone
from support.wait import exited, until

WAIT_S = 120  # a worker's and a writer's start on a loaded 2-core machine


def test_a_killed_writer_loses_only_its_checkpoint_and_a_killed_worker_takes_its_writer_along(tmp_path):
    out = str(tmp_path)
    proc = subprocess.Popen([sys.executable, W.__file__, out])
    try:
        until(lambda: os.path.exists(os.path.join(out, "held-2.json")), timeout=WAIT_S, procs=[proc],
              what="the writer of step-2 holding half-way")
        writer = json.load(open(os.path.join(out, "held-2.json")))["writer"]
        os.kill(writer, signal.SIGKILL)  # the writer process alone
        until(lambda: os.path.exists(os.path.join(out, "result.json")), timeout=WAIT_S, procs=[proc],
              what="the worker's report after the kill")
        seen = json.load(open(os.path.join(out, "result.json")))
        assert seen["raised"] is not None and seen["raised"][0] == "CheckpointError", seen  # typed, to the caller
        assert "killed by signal 9" in seen["raised"][1] and "step-2" in seen["raised"][1], seen
        assert seen["done"] is True  # its outcome is known: the error
        assert not [n for n in seen["after_kill"] if n.startswith("step-2")], seen  # only the one in flight lost
        assert seen["latest"] == os.path.join(out, "step-1")
        assert seen["step-3"] == 3 and seen["writer-3"] != writer  # the next save started another writer
        assert launcher_gone(writer)

        until(lambda: os.path.exists(os.path.join(out, "held-4.json")), timeout=WAIT_S, procs=[proc],
              what="the writer of step-4 holding half-way")
        pids = json.load(open(os.path.join(out, "held-4.json")))
        assert pids["worker"] == proc.pid
        proc.kill()  # the worker: SIGKILL
        assert exited(proc, timeout=WAIT_S, what="the killed worker") == -signal.SIGKILL
        until(lambda: launcher_gone(pids["writer"]), timeout=WAIT_S, what="its writer process ending with it")
    finally:
        proc.kill()
        proc.wait()
    assert glob.glob(os.path.join(out, "step-4.tmp-*", "partial-0"))  # cut half-way: a part reached the disk
    assert px.latest_checkpoint(out) == os.path.join(out, "step-3")  # the partial one is passed over
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    assert px.load_checkpoint(os.path.join(out, "step-1"), model)["step"] == 1
    for p, saved in zip(model.parameters(), torch.load(os.path.join(out, "weights-1.pt"), weights_only=True),
                        strict=True):
        assert torch.equal(p, saved)
