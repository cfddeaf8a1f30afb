"""The synchronous parameter server's reducer: average each step's gradients over the workers.

Every worker sends its gradients for step s with the number of workers it counts; the
server sums them, and when the last one arrives it answers everyone with the mean.
Rounds are bounded: one that does not complete within the timeout is abandoned (its
waiting workers told), and only a few may be open at once. Under ``--elastic`` each
request also names the worker group's generation: after a regroup the survivors redo
steps with a new worker count, so a round is keyed by (generation, step), and the first
round of a newer generation drops the rounds the old group left half-filled.

Example:
    >>> import torch
    >>> from phalanx.ps.wire import Header
    >>> r = Reducer(timeout=5.0)
    >>> r.contribute(0, 2, b"a", [(Header("w", torch.float32, (1,)), torch.ones(1))]) is None
    True
    >>> who, means = r.contribute(0, 2, b"b", [(Header("w", torch.float32, (1,)), torch.full((1,), 3.0))])
    >>> who, means[0][1]
    ([b'a', b'b'], tensor([2.]))
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch

from .shards import RejectError, Tensors, mismatch
from .wire import Header


class Reducer:
    """Synchronous mode: average each step's gradients over all workers, then answer them all.

    A round that does not complete within ``timeout`` seconds (a worker died or never
    came) is abandoned: its partial sum is dropped and the workers waiting on it are told.
    At most ``max_rounds`` rounds are open at once, so open rounds cannot pile up.
    """

    MAX_WORKERS = 65536

    def __init__(self, timeout: float = 30.0, max_rounds: int = 8) -> None:
        self._lock = threading.Lock()
        self._rounds: dict[tuple[int, int], dict[str, Any]] = {}  # (generation, step) -> round
        self.timeout, self.max_rounds = timeout, max_rounds

    def expire(self, now: float | None = None) -> list[tuple[Any, str]]:
        """Abandon rounds older than the timeout; returns (waiting worker, why) for each one to tell."""
        now = time.monotonic() if now is None else now
        told = []
        with self._lock:
            for (generation, step), rnd in list(self._rounds.items()):
                if now - rnd["started"] > self.timeout:
                    del self._rounds[(generation, step)]
                    why = (f"synchronous round of step {step} abandoned after {self.timeout:g} s: only "
                           f"{len(rnd['who'])} of {rnd['workers']} workers contributed (a worker crashed, stopped or "
                           "counts steps differently); its partial sum was dropped")
                    told += [(who, why) for who in rnd["who"]]
        return told

    def contribute(self, step: Any, workers: Any, who: bytes, tensors: Tensors,
                   generation: Any = 0) -> tuple[list[bytes], list[tuple[Header, torch.Tensor]]] | None:
        """Add one worker's gradients; when the last arrives, return (everyone waiting, the means)."""
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (step, workers, generation)) \
                or not 1 <= workers <= self.MAX_WORKERS or generation < 0:
            raise RejectError(f"reduce needs an integer step, 1 <= workers <= {self.MAX_WORKERS} and an integer "
                              f"generation >= 0; got step={step!r}, workers={workers!r}, generation={generation!r}")
        if len({h.name for h, _ in tensors}) != len(tensors):
            raise RejectError("a shard appears twice in one request")
        with self._lock:
            for old in [k for k in self._rounds if k[0] < generation]:
                del self._rounds[old]  # left half-filled by a group that regrouped; its survivors redo it
            rnd = self._rounds.get((generation, step))
            if rnd is None:
                if len(self._rounds) >= self.max_rounds:
                    raise RejectError(f"{len(self._rounds)} synchronous rounds are already open (steps "
                                      f"{sorted(s for _, s in self._rounds)[:8]}); a worker is far ahead of "
                                      "the others")
                rnd = self._rounds[(generation, step)] = {"workers": workers, "who": [], "started": time.monotonic(),
                                            "sums": [(h, t) for h, t in tensors]}
            else:
                self._check_round(rnd, step, workers, who, tensors)
                for (_, acc), (_, t) in zip(rnd["sums"], tensors, strict=True):
                    acc.add_(t)
            rnd["who"].append(who)
            if len(rnd["who"]) < workers:
                return None
            del self._rounds[(generation, step)]
        means = [(Header(h.name, h.dtype, h.shape, step), acc.div_(workers)) for h, acc in rnd["sums"]]
        return rnd["who"], means

    @staticmethod
    def _check_round(rnd: dict[str, Any], step: int, workers: int, who: bytes, tensors: Tensors) -> None:
        if rnd["workers"] != workers:
            raise RejectError(f"step {step}: this worker counts {workers} workers, the first counted {rnd['workers']}")
        if who in rnd["who"]:
            raise RejectError(f"step {step}: this worker already contributed")
        first = [h for h, _ in rnd["sums"]]
        if [h.name for h, _ in tensors] != [h.name for h in first]:
            raise RejectError(f"step {step}: the shard names differ from the first worker's; is it the same model?")
        for (header, _), ref in zip(tensors, first, strict=True):
            problem = mismatch(header, ref.dtype, ref.shape)
            if problem:
                raise RejectError(f"step {step}: {problem} (as the first worker sent it)")
