"""Preemption: SIGTERM to `phalanx run` stops every worker after the same step, saves, exits 75; --resume-from auto."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import phalanx as px
from phalanx.group.liveness import STALE_AFTER_S
from phalanx.step.preempt import PREEMPTED_EXIT, latest_checkpoint
from phalanx.step.preempt import PREEMPTION
from support.preempt_job import oracle, weights
from support.paths import REPO, TESTS
from support.forked_launch import STARTING, Launcher, start_cli
from support.procs import at_once, outcome, run_workers
from support.wait import until

WORKER = os.path.join(TESTS, "workers", "preempt.py")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"),
                                                     os.environ.get("PYTHONPATH", "")])}


def phalanx(*args: str, logs: str) -> Launcher:
    """``phalanx run ARGS``, its stdout and stderr kept in ``LOGS/launcher.{out,err}``.

    The launcher is forked from the tests' preloaded server (support.forked_launch), not a fresh interpreter: what
    these tests check is what it does with the signals and its workers, which torch's agent still starts as
    ``python -u WORKER`` (each a fresh interpreter); a fresh launcher cost 1.4 CPU-s more.
    """
    os.makedirs(logs, exist_ok=True)
    return start_cli(["run", *args], logs, {"PYTHONPATH": ENV["PYTHONPATH"]})  # one thread at a time inside


def stderr_of(job: Launcher) -> str:
    with open(job.paths[1], errors="replace") as f:
        return f.read()


def wait_for(path: str, proc: Launcher, deadline_s: float = 120) -> None:
    """Until the worker writes ``path`` (polling a file; the launcher ending first is a failure)."""
    until(lambda: os.path.exists(path), timeout=deadline_s, what=f"the worker's {os.path.basename(path)}",
          procs=[proc], detail=lambda: stderr_of(proc))


def sigterm_once(job: Launcher, *markers: str) -> str:
    """SIGTERM to the launcher once the workers wrote every marker file; its stderr once it ended (killed if not)."""
    try:
        for marker in markers:
            wait_for(marker, job)
        os.kill(job.pid, signal.SIGTERM)
        return job.communicate(timeout=120)[1]
    finally:
        if job.poll() is None:
            job.kill()


def delivered(pid: int, sig: int) -> bool:
    """The kernel handed ``sig`` to process ``pid`` (no longer pending: its handler has been entered)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            pending = {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("SigPnd", "ShdPnd")}
    except FileNotFoundError:
        return True  # it ended
    return not any(mask >> (sig - 1) & 1 for mask in pending.values())


def sigterm_then_repeats(job: Launcher, out: str) -> str:
    """SIGTERM to the launcher at ``OUT.reached``; then, while rank 0 holds before its save (``OUT.saving``, inside
    the launcher's grace), SIGUSR1 and SIGTERM again, to the launcher twice each and to every worker, as SLURM and a
    scheduler that resends do; each is delivered before the next is sent (a signal sent twice before its handler ran
    arrives once). Then ``OUT.go``: the save goes on. Returns the launcher's stderr (killed if it did not end)."""
    try:
        wait_for(out + ".reached", job)
        os.kill(job.pid, signal.SIGTERM)
        wait_for(out + ".saving", job)
        workers = [pid for pid in _procs_with(out) if pid != job.pid]
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM):
            for pid in (job.pid, *workers):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                until(lambda pid=pid, sig=sig: job.poll() is not None or delivered(pid, sig), timeout=60,
                      what=f"{sig!r} to {pid}")
        with open(out + ".go", "w"):
            pass
        return job.communicate(timeout=120)[1]
    finally:
        if job.poll() is None:
            job.kill()


# The three jobs that are preempted and resumed start at once, each in its own thread and folder (one module
# fixture), and each test reads its own job's outcome: a job mostly waits (for a marker, a grace, a checkpoint's
# fsync, the next launch), so one after the other they left the cores idle for most of their 40 s.
def _stops_and_resumes(tmp) -> dict:
    ckpt, out = str(tmp / "ckpt"), str(tmp / "model.pt")
    job = phalanx("-n", "2", "--checkpoint-dir", ckpt, WORKER, out, "5", "--hold-before-save", logs=str(tmp / "run"))
    err = sigterm_then_repeats(job, out)  # rank 0 finished step 5 and waits for the signal; repeats in the grace
    got = {"ckpt": ckpt, "out": out, "code": job.returncode, "err": err, "listed": _listed(ckpt),
           "latest": latest_checkpoint(ckpt), "out_before_resume": os.path.exists(out)}
    resumed = phalanx("-n", "2", "--checkpoint-dir", ckpt, "--resume-from", "auto", WORKER, out,
                      logs=str(tmp / "resume"))
    got["resumed_err"] = resumed.communicate(timeout=120)[1]
    got["resumed_code"] = resumed.returncode
    return got


