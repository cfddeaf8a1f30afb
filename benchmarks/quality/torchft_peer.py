"""torchft's DiLoCo and Streaming DiLoCo as peers of the quality benchmark: an optional extra.

torchft (``pip install torchft==0.2.0``; never a dependency of phalanx) is used only when it
can be imported by the benchmark's workers (``benchmarks/torchft/setup.sh`` builds an
environment for it; ``pip install --target DIR --no-deps torchft==0.2.0`` plus its
opentelemetry exporters on ``PYTHONPATH`` does too). Otherwise its setups are left out with
the reason (:func:`missing`).

How it runs inside a shaped link (each of the 2 workers in its own network namespace):

* each worker is one torchft replica group of one process (its own Manager, TCPStore and
  ``ProcessGroupGloo``, on this worker's own address on the link);
* rank 0 runs torchft's lighthouse (the Rust server shipped in the wheel) in its own process,
  so inside its namespace, bound to every address of it; both Managers reach it at rank 0's
  address on the link, so quorums, heartbeats and the replicas' all-reduces all cross the
  shaped link (the session's own gloo group only passes the lighthouse's port, once);
* torchft advertises its checkpoint server (used to heal a replica) under the machine's host
  name, which inside a namespace resolves to that namespace's own loopback: here it
  advertises the worker's address on the link instead (:func:`_transport`). Both replicas
  start from the same seed, so ``init_sync=False`` skips the heal at step 0, as phalanx does.

Settings as phalanx's: AdamW inner, Nesterov SGD outer (lr 0.7, momentum 0.9), H = 50.
torchft's Streaming DiLoCo needs H divisible by the fragment count, so it runs with H = 48
(4 fragments, one every 12 steps; phalanx's are 12-13 steps apart), τ = 5, mixing α = 0.5,
fragments cut where phalanx cuts them (consecutive parameters, balanced bytes). torchft's
quantised exchange needs triton (CUDA), so its exchange is float32. Bytes are counted where
torchft hands tensors to ``Manager.allreduce``; the veth's ``tx_bytes`` counts the rest
(quorums, heartbeats).

Example:
    >>> sorted(NAMES)
    ['torchft-diloco', 'torchft-streaming-diloco', 'torchft-streaming-diloco-avg']
"""
from __future__ import annotations

import importlib.util
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.strategies.fragments import balanced_split
from phalanx.bench.worker import Accountant

H, STREAM_H, STREAM_FRAGMENTS, STREAM_OVERLAP, STREAM_MIXING = 50, 48, 4, 5, 0.5
PEERS = ("torchft-diloco", "torchft-streaming-diloco")  # the papers' settings: in the default run
NAMES = (*PEERS, "torchft-streaming-diloco-avg")  # with the opt-in variant
TIMEOUT = timedelta(seconds=120)


def missing() -> str | None:
    """None when torchft can be imported here (and so by the benchmark's workers), else why not, in words."""
    if importlib.util.find_spec("torchft") is None:
        return ("torchft is not importable by this interpreter: it is an optional extra, never a dependency of "
                "phalanx; build its environment with benchmarks/torchft/setup.sh and run the benchmark with that "
                "venv's python (PY=benchmarks/torchft/.venv-torchft/bin/python benchmarks/quality.sh)")
    return None


class _Fragment(nn.Module):
    """A module holding some of the model's parameters (the same tensors): torchft syncs modules."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


def fragments(model: nn.Module, parts: int) -> list[nn.Module]:
    """``parts`` fragments of consecutive parameters balanced by bytes, cut where px.StreamingDiLoCo cuts."""
    params = [p for p in model.parameters() if p.requires_grad]
    ranges = balanced_split([p.numel() * p.element_size() for p in params], parts)
    return [_Fragment([params[i] for i in r]) for r in ranges]


def _transport(host: str) -> Any:
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:  # torchft's own names socket.gethostname(): the namespace's loopback
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=TIMEOUT, num_chunks=0)


class TorchftAccountant(Accountant):
    """Counts what torchft all-reduces; ``finish()`` leaves DiLoCo and shuts the Manager and lighthouse down."""

    def __init__(self, diloco: Any, manager: Any, lighthouse: Any, store: Any) -> None:
        self.diloco, self.manager, self.lighthouse, self.store = diloco, manager, lighthouse, store
        self.sent = 0
        allreduce = manager.allreduce

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.sent += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = counting  # the accountant's only hook: torchft's DiLoCo calls it per exchange

    def bytes_sent(self) -> float:
        return float(self.sent)

    def period(self) -> int:
        return H

    def finish(self) -> None:
        """The model kept is each replica's own (torchft has no closing average, unlike phalanx's finish())."""
        self.diloco.__exit__(None, None, None)
        if dist.is_initialized():
            dist.barrier()  # both replicas are done with the lighthouse before it stops
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
        self.store = None


def build(streaming: bool, outer_lr: float = 0.7, outer_momentum: float = 0.9) -> Any:
    """A :class:`.setups.QSetup` build function: (model, inner optimizer, lr) -> (model, optimizer, accountant).

    The outer optimiser is SGD at ``outer_lr`` with Nesterov momentum ``outer_momentum`` (0: none; lr 1 and
    momentum 0 is plain averaging), as phalanx's setup beside it."""
    def make(model: nn.Module, opt: torch.optim.Optimizer, lr: float) -> tuple[nn.Module, Any, Any]:
        from torchft import Manager, ProcessGroupGloo
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo

        import phalanx as px

        px.init()  # the session's group: only the lighthouse's port travels on it
        rank, world = px.rank(), px.world_size()
        # This worker's address on the link (link.env sets it), rank 0's as the session's master address.
        here = os.environ.get("PHALANX_PS_HOST", "127.0.0.1")
        main = os.environ.get("MASTER_ADDR", "127.0.0.1")
        lighthouse = LighthouseServer(bind="0.0.0.0:0", min_replicas=world) if rank == 0 else None
        port = [int(lighthouse.address().rsplit(":", 1)[1]) if lighthouse is not None else 0]
        if dist.is_initialized():
            dist.broadcast_object_list(port, 0)
        store = dist.TCPStore(here, 0, is_master=True, wait_for_workers=False)
        manager = Manager(pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=world, use_async_quorum=False,
                          load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                          replica_id=str(rank), store_addr=here, store_port=store.port, rank=0, world_size=1,
                          lighthouse_addr=f"http://{main}:{port[0]}", hostname=here, port=0, timeout=TIMEOUT,
                          quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT, checkpoint_transport=_transport(here),
                          init_sync=False)
        frags = fragments(model, STREAM_FRAGMENTS) if streaming else [model]
        outer = [torch.optim.SGD(f.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
                 for f in frags]
        if streaming:
            diloco = DiLoCo(manager, frags, opt, outer, sync_every=STREAM_H, fragment_sync_delay=STREAM_OVERLAP,
                            fragment_update_alpha=STREAM_MIXING)
        else:
            diloco = DiLoCo(manager, frags, opt, outer[0], sync_every=H)
        diloco.__enter__()  # its optimizer hooks; left in TorchftAccountant.finish()
        return model, opt, TorchftAccountant(diloco, manager, lighthouse, store)
    return make


__all__ = ["NAMES", "PEERS", "TorchftAccountant", "build", "fragments", "missing"]
