"""Elastic training: survive a lost worker, continue with fewer, and let workers join.

Under ``phalanx run --elastic -n 3 --min-workers 2 train.py`` a worker that dies
(kill -9, out of memory, a lost host) or hangs (killed by the launcher when its
heartbeat stops) no longer ends the job: the survivors keep their processes, rebuild
the group without it, roll back to the newest in-memory commit they all hold, and
go on with fewer workers. Everything else runs unchanged under plain torchrun.

Example:
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(2, 1); opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> state = px.elastic.State(net, opt)
    >>> state.elastic      # not under `phalanx run --elastic`
    False
"""
from __future__ import annotations

from .membership import QuorumError
from .resize import KeepGlobalBatch, KeepWorkerBatch, Resize, ResizePolicy, rescale_lr
from .run import JoinersAdmitted, MembershipChange, WorkersLeaving, is_peer_failure, run
from .state import State

__all__ = ["State", "run", "QuorumError", "is_peer_failure", "MembershipChange", "JoinersAdmitted", "WorkersLeaving",
           "KeepGlobalBatch", "KeepWorkerBatch", "Resize", "ResizePolicy", "rescale_lr"]
