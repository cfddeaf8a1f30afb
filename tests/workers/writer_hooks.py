"""A DCP storage writer that the checkpoint tests put in place of phalanx's (``saver._writer``) to cut a write
half-way. An asynchronous save pickles its writer to the worker's writer process, where ``write_data`` runs: so it
lives in a module that process imports (not in a test's ``__main__``) and takes what it needs as attributes.
"""
from __future__ import annotations

import json
import os
import signal
import threading

from torch.distributed.checkpoint import FileSystemWriter


class CutWriter(FileSystemWriter):
    """Writes a part of its data (``partial-<rank>``), then, with ``kill_worker``, SIGKILLs its worker (the process
    that started this writer) and itself; with ``held``, says so in that file (its pid and its worker's) and holds
    until killed. With neither, it writes as DCP's own."""

    def __init__(self, path: str, *, held: str | None = None, kill_worker: bool = False, rank: int = 0) -> None:
        super().__init__(path, sync_files=True)
        self.held, self.kill_worker, self.rank = held, kill_worker, rank

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if self.held or self.kill_worker:
            with open(os.path.join(self.path, f"partial-{self.rank}"), "wb") as f:
                f.write(b"x" * 1024)  # a part of the data reaches the disk...
        if self.kill_worker:
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.held:
            with open(f"{self.held}.tmp", "w") as f:
                json.dump({"writer": os.getpid(), "worker": os.getppid()}, f)
            os.replace(f"{self.held}.tmp", self.held)
            threading.Event().wait()  # ...then the write stops until the process is killed
        return super().write_data(plan, planner)
