"""Checkpoints: sharded, asynchronous and reshardable (torch.distributed.checkpoint), atomic and verified.

Two kinds:

* ``px.save(model, path)``: the plain ``state_dict`` of the user's module (no
  ``module.`` prefixes), a normal ``torch.save`` file that ``Net().load_state_dict``
  takes as it is. Main worker only; call it anywhere, e.g. under ``if px.is_main():``.
* ``px.save_checkpoint(path, model, optimizer, ...)``: everything a run needs to
  continue exactly, written as a **directory** by torch's distributed checkpoint (DCP):
  every worker writes its own part (a sharded model's shards, its share of the
  replicated tensors), nothing is gathered to one worker. **Collective**: call it on
  every worker. Called on some workers only (say under ``if rank == 0:``, where
  ``torch.save`` was), it fails within the group's timeout (60 s; :data:`agreement.ENTRY_WAIT_S`) with a
  message that says so, instead of hanging. ``blocking=False`` returns a
  :class:`SaveHandle` once the state is copied into shared memory, and a writer process of
  the worker's own writes it while training goes on.

A checkpoint directory holds DCP's files (``.metadata``, ``__<rank>_0.distcp``) with
every tensor (model, optimizer, the strategy's shared state, each worker's own strategy
state and buffers), one small verified file per worker (``rank-<r>.pt``: the non-tensor
skeleton, data position, RNG, step, scheduler, scaler, ``extra``) and ``phalanx.json``,
written last. It is written into ``<path>.tmp-<id>`` and renamed into place only when
every worker finished, so a save killed half-way never replaces the last good one.

It loads on any number of workers (DCP reshards), and loading runs no code from the
files: the per-worker files load with ``weights_only=True`` and DCP's metadata is read by
an unpickler that builds only DCP's own metadata classes. ``phalanx export CKPT model.pt``
turns one into a plain ``state_dict``. One-file checkpoints of earlier versions still load.

The package, one concept a module (each imports only those listed before it):

* :mod:`.dcp`: what a checkpoint directory holds, written and read with DCP;
* :mod:`.hashing`: DCP's file writer, each chunk hashed as it is written (the seal reads nothing back);
* :mod:`.legacy`: the one-file checkpoint of earlier versions (loaded and exported);
* :mod:`.agreement`: how the workers of one save agree on the group's store;
* :mod:`.handle`: :class:`SaveHandle`, and the directory put in place whole or not at all;
* :mod:`.snapshot`: the fork that copies an asynchronous save's state (copy-on-write);
* :mod:`.writer`: the writer process an asynchronous save is written by;
* :mod:`.saver`: ``px.save``, ``px.save_checkpoint``;
* :mod:`.loader`: ``px.load_checkpoint``, ``px.read_checkpoint``, ``phalanx export``.

Example:
    >>> import torch, phalanx as px, tempfile, os
    >>> net = torch.nn.Linear(2, 2)
    >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
    >>> px.save(net, path); net.load_state_dict(torch.load(path, weights_only=True))
    <All keys matched successfully>
"""
from __future__ import annotations

# Kept importable from here: the parameter-server shard store, the launchers, the Keras optimizer state and older
# code use these names (the framing and RNG helpers live in phalanx.framing and phalanx.checkpoint.training_state).
from ..framing import MAGIC, MARKER, atomic_write, check_plain, read_verified, write_verified
from .training_state import rng_state, set_rng_state
from .agreement import LAST_SAVED_KEY
from .dcp import DCP_FORMAT
from .handle import SaveHandle
from .legacy import FORMAT, SAME_AS_RANK0
from .loader import checkpoint_step, export, load_checkpoint, load_state, read_checkpoint
from .saver import save, save_checkpoint, save_state, wait_for_saves

__all__ = ["DCP_FORMAT", "FORMAT", "LAST_SAVED_KEY", "MAGIC", "MARKER", "SAME_AS_RANK0", "SaveHandle",
           "atomic_write", "check_plain", "checkpoint_step", "export", "load_checkpoint", "load_state",
           "read_checkpoint", "read_verified", "rng_state", "save", "save_checkpoint", "save_state",
           "set_rng_state", "wait_for_saves", "write_verified"]
