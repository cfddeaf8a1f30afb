"""`phalanx run` and the `phalanx` command: argument checks in-process, real launches in subprocesses.

A launch whose test is not about the launcher's own process start (what a fresh interpreter prints, the installed
script's exit status) runs its launcher forked from this process's preloaded server (support.forked_launch): the
same ``phalanx.cli.main``, without the CPU second of a fresh interpreter importing torch; its workers are still
fresh interpreters, spawned by torch's agent as `phalanx run` spawns them.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from phalanx import ConfigError
from phalanx.launch.allocator import heap_env
from phalanx.cli import main
from phalanx.launch.run import RunConfig, _status
from support.forked_launch import Launcher, start_cli
from support.procs import at_once, free_port, outcome
from support.wait import until

SCRIPT = """\
import json, os, signal, sys, time
import torch, phalanx as px
from support.procs import kill_at

def say(obj):  # one write per line: print() writes the newline separately, and workers share stdout
    sys.stdout.write(json.dumps(obj) + "\\n")
    sys.stdout.flush()


px.init()
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
total = torch.zeros(1)
for step in range(4 if mode in ("ok", "fail", "sleep") else 1000):
    if mode == "fail":
        kill_at(2, rank=1, now=step, code=3)
    if mode == "raise" and px.rank() == 1 and step == 5:
        say({"raised_at": time.time()})
        raise ValueError("boom at step 5")
    if mode == "usage" and step == 2:  # every rank makes the same usage error, as a bad argument would
        raise px.ConfigError("lr=-1; expected a positive learning rate. Pass e.g. lr=0.1.")
    t = torch.tensor([float(px.rank() + 1)])
    px.Comm().all_reduce_([t], op="sum")
    total += t
if mode == "sleep":
    say({"ready": px.rank(), "pid": os.getpid()})
    signal.pause()  # until the test's signal ends this worker
say({"rank": px.rank(), "world": px.world_size(), "total": total.item(), "args": sys.argv[1:],
     "threads": torch.get_num_threads(), "timeout": os.environ.get("PHALANX_TIMEOUT"),
     "ps": os.environ.get("PHALANX_PS_ADDRS")})
"""


def phalanx_command() -> list[str]:
    """The installed `phalanx` script beside this interpreter (what users type), else the same entry point."""
    script = os.path.join(os.path.dirname(sys.executable), "phalanx")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


COLLECTIVE_S = 60.0  # the collective timeout the raising job runs with (--timeout)


# multiprocessing's handles of the forked launchers are started and read by one thread at a time: starting one
# swaps multiprocessing's module-level fork server in (start_cli), and reads every earlier child's exit status; and
# no subprocess starts meanwhile: the first start sets this process's environment for the fork server it starts
_HANDLES = threading.Lock()


def _run(argv: list[str]) -> dict:
    """One command to its end: its CompletedProcess, and when it started and ended (monotonic, wall clock)."""
    started = time.monotonic()
    with _HANDLES:  # it inherits this process's environment, whole
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return {"proc": subprocess.CompletedProcess(argv, proc.returncode, out, err), "started": started,
            "ended_monotonic": time.monotonic(), "ended": time.time()}


def _start(argv: list[str], out: str) -> Launcher:
    """`phalanx ARGV` with its launcher forked (support.forked_launch), its output in ``OUT/launcher.{out,err}``."""
    os.makedirs(out, exist_ok=True)
    with _HANDLES:
        return start_cli(argv, out)


def _finish(launcher: Launcher, started: float, timeout: float = 120) -> dict:
    """:func:`_run`'s answer for a launcher from :func:`_start`, once it has ended (killed after ``timeout``)."""
    try:
        fd = os.pidfd_open(launcher.pid)  # readable once it has exited: waited on without the lock
    except ProcessLookupError:
        ended = True  # already exited and reaped by the server
    else:
        try:
            ended = bool(select.select([fd], [], [], max(0.0, started + timeout - time.monotonic()))[0])
        finally:
            os.close(fd)
    ended_monotonic, ended_wall = time.monotonic(), time.time()
    with _HANDLES:
        if not ended:
            launcher.kill()
        code = launcher.wait(60)  # its status, which the server writes as it reaps it
    out, err = launcher.communicate()
    if not ended:
        raise subprocess.TimeoutExpired(launcher.args, timeout, output=out, stderr=err)
    return {"proc": subprocess.CompletedProcess(launcher.args, code, out, err), "started": started,
            "ended_monotonic": ended_monotonic, "ended": ended_wall}


