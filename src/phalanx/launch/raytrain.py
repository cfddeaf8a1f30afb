"""phalanx on Ray: Ray places the workers and replaces lost ones, phalanx regroups the survivors in process.

    from phalanx.launch.raytrain import train
    train(main, num_workers=3, min_workers=2)    # main: the same function `phalanx run --elastic` runs

``main`` is the training function you run under ``phalanx run``: it calls ``px.init()``,
``px.wrap``, ``px.shard`` and, to survive a lost worker, ``px.elastic.State`` with
``@px.elastic.run`` (or ``state.epochs``). It runs on ``num_workers`` Ray Train workers.

The Ray Train backend (:class:`~phalanx.launch.raybackend.PhalanxConfig`), the job's store and its
heartbeat watcher in Ray Train's controller: :mod:`phalanx.launch.raybackend`.

Losing the controller (the driver's node) ends the job: ``train``
raises one :class:`~phalanx.errors.JobLostError` line naming the newest checkpoint (the driver
follows it in the store), and the workers end (Ray ends the actors of a lost owner); so does
losing every worker that held the training state (the replacements would have nobody to enter
from). ``train(..., resume_from_checkpoint=PATH)`` starts a new job from that checkpoint
(``px.resume_from()`` on every worker).

Elastic bounds map onto Ray's worker counts: Ray Train runs ``num_workers + spares``
workers; ``min_workers`` is phalanx's floor (fewer survivors end the job); spares are
parked workers that take a lost worker's place at the regroup; the group never grows past
``max_workers`` (default ``num_workers + spares``). ``max_failures`` bounds how many lost
workers Ray Train replaces (Ray's ``FailureConfig``).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any, Callable

from ..elastic import secret
from ..elastic.membership import key
from ..errors import ConfigError, JobLostError, usage
from ..sealed import verify_directory
from .elastic import generation_members, saved_checkpoint
from .ports import free_port
from .raybackend import PhalanxConfig, data_parallel_trainer, training_function
from .rayjob import lost_state_error
from .status import JobStatus, status_address

INSTALL = "pip install 'phalanx[ray]'"
CONNECT_TIMEOUT_S = 10.0  # a Ray address that does not answer is refused this soon


def require_ray() -> Any:
    """The ``ray`` module with Ray Train, or one :class:`ConfigError` line naming the extra to install."""
    try:
        import ray
        import ray.train  # noqa: F401
        from ray.train.v2._internal.constants import is_v2_enabled
    except ImportError as err:
        raise ConfigError(usage(f"phalanx on Ray without Ray Train ({err.name or 'ray'} is not installed)",
                                "ray[train] 2.60 or newer", f"Install it: {INSTALL}")) from None
    if not is_v2_enabled():
        raise ConfigError(usage("RAY_TRAIN_V2_ENABLED=0", "Ray Train v2 (the default since Ray 2.51)",
                                "Unset RAY_TRAIN_V2_ENABLED: only Train v2 replaces one lost worker alone."))
    return ray


class _Ledger:
    """On the driver: the newest checkpoint the job wrote, read from its store while the store lives.

    The store lives in Ray Train's controller; if the controller is lost, the line that ends the job
    names what was read here last (a checkpoint whose write finished after the last read, within
    ``poll_s``, is not named)."""

    def __init__(self, host: str, port: int, poll_s: float = 0.5) -> None:
        self.host, self.port, self.poll_s = host, port, poll_s
        self.checkpoint: str | None = None
        self.placement_group: str | None = None  # the workers' (see raybackend._PhalanxBackend.on_start)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="phalanx-ray-ledger", daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        store = None
        while not self.stopped.wait(self.poll_s):
            if store is None:  # the controller starts the store in a moment: a plain connect says when
                try:
                    socket.create_connection((self.host, self.port), timeout=2).close()
                    store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=30),
                                          wait_for_workers=False)
                except Exception:  # noqa: BLE001 - not listening yet
                    continue
            try:
                if self.placement_group is None and store.check([key("ray", "placement_group")]):
                    self.placement_group = store.get(key("ray", "placement_group")).decode()
                self.checkpoint = saved_checkpoint(store, generation_members(store)[0]) or self.checkpoint
            except Exception:  # noqa: BLE001 - gone with the controller: keep what was read
                return

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)


def one_line(err: BaseException) -> str:
    """A failed Ray Train run as one line: its type and what failed on each worker (or in the controller).

    Ray's messages are headings ending in a colon, followed by the detail on later lines, and
    tracebacks: the detail is kept, joined into one line, never cut at the heading's colon.

    Example:
        >>> one_line(RuntimeError("Training failed due to controller error:\\nThe actor died."))
        'RuntimeError: Training failed due to controller error: The actor died.'
    """
    failures = getattr(err, "worker_failures", None)
    if isinstance(failures, dict) and failures:
        return f"{type(err).__name__}: " + "; ".join(f"Ray Train rank {rank}: {_gist(e)}"
                                                      for rank, e in sorted(failures.items()))
    cause = getattr(err, "controller_failure", None)
    if isinstance(cause, BaseException):
        return f"{type(err).__name__}: controller: {_gist(cause)}"
    return _gist(err)


def _gist(err: BaseException, limit: int = 300) -> str:
    """``Type: what happened`` for one exception: a traceback's exception line, else the heading and its detail."""
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    if any(ln.startswith("Traceback (most recent call last):") for ln in lines):
        said = [ln.strip() for ln in lines if not ln[:1].isspace()][-1]  # the traceback's last line names the error
    else:
        taken = []
        for ln in lines:  # a heading "...:" is followed by its detail; the first line that is not a heading ends it
            taken.append(ln.strip())
            if not ln.rstrip().endswith(":"):
                break
        said = " ".join(taken) or type(err).__name__
        said = f"{type(err).__name__}: {said}" if not said.startswith(type(err).__name__) else said
    inner = getattr(err, "health_check_failure", None)  # Ray's worker health check names its cause apart
    if isinstance(inner, BaseException):
        said = f"{said} ({_gist(inner, limit)})"
    return said if len(said) <= limit else said[:limit - 1] + "…"


