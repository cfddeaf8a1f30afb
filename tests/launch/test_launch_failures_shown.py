"""`phalanx run --elastic`: a worker that fails on its own (not by losing a peer) ends the job with its one line.

Real launches of a two-worker script; the worker's failure reaches the launcher through the failure
record it writes (torch elastic's error file), never through its text. Nothing is replaced: a new
process would run the same script into the same error.
"""
from __future__ import annotations

import os
import subprocess

import pytest
from support.forked_launch import run_cli


SCRIPT = """\
import os, sys
import torch, phalanx as px

px.init()
mode, out = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if mode == "usage":  # every worker makes the same mistake, as a bad argument would
    model, opt = px.wrap(model, opt, strategy=px.LocalSGD(every=0))
model, opt = px.wrap(model, opt)
for step in range(3):
    opt.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
px.save_checkpoint(os.path.join(out, "ckpt"), model, opt, step=3)
if px.rank() == 1:
    len(3)  # a plain bug: TypeError: object of type 'int' has no len()
for step in range(1000):  # rank 0 would train on
    opt.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
"""


def launch(tmp_path, mode: str, *flags: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # the launcher is a fork of this process, its workers forks of one preloaded server (no fresh interpreter)
    return run_cli(["run", "-n", "2", "--elastic", *flags, str(script), mode, str(tmp_path)], str(tmp_path), 240)


@pytest.mark.multiproc
def test_a_usage_error_under_elastic_is_one_line_once_and_nothing_is_replaced(tmp_path):
    proc = launch(tmp_path, "usage", "--replace")
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    said = [ln for ln in err.splitlines() if "every=0; expected an integer >= 1" in ln]
    assert len(said) == 1 and said[0].startswith("phalanx: error: every=0; expected an integer >= 1"), err[-3000:]
    assert "`phalanx run --debug` or PHALANX_DEBUG=1 shows the traceback" in said[0]
    assert "Traceback" not in err, err[-3000:]
    assert "started worker r" not in err and "last worker" not in err, err[-3000:]  # no replacement, no falsehood
    end = [ln for ln in err.splitlines() if ln.startswith("phalanx: elastic: the job stopped")]
    assert len(end) == 1 and "not by losing a peer" in end[0] and "no disk checkpoint was saved" in end[0], err


@pytest.mark.multiproc
def test_a_plain_bug_under_elastic_is_named_with_its_one_line_and_where_to_resume(tmp_path):
    proc = launch(tmp_path, "type", "--replace", "--min-workers", "1")
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    assert "phalanx: worker 1 raised TypeError: object of type 'int' has no len()" in err.splitlines(), err[-3000:]
    assert "started worker r" not in err and "last worker" not in err, err[-3000:]
    end = [ln for ln in err.splitlines() if ln.startswith("phalanx: elastic: the job stopped")]
    # who is left (worker 0 was still training, or had just ended), why, and the newest checkpoint
    assert len(end) == 1 and "worker 1 failed in the script" in end[0], err[-3000:]
    assert f"resume from the last disk checkpoint, {os.path.realpath(tmp_path / 'ckpt')}" in end[0] \
        or f"resume from the last disk checkpoint, {tmp_path / 'ckpt'}" in end[0], end
