"""Who can reach and enter an elastic job (issue 20, items 1, 2, 6, 7, 17): real launchers, real joiners.

The store an elastic job coordinates through listens where ``--master-addr`` says
(loopback by default); a joiner must present the job's secret; a joiner admitted but
never arriving is dropped within the heartbeat timeout; a joiner arriving after the
end leaves at once with no thread left behind.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest
from support.forked_launch import Launcher, start_cli  # the launchers forked, their workers from one server
from support.paths import TESTS
from support.procs import reap
from support.wait import until

WORKER = os.path.join(TESTS, "workers", "elastic.py")
DOOR = os.path.join(TESTS, "workers", "elastic_door.py")  # trains until OUT/stop exists
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]

pytestmark = pytest.mark.multiproc


def listening(port: int) -> list[str]:
    """The local addresses of every listening TCP socket (IPv4 and IPv6) on ``port``, as hex from /proc."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:
                found.append(addr)
    return found


def results_of(tmp_path) -> dict:
    return {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}


def assert_untouched(tmp_path, launcher: Launcher, stderr: str, workers: tuple[str, ...] = ("0", "1")) -> None:
    """The job ended as if nobody had tried to enter: its own workers, its own world size, the oracle's weights."""
    from support.elastic_job import oracle
    assert launcher.returncode == 0, stderr[-3000:]
    results = results_of(tmp_path)
    assert sorted(results) == sorted(workers), stderr[-3000:]
    record = results["0"]["record"]
    assert {w for _, w, _ in record} == {len(workers)} and all(r["record"] == record for r in results.values())
    for r in results.values():
        for got, want in zip(r["params"], oracle(record), strict=True):
            torch_close(got, want)


def torch_close(got, want) -> None:
    import torch
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


SECRET = "0123456789abcdef" * 4  # the tests' job secret (the launcher takes PHALANX_SECRET when it is set)
HEARTBEAT_S = 3  # the door job's heartbeat timeout: a joiner with no process behind it is dropped after this
# the door job's timeout (PHALANX_TIMEOUT): what a live joiner that never reaches training costs the members. Derived
# from the heartbeat timeout, far enough above it that the idle joiner is dropped by this bound, not by a silent
# heartbeat (its heartbeat runs), and high enough for a gloo collective beside two busy loops. (2x was tried: on a
# machine loaded far past two busy loops, load 37, the door job ended during the idle joiner's wait.)
TIMEOUT_S = 4 * HEARTBEAT_S


def start_door(tmp_path, *flags: str, env: dict | None = None) -> tuple[Launcher, int]:
    """``workers/elastic_door.py`` on 2 workers, training until :func:`end_door`; returns the launcher and port.

    The launcher is forked (:mod:`support.forked_launch`): no test here kills it or reads what a fresh
    interpreter prints at its start; its stderr (its workers' too) is ``OUT/launcher.err``.
    """
    argv = ["run", "-n", "2", "--elastic", "--min-workers", "1", *flags, DOOR, "--out", str(tmp_path)]
    launcher = start_cli(argv, str(tmp_path), env={"PHALANX_SECRET": SECRET, **(env or {})})
    err = lambda: (tmp_path / "launcher.err").read_text() if (tmp_path / "launcher.err").exists() else ""  # noqa: E731
    found = re.compile(r"its store is at \S+:(\d+)")
    try:
        until(lambda: found.search(err()), timeout=90, what="the job's store", procs=[launcher],
              detail=lambda: err()[-2000:])
        until(lambda: len(glob.glob(str(tmp_path / "training*"))) >= 2, timeout=90, what="the workers' training",
              procs=[launcher], detail=lambda: err()[-2000:])
    except BaseException:
        end_door(tmp_path, launcher, timeout=30)  # no job left training after a failed start
        raise
    return launcher, int(found.search(err()).group(1))


def end_door(tmp_path, launcher: Launcher, timeout: float = 120) -> str:
    """Tell the job to stop (every worker at the same step) and return the launcher's stderr (killed if late)."""
    open(tmp_path / "stop", "w").close()
    try:
        return launcher.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        launcher.kill()
        raise