def _release(group_id: str | None) -> None:
    """Remove the placement group of a job whose controller was lost (its workers are gone with it)."""
    if group_id is None:
        return
    import ray
    from ray.util.placement_group import PlacementGroup

    try:
        ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
    except Exception:  # noqa: BLE001 - removed already (Ray Train's own cleaner got there first)
        pass


def _connect(ray: Any, address: str | None) -> None:
    """``ray.init(address)`` unless connected; an address that does not answer is one line within seconds."""
    if ray.is_initialized():
        return
    if address not in (None, "", "auto", "local") and not address.startswith("ray://"):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host or address, int(port or 6379)), timeout=CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as err:
            raise ConfigError(usage(f"Ray address {address!r} ({getattr(err, 'strerror', None) or err})",
                                    "the GCS address of a running Ray cluster (HOST:PORT, default port 6379)",
                                    "Start one with `ray start --head`, or check the address it printed.")) from None
    ray.init(address=address, log_to_driver=True)


def train(fn: Callable[..., Any], *args: Any, num_workers: int, min_workers: int | None = None, spares: int = 0,
          heartbeat_s: float = 10.0, threads: int = 1, timeout_s: float | None = None, max_failures: int = 3,
          resources_per_worker: dict[str, float] | None = None, address: str | None = None,
          storage_path: str | None = None, name: str | None = None, debug: bool = False,
          max_workers: int | None = None, status: str | int | None = None,
          resume_from_checkpoint: str | os.PathLike | None = None) -> Any:
    """Run ``fn(*args)`` on ``num_workers`` Ray Train workers as one elastic phalanx job; returns rank 0's result.

    ``fn`` is the function ``phalanx run --elastic`` would run (``px.init()``, ``px.wrap``,
    ``px.elastic.State``...). A lost worker is replaced by Ray alone, up to ``max_failures``
    times; the survivors regroup in process (see the module's docstring). ``address``: a
    running Ray cluster (``ray.init`` is called unless Ray is already initialised). ``max_workers``: grow up
    to this many workers when nodes are added (each new one joins at the next commit). ``status``:
    ``"[HOST:]PORT"``, where Ray Train's controller (on this node) serves the job's status page, as
    ``phalanx run --status`` does; the link is printed here. ``resume_from_checkpoint``: a checkpoint
    ``px.save_checkpoint`` wrote (the one a failed run's line names); ``px.resume_from()`` returns it on
    every worker, as under ``phalanx run --resume-from`` (Ray Train's own ``resume_from_checkpoint`` is its
    checkpoint object; this is phalanx's checkpoint directory).

    Raises :class:`~phalanx.PhalanxError` with one line when the job fails; when the training state is
    gone (every worker holding it, or Ray Train's controller, which holds the job's store, was lost) that is
    a :class:`~phalanx.errors.JobLostError` whose ``checkpoint`` names the newest checkpoint to resume from.

    Example:
        >>> train(print, num_workers=1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        phalanx.errors.ConfigError: num_workers=1; expected an integer >= 2 ...
    """
    ray = require_ray()
    run = training_function(fn, *args)
    page = status_address(status, "status=")  # the port is tried here first: in use, nothing starts
    job_secret = (os.environ.get(secret.ENV) or secret.make()) if page is not None else None
    extra_env = {}
    if resume_from_checkpoint is not None:
        extra_env["PHALANX_RESUME_FROM"] = _checked_checkpoint(resume_from_checkpoint)
    cfg = PhalanxConfig(num_workers=num_workers, min_workers=min_workers, spares=spares, heartbeat_s=heartbeat_s,
                        threads=threads, timeout_s=timeout_s, debug=debug, max_workers=max_workers,
                        grow=run, resources=resources_per_worker, status=page, secret=job_secret,
                        extra_env=extra_env)
    if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < -1:
        raise ConfigError(usage(f"max_failures={max_failures!r}", "an integer >= 0 (or -1: no limit)",
                                "Pass e.g. max_failures=3."))
    if page is not None:
        JobStatus.bind(*page).server.close(0)  # free now: the controller binds it in a moment
        print(f"phalanx: status page at {JobStatus.link(page, job_secret)} (served by Ray Train's controller "
              "on this node; /status.json and /metrics take `Authorization: Bearer <token>`)", file=sys.stderr,
              flush=True)
    _connect(ray, address)
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    # The store listens where the controller runs (Ray pins it to this node): on a port chosen here, so that
    # this driver follows the newest checkpoint in it and can name it if the controller is lost with the store.
    cfg.host = ray.util.get_node_ip_address()
    cfg.port = free_port(cfg.host)
    ledger = _Ledger(cfg.host, cfg.port)
    # pg_cleaner=False: Ray Train's own cleaner asks the state API (absent without the dashboard); the placement
    # group of a lost controller is released here instead (_release)
    trainer = data_parallel_trainer(
        run, backend_config=cfg, pg_cleaner=False,
        scaling_config=ScalingConfig(num_workers=cfg.total_workers, resources_per_worker=resources_per_worker),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures),
                             worker_runtime_env={"env_vars": cfg.worker_env()}))
    try:
        return trainer.fit().return_value
    except ray.train.TrainingFailedError as err:
        cause = getattr(err, "controller_failure", None)
        if isinstance(cause, JobLostError):  # every holder of the state was lost: the controller said so
            raise JobLostError(str(cause), cause.checkpoint) from err
        raise lost_state_error(f"the job failed ({one_line(err)})", ledger.checkpoint) from err
    except ray.exceptions.RayActorError as err:  # the controller, and the job's store with it
        ledger.stop()
        _release(ledger.placement_group)  # its workers ended with it; their resources must not stay reserved
        raise lost_state_error(f"Ray Train's controller, which held the job's store, was lost ({type(err).__name__});"
                               " the workers end with it", ledger.checkpoint) from err
    finally:
        ledger.stop()


def _checked_checkpoint(path: str | os.PathLike) -> str:
    """``resume_from_checkpoint``, absolute, once it verifies (every byte: a damaged one is one CheckpointError)."""
    full = os.path.abspath(os.fspath(path))
    if not os.path.isdir(full):
        raise ConfigError(usage(f"resume_from_checkpoint={os.fspath(path)!r} (not a directory)",
                                "a checkpoint px.save_checkpoint wrote (the path a failed run's line names)",
                                "Pass that path, or leave resume_from_checkpoint out to start afresh."))
    verify_directory(full)
    return full
