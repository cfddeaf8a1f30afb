"""The one-file checkpoint of earlier versions (format ``phalanx-checkpoint-2``): still loaded and exported.

One framed file (:mod:`phalanx.framing`: its SHA-256 checked, loaded weights-only)
held every worker's whole snapshot; a part of a worker's snapshot equal to rank 0's was
stored once, as :data:`SAME_AS_RANK0`. ``px.save_checkpoint`` writes a directory now
(:mod:`phalanx.checkpoint.dcp`); these files load on the number of workers that saved
them (each takes its own snapshot) or on another (each takes rank 0's shared part).
"""
from __future__ import annotations

from typing import Any

import torch

from ..group import group
from ..errors import CheckpointError
from ..framing import read_verified
from .training_state import TrainingState, check_fit, resize_warning, shared

FORMAT = "phalanx-checkpoint-2"  # the one-file format of earlier versions, still loaded
SAME_AS_RANK0 = "=rank0"  # one-file format: a part of a worker's snapshot that equals rank 0's is stored once


def _load_file(path: str, state: TrainingState, *, restore_rng: bool) -> dict[str, Any]:
    """Restore ``state`` from a one-file checkpoint (this worker's snapshot, or rank 0's shared part)."""
    body = read_verified(path)
    if body.get("format") == "phalanx-ps-shards-1":
        raise CheckpointError(f"{path!r} is a parameter-server shard file; expected a file from "
                              "px.save_checkpoint. Give shard files to the servers (--checkpoint PATH), "
                              "not to px.load_checkpoint.")
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is a phalanx file of format {body.get('format', 'phalanx-checkpoint-1')!r}; "
                              f"expected {FORMAT!r} or a checkpoint directory (from px.save_checkpoint). Resume "
                              "from a checkpoint written by this version, or start afresh.")
    _check_structure(body, path)
    ranks, me, world = body["ranks"], group.rank(), group.world_size()
    if len(ranks) == world:
        snapshot = {k: (ranks[0][k] if isinstance(v, str) and v == SAME_AS_RANK0 else v)
                    for k, v in ranks[me].items()}
    else:
        resize_warning(len(ranks), world, f"the checkpoint {path!r}")
        snapshot = shared(ranks[0])
    if not restore_rng:
        snapshot = {k: v for k, v in snapshot.items() if k != "rng"}
    optimizer = state.optimizer
    check_fit(path, optimizer, snapshot.get("optimizer"), optimizer.state_dict() if optimizer is not None else None,
              snapshot.get("rng"))
    try:
        state.restore(snapshot)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path!r} does not fit this model or optimizer: {str(err).splitlines()[0][:300]}. "
                              "Build the same architecture (and optimizer) before loading; it holds weights "
                              "for another model otherwise.") from err
    return body


def _check_structure(body: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint whose framing and hash are valid but whose body is not what save_state writes
    (edited by hand, or by another program), with one line, before anything is restored or warned about."""
    ranks = body.get("ranks")
    problem = None
    if not isinstance(ranks, list) or not ranks:
        problem = f"'ranks' is {type(ranks).__name__ if not isinstance(ranks, list) else 'an empty list'}, " \
                  "not a list of one snapshot per worker"
    elif not all(isinstance(r, dict) for r in ranks):
        problem = "a worker's snapshot is not a dict"
    elif body.get("world_size") != len(ranks) or isinstance(body.get("world_size"), bool):
        problem = f"'world_size' is {body.get('world_size')!r} but {len(ranks)} snapshots are stored"
    elif isinstance(body.get("step"), bool) or not isinstance(body.get("step"), int):
        problem = f"'step' is {body.get('step')!r}, not an integer"
    elif any(v == SAME_AS_RANK0 for v in ranks[0].values() if isinstance(v, str)):
        problem = "rank 0's snapshot refers to itself"
    else:
        lacking = sorted({k for r in ranks[1:] for k, v in r.items()
                          if isinstance(v, str) and v == SAME_AS_RANK0 and k not in ranks[0]})
        if lacking:
            problem = f"a worker's part {lacking[0]!r} refers to rank 0's, which rank 0 lacks"
    if problem:
        raise CheckpointError(f"{path!r} has the framing of a phalanx checkpoint but not its structure: {problem}. "
                              "Resume from a checkpoint px.save_checkpoint wrote, unedited.")


def _model_state(path: str) -> dict[str, torch.Tensor]:
    """Rank 0's plain model ``state_dict`` from the one-file checkpoint at ``path`` (for ``phalanx export``)."""
    body = read_verified(path)
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is a phalanx file of format {body.get('format')!r}; expected a "
                              "checkpoint from px.save_checkpoint. Export a checkpoint, not another file.")
    _check_structure(body, path)
    return body["ranks"][0]["model"]
