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

Launch with ``phalanx run -n 2 train.py`` or ``torchrun --nproc-per-node 2 train.py``.
"""
from __future__ import annotations

from .checkpoint import load_checkpoint, read_checkpoint, save, save_checkpoint
from .comm import Comm, CommStats
from .compression import FP16, Compressor, PowerSGD, Threshold, TopK
from .data import ShardedLoader, shard
from .errors import CheckpointError, ConfigError, PhalanxError, WorkerLostError
from .group import barrier, device, init, is_initialized, is_main, local_rank, rank, shutdown, world_size
from .lr import scale_lr, warmup
from .ps import AsyncEASGD, Downpour, ParameterServer
from .strategies import AllReduce, Exchange, ParameterAverage, Periodic, Strategy, SyncCondition
from .strategies import EASGD, DiLoCo, LocalSGD
from .sync import every, schedule
from .wrap import strategy_of, unwrap, wrap

__version__ = "0.1.0"

__all__ = [
    "Compressor", "DiLoCo", "EASGD", "FP16", "LocalSGD", "PowerSGD", "Threshold", "TopK", "schedule",
    "AsyncEASGD", "Downpour", "ParameterServer",
    "AllReduce", "CheckpointError", "Comm", "CommStats", "ConfigError", "Exchange", "ParameterAverage", "Periodic",
    "PhalanxError", "ShardedLoader", "Strategy", "SyncCondition", "WorkerLostError", "barrier", "device", "every",
    "init", "is_initialized", "is_main", "load_checkpoint", "local_rank", "rank", "read_checkpoint", "save",
    "save_checkpoint", "scale_lr", "shard", "shutdown", "strategy_of", "unwrap", "warmup", "world_size", "wrap",
]
