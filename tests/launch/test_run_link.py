"""`phalanx run --link RATE` (issue 41 item 4): the user's script across a shaped link, and its closing summary.

The bad-input tests need nothing; the run itself needs root, `ip` and `tc` (skipped otherwise, with the reason).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import needs_root_netns
from phalanx.errors import ConfigError
from phalanx.launch.config import RunConfig
from phalanx.launch.linked import summary
from support.forked_launch import start_cli

TINY = """
import torch, torch.nn.functional as F, phalanx as px
px.init()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
gen = torch.Generator().manual_seed(px.rank())
for step in range(8):
    x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
px.strategy_of(opt).finish()
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return str(path)


def refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_argv(argv)
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("rate", ["fast", "100", "0mbit", "5 mbit/s", "100mbps"])
def test_a_malformed_rate_is_one_line(script, rate):
    assert "--link 100mbit" in refusal(["-n", "2", "--link", rate, script])


def test_one_worker_or_several_hosts_with_link_are_one_line(script):
    assert "2 or more workers" in refusal(["-n", "1", "--link", "100mbit", script])
    assert "--nnodes 2" in refusal(["-n", "2", "--nnodes", "2", "--link", "100mbit", script])


def test_without_root_it_says_what_is_needed_in_one_line(script, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in refusal(["-n", "2", "--link", "100mbit", script])


def test_without_tc_it_says_so_in_one_line(script, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("as a user the missing root is reported first")
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else which(tool))
    assert "`tc`" in refusal(["-n", "2", "--link", "100mbit", script])


def test_the_summary_splits_the_step_and_divides_the_wire_bytes_by_the_steps():
    line = summary("10mbit", [{"total": 20, "steps": 18, "step_s": 0.2, "wait_s": 0.15},
                              {"total": 20, "steps": 18, "step_s": 0.2, "wait_s": 0.05}], 4_000_000)
    assert "a step took 200 ms: computing 100 ms, waiting on the exchange 100 ms" in line
    assert "on the wire 200 kB a step" in line and "compute-only step is 100 ms, so this run took 2.00x it" in line
    assert "no step split" in summary("10mbit", [], 5000)


@pytest.mark.netns
@needs_root_netns()
def test_a_tiny_script_under_100mbit_ends_with_the_summary_and_bytes_on_the_wire(script):
    # the launcher forked from this process's preloaded server (the test is about the link, not its process start)
    proc = start_cli(["run", "-n", "2", "--link", "100mbit", script], os.path.dirname(script))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("phalanx run --link 100mbit: 8 steps; a step took "), err[-3000:]
    wire = re.search(r"on the wire ([\d.]+) (B|kB|MB) a step", last)
    assert wire and float(wire.group(1)) > 0
    split = re.search(r"computing ([\d.]+) ms, waiting on the exchange ([\d.]+) ms", last)
    assert split and float(split.group(1)) > 0
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"phxb{proc.pid}" not in left  # the link is gone with the run