def _printed(launcher: Launcher, fd: int = 1) -> str:
    """What a running launcher (and its workers) printed so far to stdout (``fd`` 1) or stderr (2)."""
    try:
        with open(launcher.paths[fd - 1]) as f:
            return f.read()
    except FileNotFoundError:  # the launcher opens its files once forked
        return ""


def _forked(argv: list[str], out: str) -> dict:
    """:func:`_run` for `phalanx ARGV`, its launcher forked."""
    started = time.monotonic()
    return _finish(_start(argv, out), started)


def _two_hosts(script: str, out: str) -> list[tuple[int, str, str]]:
    # Two "hosts" on loopback: the same command with --node-rank 0 and 1.
    port = str(free_port())
    started = time.monotonic()
    hosts = [_start(["run", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                     port, "-n", "1", script], os.path.join(out, f"node{node}")) for node in (1, 0)]
    try:
        ran = [_finish(h, started)["proc"] for h in hosts]
    finally:
        for h in hosts:
            with _HANDLES:
                h.kill()  # only one still running (the other failed first): nothing otherwise
    return [(p.returncode, p.stdout, p.stderr) for p in ran]


def servers_available() -> bool:
    """Whether this installation has parameter servers (phalanx.ps, the extra `phalanx[ps]`)."""
    try:
        import phalanx.ps.launcher  # noqa: F401
    except ImportError:
        return False
    return True


CONCURRENT = 4  # launches at a time: enough to fill the cores' idle time, few enough to keep each one's bounds


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """The launches that only run to their end, all started at once (threads), each read by its own test.

    A launch is a launcher and its workers importing torch, then waiting on each other: one after the other they
    left a core idle much of the time. Each job is its own launcher with its own store on its own port. The job
    with parameter servers is the one with threads, timeout and arguments (one launch checks both).
    """
    folder = tmp_path_factory.mktemp("launch")
    script = str(folder / "train.py")
    with open(script, "w") as f:
        f.write(SCRIPT)

    def forked(name: str, *argv: str):
        return lambda: _forked(["run", *argv], str(folder / name))

    servers = ["--servers", "1"] if servers_available() else []
    jobs = {
        "args": forked("args", "-n", "2", "--threads", "2", "--timeout", "90", *servers, script, "ok", "--flag"),
        "fail": forked("fail", "-n", "2", "--timeout", "10", script, "fail"),
        # the installed script in a fresh interpreter: its exit status, and nothing printed but the one line
        "bad": lambda: _run([*phalanx_command(), "run", "-n", "0", "train.py"]),
        "raise2": forked("raise2", "-n", "2", "--timeout", str(COLLECTIVE_S), script, "raise"),
        "raise3": forked("raise3", "-n", "3", "--timeout", str(COLLECTIVE_S), script, "raise"),
        "usage": forked("usage", "-n", "2", script, "usage"),
        # one worker shows the traceback as well as two (which rank failed first is the run above's question)
        "debug": forked("debug", "--debug", "-n", "1", script, "usage", "-n", "2"),
        "torchrun": lambda: _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                  "--master-port", str(free_port()), script]),  # off torchrun's fixed port
        "hosts": lambda: _two_hosts(script, str(folder / "hosts")),
    }
    return at_once(jobs, CONCURRENT)


_job = outcome


def reports(stdout: str) -> dict[int, dict]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {r["rank"]: r for r in lines if "rank" in r}


# -- the frozen config: every check in one place ------------------------------------------------------------------