def _hangs_in_the_grace(tmp) -> dict:
    ckpt, out = str(tmp / "ckpt"), str(tmp / "model.pt")
    job = phalanx("-n", "2", "--grace", str(HANG_GRACE_S), "--checkpoint-dir", ckpt, WORKER, out, "5",
                  "--hang-before-save", logs=str(tmp / "run"))
    err = sigterm_once(job, out + ".reached")
    return {"code": job.returncode, "err": err, "latest": latest_checkpoint(ckpt)}


def _diloco_drifts(tmp) -> dict:
    ckpt, out, ref = str(tmp / "ckpt"), str(tmp / "model.pt"), str(tmp / "reference.pt")
    job = phalanx("-n", "2", "--checkpoint-dir", ckpt, PERIODIC, out, "diloco", "--drift", logs=str(tmp / "run"))
    # the uninterrupted run, alongside: the same script's loop on two ranks forked from the tests' preloaded server
    # (what it checks is the weights, not a launch: a launcher and two fresh interpreters cost 6 CPU-s more)
    with STARTING:  # its workers start through the functions start_cli swaps
        reference = run_workers("workers.preempt_periodic:reference", check=False, timeout=120, out=ref,
                                strategy="diloco")
    err = sigterm_once(job, out + ".reached0", out + ".reached1")
    got = {"out": out, "ref": ref, "code": job.returncode, "err": err, "listed": _listed(ckpt)}
    resumed = phalanx("-n", "2", "--checkpoint-dir", ckpt, "--resume-from", "auto", PERIODIC, out, "diloco",
                      logs=str(tmp / "resume"))
    got["resumed_err"] = resumed.communicate(timeout=120)[1]
    got["resumed_code"] = resumed.returncode
    got["ref_err"] = "\n".join(log[-1500:] for log in reference.logs)
    got["ref_code"] = max(reference.returncodes, key=abs)
    return got


def _listed(directory: str) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> dict:
    """Each preempted job's outcome by name (or the exception its thread raised, raised again by its test)."""
    chains = {"stops": _stops_and_resumes, "hangs": _hangs_in_the_grace, "diloco": _diloco_drifts}
    return at_once({name: functools.partial(chain, tmp_path_factory.mktemp(name)) for name, chain in chains.items()})


_outcome = outcome


