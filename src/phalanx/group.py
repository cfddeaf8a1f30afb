"""The worker group: the one place that reads the environment.

A script launched by ``phalanx run`` or ``torchrun`` sees ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. A plain ``python script.py``
sees none of them and is a group of one, which needs no process group at all.

Example:
    >>> import phalanx as px
    >>> px.init()
    >>> px.rank(), px.world_size()
    (0, 1)
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from .errors import ConfigError, usage

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

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "WorkerEnv":
        """Parse and validate the standard torchrun variables (plus PHALANX_*)."""
        env = os.environ if env is None else env
        names = ("RANK", "WORLD_SIZE")
        present = [n for n in names if n in env]
        if not present:
            return cls(timeout_s=_float(env, "PHALANX_TIMEOUT", DEFAULT_TIMEOUT_S),
                       threads=_opt_int(env, "PHALANX_THREADS"))
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
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 29500),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                   attempt=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
                   timeout_s=_float(env, "PHALANX_TIMEOUT", DEFAULT_TIMEOUT_S),
                   threads=_opt_int(env, "PHALANX_THREADS"))


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
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(usage(f"{name}={raw!r}", "a positive number of seconds", f"Set {name}, e.g. 60."))
    return value


@dataclass
class _Group:
    env: WorkerEnv
    device: torch.device
    store: dist.Store | None = None


_group: _Group | None = None


def init(backend: str | None = None, timeout: float | None = None, threads: int | None = None) -> None:
    """Join the worker group described by the environment; idempotent.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise.
    ``timeout`` bounds every collective (seconds), so a lost peer fails fast.

    Example:
        >>> import phalanx as px; px.init(); px.world_size()
        1
    """
    global _group
    if _group is not None:
        return
    env = WorkerEnv.from_environ()
    if timeout is not None:
        if not float(timeout) > 0:
            raise ConfigError(usage(f"timeout={timeout}", "a positive number of seconds", "Pass e.g. timeout=60."))
        env = replace(env, timeout_s=float(timeout))
    if threads is not None:
        if int(threads) < 1:
            raise ConfigError(usage(f"threads={threads}", "an integer >= 1", "Pass e.g. threads=1."))
        env = replace(env, threads=int(threads))
    timeout_s = env.timeout_s
    if env.threads is not None:
        torch.set_num_threads(env.threads)
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    store = None
    if env.world_size > 1 and not dist.is_initialized():
        # We own the store so that failure diagnosis (which rank is gone?) has a side channel
        # that does not depend on the broken process group.
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.rank == 0 and not env.agent_store,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        store = dist.PrefixStore(f"phalanx/{env.attempt}", store)
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), store=store,
                                rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    _group = _Group(env=env, device=device, store=store)
    if store is not None:
        atexit.register(shutdown)  # scripts rarely call shutdown(); exiting without it can abort (see shutdown)


def shutdown() -> None:
    """Leave the group; runs at interpreter exit too, and is safe to call twice.

    Workers meet at a short barrier first: destroying a gloo group while a peer is
    still tearing its own down aborts the process now and then ("terminate called
    without an active exception", seen in about 1 run in 6 on 2 workers here, plain
    torch too). The barrier is bounded, so a dead peer only delays exit.
    """
    global _group
    if dist.is_initialized():
        if _group is not None and _group.env.world_size > 1:
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=min(10.0, _group.env.timeout_s)))
            except RuntimeError:
                pass  # a peer is gone or went elsewhere; leave anyway
        dist.destroy_process_group()
    _group = None


# --- elastic hook (phalanx.elastic): re-point the group at a rebuilt generation -------------
def regroup(rank: int, world_size: int, store: dist.Store | None) -> None:
    """After ``phalanx.elastic`` rebuilt the process group: this worker's new rank, size and store."""
    global _group
    current = _current()
    _group = _Group(env=replace(current.env, rank=rank, world_size=world_size), device=current.device, store=store)
# --- end of elastic hook ------------------------------------------------------------------


def _current() -> _Group:
    if _group is not None:
        return _group
    env = WorkerEnv.from_environ()
    if env.world_size > 1:
        raise ConfigError(usage(f"a phalanx call in a {env.world_size}-worker run before px.init()",
                                "px.init() first", "Call px.init() at the top of the script."))
    return _Group(env=env, device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def is_initialized() -> bool:
    """True once px.init() has run in this process."""
    return _group is not None


def rank() -> int:
    """This worker's global rank (0 in a plain process)."""
    return _current().env.rank


def world_size() -> int:
    """Number of workers in the group (1 in a plain process)."""
    return _current().env.world_size


def local_rank() -> int:
    """Rank within this host; picks the GPU."""
    return _current().env.local_rank


def is_main() -> bool:
    """True on rank 0, the worker that prints and saves."""
    return rank() == 0


def device() -> torch.device:
    """The device this worker computes on: its own GPU, or the CPU."""
    return _current().device


def timeout_s() -> float:
    """The bound on every collective, in seconds."""
    return _current().env.timeout_s


def store() -> dist.Store | None:
    """The group's key-value store (None in a group of one)."""
    return _current().store


def barrier() -> None:
    """Wait for every worker; a no-op in a group of one."""
    if world_size() > 1:
        from .comm import guarded
        with guarded("barrier"):
            dist.barrier()
