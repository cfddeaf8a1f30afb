"""How ``phalanx run`` tells a failed worker in one line: which failure caused the others, and how it ended.

torch's agent reports every worker that stopped; the cause is the earliest failure that
is not a consequence (a peer's WorkerLostError, or the agent's own SIGTERM), and its line
says the rank, then the Python exception our worker wrote into torch's error file, or
the signal or status it ended with.

``phalanx run --elastic`` reads the same error file itself (:meth:`Recorded.read`): a worker
that wrote a record that is not a lost peer's consequence failed on its own
(:func:`own_failure`), and the job ends with the same one line, since no regroup or
replacement can get past an error in the script.

Example:
    >>> status(-9)
    ('was killed by SIGKILL', 137)
    >>> status(3)
    ('exited with status 3', 3)
"""
from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field


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


def failure_line(rank: int, failure, others: bool, who: str | None = None) -> str:
    """The one line ``phalanx run`` prints for a failed worker (``failure``: torch's ProcessFailure or a
    :class:`Recorded`); ``who`` names the worker (default ``worker rank <rank>``; an elastic job's ids outlive ranks).

    Example:
        >>> failure_line(1, Recorded(3), others=True)
        'phalanx: worker rank 1 exited with status 3 (first failure); stopped the others'
    """
    info, how = _phalanx_info(failure), status(failure.exitcode)[0]
    who = who or f"worker rank {rank}"
    tail = " (first failure); stopped the others" if others else ""
    if info.get("usage"):
        return f"phalanx: error: {info.get('text') or failure.message} ({who}; `phalanx run --debug` " \
               "or PHALANX_DEBUG=1 shows the traceback)"
    if info.get("type") == "KeyboardInterrupt":
        return f"phalanx: {who} was interrupted (KeyboardInterrupt){tail}"
    if info:
        return f"phalanx: {who} raised {failure.message}{tail}"
    return f"phalanx: {who} {how}{tail}"


def own_failure(failure) -> bool:
    """Did the worker fail on its own: it recorded an exception that is not a lost peer's consequence?

    Told by the record's typed fields (written by the worker from the exception's type), never by its text.
    A worker that recorded nothing (killed, or exited before ``px.init()``) is not known to have failed on its own.

    Example:
        >>> own_failure(Recorded(1, {"phalanx": {"type": "TypeError", "consequence": False}}))
        True
        >>> own_failure(Recorded(1, {"phalanx": {"type": "WorkerLostError", "consequence": True}}))
        False
        >>> own_failure(Recorded(-9))  # killed: it wrote nothing
        False
    """
    info = _phalanx_info(failure)
    return bool(info) and not info.get("consequence")


@dataclass(frozen=True)
class Recorded:
    """A worker's end as a launcher that is not torch's agent saw it: its exit status and its error file.

    It has the fields of torch's ``ProcessFailure`` that :func:`failure_line` and :func:`root_cause` read,
    so both launchers say a worker's failure in the same words.

    Example:
        >>> Recorded(1, {"message": "TypeError: bad", "phalanx": {"type": "TypeError"}}).message
        'TypeError: bad'
    """

    exitcode: int
    error_file_data: dict = field(default_factory=dict)
    timestamp: float = field(default_factory=time.time)

    @property
    def message(self) -> str:
        """The worker's own line (``Type: first line of its text``), or how it ended when it wrote none."""
        text = self.error_file_data.get("message")
        return text if isinstance(text, str) and text else status(self.exitcode)[0]

    @classmethod
    def read(cls, path: str | None, exitcode: int) -> "Recorded":
        """What the worker that ended with ``exitcode`` wrote at ``path`` (torch elastic's error-file format);
        an empty record when it wrote nothing or something unreadable (it was killed mid-write).

        Example:
            >>> Recorded.read("/nonexistent/error.json", -9).message
            'was killed by SIGKILL'
        """
        data: object = {}
        if path is not None:
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                data = {}
        data = data if isinstance(data, dict) else {}
        info = data.get("phalanx") if isinstance(data.get("phalanx"), dict) else {}
        when = info.get("time", data.get("timestamp"))
        return cls(exitcode, data, float(when) if isinstance(when, (int, float)) else time.time())
