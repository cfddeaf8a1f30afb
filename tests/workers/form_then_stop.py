"""A rank that dies inside the forming of a group, after it published its gloo address and before it connects.

``python tests/workers/form_then_stop.py PORT``: rank 1 of 2 forms a group (``phalanx.group.forming.form``) on
the TCPStore at 127.0.0.1:PORT and stops itself (SIGSTOP) right after gloo wrote its address there: a peer
that arrived and went silent (killed or hung) at the worst moment for the others
(tests/group/test_group_forming.py kills it afterwards).
"""
from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from phalanx.group import forming


class StopAfterAddress(dist.Store):
    """The test's store, but the process stops once gloo's address key for this rank is written."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner

    def set(self, key: str, value) -> None:  # noqa: ANN001 - what torch passes
        self.inner.set(key, value)
        if key.startswith("gloo/") and key.endswith("/1"):  # gloo's key for rank 1's address ("gloo/0/1")
            os.kill(os.getpid(), signal.SIGSTOP)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:  # noqa: ANN001 - what torch passes
        return self.inner.compare_set(key, expected, desired)


if __name__ == "__main__":
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=120),
                          wait_for_workers=False)
    forming.form(StopAfterAddress(store), 1, 2, timeout_s=120.0, lost=lambda: [])