def test_config_defaults_to_a_standalone_local_run(script):
    cfg = RunConfig.from_argv(["-n", "2", script, "--lr", "0.1"])
    assert (cfg.nproc, cfg.threads, cfg.standalone, cfg.script_args) == (2, 1, True, ("--lr", "0.1"))
    env = cfg.worker_env()
    assert {k: env[k] for k in ("OMP_NUM_THREADS", "PHALANX_THREADS", "PHALANX_LAUNCHER")} == \
        {"OMP_NUM_THREADS": "1", "PHALANX_THREADS": "1", "PHALANX_LAUNCHER": "run"}
    # One host: the launcher's own store on loopback (the port run() bound), found by the static rendezvous.
    launch = cfg.launch_config(store_port=12345)
    assert (launch.rdzv_backend, launch.rdzv_endpoint, launch.max_restarts) == ("static", "127.0.0.1:12345", 0)


def test_workers_keep_freed_memory_in_the_heap_unless_the_user_chose_an_allocator_setting(script, monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "PHALANX_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)
    cfg = RunConfig.from_argv(["-n", "2", script])
    env = cfg.worker_env()
    assert (env["MALLOC_MMAP_THRESHOLD_"], env["MALLOC_TRIM_THRESHOLD_"]) == (str(32 * 2**20), str(2 * 2**30))
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")  # the user's own setting wins, and nothing is added
    assert not {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(cfg.worker_env())
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("PHALANX_ALLOCATOR", "system")
    assert "MALLOC_MMAP_THRESHOLD_" not in cfg.worker_env()


def test_config_for_several_hosts_means_what_torchrun_means(script):
    cfg = RunConfig.from_argv(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                               "--master-port", "29501", "-n", "2", "--threads", "3", "--timeout", "30", script])
    launch = cfg.launch_config()
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (2, 2, 2)
    assert (launch.rdzv_backend, launch.rdzv_endpoint, launch.rdzv_configs["rank"]) == ("static", "10.0.0.1:29501", 1)
    assert cfg.worker_env() == {"OMP_NUM_THREADS": "3", "PHALANX_THREADS": "3", "PHALANX_TIMEOUT": "30.0",
                                "PHALANX_LAUNCHER": "run",  # several hosts: gloo picks the routable interface
                                "PHALANX_LAUNCHER_PID": str(os.getpid()),  # a worker ends when its launcher is gone
                                **heap_env(os.environ)}
    ranged = RunConfig.from_argv(["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400",
                                  "--rdzv-id", "job7", "--max-restarts", "2", script]).launch_config()
    assert (ranged.min_nodes, ranged.max_nodes, ranged.rdzv_endpoint, ranged.run_id, ranged.max_restarts) == \
        (1, 4, "h:29400", "job7", 2)


def test_help_says_elastic_only_of_elastic():
    """One meaning: "elastic" is membership changing while the workers run (--elastic), not --nnodes MIN:MAX."""
    from phalanx.launch.run import build_parser
    text = build_parser().format_help()
    before_group = text.split("\nelastic (")[0]  # everything outside the --elastic group and its examples
    outside = [ln for ln in before_group.splitlines() + text.split("examples:")[1].splitlines()
               if "elastic" in ln.lower() and "--elastic" not in ln]
    assert outside == [], outside
    nnodes = text.split("  --nnodes N|MIN:MAX ")[1].split("--node-rank")[0]  # its help: what MIN:MAX does instead
    assert "restarts the whole group" in " ".join(nnodes.split()), nnodes


@pytest.mark.parametrize("argv,given", [
    (["-n", "0", "S"], "-n 0"),
    (["-n", "two", "S"], "-n two"),
    (["-n", "2"], "no script"),
    (["-n", "2", "missing.py"], "'missing.py' (not found"),
    (["-n", "2", "DIR"], "(a directory"),
    (["--bogus", "S"], "unrecognized arguments: --bogus"),
    (["--master-port", "70000", "S"], "--master-port 70000"),
    (["--master-port", "x", "S"], "--master-port x"),
    (["--nnodes", "2:1", "S"], "--nnodes 2:1"),
    (["--nnodes", "2", "--node-rank", "2", "S"], "--node-rank 2"),
    (["--rdzv-backend", "zk", "S"], "--rdzv-backend zk"),
    (["--rdzv-backend", "c10d", "S"], "without --rdzv-endpoint"),
    (["--rdzv-endpoint", "h:99999", "S"], "port"),
    (["--threads", "0", "S"], "--threads 0"),
    (["--timeout", "-1", "S"], "--timeout -1"),
    (["--servers", "-1", "S"], "--servers -1"),
    (["--servers", "2", "--nnodes", "2", "S"], "--servers 2 with --nnodes 2"),
])
def test_bad_input_is_one_line_saying_given_expected_and_what_to_do(argv, given, script, tmp_path):
    argv = [script if a == "S" else str(tmp_path) if a == "DIR" else a for a in argv]
    with pytest.raises(ConfigError) as err:
        RunConfig.from_argv(argv)
    msg = str(err.value)
    assert given in msg and "expected" in msg and "\n" not in msg, msg


def test_exit_status_passed_on_is_the_workers_or_128_plus_its_signal():
    assert _status(3) == ("exited with status 3", 3)
    assert _status(-signal.SIGKILL) == ("was killed by SIGKILL", 137)


def test_cli_prints_usage_errors_as_one_line_with_status_2(capsys, script):
    assert main(["run", "-n", "0", script]) == 2
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("phalanx: error: ") for line in err), err
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("phalanx ")
    assert main(["--help"]) == 0
    assert "run" in capsys.readouterr().out


