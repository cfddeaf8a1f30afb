"""The chaos harness: run an elastic job, SIGKILL its workers at random and inside chosen phases, check the result.

Used by ``benchmarks/chaos.py`` (the soak) and ``tests/elastic/test_chaos_short.py`` (5 placed
kills in ``make test``); the job is ``tests/workers/chaos_job.py``. It lives here, not in
``benchmarks/``, because the test suite must import it and ``tests/`` is already the import
root of the tests and of their worker scripts (``benchmarks/`` is a folder of scripts, not a
package); the benchmark puts ``tests/`` on its path, as ``benchmarks/elastic.py`` already runs
``tests/workers/elastic.py``. The product (``src/phalanx``) imports neither.

What it watches is what the job writes: its event lines (``DIR/events/*.jsonl``, see
``workers/chaos_job.py``), phalanx's checkpoint temporaries and the launcher's store (``elastic/gen``,
``elastic/gen/<g>/members``). A kill is either *random* (a live worker chosen at random, on average
every ``period_s``: the one clock here, and the soak's point) or *aimed* at a phase, placed by those
markers and never by a timer: the harness waits for a worker's ``<phase>+`` event and
kills at once (or, for the phases the job holds with ``--hold``, kills the held worker, which is
then inside that phase for certain). Where a kill landed is read afterwards from the victim's own
event file: the innermost phase it had opened and not closed when it died. It never kills the last
live worker. If no step follows for ``stall_s`` the job is declared wedged: every process is
asked for its stacks (faulthandler on SIGUSR2) and the job is stopped.

Example (one kill aimed at a regroup, one at random, checked against the oracle):
    >>> from support import chaos                               # doctest: +SKIP
    >>> run = chaos.Soak(out, ["-n", "3", "--elastic", "--min-workers", "1", "--replace"],
    ...                  ["--size", "tiny"], plan=["step", "regroup"], period_s=5)  # doctest: +SKIP
    >>> report = run.run(); report["exit"], report["exactly_once"]   # doctest: +SKIP
    (0, True)
"""
from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from support.elastic_job import gone
from support.paths import TESTS

JOB = os.path.join(TESTS, "workers", "chaos_job.py")
RAY_JOB = os.path.join(TESTS, "workers", "chaos_ray.py")  # the same job on Ray Train workers (phalanx.raytrain)
# The launcher, with its stacks on SIGUSR2 (into its log) like the workers'
LAUNCHER = [sys.executable, "-c", "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR2, "
            "all_threads=True); from phalanx.cli import main; sys.exit(main())"]
PHASES = ("commit", "ckpt", "regroup", "join")  # what a kill can be aimed at; "step" is anything else
OPENS = {"commit+": "commit", "ckpt+": "ckpt", "regroup+": "regroup", "grow+": "join", "placed": "join",
         "join+": "join"}
CLOSES = {"commit-": "commit", "ckpt-": "ckpt", "regroup-": "regroup", "grow-": "join", "join-": "join"}


@dataclass
class Proc:
    """One process of the job as its events tell it."""

    id: str
    pid: int
    open: list[str] = field(default_factory=list)  # phases opened and not closed, innermost last
    worker: bool = False  # trains in the group (an original worker, or a joiner once it entered)
    last: dict | None = None
    killed_at: float | None = None

    def phase(self) -> str:
        return self.open[-1] if self.open else "step"


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie its parent has not reaped yet."""
    return not gone(pid)


def pause(seconds: float) -> None:
    """The harness's one poll: the job's markers (event lines, files, store keys) come with no notification,
    and the random kills' cadence is what the soak is about; every loop that calls this is bounded."""
    time.sleep(seconds)  # sleep: the poll of the job's markers, and the random kills' cadence (see the docstring)


