"""The elastic flags of ``phalanx run`` and their checks: ``--elastic``, ``--min-workers``,
``--max-workers``, ``--replace``, ``--spares``, ``--heartbeat-timeout``.

Every flag is read as text and checked once in :class:`ElasticConfig`, so that each
mistake is one clear line.

Example:
    >>> cfg = ElasticConfig.from_flags(nproc=3, min_workers="2", max_workers=None, heartbeat="10")
    >>> cfg.min_workers, cfg.max_workers, cfg.heartbeat_s
    (2, 3, 10.0)
    >>> ElasticConfig.from_flags(nproc=3, min_workers=None, max_workers=None, heartbeat=None, spares="1").max_workers
    4
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from ..errors import ConfigError, usage

DEFAULT_HEARTBEAT_S = 10.0
_FLAGS = {"min_workers": "--min-workers", "max_workers": "--max-workers", "heartbeat": "--heartbeat-timeout",
          "spares": "--spares"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The elastic flags of ``phalanx run`` (read as text; checked in :meth:`ElasticConfig.from_flags`)."""
    g = parser.add_argument_group("elastic (workers leave and join while the others keep training, no restart; "
                                  "see docs/elastic.md)")
    g.add_argument("--elastic", action="store_true",
                   help="keep training when a worker is lost: survivors regroup and roll back to the last commit")
    g.add_argument("--min-workers", default=None, metavar="M", help="stop when fewer than M workers are left "
                   "(default: more than half of -n; spares do not count)")
    g.add_argument("--max-workers", default=None, metavar="M",
                   help="largest group joiners may grow (default -n plus --spares)")
    g.add_argument("--replace", action="store_true",
                   help="start a new worker for each one lost (up to -n), once the spares are used up; it joins "
                        "at the next commit")
    g.add_argument("--spares", default=None, metavar="K",
                   help="start K standby workers besides the -n: each has imported the script and waits; one "
                        "takes a lost worker's place at the regroup (default 0)")
    g.add_argument("--start-method", default=None, choices=("spawn", "forkserver"), dest="start_method",
                   help="how workers, spares and replacements start: a fresh interpreter each (spawn, default; "
                        "PHALANX_START_METHOD sets it too), or a fork of a server that imported torch once "
                        "(forkserver: seconds less per worker)")
    g.add_argument("--heartbeat-timeout", default=None, metavar="S", dest="heartbeat",
                   help=f"kill a worker whose heartbeat stopped for S seconds (default {DEFAULT_HEARTBEAT_S:g})")


@dataclass(frozen=True)
class ElasticConfig:
    """What ``--elastic`` asked for, checked once."""

    min_workers: int
    max_workers: int
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    replace: bool = False
    spares: int = 0  # standby workers started besides -n; they never count toward --min-workers
    start_method: str = "spawn"  # phalanx.launch.workers: a fresh interpreter per worker, or a fork of a server

    @classmethod
    def from_args(cls, a: argparse.Namespace, nproc: int, nodes: int) -> "ElasticConfig | None":
        """The config for ``phalanx run``'s parsed flags; None without ``--elastic``."""
        if not getattr(a, "elastic", False):
            given = ["--replace"] if getattr(a, "replace", False) else []
            given += [name for flag, name in _FLAGS.items() if getattr(a, flag, None) is not None]
            given += ["--start-method"] if getattr(a, "start_method", None) is not None else []
            if given:
                raise ConfigError(usage(f"{given[0]} without --elastic", "--elastic with it",
                                        f"Add --elastic, or drop {given[0]}."))
            return None
        if nodes > 1:
            raise ConfigError(usage("--elastic with --nnodes > 1", "--elastic on one launcher host (workers of "
                                    "other hosts join with `phalanx join`)", "Drop --nnodes."))
        cfg = cls.from_flags(nproc=nproc, min_workers=a.min_workers, max_workers=a.max_workers,
                             heartbeat=a.heartbeat, spares=getattr(a, "spares", None))
        method = getattr(a, "start_method", None) or os.environ.get("PHALANX_START_METHOD") or "spawn"
        if method not in ("spawn", "forkserver"):
            raise ConfigError(usage(f"PHALANX_START_METHOD={method}", "spawn or forkserver",
                                    "Set it to one of those, or unset it."))
        return cls(cfg.min_workers, cfg.max_workers, cfg.heartbeat_s, replace=bool(a.replace), spares=cfg.spares,
                   start_method=method)

    @classmethod
    def from_flags(cls, *, nproc: int, min_workers: str | None, max_workers: str | None,
                   heartbeat: str | None, spares: str | None = None) -> "ElasticConfig":
        """Check the flags' text against ``-n``; raises :class:`ConfigError` with one line."""
        if nproc < 2:
            raise ConfigError(usage(f"--elastic with -n {nproc}", "-n 2 or more (one worker has no one to "
                                    "survive)", "Pass e.g. -n 3 --elastic --min-workers 2, or drop --elastic."))
        low = _count("--min-workers", min_workers, nproc // 2 + 1)
        if low > nproc:
            raise ConfigError(usage(f"--min-workers {low} with -n {nproc}", f"--min-workers <= -n ({nproc})",
                                    f"Pass e.g. --min-workers {max(1, nproc - 1)}."))
        spare = _count("--spares", spares, 0, minimum=0)
        high = _count("--max-workers", max_workers, nproc + spare)
        if high < nproc:
            raise ConfigError(usage(f"--max-workers {high} with -n {nproc}", f"--max-workers >= -n ({nproc})",
                                    f"Pass e.g. --max-workers {nproc}, or leave it out."))
        if high < nproc + spare:
            raise ConfigError(usage(f"-n {nproc} --spares {spare} with --max-workers {high}",
                                    f"-n plus --spares <= --max-workers ({nproc} + {spare} > {high})",
                                    f"Pass --max-workers {nproc + spare} or more, or fewer spares."))
        hb = DEFAULT_HEARTBEAT_S
        if heartbeat is not None:
            try:
                hb = float(heartbeat)
            except ValueError:
                hb = -1.0
            if not hb > 0:
                raise ConfigError(usage(f"--heartbeat-timeout {heartbeat}", "a positive number of seconds",
                                        "Pass e.g. --heartbeat-timeout 10."))
        return cls(min_workers=low, max_workers=high, heartbeat_s=hb, spares=spare)


def _count(flag: str, raw: str | None, default: int, minimum: int = 1) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(usage(f"{flag} {raw}", f"an integer >= {minimum}", f"Pass e.g. {flag} {max(minimum, 1)}."))
    return value
