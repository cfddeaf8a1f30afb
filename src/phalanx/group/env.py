"""What the launcher told this worker: the torchrun/phalanx environment, parsed and validated once.

Example:
    >>> from phalanx.group.env import WorkerEnv
    >>> WorkerEnv.from_environ({}).world_size
    1
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from .. import check
from ..errors import ConfigError, usage

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WorkerEnv:
    """Where this worker stands, read once from the environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    agent_store: bool = False  # torchrun's agent hosts the TCPStore; workers connect as clients
    attempt: int = 0  # the agent's restart count: its store outlives a failed attempt, so keys are per attempt
    timeout_s: float = DEFAULT_TIMEOUT_S
    threads: int | None = None
    launched_by_phalanx: bool = False  # `phalanx run` prints a failing worker's error itself, in one line
    debug: bool = False  # PHALANX_DEBUG=1: full tracebacks even for usage errors
    error_file: str | None = None  # torchrun/phalanx run read a failed worker's error from here
    elastic_id: str | None = None  # `phalanx run --elastic` / `phalanx join`: this worker's stable id; ranks change
    elastic_join: bool = False  # started by `phalanx join` or `--replace`: enters the running group at a commit
    elastic_secret: str | None = field(default=None, repr=False)  # PHALANX_SECRET: the elastic job's secret
    ps_servers: int = 0  # parameter servers `phalanx run --servers N` started (PHALANX_PS_ADDRS)
    profile_dir: str | None = None  # `phalanx run --profile DIR` (PHALANX_PROFILE): record a timeline there
    step_report: str | None = None  # `phalanx run --link` (PHALANX_STEP_REPORT): write where the steps went there
    checkpoint_dir: str | None = None  # `phalanx run --checkpoint-dir`: where a preempted job saves
    resume_from: str | None = None  # `phalanx run --resume-from`: the checkpoint to continue from (resolved)
    preempt_notes: str | None = None  # a directory where a preempted worker tells its launcher what it saved
    launcher_pid: int | None = None  # PHALANX_LAUNCHER_PID: the launcher whose end ends this worker (group.orphan)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "WorkerEnv":
        """Parse and validate the standard torchrun variables (plus PHALANX_*)."""
        env = os.environ if env is None else env
        names = ("RANK", "WORLD_SIZE")
        present = [n for n in names if n in env]
        common = dict(timeout_s=_float(env, "PHALANX_TIMEOUT", DEFAULT_TIMEOUT_S),
                      threads=_opt_int(env, "PHALANX_THREADS"),
                      launched_by_phalanx=env.get("PHALANX_LAUNCHER") == "run",
                      debug=env.get("PHALANX_DEBUG", "").lower() not in ("", "0", "false", "no"),
                      error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
                      elastic_id=env.get("PHALANX_ELASTIC_ID"),
                      elastic_join=env.get("PHALANX_ELASTIC_JOIN") == "1",
                      elastic_secret=env.get("PHALANX_SECRET") or None,
                      # a joiner has no rank yet, but it has the job's store (`phalanx join`, --spares, --replace)
                      master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 29500),
                      checkpoint_dir=env.get("PHALANX_CHECKPOINT_DIR") or None,
                      resume_from=env.get("PHALANX_RESUME_FROM") or None,
                      preempt_notes=env.get("PHALANX_PREEMPT_NOTES") or None,
                      launcher_pid=_opt_int(env, "PHALANX_LAUNCHER_PID"),
                      ps_servers=len([a for a in env.get("PHALANX_PS_ADDRS", "").split(",") if a.strip()]),
                      profile_dir=env.get("PHALANX_PROFILE") or None,
                      step_report=env.get("PHALANX_STEP_REPORT") or None)
        if not present:
            return cls(**common)
        if len(present) != len(names):
            missing = [n for n in names if n not in env]
            raise ConfigError(usage(f"{present[0]}={env[present[0]]} is set but {missing[0]} is not",
                                    "RANK and WORLD_SIZE to be set together",
                                    "Launch with `phalanx run -n N` or torchrun, or unset both."))
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if world < 1:
            raise ConfigError(usage(f"WORLD_SIZE={world}", "WORLD_SIZE >= 1", "Fix the launcher's -n."))
        if not 0 <= rank < world:
            raise ConfigError(usage(f"RANK={rank} with WORLD_SIZE={world}",
                                    f"0 <= RANK < {world}", "Give every worker a distinct rank below WORLD_SIZE."))
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        local_rank = _int(env, "LOCAL_RANK", rank)
        if not 0 <= local_rank < max(local_world, 1):
            raise ConfigError(usage(f"LOCAL_RANK={local_rank} with LOCAL_WORLD_SIZE={local_world}",
                                    f"0 <= LOCAL_RANK < {local_world}", "Check the launcher's per-node count."))
        if world > 1 and "MASTER_ADDR" not in env:
            raise ConfigError(usage(f"WORLD_SIZE={world} without MASTER_ADDR", "MASTER_ADDR and MASTER_PORT",
                                    "Launch with `phalanx run` or torchrun, which set them."))
        return cls(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                   attempt=_int(env, "TORCHELASTIC_RESTART_COUNT", 0), **common)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(usage(f"{name} unset", f"{name} in the environment", "Launch with `phalanx run`."))
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(usage(f"{name}={raw!r}", "an integer", f"Set {name} to a whole number.")) from None


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if name in env else None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    return check.parse_float(name, raw, f"Set {name} to seconds, e.g. 60.")
