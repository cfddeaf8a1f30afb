"""`phalanx run` inside SLURM: hosts from SLURM's variables; a real two-node cluster on this machine.

The cluster lives in the test's temporary directory: munged with its own key and socket,
slurmctld and two slurmd (``slurmd -N node1`` / ``-N node2``, two node entries sharing
127.0.0.1 on different ports), all with our own slurm.conf (``SLURM_CONF``). It needs
root and Debian's slurm-wlm (`make setup` installs it when root); otherwise it is skipped.
"""
from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

from phalanx import ConfigError
from phalanx.launch.run import RunConfig
from phalanx.launch.slurm import PORT_BASE, PORT_SPAN, SlurmEnv, expand_nodelist
from support.procs import free_port
from support.wait import until
from support.preempt_job import oracle, weights
from workers import elastic as base
from support.paths import REPO, TESTS

WORKER = os.path.join(TESTS, "workers", "preempt.py")
ELASTIC = os.path.join(TESTS, "workers", "slurm_elastic.py")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
SRC = os.path.join(REPO, "src")

# -- the environment handling, without a cluster --------------------------------------------------------------

ALLOC = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
         "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1"}


def test_nodelists_expand_as_scontrol_show_hostnames():
    assert expand_nodelist("node[1-2]") == ["node1", "node2"]
    assert expand_nodelist("gpu[008-010,12],login") == ["gpu008", "gpu009", "gpu010", "gpu12", "login"]
    assert expand_nodelist("a[1-2]-ib,b[3]") == ["a1-ib", "a2-ib", "b3"]


def test_inside_an_allocation_no_host_flags_are_needed(monkeypatch):
    for k, v in {**ALLOC, "SLURM_GPUS_ON_NODE": "2"}.items():
        monkeypatch.setenv(k, v)
    cfg = RunConfig.from_argv([WORKER])
    assert (cfg.min_nodes, cfg.max_nodes, cfg.node_rank, cfg.nproc) == (2, 2, 1, 2)
    assert cfg.master_addr == "127.0.0.1" and cfg.master_port == SlurmEnv.from_environ(ALLOC).port == 15077
    assert not cfg.standalone and cfg.launch_config().rdzv_endpoint == "127.0.0.1:15077"


def test_a_later_node_joins_once_the_first_node_published_the_job_not_when_its_port_opens(monkeypatch, capfd):
    """Red until 2026-11-30: the second node joined as soon as the first node's store port answered; that launcher
    writes the job's config after opening the port, so a join in between was told "not elastic" and the job
    failed (CI: test_an_elastic_job_spans_the_allocation_and_survives_losing_a_node_as_the_oracle)."""
    import torch.distributed as dist

    from phalanx.elastic.membership import key
    from phalanx.launch import run as launch_run

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the port open, no job yet
    for k, v in ALLOC.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PHALANX_SECRET", "s" * 32)
    cfg = RunConfig.from_argv(["--elastic", "--master-port", str(store.port), WORKER])
    joined: list[str] = []
    monkeypatch.setattr(launch_run.launch_join, "main", lambda argv: joined.append(argv[1]) or 0)
    assert launch_run._join_slurm_job(cfg, within=1.0) == 1 and joined == []
    assert "published no elastic job within 1 s" in capfd.readouterr().err
    store.set(key("config"), "{}")
    assert launch_run._join_slurm_job(cfg, within=30.0) == 0 and joined == [f"127.0.0.1:{store.port}"]


@pytest.mark.parametrize("change, argv, given", [
    ({}, ["--nnodes", "3"], "--nnodes 3 inside SLURM job 77; expected --nnodes 2 (from SLURM_NNODES)"),
    ({}, ["--node-rank", "0"], "--node-rank 0 inside SLURM job 77; expected --node-rank 1 (from SLURM_NODEID)"),
    ({}, ["--master-addr", "10.1.1.1"], "--master-addr 10.1.1.1 inside SLURM job 77; expected the first node"),
    ({"SLURM_STEP_ID": None}, [], "`phalanx run` in the batch script of a 2-node job"),
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_NTASKS": "8"}, [], "4 SLURM tasks per node"),
    ({"SLURM_NNODES": "3"}, [], "SLURM_JOB_NODELIST with 2 host(s), SLURM_NNODES=3"),
    ({"SLURM_NODEID": "x"}, [], "SLURM_JOB_NODELIST='127.0.0.[1-2]'"),
])
def test_flags_or_variables_that_disagree_are_one_line(monkeypatch, change, argv, given):
    for k, v in {**ALLOC, **change}.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as err:
        RunConfig.from_argv([*argv, WORKER])
    assert str(err.value).startswith(given) and "\n" not in str(err.value), str(err.value)


def test_elastic_over_several_nodes_needs_the_secret_in_the_environment(monkeypatch):
    for k, v in ALLOC.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PHALANX_SECRET", raising=False)
    with pytest.raises(ConfigError, match="without PHALANX_SECRET"):
        RunConfig.from_argv(["-n", "2", "--elastic", WORKER])