@pytest.mark.multiproc
def test_sigterm_and_its_repeats_stop_after_one_agreed_step_save_and_resume_auto_ends_as_the_oracle(preempted):
    got = _outcome(preempted, "stops")
    err, ckpt, out = got["err"], got["ckpt"], got["out"]
    # SIGTERM, then SIGUSR1/SIGTERM four times more to the launcher and to every worker while they save (issue 36:
    # a repeat ended torch's agent's grace, the launcher SIGKILLed the saving workers: "received SIGUSR1; stopped
    # all workers", exit 138, nothing saved, no requeue): one agreed stop, one checkpoint, 75.
    assert got["code"] == PREEMPTED_EXIT, err
    # Both workers name one step (the launcher lists every distinct one): the step after the last one heard it.
    stopped = re.search(r"received SIGTERM; the workers stopped after step (\d+) to save", err)
    assert stopped, err
    step = int(stopped.group(1))
    saved = os.path.join(ckpt, f"step-{step}.pt")
    assert step > 5 and got["listed"] == [os.path.basename(saved)] and got["latest"] == saved
    assert px.read_checkpoint(saved)["step"] == step and not got["out_before_resume"]

    err = got["resumed_err"]
    assert got["resumed_code"] == 0, err
    assert f"resuming from {saved}" in err
    for a, b in zip(weights(out), oracle().state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# The grace the hanging job gets, which its test waits out: it covers only the workers reaching the agreed stop
# step after the signal (two steps and a store key, milliseconds) and writing their notes. Derived from the
# heartbeat: a loaded machine starves a thread for a second or two, never for its stale time (STALE_AFTER_S).
HANG_GRACE_S = int(STALE_AFTER_S) + 1


@pytest.mark.multiproc
def test_a_stop_that_wrote_no_checkpoint_within_the_grace_is_not_reported_as_resumable(preempted):
    # Both workers stop at the agreed step, but rank 1 hangs instead of saving: the grace runs out and the
    # launcher kills them. It must not say "stopped to save a checkpoint ... resumable" and exit 75.
    got = _outcome(preempted, "hangs")
    err = got["err"]
    assert got["code"] == 128 + signal.SIGTERM, err[-3000:]
    assert re.search(r"received SIGTERM; the workers stopped after step \d+ but wrote no checkpoint in ", err), err
    assert got["latest"] is None


PERIODIC = os.path.join(TESTS, "workers", "preempt_periodic.py")


@pytest.mark.multiproc
def test_under_diloco_drifting_workers_stop_at_one_sync_step_and_resume_as_the_uninterrupted_run(preempted):
    # DiLoCo(every=8): rank 1 hears the signal and tells the others at step 3, then runs ahead to step 7
    # (its local steps need no one); rank 0 tells them last, at step 2. "The step after the last one heard"
    # is 3, which rank 1 has passed: every worker must stop at the next sync (8), where none can pass alone.
    got = _outcome(preempted, "diloco")
    err = got["err"]
    assert got["code"] == PREEMPTED_EXIT, err[-3000:]
    assert "the workers stopped after step 8 to save" in err, err[-3000:]
    assert got["listed"] == ["step-8.pt"]
    assert got["resumed_code"] == 0, got["resumed_err"][-3000:]
    assert got["ref_code"] == 0, got["ref_err"][-3000:]
    for a, b in zip(weights(got["out"]), weights(got["ref"]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _procs_with(text: str) -> list[int]:
    """Pids of the processes whose command line contains ``text`` (the job's own output path: its workers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.multiproc
def test_sigterm_during_start_up_ends_the_job_in_one_line_with_no_worker_left(tmp_path):
    out = str(tmp_path / "model.pt")
    job = phalanx("-n", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), WORKER, out, logs=str(tmp_path / "run"))
    try:
        # both workers started (importing torch, or in px.init): not trained
        until(lambda: len(_procs_with(out)) >= 2, timeout=120, what="both workers' start", procs=[job],
              detail=lambda: stderr_of(job))
        os.kill(job.pid, signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert job.returncode in (PREEMPTED_EXIT, 128 + signal.SIGTERM), err
    assert len(lines) == 1 and lines[0].startswith("phalanx: received SIGTERM"), err
    assert _procs_with(out) == [] and not os.path.exists(tmp_path / "ckpt") and not os.path.exists(out)


def test_the_launcher_ends_the_processes_it_started_and_only_those():
    # A SIGTERM while torch's agent is starting the workers can leave some it does not track yet; under load
    # one such run left 2 workers alive (holding the launcher's stderr, retrying a store that was gone).
    from phalanx.launch.run import _children, _reap_children
    older = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        before = _children()
        newer = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
        assert {older.pid, newer.pid} <= _children()
        _reap_children(before)
        assert newer.wait(timeout=10) == -signal.SIGKILL and older.poll() is None
    finally:
        older.kill()
        older.wait()


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path):
    assert latest_checkpoint(tmp_path) is None and latest_checkpoint(tmp_path / "missing") is None
    net = torch.nn.Linear(2, 1)
    old, new = str(tmp_path / "step-1.pt"), str(tmp_path / "step-2.pt")
    px.save_checkpoint(old, net, step=1)
    px.save_checkpoint(new, net, step=2)
    os.utime(old, (1, 1))
    half = tmp_path / "step-3.pt.tmp-host-123-x"  # a save in progress: DCP's files, no marker yet
    half.mkdir()
    (half / ".metadata").write_bytes(b"")
    (tmp_path / "step-4.pt").write_bytes(b"not a checkpoint")  # a one-file checkpoint that fails verification
    assert latest_checkpoint(tmp_path) == new
    (tmp_path / "dcp").mkdir()  # a directory counts once the marker px.save_checkpoint writes last is there
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    assert latest_checkpoint(tmp_path) == new
    (tmp_path / "dcp" / "phalanx.json").write_bytes(b"{}")
    assert latest_checkpoint(tmp_path) == new  # ... and verifies: a marker that vouches for nothing is passed over
    px.save_checkpoint(str(tmp_path / "dcp"), net, step=3)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "dcp")
    superseded = tmp_path / "step-5.pt.old-abcd1234"  # the copy a newer save replaced
    superseded.mkdir()
    (superseded / "phalanx.json").write_bytes(b"{}")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "dcp")


@pytest.mark.parametrize("argv, given", [
    (["--resume-from", "auto"], "--resume-from auto without --checkpoint-dir"),
    (["--resume-from", "nope.pt"], "--resume-from nope.pt (not found"),
])
def test_bad_resume_flags_are_one_line(argv, given, tmp_path):
    from phalanx.launch.run import RunConfig
    with pytest.raises(px.ConfigError, match=None) as err:
        RunConfig.from_argv([*argv, WORKER])
    assert str(err.value).startswith(given) and "\n" not in str(err.value)


# -- under --elastic: SIGTERM to one worker is a graceful leave ---------------------------------------------------

@pytest.mark.multiproc
def test_sigterm_to_one_elastic_worker_leaves_at_the_commit_and_the_others_redo_nothing(tmp_path):
    from support.elastic_job import oracle as elastic_oracle
    from support.forked_launch import launch
    from workers import elastic as worker
    proc, results = launch(tmp_path, "--min-workers", "2", "--", "--kill", "1@5", "--term", "--commit-every", "3",
                           timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 1 leaves the group after step 6" in proc.stderr, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2"]
    record = results["0"]["record"]
    assert all(r["record"] == record for r in results.values())
    history = results["0"]["history"]
    assert [h["left"] for h in history] == [["1"]] and history[0]["step"] == 6 and history[0]["redone_steps"] == 0
    for epoch in (0, 1):  # every sample exactly once per epoch
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    worlds = [w for _, w, _ in record]
    assert worlds == [3] * 6 + [2] * (len(worlds) - 6)  # steps 1-6 by three workers, the rest by two, none twice
    for r in results.values():
        for got, want in zip(r["params"], elastic_oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def test_the_trainer_saves_on_sigterm_exits_75_and_resume_auto_ends_as_the_uninterrupted_fit(tmp_path, monkeypatch):
    import torch.nn.functional as F
    from phalanx.group import group
    from phalanx.step import preempt
    from phalanx.train.callbacks import LambdaCallback, ModelCheckpoint

    g = group.current() if group.is_initialized() else group.init()
    monkeypatch.setattr(g, "env", dataclasses.replace(g.env, launched_by_phalanx=True))  # as `phalanx run -n 1`
    data = torch.utils.data.TensorDataset(torch.randn(48, 4, generator=torch.Generator().manual_seed(0)),
                                          torch.randint(0, 3, (48,), generator=torch.Generator().manual_seed(1)))

    def fit(**kw):
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        saves = ModelCheckpoint(str(tmp_path / "ckpt" / "epoch-{epoch}.pt"))
        trainer = px.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), F.cross_entropy,
                             callbacks=[saves, *kw.pop("cb", [])])
        trainer.fit(data, epochs=2, batch_size=8, progress=False, **kw)
        return net

    try:
        want = fit()
        PREEMPTION.of(g).value = None  # a fresh preemption state, as in a new process
        term = LambdaCallback(on_step_end=lambda t, step, logs: step == 7 and os.kill(os.getpid(), signal.SIGTERM))
        with pytest.raises(SystemExit) as stop:
            fit(cb=[term])
        assert stop.value.code == PREEMPTED_EXIT and stop.value.checkpoint.endswith("step-00000009.pt")
        assert latest_checkpoint(tmp_path / "ckpt") == stop.value.checkpoint  # newer than epoch-1.pt
        PREEMPTION.of(g).value.uninstall()
        PREEMPTION.of(g).value = None
        got = fit(resume_from="auto")
    finally:
        if PREEMPTION.of(g).value is not None:
            PREEMPTION.of(g).value.uninstall()
        PREEMPTION.of(g).value = None
        del preempt
    for a, b in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(a, b)
