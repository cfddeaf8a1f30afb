"""How ``phalanx run`` tells a failed worker in one line: which failure caused the others, and how it ended.

torch's agent reports every worker that stopped; the cause is the earliest failure that
is not a consequence (a peer's WorkerLostError, or the agent's own SIGTERM), and its line
says the rank, then the Python exception our worker wrote into torch's error file, or
the signal or status it ended with.

Example:
    >>> status(-9)
    ('was killed by SIGKILL', 137)
    >>> status(3)
    ('exited with status 3', 3)
"""
from __future__ import annotations

import signal


def status(exitcode: int) -> tuple[str, int]:
    """How a worker ended, in words, and the exit status the launcher passes on (shell convention)."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}", 128 - exitcode
    return f"exited with status {exitcode}", exitcode


def _phalanx_info(failure) -> dict:  # failure: torch's ProcessFailure
    """What our worker wrote into torch elastic's error file (empty if it wrote nothing)."""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    info = data.get("phalanx")
    return info if isinstance(info, dict) else {}


def root_cause(failures: dict) -> tuple[int, object]:
    """The failure that caused the others: not a WorkerLostError or a stop by the agent, and the earliest."""
    def consequence(f) -> bool:
        return bool(_phalanx_info(f).get("consequence")) or f.exitcode == -signal.SIGTERM
    causes = {r: f for r, f in failures.items() if not consequence(f)} or failures
    return min(causes.items(), key=lambda kv: (float(_phalanx_info(kv[1]).get("time", kv[1].timestamp)), kv[0]))


def failure_line(rank: int, failure, others: bool) -> str:
    """The one line ``phalanx run`` prints for a failed worker (``failure``: torch's ProcessFailure)."""
    info, how = _phalanx_info(failure), status(failure.exitcode)[0]
    tail = " (first failure); stopped the others" if others else ""
    if info.get("usage"):
        return f"phalanx: error: {info.get('text') or failure.message} (worker rank {rank}; `phalanx run --debug` " \
               "or PHALANX_DEBUG=1 shows the traceback)"
    if info.get("type") == "KeyboardInterrupt":
        return f"phalanx: worker rank {rank} was interrupted (KeyboardInterrupt){tail}"
    if info:
        return f"phalanx: worker rank {rank} raised {failure.message}{tail}"
    return f"phalanx: worker rank {rank} {how}{tail}"
