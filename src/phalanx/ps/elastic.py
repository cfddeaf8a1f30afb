"""How asynchronous PS training (Downpour, async EASGD) follows an elastic job's worker group.

Under ``phalanx run --elastic --servers K`` the servers outlive every worker, and hold the
model. Three rules keep every sample trained exactly once in the final model's history:

* **A commit is one consistent cut** (:meth:`FollowsElasticGroup.commit_point`): every worker
  waits for the others just before and just after it, so the servers' snapshot in each
  worker's commit holds every push up to the commit's step and none after it.
* **A rollback puts the servers back** to that snapshot (rank 0 sends it), before anyone
  passes the barrier of :meth:`FollowsElasticGroup.regroup`. The pushes made after the
  commit, the dead worker's and the survivors', are taken back; the survivors redo those
  steps on the re-split data, exactly as synchronous training does.
* **A joiner never puts them back** (:meth:`FollowsElasticGroup.load_joiner_state_dict`):
  it takes rank 0's step count, optimizer and data position and, as its model, the
  servers' shards as they are (a pull after the barrier). Nobody rolls back.

A server that exits is started again, empty, on its address by the launcher
(:func:`phalanx.ps.launcher.restart_exited`, at most ``MAX_RESTARTS`` times). The workers
waiting on it or refused by it give up (:meth:`FollowsElasticGroup.server_restarted`), and the group
rolls back as after a worker's crash: rank 0 registers the shards again and restores
them from the commit (the synchronous PS holds no model: its workers only register).

Outside ``--elastic`` all of this does nothing. What it needs of the membership (is the
group elastic, its generation, the job's store that outlives generations) it reads from
the worker group (:class:`phalanx.group.group.Group`), which ``phalanx.elastic`` rebuilds: this
module never imports ``phalanx.elastic``.

Example (one worker, not elastic: nothing to wait for):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(2, 1)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.Downpour())
    >>> px.strategy_of(opt).commit_point(); px.strategy_of(opt).finish()
"""
from __future__ import annotations

from typing import Any

from ..group import group
from ..strategies.allreduce import rebuilt


class FollowsElasticGroup:
    """What a PS strategy does around commits, rollbacks and joins (mixed into ``PSStrategy``)."""

    def commit_point(self) -> None:
        """Under ``--elastic``, just before and just after each commit: wait for every worker (collective).

        Before: every worker's exchanges up to this step have reached the servers, so the
        snapshot in the commit holds them all. After: no one's next exchange lands before
        every worker took its snapshot. The commit is then one consistent cut of the data
        position and the servers' shards, and a rollback to it trains each sample exactly
        once in the final model's history. Elsewhere (no group, or servers holding no model)
        it does nothing.
        """
        if self.servers_hold_the_model and rebuilt(group.current()) and group.world_size() > 1:
            self.comm.barrier()  # type: ignore[attr-defined]

    def load_joiner_state_dict(self, state: dict[str, Any]) -> None:
        """A worker joining a running ``--elastic`` job: rank 0's step count, and the servers as they are now.

        Unlike :meth:`load_state_dict` (a rollback or a resume), this never puts the servers
        back to the snapshot in ``state``: the members go on from the servers' current shards
        and so does the joiner, whose model becomes those shards (a pull).
        """
        super().load_state_dict({k: v for k, v in state.items() if k != "servers"})  # type: ignore[misc]
        self._pull_at_regroup = self.servers_hold_the_model  # after every member passed regroup()'s barrier

    def watch_servers(self) -> None:
        """Under ``--elastic`` with separate servers: a call that a restarted server will never answer gives up.

        The launcher starts an exited server again, empty, on its address, and counts it in
        the job's store; a worker waiting on it (or refused by it) then raises
        :class:`~phalanx.WorkerLostError`, and the group rolls back to its last commit,
        which holds the servers' shards.
        """
        if rebuilt(group.current()) and self.link is not None and self.link.hosted is None:  # type: ignore[attr-defined]
            self._restarts_seen = servers_restarted()
            self.link.client.abandon = self.server_restarted  # type: ignore[attr-defined]

    def server_restarted(self) -> str | None:
        """Why the servers lost their state since this worker last regrouped (a restart), or None."""
        if servers_restarted() > getattr(self, "_restarts_seen", servers_restarted()):
            return ("a parameter server exited and the launcher started it again, empty; the workers roll back "
                    "to their last commit, which holds its shards")
        return None

    def _servers_back(self, *, register: bool) -> None:
        """After a regroup: a restarted server is known again (``register``: we send it our names and rule)."""
        restarted = self.server_restarted()
        self._restarts_seen = servers_restarted()  # first: our own calls to it must not give up now
        if register and restarted:
            self._exchange(self.join)  # type: ignore[attr-defined]

    def regroup(self) -> None:
        """Under ``--elastic``, after a change, on every member of the new group: one barrier.

        A rollback's ``set`` (rank 0, in :meth:`load_state_dict`) is on the servers before
        anyone passes it, so no one's next push is overwritten and a joiner's pull sees it.
        """
        if not self.servers_hold_the_model:
            return
        self.comm.barrier()  # type: ignore[attr-defined]
        self._servers_back(register=False)  # rank 0 registered and restored the shards before the barrier
        self._generation = group.current().generation
        if getattr(self, "_pull_at_regroup", False):
            self._pull_at_regroup = False
            self._exchange(self.table.pull)  # type: ignore[attr-defined]

    def _regroup_pending(self) -> bool:
        """Under ``--elastic``: the group changed and :meth:`regroup` has not run yet (we are rolling back)."""
        g = group.current()
        return rebuilt(g) and g.generation != getattr(self, "_generation", 0)


def servers_restarted() -> int:
    """How many times the launcher started an exited parameter server (``--servers``) again; 0 outside ``--elastic``.

    Read from the job's store, which outlives every generation of the group.
    """
    store = group.current().job_store
    if store is None or not rebuilt(group.current()):
        return 0
    return int(store.get(RESTARTS)) if store.check([RESTARTS]) else 0


RESTARTS = group.job_key("ps", "restarts")  # counted by the launcher in the job's store, read by the workers
