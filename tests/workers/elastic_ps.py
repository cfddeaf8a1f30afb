"""tests/workers/elastic.py on asynchronous parameter servers, with a model whose servers count samples.

Run it like that script (``phalanx run --elastic -n 3 --servers 1 tests/workers/elastic_ps.py --out DIR
--strategy downpour --kill 1@5``); it trains the same data with the same record of sample ids, and:

* the model is :class:`Counting`: under ``F.mse_loss(out, 0)`` each sample adds exactly its ``x``
  to the weight's gradient and 1 to the bias's, whatever the parameters are. With plain SGD on
  the servers (Downpour), the servers' final bias is ``b0 - lr * (samples applied)`` and their
  weight ``W0 - lr * (sum of their x)``, in any order and at any staleness: an exact oracle of
  an asynchronous run, which counts every sample the servers applied;
* ``--server-dies-at S``: worker 0 waits after step S until the test has killed the server;
* it writes ``servers<ID>.json``: the digest of the servers' snapshot in each commit it took,
  and, after each rollback, the digest of the servers right after the regroup next to the
  digest of the commit rolled back to.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import phalanx as px
from support.wait import until

try:
    from workers import elastic as base
except ImportError:  # run as a script: tests/workers is on the path
    import elastic as base  # type: ignore[no-redef]

LR = 0.01
DATA = base.dataset  # the regression data of tests/workers/elastic.py (its targets are replaced by 0)


class Counting(torch.nn.Module):
    """Outputs 1; d loss / d (W x_i + b) is 1 for every sample under mean-squared error against 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(base.DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        return 1 + (z - z.detach()) * len(x) / 2  # mse's 2/B times B/2: each sample's gradient is (x_i, 1)


def dataset() -> torch.utils.data.TensorDataset:
    x, _, ids = DATA().tensors
    return torch.utils.data.TensorDataset(x, torch.zeros(len(x), 1), ids)


def counted(samples: int) -> list[torch.Tensor]:
    """The servers' parameters after applying ``samples`` passes over the data set: [weight, bias]."""
    net, (x, _, _) = Counting(), dataset().tensors
    epochs = samples / len(x)
    return [net.lin.weight.detach() - LR * epochs * x.sum(0, keepdim=True),
            net.lin.bias.detach() - LR * samples]


def digest(shards: dict) -> list[float]:
    """Sums of the servers' values per parameter (model order), in float64."""
    return [float(shards[n]["value"].double().sum()) for n, _ in Counting().named_parameters()]


LOG: dict = {"commits": [], "after_rollback": []}


class RecordingState(px.elastic.State):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        LOG["state"] = self

    def commit(self) -> None:
        super().commit()
        snap = self.commits.get(self.step) if self.elastic else None
        if snap is not None and snap["strategy"].get("servers") is not None:
            LOG["commits"].append([self.step, digest(snap["strategy"]["servers"])])

    def at_commit_point(self) -> None:
        super().at_commit_point()
        # --server-dies-at S: worker 0 stops after step S (before step S+1) until the test has killed the server
        if SERVER_DIES_AT and os.environ.get("PHALANX_ELASTIC_ID") == "0" and self.step == SERVER_DIES_AT \
                and not self.history:
            open(os.path.join(OUT, "kill-server"), "w").close()
            until(lambda: os.path.exists(os.path.join(OUT, "server-killed")), timeout=60, what="the server's kill")

    def recover(self, failure: str, failed_at: float | None = None) -> None:
        super().recover(failure, failed_at)
        if self.commits[self.step]["strategy"].get("servers") is None:
            return  # the synchronous PS: its servers hold no model
        # Nobody pushes yet: the others wait for us in the next step's gather (tests/workers/elastic.py).
        now = px.strategy_of(self.optimizer).table.snapshot()
        LOG["after_rollback"].append({"step": self.step, "servers": digest(now),
                                      "commit": digest(self.commits[self.step]["strategy"]["servers"])})


SERVER_DIES_AT, OUT = 0, ""


def main() -> None:
    global SERVER_DIES_AT, OUT
    OUT = sys.argv[sys.argv.index("--out") + 1]
    if "--server-dies-at" in sys.argv:  # ours, not tests/workers/elastic.py's
        at = sys.argv.index("--server-dies-at")
        SERVER_DIES_AT = int(sys.argv[at + 1])
        del sys.argv[at:at + 2]
    base.model, base.dataset = Counting, dataset
    base.optimizer = lambda net: torch.optim.SGD(net.parameters(), lr=LR)  # the servers apply it: plain SGD
    px.elastic.State = RecordingState  # main() builds its state through this name
    base.main()
    strategy = px.strategy_of(LOG.pop("state").optimizer)
    strategy.finish()  # every worker's last pushes, then the servers' final model on each
    LOG["final"] = [p.tolist() for p in strategy.params]
    me = os.environ.get("PHALANX_ELASTIC_ID", "0")
    with open(os.path.join(OUT, f"servers{me}.json"), "w") as f:
        json.dump(LOG, f)


if __name__ == "__main__":
    main()
