"""Errors a user can act on.

Every usage error says what was given, what was expected and what to do, so the
CLI can print it as one line instead of a traceback.
"""
from __future__ import annotations

import argparse
from typing import NoReturn


class PhalanxError(Exception):
    """Base class for every error phalanx raises on purpose."""


class ConfigError(PhalanxError, ValueError):
    """A bad argument, environment variable or setting given by the user."""


class WorkerLostError(PhalanxError, RuntimeError):
    """A peer stopped answering in the middle of a collective or a store wait.

    ``lost_ranks`` names the ranks known to be gone (empty when nobody can tell, e.g.
    the store itself is gone). ``phalanx.elastic`` recovers from this type, and only
    from it: a failure is recognised by its type, never by its message.

    Example:
        >>> err = WorkerLostError("rank 0 lost contact with rank 1", lost_ranks=[1])
        >>> err.lost_ranks, isinstance(err, RuntimeError)
        ([1], True)
    """

    def __init__(self, message: str = "", lost_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.lost_ranks: list[int] = sorted(lost_ranks or [])


class StoreLostError(WorkerLostError):
    """The group's store no longer answers: its host (rank 0, or the launcher) is gone."""


class CheckpointError(PhalanxError, RuntimeError):
    """A checkpoint is missing, truncated, corrupted or from another model."""


class JobLostError(PhalanxError):
    """The job cannot go on: every worker holding its training state, or the job's coordinator, was lost.

    ``checkpoint`` names the newest checkpoint the job wrote (``px.save_checkpoint``), to resume from, or None.

    Example:
        >>> err = JobLostError("the job ended", checkpoint="/ckpt/step-8")
        >>> err.checkpoint, str(err)
        ('/ckpt/step-8', 'the job ended')
    """

    def __init__(self, message: str = "", checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint

    def __reduce__(self):  # type: ignore[no-untyped-def]  # it crosses processes (Ray's controller -> the driver)
        return type(self), (str(self), self.checkpoint)


class StacksRefused(PhalanxError):
    """A request for a job's stacks (``phalanx stacks``) made without that job's secret: its workers answer none."""


def usage(given: str, expected: str, fix: str) -> str:
    """Format the three parts every usage error carries."""
    return f"{given}; expected {expected}. {fix}"


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises one :class:`ConfigError` line instead of printing its usage block and exiting.

    Example:
        >>> p = OneLineParser(prog="demo", usage_hint="`demo [opts]`")
        >>> p.parse_args(["--bogus"])
        Traceback (most recent call last):
        ...
        phalanx.errors.ConfigError: `demo`: unrecognized arguments: --bogus; expected `demo [opts]`. See `demo --help`.
    """

    def __init__(self, *args, usage_hint: str = "", **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.usage_hint = usage_hint or f"`{self.prog} [options]`"

    def error(self, message: str) -> NoReturn:
        raise ConfigError(usage(f"`{self.prog}`: {message}", self.usage_hint, f"See `{self.prog} --help`."))
