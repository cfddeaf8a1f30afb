"""phalanx: data-parallel training for any PyTorch model, on CPU cores, GPUs or machines.

Your loop stays yours; four lines make it data-parallel::

    import phalanx as px

    px.init()                                               # 1: join the group (a plain process is a group of one)
    model, opt = px.wrap(model, opt)                        # 2: synchronous gradient averaging by default
    loader = px.shard(train_set, batch_size=64, seed=0)     # 3: each worker reads only its own shard
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    px.save(model, "model.pt")                              # 4: plain state_dict, main worker only
    px.shutdown()                                           # leave the group once every worker is done

Launch with ``phalanx run -n 2 train.py`` or ``torchrun --nproc-per-node 2 train.py``.
``px.shutdown()`` also runs at exit; call it yourself where you would call
``dist.destroy_process_group()``, never under ``if rank == 0:``.
"""
from __future__ import annotations

from .train.callbacks import Callback, LambdaCallback, ModelCheckpoint
from .checkpoint import load_checkpoint, read_checkpoint, save, save_checkpoint
from .group.collectives import Comm, CommStats, barrier, scatter_back
from .strategies.compression import FP16, Compressor, PowerSGD, Threshold, TopK
from .data.loader import ShardedLoader, shard
from .errors import CheckpointError, ConfigError, PhalanxError, WorkerLostError
from .group.group import Group, device, is_initialized, is_main, local_rank, rank, shutdown, world_size
from .group.group import current as current_group
from .group.group import init as _join_group
from .train.lr import scale_lr, warmup
from .step.preempt import PREEMPTED_EXIT, latest_checkpoint, preempted, resume_from
from .train.metrics import Accuracy, MeanLoss, Metric, ThroughputMeter
from .step.profiling import Timeline, profile
from .ps import AsyncEASGD, Downpour, ParameterServer
from .strategies.quantize import Quantize
from .strategies.sparseloco import SparseLoCo
from .strategies import (EASGD, AllReduce, Auto, DiLoCo, Exchange, LocalSGD, ParameterAverage, Periodic, Strategy,
                         StreamingDiLoCo, SyncCondition, fill_missing_grads)
from .sharding.layout import FullyShard
from .strategies.sync import every, schedule
from .checkpoint.training_state import TrainingState
from .train.trainer import History, Trainer
from .train.tracking import Tracker
from .wrap import no_sync, strategy_of, unwrap, wrap
from . import elastic  # px.elastic.State / px.elastic.run
from .elastic.state import attach as _attach_elastic
from . import stream  # px.stream.RedisStream / px.stream.StreamLoader (redis itself is imported on first use)

__version__ = "0.1.0"


def init(backend: str | None = None, timeout: float | None = None, threads: int | None = None) -> Group:
    """Join the worker group described by the environment and return it; idempotent (:func:`phalanx.group.group.init`).

    Under ``phalanx run --elastic`` a joiner or a spare waits here until the job admits it, so
    the group it gets back already holds its rank, world size and generation.

    Example:
        >>> import phalanx as px; px.init().world_size
        1
    """
    # the group is core; elastic membership is a feature, composed here: it takes this worker's place in the job
    return _join_group(backend, timeout, threads, place=_attach_elastic)


def __getattr__(name: str):  # noqa: ANN202 - px.keras imports Keras (seconds), so only on first use
    if name == "keras":
        import importlib
        return importlib.import_module(".keras", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    # the loop
    "init", "wrap", "unwrap", "shard", "save", "rank", "world_size", "local_rank", "is_main", "is_initialized",
    "barrier", "device", "shutdown", "scale_lr", "warmup", "strategy_of", "no_sync", "ShardedLoader",
    "Group", "current_group", "FullyShard",
    # strategies, sync conditions and compressors
    "Strategy", "Periodic", "Exchange", "ParameterAverage", "SyncCondition", "every", "schedule",
    "Auto", "AllReduce", "LocalSGD", "DiLoCo", "StreamingDiLoCo", "EASGD", "AsyncEASGD", "Downpour",
    "ParameterServer", "Compressor", "FP16", "TopK", "Threshold", "PowerSGD", "Quantize", "SparseLoCo", "Comm",
    "CommStats", "scatter_back", "fill_missing_grads",
    # the Trainer
    "Trainer", "History", "Callback", "LambdaCallback", "ModelCheckpoint", "Metric", "Accuracy", "MeanLoss",
    "ThroughputMeter", "Tracker",
    # the timeline (phalanx.step.profiling)
    "profile", "Timeline",
    # checkpoints and errors
    "save_checkpoint", "load_checkpoint", "read_checkpoint", "TrainingState",
    "PhalanxError", "ConfigError", "WorkerLostError", "CheckpointError",
    # fault tolerance
    "elastic", "stream", "preempted", "PREEMPTED_EXIT", "latest_checkpoint", "resume_from",
]