def test_elastic_bounds_count_the_workers_of_every_node_of_the_allocation(monkeypatch):
    # -n is per node: 2 nodes x -n 1 is a 2-worker elastic job (it was refused as "--elastic with -n 1").
    for k, v in {**ALLOC, "PHALANX_SECRET": "ab" * 16}.items():
        monkeypatch.setenv(k, v)
    cfg = RunConfig.from_argv(["-n", "1", "--elastic", "--min-workers", "1", WORKER])
    assert (cfg.nproc, cfg.elastic.min_workers, cfg.elastic.max_workers) == (1, 1, 2)


# -- a real cluster --------------------------------------------------------------------------------------------

# How long a job credential lives: a requeued job is held this long before it may start again, so the preemption
# test waits it out. Slurm's minimum (a smaller value is refused and 120 s used): a credential is checked when
# slurmd starts a step, a C daemon on loopback here, well within it even on a loaded machine.
CRED_EXPIRE_S = 5


def _skip_reason() -> str | None:
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing; `apt-get install slurm-wlm` or make setup)"
    if os.geteuid() != 0:
        return "a test SLURM cluster needs root (slurmd runs jobs as their user)"
    return None


def _first_job_id(jobs: int = 8) -> int:
    """A first job id whose stores' ports (``PORT_BASE`` + job id, one per job of the module) are free now.

    Every test cluster numbering its jobs from 1 gave every cluster's first job port 15001: two
    clusters on one machine (parallel test runs) collided there (EADDRINUSE, the job FAILED).
    """
    rng = random.Random(os.getpid())
    while True:
        first = rng.randrange(1, PORT_SPAN - jobs)
        try:
            for port in range(PORT_BASE + first, PORT_BASE + first + jobs):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _until(what: str, check, deadline_s: float = 120.0, every_s: float = 0.05, detail=lambda: ""):
    """Poll ``check()`` until it returns something true; a bounded wait that names what never happened
    (and, from ``detail()``, what the job and the daemons said meanwhile).

    The checks read a file or run one ``scontrol`` (20 ms): polling often costs little and ends the wait
    as soon as the state changed (SLURM has no event to block on for a job's state).
    """
    got: list = []
    until(lambda: got.append(check()) or got[-1], timeout=deadline_s, what=what, detail=detail)
    return got[-1]