def ghost(port: int, name: str, secret: str | None):  # -> its store connection
    """What an intruder (or a joiner that dies at once) leaves: its name in the store's joiners list, no process."""
    from datetime import timedelta

    import torch.distributed as dist

    from phalanx.elastic import secret as job_secret
    from phalanx.elastic.membership import key
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    if secret is not None:
        config = json.loads(store.get(key("config")))
        store.set(key("proof", name), job_secret.proof(secret, config["nonce"], name))
    while True:
        old = store.get(key("joiners")).decode() if store.check([key("joiners")]) else ""
        new = json.dumps(sorted(set(json.loads(old or "[]")) | {name}))
        if store.compare_set(key("joiners"), old, new).decode() == new:
            return store


@pytest.fixture(scope="module")
def door(tmp_path_factory) -> dict:
    """One door job for the module, training with room for one more worker until the last test here ends it.

    What listens on its store's port is read at once, while the job runs (whatever order the tests run in).
    """
    out = tmp_path_factory.mktemp("door")
    launcher, port = start_door(out, "--heartbeat-timeout", str(HEARTBEAT_S), "--max-workers", "3",  # room for one
                                env={"PHALANX_TIMEOUT": str(TIMEOUT_S)})
    job = {"out": out, "launcher": launcher, "port": port, "listening": listening(port)}
    yield job
    if launcher.poll() is None:  # a test failed before it ended the job
        end_door(out, launcher)


def test_the_elastic_store_listens_on_loopback_only_by_default(door):
    # read while the door job (started without --master-addr) and its store were running
    addrs = door["listening"]
    assert addrs, "nothing listens on the port the launcher printed"
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    assert set(addrs) <= loopback, addrs


