"""Errors a user can act on.

Every usage error says what was given, what was expected and what to do, so the
CLI can print it as one line instead of a traceback.
"""
from __future__ import annotations


class PhalanxError(Exception):
    """Base class for every error phalanx raises on purpose."""


class ConfigError(PhalanxError, ValueError):
    """A bad argument, environment variable or setting given by the user."""


class WorkerLostError(PhalanxError, RuntimeError):
    """A peer stopped answering in the middle of a collective."""


class CheckpointError(PhalanxError, RuntimeError):
    """A checkpoint is missing, truncated, corrupted or from another model."""


def usage(given: str, expected: str, fix: str) -> str:
    """Format the three parts every usage error carries."""
    return f"{given}; expected {expected}. {fix}"