def test_servers_start_before_the_workers_or_say_clearly_they_are_unavailable(capsys, script, launched):
    if not servers_available():
        assert main(["run", "--servers", "2", script]) == 2
        assert "parameter servers" in capsys.readouterr().err
        return
    proc = _job(launched, "args")["proc"]  # -n 2 --servers 1
    assert proc.returncode == 0, proc.stderr
    seen = reports(proc.stdout)
    assert sorted(seen) == [0, 1] and all(r["ps"] for r in seen.values()), proc.stdout  # the servers' addresses
    # reached every worker


# -- real launches ----------------------------------------------------------------------------------------------

def test_phalanx_run_starts_workers_with_their_threads_timeout_and_arguments(launched):
    proc = _job(launched, "args")["proc"]
    assert proc.returncode == 0, proc.stderr
    seen = reports(proc.stdout)
    assert sorted(seen) == [0, 1]
    for r in seen.values():
        assert (r["world"], r["total"], r["threads"], r["timeout"], r["args"]) == (2, 12.0, 2, "90.0", ["ok", "--flag"])


def test_phalanx_run_exits_with_the_first_failing_workers_status(launched):
    job = _job(launched, "fail")
    proc = job["proc"]
    assert proc.returncode == 3, proc.stderr
    assert "phalanx: worker rank 1 exited with status 3 (first failure); stopped the others" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert job["ended_monotonic"] - job["started"] < 60


