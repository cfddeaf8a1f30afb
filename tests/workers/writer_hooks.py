"""DCP storage writers that the checkpoint tests put in place of phalanx's (``saver._writer``), to stop or kill a
write half-way. An asynchronous save pickles its writer to the worker's writer process, where ``write_data`` runs:
so they live in a module that process imports (not in a test's ``__main__``), and take what they need as
attributes, not from closures.
"""
from __future__ import annotations

import json
import os
import signal
import threading

from torch.distributed.checkpoint import FileSystemWriter


def _part(path: str, name: str) -> None:
    with open(os.path.join(path, name), "wb") as f:
        f.write(b"x" * 1024)  # a part of the data reaches the disk...


class HeldWriter(FileSystemWriter):
    """Writes a part of its data, says so in the file ``held`` (its pid and its worker's), then holds until killed."""

    def __init__(self, path: str, held: str, rank: int = 0) -> None:
        super().__init__(path, sync_files=True)
        self.held, self.rank = held, rank

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        _part(self.path, f"partial-{self.rank}")
        with open(f"{self.held}.tmp", "w") as f:
            json.dump({"writer": os.getpid(), "worker": os.getppid()}, f)
        os.replace(f"{self.held}.tmp", self.held)
        threading.Event().wait()  # ...then the write stops until the process is killed
        return super().write_data(plan, planner)


class KillsItsWorker(FileSystemWriter):
    """With ``kill``: writes a part of its data, then SIGKILLs its worker (the process that started this writer)."""

    def __init__(self, path: str, kill: bool) -> None:
        super().__init__(path, sync_files=True)
        self.kill = kill

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if self.kill:
            _part(self.path, "partial-0")
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write_data(plan, planner)
