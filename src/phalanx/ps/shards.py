"""What a server holds: shards with versions and their update policy (the sync reducer is in reducer.py).

A shard is one variable, or one piece of a variable that placement split. It carries:

* a ``version``, bumped by every applied update. A push names the version it was
  computed from, and the gap between the two is the update's staleness;
* a :class:`Policy`: the server-side optimizer, ``max_staleness`` (staler pushes are
  dropped and counted), and a lock policy. The first worker to register the shard sets
  the policy.

Every request is checked whole before anything changes. An unknown name, a wrong dtype,
a wrong shape, a non-finite value (NaN, inf), an update whose *result* would not be finite
(a finite gradient at a huge lr) or a version past :data:`VERSION_LIMIT` rejects the
request, and no shard moves.
:meth:`ShardStore.admit` runs on each tensor header before its tensor is even allocated.

The shards a server may hold are bounded: a strategy registers its whole set at once and
*seals* it (``seal=True``); after that no new name is accepted. Before sealing,
``max_bytes`` bounds what registrations may allocate.

Example:
    >>> import torch
    >>> from phalanx.ps.wire import Header
    >>> store = ShardStore()
    >>> _ = store.init([(Header("w", torch.float32, (2,)), torch.zeros(2))], Policy(SGD(lr=1.0)))
    >>> store.push([(Header("w", torch.float32, (2,), version=0), torch.ones(2))])
    ([], 1)
    >>> store.shards["w"].value, store.shards["w"].version
    (tensor([-1., -1.]), 1)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, ContextManager, Sequence

import torch

from .. import check
from ..framing import read_verified, write_verified
from ..errors import ConfigError, PhalanxError, usage
from .optim import SGD, Adagrad, from_spec
from .wire import MAX_VERSION, Header

Tensors = Sequence[tuple[Header, torch.Tensor]]


# Updates stop here, far below what the wire carries (MAX_VERSION): a concurrent update or two past the check
# still travels, so no reply can fail to pack and no shard can be silenced by a `set` near the limit.
VERSION_LIMIT = MAX_VERSION // 2


class RejectError(PhalanxError, ValueError):
    """A request the server refused as a whole; its state is unchanged."""


class ShardLock:
    """Serialise updates of each shard: no update is lost, concurrent pushes queue."""

    def new(self) -> ContextManager[Any]:
        return threading.Lock()


class NoLock:
    """Hogwild: concurrent updates of one shard may interleave; faster, and some updates may be lost."""

    def new(self) -> ContextManager[Any]:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class Policy:
    """The rules of a shard, fixed when the first worker registers it."""

    rule: "SGD | Adagrad | None"  # None: the shard takes no gradients (an EASGD centre)
    lock: bool = True
    max_staleness: int | None = None

    def spec(self) -> dict[str, Any]:
        return {"rule": self.rule.spec() if self.rule else None, "lock": self.lock, "max_staleness": self.max_staleness}

    def json(self) -> str:
        return json.dumps(self.spec(), sort_keys=True)

    @classmethod
    def from_spec(cls, spec: Any) -> "Policy":
        if not isinstance(spec, dict):
            raise ConfigError(usage(f"policy {spec!r}", "a JSON object", "Send rule, lock and max_staleness."))
        stale = spec.get("max_staleness")
        if stale is not None:
            check.integer("max_staleness", stale, "Send None for no limit; 0 applies only pushes computed from the "
                          "current version.")
        rule = spec.get("rule")
        return cls(None if rule is None else from_spec(rule), bool(spec.get("lock", True)), stale)


def _finite(tensors: Tensors, what: str,
            fix: str = "Check the loss for overflow (or skip the step, as GradScaler does).") -> None:
    for header, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise RejectError(f"{what} of {header.name!r} holds NaN or inf; refused, nothing changed. {fix}")


def _lr(value: Any) -> float:
    """A learning rate sent with a push: a finite number >= 0 (a schedule may reach 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise RejectError(f"lr={value!r} sent with a push; expected a finite number >= 0")
    return float(value)


STATE_SEP = "#"  # "w#sum": the rule's state tensor "sum" of shard "w", in snapshot and set requests


class Shard:
    def __init__(self, value: torch.Tensor, policy: Policy, version: int = 0,
                 state: dict[str, torch.Tensor] | None = None) -> None:
        self.value, self.policy, self.version = value, policy, version
        self.state = (policy.rule.init_state(value) if policy.rule else {}) if state is None else state
        self.guard = (ShardLock() if policy.lock else NoLock()).new()

    def stale(self, computed_from: int) -> bool:
        """Whether a push computed from version ``computed_from`` is too stale to apply (hold the guard)."""
        limit = self.policy.max_staleness
        return limit is not None and self.version - computed_from > limit

    def propose(self, name: str, grad: torch.Tensor, lr: float | None = None) -> tuple[torch.Tensor, dict]:
        """The value and state after ``grad``, computed aside (hold the guard); raises :class:`RejectError`
        when the result is not finite: finite inputs can still overflow (a finite push at lr 1e30)."""
        value, state = self.value.clone(), {k: v.clone() for k, v in self.state.items()}
        self.policy.rule.apply_(value, grad, state, lr=lr)  # type: ignore[union-attr]
        _finite([(Header(name, value.dtype, tuple(value.shape)), value),
                 *((Header(f"{name}{STATE_SEP}{k}", v.dtype, tuple(v.shape)), v) for k, v in state.items())],
                "the result of this update", "The inputs were finite: the learning rate or the gradient is too "
                "large for the shard's dtype.")
        return value, state

    def commit(self, value: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Install a proposed update (hold the guard)."""
        self.value, self.state = value, state
        self.version += 1

    def push(self, name: str, grad: torch.Tensor, computed_from: int, lr: float | None = None) -> bool:
        """Apply ``grad`` (at ``lr``, when the worker sends its current one) unless too stale; True if applied."""
        with self.guard:
            if self.stale(computed_from):
                return False
            self.commit(*self.propose(name, grad, lr))
            return True

    def propose_easgd(self, name: str, x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        """EASGD's elastic move ``d = α(x − c)`` and the new centre ``c + d``, refused unless both are finite."""
        d = (x - self.value).mul_(alpha)
        centre = self.value + d
        _finite([(Header(name, d.dtype, tuple(d.shape)), d), (Header(name, centre.dtype, tuple(centre.shape)), centre)],
                "the result of this elastic move", "The inputs were finite: the worker's parameter and the centre "
                "are too far apart for the shard's dtype.")
        return d, centre

    def snapshot(self) -> tuple[torch.Tensor, int]:
        with self.guard:
            return self.value.clone(), self.version

    def set(self, value: torch.Tensor, version: int, state: dict[str, torch.Tensor]) -> None:
        """Replace value, version (at most :data:`VERSION_LIMIT`) and the rule's state (a job resuming)."""
        with self.guard:
            self.value.copy_(value)
            self.version = version
            for key, saved in state.items():
                self.state[key].copy_(saved)


def _below_limit(name: str, version: int) -> None:
    if version >= VERSION_LIMIT:
        raise RejectError(f"{name!r} is at version {version}, the limit (2^62): it takes no more updates. "
                          "Restore it from a checkpoint.")


@contextlib.contextmanager
def _holding(shards: Sequence[Shard]) -> Any:
    """Hold the guards of several shards, in one global order (by identity), so two requests cannot deadlock."""
    with contextlib.ExitStack() as stack:
        for shard in sorted(set(shards), key=id):
            stack.enter_context(shard.guard)
        yield


def mismatch(header: Header, dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    """What is wrong with ``header`` for a shard of ``dtype`` and ``shape``, or None."""
    if header.dtype != dtype or header.shape != shape:
        return (f"{header.name!r} sent as {header.dtype} {list(header.shape)}; "
                f"the server holds {dtype} {list(shape)}")
    return None


class ShardStore:
    """All shards of one server. Thread-safe: handler threads share it."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.shards: dict[str, Shard] = {}
        self.counts: Counter[str] = Counter()  # applied, dropped_stale, easgd: shard updates
        self._counts_lock = threading.Lock()  # handler threads update counts concurrently
        self._registry = threading.Lock()
        self.sealed = False  # True once a strategy registered its whole set: no new names after that
        self.max_bytes = max_bytes  # what registrations may allocate before the set is sealed

    @property
    def bytes_held(self) -> int:
        return sum(s.value.numel() * s.value.element_size() for s in list(self.shards.values()))

    def admit(self, op: Any, header: Header) -> None:
        """Refuse a tensor header before its tensor is allocated, unless ``op`` may carry it."""
        if op == "init":
            shard = self.shards.get(header.name)
            if shard is not None:
                problem = mismatch(header, shard.value.dtype, tuple(shard.value.shape))
                if problem:
                    raise RejectError(f"cannot register {problem}. Is this the same model?")
                return
            if self.sealed:
                raise RejectError(f"cannot register {header.name!r}: this server's shards were sealed by the job's "
                                  f"first registration ({len(self.shards)} shards); one model per set of servers")
            if self.max_bytes is not None and self.bytes_held + header.nbytes > self.max_bytes:
                raise RejectError(f"registering {header.name!r} ({header.nbytes} bytes) would pass this server's "
                                  f"limit of {self.max_bytes} bytes")
            return
        if op not in ("push", "easgd", "reduce", "set"):
            raise RejectError(f"op {op!r} carries no tensors; got {header.name!r}")
        name, _, key = header.name.partition(STATE_SEP) if op == "set" else (header.name, "", "")
        shard = self.shards.get(name)
        if shard is None:
            raise RejectError(f"unknown variable {name[:200]!r}; this server holds {len(self.shards)} shards. "
                              "Register it first (the strategy's attach does), or check the placement.")
        ref = shard.value if not key else shard.state.get(key)
        if ref is None:
            raise RejectError(f"{name!r} has no state {key!r}; its rule keeps {sorted(shard.state)}")
        problem = mismatch(header, ref.dtype, tuple(ref.shape))
        if problem:
            raise RejectError(problem)

    def check(self, tensors: Tensors) -> list[Shard]:
        """The shards ``tensors`` address; raises :class:`RejectError` if any is unknown or mismatched."""
        names = [h.name for h, _ in tensors]
        if len(set(names)) != len(names):
            raise RejectError("a shard appears twice in one request")
        found = []
        for header, _ in tensors:
            shard = self.shards.get(header.name)
            if shard is None:
                raise RejectError(f"unknown variable {header.name!r}; this server holds {len(self.shards)} shards. "
                                  "Register it first (the strategy's attach does), or check the placement.")
            problem = mismatch(header, shard.value.dtype, tuple(shard.value.shape))
            if problem:
                raise RejectError(problem)
            found.append(shard)
        return found

    def init(self, tensors: Tensors, policy: Policy, *, seal: bool = False) -> dict[str, Any]:
        """Register shards that do not exist yet; existing ones keep their value (a late joiner pulls them).

        ``seal``: these are all the shards this server will hold for the job; refuse new names afterwards.
        """
        if len({h.name for h, _ in tensors}) != len(tensors):
            raise RejectError("a shard appears twice in one registration")
        _finite(tensors, "the initial value")
        with self._registry:
            for header, _ in tensors:
                self.admit("init", header)  # again, under the lock: another registration may have raced us
            if self.max_bytes is not None and \
                    self.bytes_held + sum(h.nbytes for h, _ in tensors if h.name not in self.shards) > self.max_bytes:
                raise RejectError(f"this registration would pass the server's limit of {self.max_bytes} bytes")
            created = [h.name for h, t in tensors if h.name not in self.shards]
            for header, tensor in tensors:
                if header.name not in self.shards:
                    self.shards[header.name] = Shard(tensor.clone(), policy)
            policies = {self.shards[h.name].policy.json() for h, _ in tensors}
            self.sealed = self.sealed or bool(seal)
        return {"created": len(created), "existing": len(tensors) - len(created),
                "same_policy": policies <= {policy.json()}}

    def push(self, tensors: Tensors, lrs: Any = None) -> tuple[list[str], int]:
        """Apply gradients; returns (names dropped as too stale, applied count).

        ``lrs``: None, or one learning rate per tensor (the worker's current ones, for an SGD rule).
        """
        shards = self.check(tensors)
        if lrs is not None and (not isinstance(lrs, list) or len(lrs) != len(tensors)):
            raise RejectError(f"push with lr={str(lrs)[:80]}; expected a list of {len(tensors)} learning rates")
        rates: list[float | None] = [_lr(v) for v in lrs] if lrs is not None else [None] * len(tensors)
        _finite(tensors, "the gradient")
        for (header, _), shard, rate in zip(tensors, shards, rates, strict=True):
            if shard.policy.rule is None:
                raise RejectError(f"{header.name!r} takes no gradients (it was registered without a server "
                                  "optimizer, e.g. as an EASGD centre)")
            if rate is not None and shard.policy.rule.kind != "sgd":  # type: ignore[union-attr]
                raise RejectError(f"{header.name!r} follows the server's own {shard.policy.rule!r}; "
                                  "a push may not set its lr")
            if header.version > shard.version:
                raise RejectError(f"{header.name!r} pushed from version {header.version} but the server is at "
                                  f"{shard.version}; pull before pushing (did the server restart from a checkpoint?)")
            _below_limit(header.name, shard.version)
        dropped: list[str] = []
        with _holding(shards):  # every result is computed and checked before any shard changes
            proposed = []
            for (header, g), shard, rate in zip(tensors, shards, rates, strict=True):
                if shard.stale(header.version):
                    dropped.append(header.name)
                else:
                    proposed.append((shard, shard.propose(header.name, g, rate)))
            for shard, (value, state) in proposed:
                shard.commit(value, state)
        with self._counts_lock:
            self.counts.update(applied=len(tensors) - len(dropped), dropped_stale=len(dropped))
        return dropped, len(tensors) - len(dropped)

    def easgd(self, tensors: Tensors, alpha: float) -> list[tuple[Header, torch.Tensor]]:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
            raise RejectError(f"elastic alpha={alpha!r}; expected 0 < alpha < 1")
        shards = self.check(tensors)
        _finite(tensors, "the parameter")
        for (header, _), shard in zip(tensors, shards, strict=True):
            _below_limit(header.name, shard.version)
        out = []
        with _holding(shards):  # every move is computed and checked before any centre changes
            moves = [shard.propose_easgd(header.name, x, float(alpha))
                     for (header, x), shard in zip(tensors, shards, strict=True)]
            for (header, _), shard, (d, centre) in zip(tensors, shards, moves, strict=True):
                shard.value = centre
                shard.version += 1
                out.append((Header(header.name, d.dtype, tuple(d.shape), shard.version), d))
        with self._counts_lock:
            self.counts.update(easgd=len(tensors))
        return out

    def pull(self, names: Any) -> list[tuple[Header, torch.Tensor]]:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RejectError("pull expects a list of shard names")
        missing = [n for n in names if n not in self.shards]
        if missing:
            raise RejectError(f"unknown variable {missing[0]!r} ({len(missing)} unknown); register it first")
        out = []
        for name in names:
            value, version = self.shards[name].snapshot()
            out.append((Header(name, value.dtype, tuple(value.shape), version), value))
        return out

    def snapshot(self) -> list[tuple[Header, torch.Tensor]]:
        """Every shard's value (its version in the header), then its rule's state as ``name#key``."""
        out = []
        for name, shard in list(self.shards.items()):
            with shard.guard:
                out.append((Header(name, shard.value.dtype, tuple(shard.value.shape), shard.version),
                            shard.value.clone()))
                out += [(Header(name + STATE_SEP + k, v.dtype, tuple(v.shape)), v.clone())
                        for k, v in shard.state.items()]
        return out

    def set(self, tensors: Tensors) -> int:
        """Overwrite shards with a snapshot (values with versions, and ``name#key`` states); all or nothing."""
        self.check([(h, t) for h, t in tensors if STATE_SEP not in h.name])
        _finite(tensors, "the value")
        values: dict[str, tuple[torch.Tensor, int]] = {}
        states: dict[str, dict[str, torch.Tensor]] = {}
        for header, t in tensors:
            name, _, key = header.name.partition(STATE_SEP)
            shard = self.shards.get(name)
            if shard is None:
                raise RejectError(f"unknown variable {name!r}")
            if key:
                ref = shard.state.get(key)
                problem = mismatch(header, ref.dtype, tuple(ref.shape)) if ref is not None else "unknown state"
                if problem or key in states.get(name, {}):
                    raise RejectError(f"state {header.name!r}: {problem or 'sent twice'}")
                states.setdefault(name, {})[key] = t
            else:
                if header.version > VERSION_LIMIT:
                    raise RejectError(f"{name!r} set to version {header.version}; expected at most 2^62 "
                                      "(a version no job reaches)")
                values[name] = (t, header.version)
        for name in states.keys() - values.keys():
            raise RejectError(f"state of {name!r} sent without its value")
        for name in values:  # all of a shard's state or none: a half-restored Adagrad sum would be wrong silently
            want, got = set(self.shards[name].state), set(states.get(name, {}))
            if got and got != want:
                raise RejectError(f"{name!r}: state {sorted(got)} sent; its rule keeps {sorted(want)}")
        for name, (value, version) in values.items():
            self.shards[name].set(value, version, states.get(name, {}))
        return len(values)

    # -- checkpoints: atomic, verified, weights_only (the format of px.save_checkpoint) ----------
    def save(self, path: str | os.PathLike) -> None:
        body: dict[str, Any] = {"format": "phalanx-ps-shards-1", "counts": dict(self.counts), "shards": {}}
        for name, shard in list(self.shards.items()):
            with shard.guard:
                body["shards"][name] = {"value": shard.value.clone(), "version": shard.version,
                                        "state": {k: v.clone() for k, v in shard.state.items()},
                                        "policy": shard.policy.json()}
        write_verified(path, body)

    def load(self, path: str | os.PathLike) -> None:
        body = read_verified(path)
        if body.get("format") != "phalanx-ps-shards-1":
            raise RejectError(f"{os.fspath(path)!r} is a phalanx checkpoint but not a parameter-server shard file")
        with self._registry:
            self.shards = {name: Shard(s["value"], Policy.from_spec(json.loads(s["policy"])),
                                       int(s["version"]), dict(s["state"])) for name, s in body["shards"].items()}
            self.counts = Counter(body.get("counts", {}))