def test_phalanx_run_bad_input_is_one_line_and_status_2(launched):
    proc = _job(launched, "bad")["proc"]
    assert proc.returncode == 2 and proc.stderr.startswith("phalanx: error: -n 0; expected"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_two_hosts_meet_through_the_torchrun_options(launched):
    hosts = _job(launched, "hosts")  # --node-rank 1 and 0: (status, stdout, stderr)
    assert [code for code, _, _ in hosts] == [0, 0], [err for _, _, err in hosts]
    seen = {**reports(hosts[0][1]), **reports(hosts[1][1])}
    assert sorted(seen) == [0, 1] and all(r["world"] == 2 and r["total"] == 12.0 for r in seen.values())


def test_sigterm_stops_every_worker(script, tmp_path):
    proc = _start(["run", "-n", "2", script, "sleep"], str(tmp_path))
    try:
        ready: list[dict] = []

        def both_ready() -> bool:
            ready[:] = [json.loads(line) for line in _printed(proc).splitlines(keepends=True)
                        if line.startswith('{"ready"') and line.endswith("\n")]  # whole lines
            return len(ready) >= 2

        until(both_ready, timeout=120, procs=[proc], what="both workers ready", detail=lambda: _printed(proc, 2))
        pids = [r["pid"] for r in ready]
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert "received SIGTERM; stopped all workers" in proc.communicate()[1]
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        proc.kill()


def test_the_same_script_runs_under_torchrun(launched):
    proc = _job(launched, "torchrun")["proc"]
    assert proc.returncode == 0, proc.stderr
    seen = reports(proc.stdout)
    assert sorted(seen) == [0, 1] and all(r["world"] == 2 and r["total"] == 12.0 for r in seen.values())


# -- failures reported in one clear line, at once ----------------------------------------------------------------

@pytest.mark.parametrize("workers", [2, 3])
def test_a_worker_that_raises_ends_the_run_at_once_naming_its_rank_and_exception(launched, workers):
    # rank 1 raises at step 5 before that step's all-reduce, so rank 0 is waiting in it (mid-run, not past it)
    job = _job(launched, f"raise{workers}")
    proc, ended = job["proc"], job["ended"]
    raised = [json.loads(line)["raised_at"] for line in proc.stdout.splitlines() if "raised_at" in line]
    assert proc.returncode == 1 and raised, (proc.stdout, proc.stderr)
    assert "phalanx: worker rank 1 raised ValueError: boom at step 5 (first failure); stopped the others" \
        in proc.stderr.splitlines(), proc.stderr
    # Before, the failing worker's exit barrier held the job for the collective timeout. The bound is half of it,
    # derived, not a target (this machine may be busy; benchmarks/failure_detection.py measures the time: 3 s).
    assert ended - raised[0] < COLLECTIVE_S / 2, ended - raised[0]


def test_a_usage_error_in_every_worker_is_one_line_once_and_debug_shows_the_traceback(launched):
    proc = _job(launched, "usage")["proc"]
    assert proc.returncode == 1
    err = proc.stderr.splitlines()
    assert len(err) == 1, proc.stderr  # both ranks failed; whichever was first is named
    assert err[0] in [f"phalanx: error: lr=-1; expected a positive learning rate. Pass e.g. lr=0.1. (worker rank {r}; "
                      "`phalanx run --debug` or PHALANX_DEBUG=1 shows the traceback)" for r in (0, 1)], err
    debug = _job(launched, "debug")["proc"]
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError: lr=-1" in debug.stderr
    # `-n 2` after the script went to the script: said once, before the workers start.
    assert debug.stderr.splitlines()[0].startswith("phalanx: warning: `-n 2` comes after the script, so it goes "
                                                   "to train.py, not to phalanx run"), debug.stderr


def test_launcher_options_after_the_script_are_named_in_a_warning(script):
    assert RunConfig.from_argv([script, "--threads=2", "--lr", "0.1"]).warnings() == [
        "phalanx: warning: `--threads=2` comes after the script, so it goes to train.py, not to phalanx run; "
        "put launcher options before the script (`phalanx run --threads=2 train.py`)"]
    assert RunConfig.from_argv(["-n", "2", script, "--lr", "0.1"]).warnings() == []


def test_demo_with_an_unknown_option_is_one_line(capsys):
    assert main(["demo", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx: error: `phalanx demo`: unrecognized arguments: --bogus; expected ") \
        and err.count("\n") == 1, err


def test_a_dead_parameter_server_is_named_instead_of_a_worker(tmp_path):
    path = tmp_path / "ps_train.py"
    path.write_text(
        "import torch, phalanx as px\n"
        "px.init()\n"
        "net = torch.nn.Linear(8, 2)\n"
        "model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01), strategy=px.Downpour())\n"
        "print('ready', flush=True) if px.rank() == 0 else None\n"
        "while True:  # until the launcher stops the workers: the job is mid-run when its server is killed\n"
        "    opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step()\n")
    # one worker: the line names the server instead of the worker its loss failed (two would fail the same way)
    proc = _start(["run", "-n", "1", "--servers", "1", str(path)], str(tmp_path))
    try:
        until(lambda: "\n" in _printed(proc), timeout=120, procs=[proc], what="the worker's first line",
              detail=lambda: _printed(proc, 2)[-3000:])
        assert _printed(proc).splitlines(keepends=True)[0] == "ready\n", (_printed(proc), _printed(proc, 2))
        server = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "phalanx.ps serve"], capture_output=True,
                                text=True).stdout.split()
        assert len(server) == 1, server
        os.kill(int(server[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert f"phalanx: parameter server 0 (pid {server[0]}) was killed by SIGKILL (first failure); stopped " \
               "the workers" in err.splitlines(), err
    finally:
        proc.kill()