class Cluster:
    """One slurmctld and two slurmd (node1, node2) on this machine, configured in ``root``."""

    def __init__(self, root: str) -> None:
        self.root, self.pids = root, []
        self.env = {**os.environ, "SLURM_CONF": os.path.join(root, "slurm.conf"),
                    "PYTHONPATH": os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")])}
        for k in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[k]

    def start(self) -> None:
        r, host = self.root, socket.gethostname()
        key = os.path.join(r, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = os.path.join(r, "munge.sock")
        self._daemon([_bin("munged"), "--force", f"--socket={sock}", f"--key-file={key}",
                      f"--log-file={r}/munged.log", f"--pid-file={r}/munged.pid", f"--seed-file={r}/munged.seed"],
                     f"{r}/munged.pid")
        ctld, n1, n2 = free_port(), free_port(), free_port()
        os.makedirs(f"{r}/state")
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(f"""ClusterName=phalanxtest
FirstJobId={_first_job_id()}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=node1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1} CPUs=1 State=UNKNOWN
NodeName=node2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2} CPUs=1 State=UNKNOWN
PartitionName=test Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
""")
        self._daemon([_bin("slurmctld"), "-c", "-i"], f"{r}/slurmctld.pid")
        for node in ("node1", "node2"):
            self._daemon([_bin("slurmd"), "-N", node], f"{r}/slurmd-{node}.pid")
        _until("both nodes idle", lambda: self.out(["sinfo", "-h", "-o", "%D %t"]).split() == ["2", "idle"], 60, 0.1)

    def _daemon(self, argv: list[str], pidfile: str) -> None:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{argv[0]} failed: {done.stderr or done.stdout}"
        self.pids.append(int(_until(f"{pidfile}", lambda: os.path.exists(pidfile) and open(pidfile).read().strip(),
                                    30)))

    def out(self, argv: list[str]) -> str:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30).stdout.strip()

    def logs(self) -> str:
        """The daemons' last lines, for an assertion's message (the cluster's directory goes with the test)."""
        lines = []
        for name in ("slurmctld.log", "slurmd-node1.log", "slurmd-node2.log"):
            with open(os.path.join(self.root, name), errors="replace") as f:
                lines += [f"{name}: {line.rstrip()}" for line in f.readlines()[-15:]]
        return "\n".join(lines)

    def job(self, job_id: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S+)", self.out(["scontrol", "show", "job", "-o", job_id])))

    def stop(self) -> None:
        subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        for pid in reversed(self.pids):  # the slurmds, slurmctld, then munged: only the daemons we started
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                _until(f"daemon {pid} to exit", lambda pid=pid: not _alive(pid), 30)
            except AssertionError:
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture(scope="module")
def cluster():
    """One cluster for every test of this module: the daemons start once (each test submits its own job)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # slurmstepd's sockets live in the spool directory, and a Unix socket's path must fit in 108 bytes
    root = tempfile.mkdtemp(prefix="pxslurm-", dir="/tmp")
    c = Cluster(root)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def _story(cluster: Cluster, job: str, out: str):
    """What a job that never ended left behind: its state, its output and the daemons' last lines."""
    log = open(out, errors="replace").read() if os.path.exists(out) else "(no job output)"
    return f"{cluster.job(job)}\n--- job output ---\n{log}\n--- daemons ---\n{cluster.logs()}"


def _ended(cluster: Cluster, job: str):
    state = cluster.job(job)
    return state if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else None


def test_a_two_node_sbatch_job_is_preempted_by_usr1_requeued_resumed_and_ends_as_the_oracle(cluster, tmp_path):
    out, ckpt = str(tmp_path / "model.pt"), str(tmp_path / "ckpt")
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --requeue --open-mode=append --output={tmp_path}/job.out
srun {sys.executable} -m phalanx.cli run -n 1 --checkpoint-dir {ckpt} --resume-from auto --requeue --grace 90 \
    {WORKER} {out} 5
""")  # --grace 90: on a loaded CI machine the two workers once took longer than the default 30 s to stop and save
    job = cluster.out(["sbatch", "--parsable", str(script)])
    assert job.isdigit(), job
    polls = iter(range(1 << 30))
    def reached() -> bool:
        if next(polls) % 20 == 0:  # the file every 50 ms, the job's state (an scontrol) every second
            assert cluster.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), cluster.job(job)
        return os.path.exists(out + ".reached")
    _until("rank 0 to reach step 5", reached)
    assert cluster.out(["scancel", "--signal=USR1", job]) == ""  # SLURM's `--signal=USR1@N` warning, now
    # requeued: back in the queue (Restarts counts up before the job has left its nodes), held until the
    # revoked job credential has expired (cred_expire: CRED_EXPIRE_S here, 120 s by default). The hold is not to be
    # skipped: `scontrol update StartTime=now` let the job start inside it, and slurmd refused it ("Job
    # credential revoked": FAILED, 1 run in 6 here). Once the hold is over, slurmctld's periodic pass starts
    # the job: every second here (sched_interval=1), every 60 s by default.
    _until("the requeue", lambda: (lambda j: j.get("Restarts") == "1" and j.get("JobState") == "PENDING")(
        cluster.job(job)), 120, 0.1, lambda: _story(cluster, job, str(tmp_path / "job.out")))
    state = _until("the job to end", lambda: _ended(cluster, job), 240, 0.1,
                   lambda: _story(cluster, job, str(tmp_path / "job.out")))
    log = open(tmp_path / "job.out").read()
    assert state["JobState"] == "COMPLETED", f"{state}\n{log}\n{cluster.logs()}"
    assert re.search(r"received SIGUSR1; the workers stopped after step \d+ to save", log), log
    assert "requeued SLURM job" in log and "resuming from" in log, log
    for a, b in zip(weights(out), oracle().state_dict().values()):  # 2 nodes x batch 4 = one process x batch 8
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_elastic_job_spans_the_allocation_and_survives_losing_a_node_as_the_oracle(cluster, tmp_path):
    # One `phalanx run --elastic` per node: node 0 hosts the store and worker "0", node 1's launcher joins
    # with its own worker. Worker "0" dies (SIGKILL) two steps after the group reached 2; node 1 goes on.
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --output={tmp_path}/job.out
export PHALANX_SECRET={os.urandom(16).hex()}
srun {sys.executable} -m phalanx.cli run -n 1 --elastic --min-workers 1 {ELASTIC} --out {tmp_path}
""")
    job = cluster.out(["sbatch", "--parsable", str(script)])
    assert job.isdigit(), job
    state = _until("the job to end", lambda: _ended(cluster, job), 240, 0.1,
                   lambda: _story(cluster, job, str(tmp_path / "job.out")))
    log = open(tmp_path / "job.out").read()
    assert state["JobState"] == "COMPLETED", f"{state}\n{log}\n{cluster.logs()}"
    assert "worker 0 (pid" in log and "was killed by SIGKILL" in log, log
    # Node 1's `phalanx join` stops calling the store once its worker finished: node 0 closes it then, and a call
    # after that printed torch's C++ backtrace into the job's output.
    assert "Exception raised from" not in log and "frame #" not in log, log
    results = [json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))]
    assert [r["id"][0] for r in results] == ["j"], log  # node 1's worker: the only one left
    (r,) = results
    worlds = [row[1] for row in r["record"]]
    assert worlds == [1] * worlds.index(2) + [2, 2] + [1] * (len(worlds) - worlds.index(2) - 2), worlds
    assert [(h["joined"], h["left"]) for h in r["history"]] == [([r["id"]], []), ([], ["0"])]
    for epoch in range(2):  # every sample exactly once per epoch, across the join and the lost node
        ids = [i for e, _, step in r["record"] for i in step if e == epoch]
        assert ids == torch.randperm(base.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for got, want in zip(r["params"], base.oracle(r["record"]), strict=True):  # one process, same global batches
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