def test_refused_joins_and_joiners_that_never_arrive_leave_the_job_untouched(door):
    """One job, knocked on five ways while it trains with room for one more worker.

    A join without the secret and one with another secret are refused in one line each; a
    name written raw into the joiners list proves nothing and is never admitted; a name that
    proves the secret but has no process behind it is admitted at the next commit and dropped
    after the heartbeat timeout (3 s, not gloo's 60 s); and nanoGPT's joiner, placed in
    px.init() but never entering the training function, is alive (its heartbeat runs), so the
    members wait for it as for a joiner still setting up, the job's timeout (TIMEOUT_S here), then
    drop it. The job ends as if nobody had knocked.
    """
    tmp_path, launcher, port = door["out"], door["launcher"], door["port"]
    join = [*CLI, "join", "--rdzv-endpoint", f"127.0.0.1:{port}", "-n", "1", DOOR, "--out", str(tmp_path)]
    bare = {k: v for k, v in os.environ.items() if k != "PHALANX_SECRET"}
    # the two refused joins knock while the ghosts below are written and dropped (each is an interpreter's start-up
    # that only waits for its refusal: one after the other, they left the cores idle); they stay fresh interpreters,
    # since what they print (one line) is what is under test
    # (a refusal is the joiner's own check against the verifier the job published: it writes nothing to the store)
    knocks = [subprocess.Popen(join, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
              for env in (bare, {**bare, "PHALANX_SECRET": "x" * 64})]
    idle = None
    try:
        ghost(port, "stray", None)
        store = ghost(port, "ghost", SECRET)
        from phalanx.elastic.membership import key

        def dropped(wid: str) -> None:  # wait until the members gave up on ``wid`` (and the job still runs)
            until(lambda: store.check([key("dead", wid)]), timeout=90, what=f"{wid} marked dead", procs=[launcher])

        # the idle joiner starts up while the ghost is dropped: listed after it ("ghost" sorts before a joiner's
        # "j..." id), it is offered the one free place only once the ghost is dead, so its place is still rank 2 of 3
        # (its launcher is forked too: it is neither killed nor read; it gets a folder of its own for its output)
        (tmp_path / "joiner").mkdir()
        idle = start_cli(["join", "--rdzv-endpoint", f"127.0.0.1:{port}", "-n", "1", DOOR, "--out", str(tmp_path),
                          "--idle-joiner"], str(tmp_path / "joiner"), env={"PHALANX_SECRET": SECRET})
        dropped("ghost")
        # the stray name proves nothing: a member pruned it from the joiners list (it was considered and refused)
        joiners = lambda: json.loads(store.get(key("joiners")) or b"[]")  # noqa: E731
        until(lambda: "stray" not in joiners(), timeout=90, what="the stray name pruned from the joiners",
              procs=[launcher], detail=lambda: str(joiners()))
        outs = [k.communicate(timeout=60) for k in knocks]
        # the file is there as soon as it is opened: its place is read once it holds the whole of it
        written = lambda: [p for p in glob.glob(str(tmp_path / "idle*")) if open(p).read().endswith("}")]  # noqa: E731
        until(written, timeout=90, what="the idle joiner's place",
              procs=[idle, launcher], detail=lambda: (tmp_path / "joiner" / "launcher.err").read_text()[-2000:])
        [placed] = written()
        assert json.load(open(placed)) == {"rank": 2, "world_size": 3}  # its place, read right after px.init()
        dropped(os.path.basename(placed)[len("idle"):])
        assert not store.check([key("dead", "stray")])  # never admitted, so never dropped either
        stderr = end_door(tmp_path, launcher)
        assert idle.wait(timeout=60) == 0, idle.communicate()[1][-2000:]
    finally:
        reap(*knocks)
        if idle is not None and idle.poll() is None:
            idle.kill()
    without, wrong = (subprocess.CompletedProcess(k.args, k.returncode, out, err)
                      for k, (out, err) in zip(knocks, outs, strict=True))
    assert without.returncode == 2 and "secret" in without.stderr and len(without.stderr.splitlines()) == 1, \
        without.stderr[-2000:]
    assert wrong.returncode == 1 and "secret" in wrong.stderr and len(wrong.stderr.splitlines()) == 1, \
        wrong.stderr[-2000:]
    assert_untouched(tmp_path, launcher, stderr)
    assert "ghost" in stderr and stderr.count("dropped") == 2, stderr[-3000:]
    assert "stray" not in stderr, stderr[-3000:]


def test_a_joiner_arriving_after_the_end_exits_0_at_once_with_no_thread_left(tmp_path):
    from datetime import timedelta

    import torch.distributed as dist

    from phalanx.elastic import secret as job_secret
    from phalanx.elastic.membership import key
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    nonce = job_secret.nonce()
    store.set(key("config"), json.dumps({"min_workers": 1, "max_workers": 3, "heartbeat_s": 5.0, "workers": 2,
                                         "spares": [], "nonce": nonce, "check": job_secret.verifier(SECRET, nonce)}))
    store.set(key("gen", 0, "members"), json.dumps(["0", "1"]))
    store.set(key("done"), "1")  # training ended; the launcher is still up while its workers exit
    env = {**os.environ, "PHALANX_ELASTIC_ID": "r1", "PHALANX_ELASTIC_JOIN": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port), "PHALANX_SECRET": SECRET}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    threads = tmp_path / "threads.json"
    proc = subprocess.run([sys.executable, "-u", DOOR, "--out", str(tmp_path), "--threads-at-exit", str(threads)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(threads.read_text()) == []  # the heartbeat thread was stopped and joined before exit


@pytest.fixture(scope="module")
def every_worker_gone(tmp_path_factory) -> dict:
    """Both jobs whose every worker fails, saved and never saved, started at once: each is its own launcher and
    store (forked, their workers from one server: no test here kills a launcher or reads what a fresh interpreter
    prints), and mostly waits on its workers' start-up; each test reads its own (or the timeout it ran into)."""
    jobs = {}
    for save in (True, False):
        out = tmp_path_factory.mktemp(f"gone-{save}")
        argv = ["run", "-n", "2", "--elastic", "--min-workers", "1", DOOR, "--out", str(out), "--fail-at", "5",
                *(["--save"] if save else [])]
        jobs[save] = out, start_cli(argv, str(out))
    gone = {}
    for save, (out, launcher) in jobs.items():
        try:
            launcher.wait(timeout=180)
            gone[save] = out, subprocess.CompletedProcess(launcher.args, launcher.returncode, *launcher.communicate())
        except subprocess.TimeoutExpired as late:
            launcher.kill()
            gone[save] = late
    return gone


@pytest.mark.parametrize("save", [True, False], ids=["saved", "never-saved"])
def test_when_every_worker_is_gone_the_launcher_says_the_job_ended_and_where_to_resume(every_worker_gone, save):
    if isinstance(every_worker_gone[save], BaseException):
        raise every_worker_gone[save]
    tmp_path, proc = every_worker_gone[save]
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("phalanx: elastic:")]
    assert "it was the last worker" in lines[-2], lines
    assert "the job ended" in lines[-1] and "exited with status 3" in lines[-1], lines
    where = str(tmp_path / "ckpt.pt") if save else "no disk checkpoint was saved"
    assert where in lines[-1], lines


