"""The one place phalanx touches a private torch attribute: the autograd engine's callback queue.

PyTorch has no public way to run code once at the end of a backward pass, after
every ``.grad`` has been accumulated and before ``backward()`` returns. DDP,
FSDP and torch's own comm hooks all use ``Variable._execution_engine.queue_callback``
for exactly this; so do we, here only, with its own test (tests/step/test_backward.py).
"""
from __future__ import annotations

from typing import Callable

from torch.autograd import Variable


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass ends (call only from inside an autograd hook)."""
    Variable._execution_engine.queue_callback(fn)
