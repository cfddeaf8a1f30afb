"""A running ``phalanx run --status`` job, as the status tests use it: start, ask, stop.

Example:
    >>> # with StatusJob(tmp_path, ["-n", "2"], ["--slow", "1"]) as job: job.status()["members"]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any, Sequence

from phalanx.monitor import token
from support.paths import TESTS
from support.procs import free_port
from support.wait import exited, until

WORKER = os.path.join(TESTS, "workers", "status_job.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]
SECRET = "5e" * 32  # the job's secret: the test holds it, so it derives the token as the page's holder would
BOUND_S = 120  # start-up of a few processes on a loaded 2-core machine, or a regroup (heartbeat-bounded)


class StatusJob:
    """``phalanx run [flags] --status PORT tests/workers/status_job.py --out DIR [args]``, in the background."""

    def __init__(self, out, flags: Sequence[str], args: Sequence[str] = (), *, forked: bool = False) -> None:
        """``forked``: the launcher forked from this test process's preloaded server, its workers from that server
        (:func:`support.forked_launch.start_cli`) instead of a fresh interpreter: for a test that neither kills the
        launcher nor reads what a fresh interpreter prints; its stdout is kept in ``OUT/launcher.out`` then."""
        self.out, self.port, self.store_port = out, free_port(), free_port()
        self.env = {**os.environ, "PHALANX_SECRET": SECRET}
        self.token = token(SECRET)
        self.err_path = out / "launcher.err"
        master = ["--master-port", str(self.store_port)] if "--elastic" in flags else []
        argv = ["run", *flags, *master, "--status", str(self.port), WORKER, "--out", str(out), *args]
        self._err = None
        if forked:
            from support.forked_launch import start_cli
            self.proc: Any = start_cli(argv, str(out), env={"PHALANX_SECRET": SECRET})  # writes OUT/launcher.err
        else:
            self._err = open(self.err_path, "w")
            self.proc = subprocess.Popen([*CLI, *argv], env=self.env, stdout=subprocess.DEVNULL, stderr=self._err)
        self.others: list[Any] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.err_path.read_text()[-4000:]

    def get(self, path: str, token_: str | None = "") -> tuple[int, bytes]:
        """(status, body) of GET ``path``; ``token_``: the bearer token ("" the job's, None none)."""
        headers = {} if token_ is None else {"Authorization": f"Bearer {token_ or self.token}"}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers), timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status.json")
        assert code == 200, (code, body)
        return json.loads(body)

    def wait_for(self, cond, what: str, timeout: float = BOUND_S) -> dict[str, Any]:
        """The status once ``cond(status)`` holds (polled; the launcher ending first fails at once)."""
        seen: dict[str, Any] = {}

        def check() -> bool:
            try:
                seen["s"] = self.status()
            except OSError:
                return False  # not serving yet
            return bool(cond(seen["s"]))

        until(check, timeout=timeout, what=what, procs=[self.proc], detail=lambda: f"{seen.get('s')}\n{self.log()}")
        return seen["s"]

    def training(self, *ids: str) -> None:
        until(lambda: all(os.path.exists(self.out / f"training{w}") for w in ids), timeout=BOUND_S,
              what=f"workers {ids} training", procs=[self.proc], detail=self.log)

    def stop(self) -> int:
        """Ask the workers to stop (they agree on a step) and return the launcher's exit status."""
        (self.out / "stop").touch()
        return exited(self.proc, timeout=BOUND_S, what="the job after stop")

    def results(self) -> dict[str, dict]:
        return {p.name[len("worker"):-len(".json")]: json.loads(p.read_text()) for p in self.out.glob("worker*.json")}

    def __enter__(self) -> "StatusJob":
        return self

    def __exit__(self, *_: Any) -> None:
        for p in [self.proc, *self.others]:
            if p.poll() is None:
                p.kill()
                p.wait()
        if self._err is not None:
            self._err.close()