class Events:
    """Tails every ``DIR/events/<id>-<pid>.jsonl`` and keeps each process's open phases."""

    def __init__(self, out: str) -> None:
        self.dir = os.path.join(out, "events")
        self.offsets: dict[str, int] = {}
        self.procs: dict[int, Proc] = {}
        self.steps: list[float] = []  # the time of every step event, any worker
        self.all: list[dict] = []

    def poll(self) -> list[dict]:
        """New events since the last call, in time order."""
        new: list[dict] = []
        for path in glob.glob(os.path.join(self.dir, "*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self.offsets[path] = self.offsets.get(path, 0) + end
            new += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        new.sort(key=lambda e: e["t"])
        for e in new:
            self._apply(e)
        self.all += new
        return new

    def _apply(self, e: dict) -> None:
        p = self.procs.setdefault(e["pid"], Proc(e["id"], e["pid"]))
        p.last = e
        ev = e["ev"]
        if ev == "init":
            p.worker = True
        elif ev == "join-":
            p.worker = True
        if ev in OPENS:
            p.open.append(OPENS[ev])
        elif ev in CLOSES and CLOSES[ev] in p.open:
            p.open.remove(CLOSES[ev])
            if ev == "join-":
                p.open = [x for x in p.open if x != "join"]
        if ev == "step":
            self.steps.append(e["t"])
            p.open = []  # a step closes whatever was left open

    def live_workers(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.worker and p.killed_at is None and alive(p.pid)]


def members(store: Any) -> list[str]:
    """The newest generation's worker ids, from the launcher's store."""
    g = int(store.get("elastic/gen")) if store.check(["elastic/gen"]) else 0
    return json.loads(store.get(f"elastic/gen/{g}/members"))


class Sampler(threading.Thread):
    """RSS and open descriptors of the launcher and every process below it, every ``every_s``."""

    def __init__(self, root: int, every_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="chaos-sampler")
        self.root, self.every_s = root, every_s
        self.samples: list[dict] = []  # {"t", "pid", "rss_kb", "fds"}
        self.names: dict[int, str] = {}  # pid: its command line (what a process not a worker is: a Ray daemon, ...)
        self.stop = threading.Event()

    def tree(self) -> list[int]:
        parent: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        found, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += [c for c, pp in parent.items() if pp == pid]
        return found

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            now = time.time()
            for pid in self.tree():
                try:
                    with open(f"/proc/{pid}/status") as f:
                        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
                    fds = len(os.listdir(f"/proc/{pid}/fd"))
                    if pid not in self.names:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            self.names[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
                except (OSError, StopIteration, ValueError):
                    continue
                self.samples.append({"t": now, "pid": pid, "rss_kb": rss, "fds": fds})


def training_samples(samples: list[dict], events: list[dict], roles: dict[int, str]) -> list[dict]:
    """The samples taken while the job trains: a worker's from its own first step on, every other process's (the
    launcher, the fork server) from the job's first step on.

    A replacement parked before its first step (no model yet) would count its own start-up as growth; so would the
    launcher, whose first samples come before the workers and the fork server are up (19 descriptors, then 43-49
    once its store serves the workers: a tiny run's first quarter ends before that on a loaded machine, and the
    report read +16 and +19 there while the count stayed flat over every kill)."""
    first_step: dict[int, float] = {}
    for e in events:
        if e["ev"] == "step":
            first_step.setdefault(e["pid"], e["t"])
    began = min(first_step.values(), default=1e18)
    return [x for x in samples if x["t"] >= first_step.get(x["pid"], 1e18 if x["pid"] in roles else began)]


def growth(samples: list[dict], launcher: int, roles: dict[int, str], long_samples: int = 120,
           names: dict[int, str] | None = None) -> dict:
    """Per process that lived through at least 8 samples: peak RSS of its last quarter / first quarter, and
    descriptors (max of the last quarter - max of the first). The worst of them, and the launcher's. ``names``
    (pid: command line) says what each process that is not a worker is."""
    by: dict[int, list[dict]] = {}
    for s in samples:
        by.setdefault(s["pid"], []).append(s)
    rows = {}
    for pid, ss in by.items():
        if len(ss) < 8:
            continue
        q = len(ss) // 4
        first, last = ss[:q], ss[-q:]
        rows[pid] = {"role": "launcher" if pid == launcher else roles.get(pid, "other"), "samples": len(ss),
                     "rss_first_mb": max(s["rss_kb"] for s in first) / 1024,
                     "rss_last_mb": max(s["rss_kb"] for s in last) / 1024,
                     "rss_ratio": max(s["rss_kb"] for s in last) / max(1, max(s["rss_kb"] for s in first)),
                     "fds_first": max(s["fds"] for s in first), "fds_last": max(s["fds"] for s in last),
                     "fds_delta": max(s["fds"] for s in last) - max(s["fds"] for s in first),
                     "command": (names or {}).get(pid, "")}
    worst = max(rows.values(), key=lambda r: r["rss_ratio"], default=None)
    worst_fd = max(rows.values(), key=lambda r: r["fds_delta"], default=None)
    # A worker killed after a minute has its first quarter in its warm-up (the optimizer's state, the first
    # checkpoint's buffers): growth over time shows in the processes that lived long, reported apart.
    # Ray's own daemons are reported apart too, not judged: its log monitor tails two log files of every worker
    # process Ray starts and keeps up to 200 open (Ray's LOG_MONITOR_MAX_OPEN_FILES) before it closes them all,
    # so under kills its descriptors climb towards 200 and fall back, whatever the job does.
    rays = [r for r in rows.values() if r["role"] == "other" and _ray_daemon(r["command"])]
    long = [r for r in rows.values() if r["samples"] >= long_samples and r not in rays]
    return {"processes": {str(k): v for k, v in rows.items()}, "launcher": rows.get(launcher),
            "worst_rss_ratio": worst["rss_ratio"] if worst else None,
            "worst_fds_delta": worst_fd["fds_delta"] if worst_fd else None,
            "long_lived": {"min_samples": long_samples, "count": len(long),
                           "worst_rss_ratio": max((r["rss_ratio"] for r in long), default=None),
                           "worst_fds_delta": max((r["fds_delta"] for r in long), default=None),
                           "worst_fds_process": max(long, key=lambda r: r["fds_delta"], default={}).get("command")},
            "ray_daemons": {"count": len(rays), "worst_fds_delta": max((r["fds_delta"] for r in rays), default=None),
                            "worst_fds_last": max((r["fds_last"] for r in rays), default=None),
                            "worst_rss_ratio": max((r["rss_ratio"] for r in rays), default=None),
                            "worst_fds_process": max(rays, key=lambda r: r["fds_delta"], default={}).get("command")}}


def _ray_daemon(command: str) -> bool:
    """A process of Ray's own (raylet, GCS, log monitor, dashboard, an idle worker of its pool): not the job's."""
    return "/ray/" in command or command.startswith("ray::IDLE")


def replay_oracle(final_path: str) -> float:
    """The largest difference between the job's final parameters (``final.pt``) and the one-process replay of its
    record (:func:`workers.chaos_job.oracle`)."""
    import torch

    from workers import chaos_job
    final = torch.load(final_path, weights_only=False)  # the harness's own file, written by its own job
    want = chaos_job.oracle(final["size"], final["record"])
    return max(float((a - b).abs().max()) for a, b in zip(final["params"], want, strict=True))


def exactly_once(record: list, n: int) -> dict:
    """Each epoch of the record trained every sample id in ``range(n)`` once: {"ok", "epochs", "bad"}."""
    epochs: dict[int, list[int]] = {}
    for epoch, _world, ids in record:
        epochs.setdefault(epoch, []).extend(ids)
    bad = {e: {"count": len(ids), "distinct": len(set(ids))} for e, ids in epochs.items()
           if sorted(ids) != list(range(n))}
    return {"ok": bool(epochs) and not bad, "epochs": len(epochs), "bad": bad}


class Wedged(Exception):
    """No step for ``stall_s`` seconds while the job was still running."""


class Soak:
    """One chaos run: start the job, apply the kill ``plan``, stop it, check and report.

    ``plan`` is a list of phases, one per kill: ``"random"`` (a live worker at random, after a
    random wait of 0.5-1.5 x ``period_s``), ``"step"`` (a worker that just stepped), or one of
    :data:`PHASES` (aimed: the first matching marker within ``aim_s``, else a random kill).
    """

    def __init__(self, out: str, run_flags: list[str], job_flags: list[str], plan: list[str], *,
                 period_s: float = 15.0, stall_s: float = 60.0, seed: int = 0, aim_s: float | None = None,
                 finish_s: float = 300.0, sample_s: float = 1.0, commit_every: int = 0, save_every: int = 0,
                 log: Any = None, ray: bool = False, replay: bool = True) -> None:
        self.out, self.run_flags, self.job_flags, self.plan = out, run_flags, job_flags, plan
        # replay=False leaves the one-process oracle for later (:func:`replay_oracle`): a long soak's replay is
        # half its length in one process, and another soak timed on the same cores must not run beside it
        self.replay = replay
        # ray: run_flags go to tests/workers/chaos_ray.py (Ray starts, replaces and places the workers; the job's
        # store lives in Ray Train's controller, so the harness goes by the job's events alone)
        self.ray = ray
        # the first step may come late: Ray starts its own cluster first (minutes on a loaded 2-core machine)
        self.first_step_s = 600.0 if ray else 120.0
        self.period_s, self.stall_s, self.finish_s, self.sample_s = period_s, stall_s, finish_s, sample_s
        self.aim_s = aim_s if aim_s is not None else 3 * period_s
        # a kill aimed at "step" lands after a step whose next one is not a commit point either (the victim may
        # already have done its part of the next step's collectives): a step kill stays a step kill
        self.commit_every = commit_every
        # a kill aimed at a commit skips the commits a disk save follows at once (steps that are multiples of
        # save_every): the survivors would meet the loss in that save, and the kill would test the save instead
        self.save_every = save_every
        self.rng = random.Random(seed)
        self.events = Events(out)
        self.kills: list[dict] = []
        self.log = log or (lambda msg: print(f"chaos: {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True))
        self.holds = {h for f in job_flags[job_flags.index("--hold") + 1:][:1] for h in f.split(",")} \
            if "--hold" in job_flags else set()
        self.released: set[tuple[int, int]] = set()
        os.makedirs(os.path.join(out, "release"), exist_ok=True)

    # -- the job ----------------------------------------------------------------------------------
    def start(self) -> None:
        import torch.distributed as dist

        from phalanx.bench.procs import free_port
        port = free_port()
        self.launcher_log = open(os.path.join(self.out, "launcher.log"), "w")  # noqa: SIM115 - closed in run()
        src = os.path.join(os.path.dirname(TESTS), "src")  # this checkout's phalanx, as the suite imports it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, TESTS, os.environ.get("PYTHONPATH")) if p),
               "PHALANX_START_METHOD": os.environ.get("PHALANX_START_METHOD", "forkserver")}
        command = ([sys.executable, "-u", RAY_JOB, *self.run_flags, "--out", self.out, *self.job_flags] if self.ray
                   else [*LAUNCHER, "run", *self.run_flags, "--master-port", str(port), JOB, "--out", self.out,
                         *self.job_flags])
        self.proc = subprocess.Popen(command, stdout=self.launcher_log, stderr=subprocess.STDOUT, env=env)
        self.started = time.time()
        self.sampler = Sampler(self.proc.pid, self.sample_s)
        self.sampler.start()
        # the launcher says where its store listens once it does (its first line): connect then, read-only
        deadline = time.monotonic() + 120
        log = os.path.join(self.out, "launcher.log")
        while "its store is at" not in open(log, errors="replace").read():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise Wedged(f"the launcher never said where its store is (status {self.proc.poll()})")
            pause(0.05)
        self.store = None if self.ray else dist.TCPStore("127.0.0.1", port, is_master=False,
                                                         timeout=timedelta(seconds=30), wait_for_workers=False)

    def running(self) -> bool:
        return self.proc.poll() is None

    # -- watching ---------------------------------------------------------------------------------
    def tick(self) -> list[dict]:
        """Read new events; release held workers we are not about to kill; raise Wedged on a long stall."""
        new = self.events.poll()
        now = time.time()
        # not reset by kills: a job that kills keep from stepping (kills faster than a regroup) is stuck too
        last_step = self.events.steps[-1] if self.events.steps else self.started
        if self.running() and now - last_step > self.stall_s and (self.events.steps
                                                                   or now - self.started > self.first_step_s):
            raise Wedged(f"no step for {now - last_step:.0f}s")
        return new

    def release(self, e: dict) -> None:
        key = (e["pid"], e["n"])
        if key not in self.released:
            self.released.add(key)
            open(os.path.join(self.out, "release", f"{e['id']}-{e['n']}"), "w").close()

    def release_all_held(self, new: list[dict], keep: int | None = None) -> None:
        for e in new:
            if e["ev"] == "held" and e["pid"] != keep:
                self.release(e)

    def wait_step(self, after: float, timeout_s: float) -> float | None:
        """Block until any worker steps after time ``after``; its time, or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.running():
            self.release_all_held(self.tick())
            later = [t for t in self.events.steps if t > after]
            if later:
                return later[0]
            pause(0.01)
        return None

    # -- killing ----------------------------------------------------------------------------------
    def victims(self, exclude_last: bool = True) -> list[Proc]:
        """Live workers that may die now: never the last live member of the group."""
        live = self.events.live_workers()
        try:
            current = set(members(self.store))
            live_members = [p for p in live if p.id in current] or live
        except Exception:  # noqa: BLE001 - the store is read between generations; the events still say who trains
            live_members = live
        return live if not exclude_last or len(live_members) > 1 else []

    def kill(self, p: Proc, aimed: str) -> None:
        seen = p.phase()
        group = sorted({q.phase() for q in self.events.live_workers() if q is not p})
        writing = self.writing(self.last_save_began())
        gen = max((e.get("gen") or 0 for e in self.events.all[-2000:] if e["ev"] == "step"), default=0)
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        t = time.time()
        p.killed_at = t
        self.kills.append({"n": len(self.kills) + 1, "t": t, "since_start_s": round(t - self.started, 2),
                           "id": p.id, "pid": p.pid, "aimed": aimed, "seen": seen, "others": group,
                           "checkpoint_files_being_written": writing,
                           "generation": gen, "member": p.worker})
        self.log(f"kill {len(self.kills)}: worker {p.id} (pid {p.pid}) aimed at {aimed}, seen in {seen}; "
                 f"others in {group}")

    def kill_one(self, aimed: str) -> bool:
        """Carry out one kill of the plan; False if the job ended first."""
        arrived = aimed == "regroup-arrived"  # a survivor killed once it arrived at the next generation
        aimed = "regroup" if arrived else aimed
        if aimed in ("random", "step"):
            if aimed == "random":
                wait = self.rng.uniform(0.5, 1.5) * self.period_s
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and self.running():
                    self.release_all_held(self.tick())
                    pause(0.02)
            while self.running():
                new = self.tick()
                self.release_all_held(new)
                choices = self.victims()
                if aimed == "step":  # the worker that just stepped, before it opens anything else
                    ce = self.commit_every
                    stepped = [self.events.procs[e["pid"]] for e in new if e["ev"] == "step"
                               and (ce < 3 or e["step"] % ce not in (0, ce - 1))]
                    choices = [p for p in stepped if p in choices and p.phase() == "step"][-1:]
                    if not choices:
                        pause(0.005)
                        continue
                if choices:
                    self.kill(self.rng.choice(choices), aimed)
                    return True
                pause(0.05)
            return False
        if aimed not in ("regroup", "join"):  # these follow the previous kill: aim at once; the others pace first
            deadline = time.monotonic() + 0.5 * self.period_s
            while time.monotonic() < deadline and self.running():
                self.release_all_held(self.tick())
                pause(0.02)
        deadline = time.monotonic() + self.aim_s
        joins = sum(k["aimed"] == "join" for k in self.kills)
        # a process inside that phase already (a regroup or join under way) will do
        if aimed not in self.holds and not arrived:
            inside = [p for p in self.events.procs.values() if p.killed_at is None and alive(p.pid)
                      and p.phase() == aimed and (not p.worker or p in self.victims())]
            if aimed == "join":  # alternately the joiner itself and a member admitting it
                inside = [p for p in inside if p.worker == (joins % 2 == 1)]
            if inside:
                self.kill(self.rng.choice(inside), aimed)
                return True
        while self.running():
            if time.monotonic() > deadline:
                self.log(f"no {aimed} marker within {self.aim_s:.0f}s: a random kill instead")
                return self.kill_one("step")
            new = self.tick()
            target = None
            for e in new:
                p = self.events.procs.get(e["pid"])
                if p is None or p.killed_at is not None:
                    continue
                if aimed == "join":  # alternately the joiner (as it is placed or enters) and a member admitting it
                    hit = e["ev"] in ("placed", "join+") if joins % 2 == 0 else e["ev"] == "grow+"
                elif aimed in self.holds:
                    hit = e["ev"] == "held" and e.get("phase") == aimed and not (
                        aimed == "commit" and self.save_every and (e.get("step") or 0) % self.save_every == 0)
                else:
                    hit = e["ev"] == f"{aimed}+"
                if hit and (not p.worker or p in self.victims()):
                    target = p
                    break
            # a survivor aimed at once it arrived must go on into the quorum: released like the others
            self.release_all_held(new, keep=target.pid if target and aimed in self.holds and not arrived else None)
            if target is not None and arrived:
                target = self.after_arrival(target)
            if target is not None and aimed == "ckpt" and aimed not in self.holds:
                target = self.inside_write(target)  # past the save's entry: its files are being written
            if target is not None:
                self.kill(target, "regroup-arrived" if arrived else aimed)
                return True
            pause(0.005)
        return False

    def after_arrival(self, p: Proc) -> Proc | None:
        """Wait until survivor ``p`` is a member of the next generation (the quorum closed with it: its id is in
        ``elastic/gen/<g>/members`` in the launcher's store); None if it left the regroup first. Its death then
        lands inside the group's formation: the others count on it."""
        gen = max((e.get("gen") or 0 for e in self.events.all if e["pid"] == p.pid and e["ev"] == "step"), default=0)
        closed = f"elastic/gen/{gen + 1}/members"
        return self._while_in(p, "regroup",
                              lambda: self.store.check([closed]) and p.id in json.loads(self.store.get(closed)))

    def writing(self, since: float) -> bool:
        """A checkpoint write is under way: files written since ``since`` in its temporary directory
        (``<path>.tmp-*``, phalanx's own; one left behind by a save a kill interrupted is older)."""
        for path in glob.glob(os.path.join(self.out, "ckpt.tmp-*", "*")):
            try:
                if os.path.getmtime(path) >= since - 0.05:
                    return True
            except OSError:
                pass
        return False

    def last_save_began(self) -> float:
        """When the newest ``ckpt+`` was seen (inf if none: nothing is being written)."""
        return max((e["t"] for e in self.events.all[-2000:] if e["ev"] == "ckpt+"), default=float("inf"))

    def inside_write(self, p: Proc) -> Proc | None:
        """Wait until the save ``p`` entered has files in its temporary directory; None if ``p`` finished first."""
        began = (p.last or {}).get("t", time.time())
        return self._while_in(p, "ckpt", lambda: self.writing(began))

    def _while_in(self, p: Proc, phase: str, reached: Callable[[], bool]) -> Proc | None:
        """``p`` once ``reached()`` while it is still in ``phase`` (the others go on meanwhile); None if it left
        the phase or died, or the run ended, first."""
        while self.running() and alive(p.pid):
            if reached():
                return p
            self.release_all_held(self.events.poll())  # the others go on meanwhile
            if p.phase() != phase:
                return None
            pause(0.001)
        return None

    # -- a whole run ------------------------------------------------------------------------------
    def run(self) -> dict:
        self.start()
        outcome = "finished"
        try:
            if self.wait_step(self.started, self.stall_s + self.first_step_s) is None:
                raise Wedged("no first step")
            self.log(f"first step {time.time() - self.started:.1f}s after the start; {len(self.plan)} kills to go")
            plan = list(self.plan)
            for i in range(len(plan)):
                if plan[i].startswith("regroup") and not (self.kills and self.kills[-1]["member"]):
                    # a regroup follows the loss of a member: after a joiner's (or before any kill) none comes, and
                    # the aim would wait out aim_s for nothing, so a kill that takes a member goes first
                    later = [j for j in range(i + 1, len(plan)) if plan[j] in ("step", "commit", "ckpt")]
                    later = later or [j for j in range(i + 1, len(plan)) if plan[j] == "random"]
                    if later:
                        plan[i], plan[later[0]] = plan[later[0]], plan[i]
                if not self.kill_one(plan[i]):
                    break
            # the last kill's recovery: a step after it, then stop after the current epoch
            if self.kills and self.running():
                if self.wait_step(self.kills[-1]["t"], self.stall_s) is None and self.running():
                    raise Wedged(f"no step after kill {len(self.kills)}")
            open(os.path.join(self.out, "stop"), "w").close()
            self.log("kills done; asked the job to stop after this epoch")
            deadline = time.monotonic() + self.finish_s
            while self.running():
                self.release_all_held(self.tick())
                if time.monotonic() > deadline:
                    raise Wedged(f"not finished {self.finish_s:.0f}s after the stop")
                pause(0.05)
        except Wedged as why:
            outcome = f"wedged: {why}"
            self.wedged_at = time.time()
            self.log(f"{outcome}; asking every process for its stacks")
            self.stacks = self.dump_stacks()
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        finally:
            self.sampler.stop.set()
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.launcher_log.close()
        self.events.poll()
        self.log(f"job ended with status {self.proc.returncode} ({outcome}); checking")
        return self.report(outcome)

    def dump_stacks(self) -> dict[str, str]:
        """SIGUSR2 to the launcher and every live worker (faulthandler), then read what they wrote."""
        pids = [p.pid for p in self.events.procs.values() if p.killed_at is None and alive(p.pid)]
        for pid in [self.proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        stacks: dict[str, str] = {}
        while time.monotonic() < deadline:
            stacks = {}
            for pid in pids:
                for path in glob.glob(os.path.join(self.out, "stacks", f"*-{pid}.txt")):
                    stacks[os.path.basename(path)] = open(path).read()
            if all(stacks.values()) and len(stacks) == len(pids):
                break
            pause(0.1)
        return stacks

    # -- the verdict ------------------------------------------------------------------------------
    def landed(self) -> None:
        """Where each kill landed: the innermost phase the victim had open in its own (complete) event file."""
        for k in self.kills:
            path = os.path.join(self.out, "events", f"{k['id']}-{k['pid']}.jsonl")
            p = Proc(k["id"], k["pid"])
            for line in open(path).read().splitlines():
                e = json.loads(line)
                if e["ev"] in OPENS:
                    p.open.append(OPENS[e["ev"]])
                elif e["ev"] in CLOSES and CLOSES[e["ev"]] in p.open:
                    p.open.remove(CLOSES[e["ev"]])
                elif e["ev"] == "step":
                    p.open = []
            k["landed"] = p.phase()
            # the first step of the group that formed without the victim (a member's loss makes a generation;
            # a step already under way when it died does not count), or any step after a joiner's loss
            later = [e["t"] for e in self.events.all if e["ev"] == "step" and e["t"] > k["t"]
                     and (not k["member"] or (e.get("gen") or 0) > k["generation"])]
            k["to_next_step_s"] = round(later[0] - k["t"], 2) if later else None

    def report(self, outcome: str) -> dict:
        self.landed()
        code = self.proc.returncode
        final_path = os.path.join(self.out, "final.pt")
        result: dict[str, Any] = {"outcome": outcome, "exit": code, "kills": len(self.kills),
                                  "planned": len(self.plan), "seconds": round(time.time() - self.started, 1)}
        result["landed"] = {ph: sum(k["landed"] == ph for k in self.kills) for ph in ("step", *PHASES)}
        result["aimed"] = {ph: sum(k["aimed"] == ph for k in self.kills)
                           for ph in ("random", "step", *PHASES, "regroup-arrived")}
        gaps = [k["to_next_step_s"] for k in self.kills if k["to_next_step_s"] is not None]
        steps = sorted(self.events.steps)
        result["longest_no_step_after_kill_s"] = max(gaps, default=None)
        # how long the launcher (or Ray) took to start a new process after each kill: the first "start" event of a
        # process not seen before, after the kill (a spare parked earlier is no new start)
        starts = sorted((e["t"], e["pid"]) for e in self.events.all if e["ev"] == "start")
        replaced = []
        for k in self.kills:
            later = [t for t, _pid in starts if t > k["t"]]
            if later:
                replaced.append(round(later[0] - k["t"], 2))
        result["replacement_start_s"] = {"median": sorted(replaced)[len(replaced) // 2] if replaced else None,
                                         "max": max(replaced, default=None), "n": len(replaced)}
        # to the wedge or the job's end too: a job that never steps again has its longest stretch at the end
        ended = getattr(self, "wedged_at", None) or max((e["t"] for e in self.events.all), default=self.started)
        result["longest_no_step_s"] = round(max((b - a for a, b in zip(steps, [*steps[1:], ended])), default=0.0), 2)
        result["steps_seen"] = len(steps)
        roles = {p.pid: f"worker {p.id}" for p in self.events.procs.values()}
        result["resources"] = growth(training_samples(self.sampler.samples, self.events.all, roles),
                                     self.proc.pid, roles, names=self.sampler.names)
        result["exactly_once"] = result["oracle_max_abs"] = None
        if os.path.exists(final_path):
            import torch

            from workers import chaos_job
            final = torch.load(final_path, weights_only=False)
            n = len(chaos_job.dataset(final["size"]))
            once = exactly_once(final["record"], n)
            result["exactly_once"], result["epochs"] = once["ok"], once["epochs"]
            result["exactly_once_bad"] = once["bad"]
            result["history"] = len(final["history"])
            if final["strategy"] == "allreduce":
                # written first: the one-process replay takes hours under load, and a harness stopped in it
                # must not lose the figures already known (three runs of this round lost theirs)
                with open(os.path.join(self.out, "chaos-before-oracle.json"), "w") as f:
                    json.dump(result, f, indent=1, default=str)
                if self.replay:
                    result["oracle_max_abs"] = replay_oracle(final_path)
                else:
                    result["oracle_deferred"] = True
        result["errors"] = [{"id": e["id"], "pid": e["pid"], "t": round(e["t"] - self.started, 2), "type": e["type"],
                             "message": e["message"].splitlines()[0] if e["message"] else "",
                             "where": e["traceback"].strip().splitlines()[-3:-1],
                             "after_the_harness_stopped_the_job": e["t"] > getattr(self, "wedged_at", e["t"] + 1)}
                            for e in self.events.all if e["ev"] == "error"]
        result["kill_log"] = self.kills
        result["launcher_tail"] = open(os.path.join(self.out, "launcher.log"), errors="replace").read()[-4000:]
        if getattr(self, "stacks", None):
            result["stacks"] = self.stacks
        return result


def table(r: dict) -> str:
    """A short text table of one report."""
    res = r["resources"]
    launcher = res.get("launcher") or {}
    rows = [("outcome", r["outcome"]), ("exit", r["exit"]), ("kills", f"{r['kills']} of {r['planned']}"),
            ("landed in", ", ".join(f"{k} {v}" for k, v in r["landed"].items())),
            ("exactly once", f"{r['exactly_once']} ({r.get('epochs', 0)} epochs)"),
            ("oracle max |diff|", "deferred (--replay)" if r.get("oracle_deferred") else r["oracle_max_abs"]),
            ("longest no step after a kill", f"{r['longest_no_step_after_kill_s']} s"),
            ("longest no step", f"{r['longest_no_step_s']} s"),
            ("replacement started after a kill", f"median {r['replacement_start_s']['median']} s, max "
                                                 f"{r['replacement_start_s']['max']} s"),
            ("launcher RSS last/first quarter", f"{launcher.get('rss_ratio', float('nan')):.3f}"),
            ("launcher fds delta", launcher.get("fds_delta")),
            ("worst process RSS ratio", res["worst_rss_ratio"]), ("worst process fds delta", res["worst_fds_delta"]),
            (f"processes sampled >= {res['long_lived']['min_samples']} times",
             f"{res['long_lived']['count']}: worst RSS ratio {res['long_lived']['worst_rss_ratio']}, worst fds delta "
             f"{res['long_lived']['worst_fds_delta']} ({res['long_lived'].get('worst_fds_process') or '-'})"),
            ("Ray's own daemons (not judged)",
             "-" if not res.get("ray_daemons", {}).get("count") else
             f"{res['ray_daemons']['count']}: worst fds delta {res['ray_daemons']['worst_fds_delta']} (to "
             f"{res['ray_daemons']['worst_fds_last']}; {res['ray_daemons']['worst_fds_process'][:80]}), worst RSS "
             f"ratio {res['ray_daemons']['worst_rss_ratio']:.3f}"),
            ("seconds", r["seconds"])]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
