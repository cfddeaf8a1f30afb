"""How `phalanx run --elastic` starts workers: both start methods behave as `python -u SCRIPT ARGS` would."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from phalanx.launch.workers import START_METHODS, start_worker

SCRIPT = """\
import os, sys
print("argv", sys.argv[1:], "env", os.environ.get("PX_TEST_VALUE"), "main", __name__, flush=True)
print("preloaded", "torch" in sys.modules, flush=True)
how = sys.argv[1]
if how == "exit":
    sys.exit(3)
if how == "raise":
    raise ValueError("boom from the script")
if how == "hard":
    os._exit(5)
if how == "hang":
    print("ready", flush=True)
    import signal; signal.pause()
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.mark.parametrize("method", START_METHODS)
def test_a_worker_runs_the_script_as_main_with_its_own_environment_and_exit_status(method, script, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PX_TEST_VALUE": method, "PYTHONPATH": ":".join(sys.path)}
    logs = {how: str(tmp_path / f"{how}.log") for how in ("ok", "exit", "raise", "hard")}
    codes = {how: start_worker(method, [script, how], env, log=log).wait(120) for how, log in logs.items()}
    assert codes == {"ok": 0, "exit": 3, "raise": 1, "hard": 5}
    out = open(logs["ok"]).read()
    assert f"argv ['ok'] env {method} main __main__" in out
    assert "ValueError: boom from the script" in open(logs["raise"]).read()
    # the point of the fork server: torch is already imported when the script starts
    assert ("preloaded True" in out) == (method == "forkserver")


@pytest.mark.parametrize("method", START_METHODS)
def test_a_worker_can_be_polled_killed_and_waited_for_like_popen(method, script):
    proc = start_worker(method, [script, "hang"], {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.kill()
    assert proc.wait(60) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL


def test_an_unknown_start_method_is_one_clear_error(script):
    with pytest.raises(ValueError, match="expected one of spawn, forkserver"):
        start_worker("fork", [script, "ok"], {})


def test_once_the_fork_server_runs_starting_a_worker_leaves_the_launchers_environment_alone(script, tmp_path,
                                                                                           monkeypatch):
    # A launcher that starts workers from two threads read an empty (or another worker's) os.environ while a
    # start swapped it: every start used to swap it, not only the one that starts the fork server.
    env = {"PATH": "/usr/bin:/bin", "PX_TEST_VALUE": "first", "PYTHONPATH": ":".join(sys.path)}
    assert start_worker("forkserver", [script, "ok"], env, log=str(tmp_path / "1.log")).wait(120) == 0
    swaps = []
    monkeypatch.setattr(os.environ, "clear", lambda: swaps.append("clear"))  # the launcher's own environment
    log = str(tmp_path / "2.log")
    assert start_worker("forkserver", [script, "ok"], {**env, "PX_TEST_VALUE": "second"}, log=log).wait(120) == 0
    assert swaps == [] and "env second" in open(log).read()


@pytest.mark.parametrize("method", START_METHODS)
def test_a_worker_that_ended_leaves_no_descriptor_open_in_the_launcher(method, script):
    # `--replace` starts a worker for every one lost, for as long as the job runs, and keeps each one's handle:
    # a descriptor kept per ended worker grew the launcher by 48 over a 34-kill chaos soak.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    start_worker(method, [script, "exit"], env).wait(120)  # the fork server's own descriptors, once
    before = len(os.listdir("/proc/self/fd"))
    ended = [start_worker(method, [script, "exit"], env) for _ in range(6)]
    assert [w.wait(120) for w in ended] == [3] * 6 and [w.poll() for w in ended] == [3] * 6  # handles kept
    assert len(os.listdir("/proc/self/fd")) - before <= 1
