"""The worker scripts' shared scaffolding: the user's own loop, tiny data and models, and what elastic workers record.

A worker script (tests/workers/) says only what is particular to it: its model sizes and seeds, its strategy, and
what it records at each step (an ``on_step`` hook); the loop itself is written once here, as the README shows it, so
a worker and its one-process oracle train alike by construction.

Example:
    >>> import torch
    >>> data = classification(8, inputs=3, classes=2, seed=0)
    >>> net = mlp(3, 4, 2, seed=0)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> take_step(net, opt, *data[:4])
"""
from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def take_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              loss: Loss = F.cross_entropy) -> None:
    """One optimizer step on one batch: zero the gradients, backward the loss, step.

    Example:
        >>> net = torch.nn.Linear(2, 2); opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> take_step(net, opt, torch.zeros(1, 2), torch.tensor([1]))
    """
    opt.zero_grad()
    loss(model(x), y).backward()
    opt.step()


def train(model: nn.Module, opt: torch.optim.Optimizer, loader: Any, epochs: int,
          on_step: Callable[[int], None] = lambda step: None, *, start_epoch: int = 0, step: int = 0) -> int:
    """The user's own loop, as the README shows it: epochs ``start_epoch..epochs-1``; returns the step count.

    ``on_step(step)`` runs after each step (what the worker records, a kill, a preemption's save).

    Example:
        >>> # train(model, opt, px.shard(data, batch_size=4), epochs=2, on_step=steps.append)
    """
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            take_step(model, opt, x, y)
            step += 1
            on_step(step)
    return step


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, loader: Any, steps: int, start_epoch: int = 0) -> int:
    """``steps`` optimizer steps over the shard, epochs as they come (the last may stop part-way); returns ``steps``.

    Example:
        >>> # train_steps(model, opt, px.shard(data, batch_size=32, seed=0), 10)
    """
    done, epoch = 0, start_epoch
    while done < steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            take_step(model, opt, x, y)
            done += 1
            if done == steps:
                return done
        epoch += 1
    return done


def lockstep(replicas: Sequence[nn.Module], opts: Sequence[torch.optim.Optimizer],
             loaders: Sequence[Any]) -> Iterator[int]:
    """One process playing every rank of an epoch: each replica steps on its own rank's batch; yields the step.

    The one-process oracles of the periodic strategies average the replicas between the yields.

    Example:
        >>> # for step in lockstep(replicas, opts, loaders):
        >>> #     if step % every == 0: average(replicas)
    """
    for loader in loaders:
        loader.set_epoch(0)
    for step, batches in enumerate(zip(*loaders, strict=True), start=1):
        for model, opt, (x, y) in zip(replicas, opts, batches, strict=True):
            take_step(model, opt, x, y)
        yield step


def classification(n: int, inputs: int, classes: int, seed: int) -> torch.utils.data.TensorDataset:
    """``n`` random samples of ``inputs`` features with a random class each, the same for every process.

    Example:
        >>> len(classification(10, inputs=5, classes=3, seed=8))
        10
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, inputs, generator=gen),
                                          torch.randint(0, classes, (n,), generator=gen))


def mlp(inputs: int, hidden: int, classes: int, seed: int) -> nn.Module:
    """Linear-Tanh-Linear with the weights torch's global seed ``seed`` draws.

    Example:
        >>> mlp(5, 8, 3, seed=2)[0].in_features
        5
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def group_ids(comm: Any, ids: torch.Tensor, width: int) -> list[int]:
    """The sample ids the whole group trains on at this step, rank by rank (each rank's part padded to ``width``).

    Example:
        >>> # record.steps.append([epoch, px.world_size(), group_ids(px.Comm(), ids, BATCH)])
    """
    mine = torch.full((width,), -1, dtype=ids.dtype)
    mine[:len(ids)] = ids
    gathered = torch.cat(comm.all_gather(mine))
    return gathered[gathered >= 0].tolist()


def elastic_parser(epochs: int | None = 2, commit_every: int | None = 3, kill: bool = True) -> argparse.ArgumentParser:
    """The flags elastic workers share: ``--out DIR``, ``--epochs``, ``--commit-every`` and ``--kill ID@STEP``.

    ``None`` (or ``kill=False``) leaves a flag out, for a worker that fixes it.

    Example:
        >>> elastic_parser(epochs=4, commit_every=None).parse_args(["--out", "o"]).epochs
        4
    """
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    if epochs is not None:
        p.add_argument("--epochs", type=int, default=epochs)
    if commit_every is not None:
        p.add_argument("--commit-every", type=int, default=commit_every)
    if kill:
        p.add_argument("--kill", default="", help="ID@STEP: the worker started as rank ID dies before step STEP")
    return p


def elastic_id() -> str:
    """This worker's elastic id (``PHALANX_ELASTIC_ID``), its rank when it runs without ``--elastic``, else "0".

    Example:
        >>> isinstance(elastic_id(), str)
        True
    """
    return os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))


def epoch_batches(state: Any, loader: Any, epochs: int) -> Iterator[tuple[int, Any, Any, Any]]:
    """An elastic training function's loop: ``(epoch, x, y, ids)`` from the state's epoch (after a rollback, the
    commit's) to ``epochs - 1``, the loader set to each epoch.

    Example:
        >>> # for epoch, x, y, ids in epoch_batches(state, loader, args.epochs): ...
    """
    for epoch in range(state.epoch, epochs):
        loader.set_epoch(epoch)
        for x, y, ids in loader:
            yield epoch, x, y, ids


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded model's parameter (a DTensor: collective), or ``t`` itself.

    Example:
        >>> whole(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def write_worker(out: str, me: str, model: nn.Module, record: Iterable[list], history: list, **extra: Any) -> None:
    """``out/worker<me>.json``: an elastic worker's id, world size, record, regroups and final parameters.

    Example:
        >>> # write_worker(args.out, me, model, record.steps, state.history)
    """
    import phalanx as px

    result = {"id": me, "world_size": px.world_size(), "record": list(record), "history": history,
              "params": [whole(t).tolist() for t in px.unwrap(model).parameters()], **extra}
    with open(os.path.join(out, f"worker{me}.json"), "w") as f:
        json.dump(result, f)


def kill_if_victim(state: Any, me: str, kill: str, *, first: Callable[[], None] = lambda: None) -> None:
    """SIGKILL this worker if it is ID of ``--kill ID@STEP`` and about to take step STEP, before any regroup.

    ``first`` runs just before the kill (e.g. wait until a spare is parked, so that it is hot when the kill comes).

    Example:
        >>> # for x, y, ids in loader: kill_if_victim(state, me, args.kill); ...
    """
    victim, _, at = kill.partition("@")
    if me == victim and state.step + 1 == int(at) and not state.history:
        first()
        os.kill(os.getpid(), signal.SIGKILL)


def strategies(every: int) -> dict[str, Callable[[], Any]]:
    """The strategies the oracle tests sweep: AllReduce, plain and with PowerSGD (rank 1), and LocalSGD, DiLoCo and
    EASGD syncing every ``every`` steps; each value makes a fresh strategy.

    Example:
        >>> # {name: run(make()) for name, make in strategies(every=2).items()}
    """
    import phalanx as px

    return {
        "allreduce": px.AllReduce,
        "powersgd": lambda: px.AllReduce(compression=px.PowerSGD(rank=1)),
        "local-sgd": lambda: px.LocalSGD(every=every),
        "diloco": lambda: px.DiLoCo(every=every),
        "easgd": lambda: px.EASGD(every=every),
    }
