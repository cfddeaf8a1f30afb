"""Streaming DiLoCo: DiLoCo by fragments, each on its own staggered schedule, its exchange overlapped.

Douillard et al. 2025 ("Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", arXiv 2501.18512, Algorithm 1):

* the parameters are cut into ``P`` fragments (here: consecutive in parameter order,
  whole tensors balanced by bytes; or ``cut="values"``: equal parts of the concatenated values,
  a tensor split where a cut falls inside it); fragment ``p`` takes its outer step every ``H`` inner steps, at the
  steps ``t`` with ``t % H == p * H // P``, so only about ``1/P`` of the model travels at once
  (the peak bandwidth falls ``P``-fold);
* at its step the fragment's pseudo-gradient ``anchor - weights`` is sent without waiting
  (a gloo ``async_op`` collective) and training goes on; ``τ`` (``overlap``) inner steps
  later the average is taken, the outer optimiser (Nesterov SGD, lr 0.7, momentum 0.9, as
  DiLoCo) moves the fragment's anchor, and the worker's fragment becomes
  ``α · local + (1 - α) · anchor`` (``mixing``: the local steps taken during the overlap
  are kept in part);
* or, ``mixing="eager"`` (Kale et al. 2025, "Eager Updates for Overlapped Communication and
  Computation in DiLoCo", arXiv 2502.12996): at the send the fragment takes the outer step
  at once with its own pseudo-gradient standing in for the average, inner steps go on from
  there, and when the average lands the stand-in is replaced by it:
  ``weights = anchor + (weights - weights_after_the_eager_step)``. Every local step taken
  during the overlap is kept whole, and the average is taken whole (a joiner, which holds no
  stand-in, takes the anchor);
* the pseudo-gradient may be quantised (``quantize=4``: :class:`phalanx.Quantize`); the
  paper found 4-bit outer gradients lose nothing measurable;
* ``moments=("exp_avg",)`` also averages the inner optimizer's named states with each
  fragment, in the same message (DES-LOC, arXiv 2505.22549; :mod:`phalanx.strategies.moments`):
  when the average lands each worker swaps its own sent part for the average's.

With ``fragments=1, overlap=0`` and no quantisation this is ``px.DiLoCo(every=H)``, bit for bit.

Elastic runs: an exchange in flight is state. ``state_dict()`` names the fragments in
flight (and holds each anchor and momentum); ``replica_state_dict()`` holds the message
this worker sent. After a regroup (or a restore) the old work handles are dropped, not
waited for, and every worker sends its message again, in fragment order, at its next
step: the survivors' average, without the lost worker's part. A joiner sends an empty
message (weight 0). Synchronous compressors (FP16, PowerSGD) finish their exchange at
once, so their result, the same on every worker, is shared state.

On shards (``shard=px.FullyShard(...)``) each rank exchanges its rows of each fragment with the
same shard of the other replica groups. Under ``--elastic`` every exchange in flight lands at each
commit (:meth:`StreamingDiLoCo.commit_point`), and the anchors, outer momentum and those averages
are rows a regroup moves with the model's (``phalanx.sharding.reshard.RowState``).

Example:
    >>> import phalanx as px
    >>> s = px.StreamingDiLoCo(every=100, fragments=4, overlap=2, quantize=4)
    >>> s.mixing, s.compression
    (0.5, Quantize(bits=4, block=128))
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from .. import check
from ..group.guard import guarded
from .compression import Compressor, check_compressor
from ..errors import ConfigError, usage
from .quantize import Gathered, Quantize, check_floating
from .sparseloco import outer_defaults
from .accounting import Accounting
from .base import (Start, StepState, Strategy, compressor_replica_state, from_rank_0, drifting_replica_state,
                   load_compressor_replica_state, load_drifting_replica_state, load_rows)
from .buffers import BufferMean
from .diloco import _outer_dtype, outer_direction
from .fragments import Fragment, Piece, balanced_split, buffers_by_fragment, piece_view, value_split, whole_pieces
from .gradients import share_total
from .moments import Moments


#: How the parameters are cut into fragments (``StreamingDiLoCo(cut=...)``).
CUTS = ("tensors", "values")


class StreamingDiLoCo(Accounting, StepState, Strategy):
    """DiLoCo by fragments on staggered schedules, each outer exchange overlapped with ``overlap`` inner steps.

    Args:
        every: inner steps between two outer steps of one fragment (H).
        fragments: how many pieces the parameters are cut into (P; consecutive, balanced bytes);
            fragment ``p`` syncs at the steps ``t % H == p * H // P``.
        overlap: inner steps an exchange has to travel before it is applied (τ, ``0 <= τ < H``).
        quantize: None (float32 all-reduce), 8 or 4 (``px.Quantize(bits)``: all-gather of packed
            values), or any compressor object (``px.Quantize(4, block=64, rounding="stochastic")``,
            ``px.SparseLoCo()`` (2-bit chunked top-k, also all-gathered and overlapped), ``px.FP16()``;
            those without an asynchronous exchange finish it at once).
        mixing: α, the local weights' part when the average lands (``α · local + (1-α) · global``);
            default 0.5 with overlap (kept local progress), 0 without (DiLoCo: the global replaces it).
            ``"eager"``: the outer step is taken at the send with this worker's own pseudo-gradient,
            and corrected with the average when it lands (arXiv 2502.12996): the local steps taken
            during the overlap are all kept.
        outer_lr, outer_momentum, nesterov: the outer optimiser, as ``px.DiLoCo`` (0.7 and 0.9; 1 and 0 with
            ``quantize=px.SparseLoCo()``, whose error-feedback accumulator replaces the outer momentum).
        moments: names of the inner optimizer's per-parameter states averaged with each fragment
            (``("momentum",)``: Adam's ``exp_avg`` or SGD's ``momentum_buffer``; default none, as the
            paper): one more copy of the fragment's size in each message per name.
        cut: ``"tensors"`` (the paper's: whole tensors, balanced by bytes as far as the cuts between tensors allow)
            or ``"values"`` (equal parts of the concatenated values: a tensor may be split between fragments, so a
            model with one dominant tensor, an LSTM's recurrent weights or a language model's embedding, still
            sends ``1 / fragments`` of itself at each send). Not with ``moments=`` or ``shard=``.
    """

    name = "streaming-diloco"

    def __init__(self, every: int = 100, fragments: int = 4, overlap: int = 1, quantize: Any = None, *,
                 mixing: float | None = None, outer_lr: float | None = None, outer_momentum: float | None = None,
                 nesterov: bool = True, moments: Sequence[str] = (), cut: str = "tensors") -> None:
        super().__init__()
        self.moments = Moments(moments)
        if cut not in CUTS:
            raise ConfigError(usage(f"StreamingDiLoCo(cut={cut!r})", " or ".join(repr(c) for c in CUTS),
                                    "Pass cut=\"tensors\" (whole tensors, the paper's) or cut=\"values\" (equal "
                                    "parts, a tensor may be split)."))
        if cut == "values" and self.moments:
            # the optimizer's states are per parameter: a fragment holding part of one has no states of its own
            raise ConfigError(usage(f"StreamingDiLoCo(cut='values', moments={self.moments.keys!r})",
                                    "moments= only with cut='tensors'",
                                    "Drop moments=, or cut whole tensors (cut='tensors')."))
        self.cut = cut
        self.every = check.positive_int("StreamingDiLoCo(every", every, "Pass the inner steps between a "
                                        "fragment's outer steps, e.g. every=100.", close=")")
        self.num_fragments = check.positive_int("StreamingDiLoCo(fragments", fragments, "Pass the number of "
                                                "fragments, e.g. fragments=4; 1 is DiLoCo.", close=")")
        self.overlap = check.integer("StreamingDiLoCo(overlap", overlap, "Pass the inner steps an exchange may "
                                     "take, e.g. overlap=1; 0 waits for it.", close=")")
        if self.overlap >= self.every:
            raise ConfigError(usage(f"StreamingDiLoCo(every={self.every}, overlap={self.overlap})",
                                    "overlap < every (an exchange lands before its fragment's next one starts)",
                                    f"Pass overlap <= {self.every - 1}, or a larger every."))
        default = 0.5 if self.overlap else 0.0
        self.mixing: float | str = "eager" if mixing == "eager" else check.number(
            "StreamingDiLoCo(mixing", default if mixing is None else mixing,
            "Pass α in [0, 1] (0 takes the global weights, 1 keeps the local ones), or \"eager\".",
            low=0, high=1, low_open=False, high_open=False, close=")")
        outer_lr, outer_momentum = outer_defaults(quantize, outer_lr, outer_momentum)
        self.outer_lr = check.positive_float("StreamingDiLoCo(outer_lr", outer_lr, "The paper uses 0.7.", close=")")
        self.outer_momentum = check.number("StreamingDiLoCo(outer_momentum", outer_momentum, "The paper uses 0.9.",
                                           low=0, high=1, low_open=False, close=")")
        self.nesterov = bool(nesterov)
        if isinstance(quantize, int) and not isinstance(quantize, bool) and quantize in (4, 8):
            quantize = Quantize(bits=quantize)
        elif isinstance(quantize, (int, float, str, bool)):
            raise ConfigError(usage(f"StreamingDiLoCo(quantize={quantize!r})", "None, 8, 4 or a compressor object",
                                    "Pass quantize=4 (packed 4-bit, as the paper) or px.Quantize(bits, block=...)."))
        self.compression: Compressor | None = check_compressor(quantize, "StreamingDiLoCo")
        if self.compression is not None and "exp_avg_sq" in self.moments.keys:
            # Adam's second moment spans orders of magnitude within a block: a compressed average rounds its small
            # entries to 0 and Adam divides by their root. Measured: the GPT of benchmarks/levers.py diverged with
            # it, 4-bit, at every=4, 8 and 16 (at 64, rarer exchanges, it did not yet in 180 steps; report: "Levers").
            raise ConfigError(usage(f"StreamingDiLoCo(quantize={quantize!r}, moments={self.moments.keys!r})",
                                    "moments=('exp_avg_sq', ...) only with quantize=None (float32)",
                                    "Average only the first moment (moments=('momentum',)) when quantising, or "
                                    "send float32 (quantize=None)."))
        self.fragments: list[Fragment] = []
        self._split: list[range] = []  # cut="tensors": each fragment's parameter indices (a reshard rebuilds from it)

    # -- the template ---------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, start: Start = from_rank_0) -> nn.Module:
        module = super().attach(model, optimizer, start=start)
        if self.moments:
            self.moments.bind(optimizer)
        if self.cut == "tensors" and self.num_fragments > len(self.params):
            raise ConfigError(usage(f"StreamingDiLoCo(fragments={self.num_fragments}) for a model with "
                                    f"{len(self.params)} trainable parameter tensors",
                                    f"fragments <= {len(self.params)} (a fragment holds whole tensors)",
                                    f"Pass fragments={len(self.params)} or fewer, or cut=\"values\"."))
        if self.compression is not None:
            for p in self.params:
                check_floating(p, f"StreamingDiLoCo(quantize={self.compression!r})")
        P, H = self.num_fragments, self.every
        if self.cut == "tensors":
            # Whole tensors' sizes (a sharded model's DTensors count their global rows): every rank cuts the same
            # fragments, so the same parameters travel together as on unsharded replicas, whichever shard it holds.
            sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
            self._split = balanced_split(sizes, P)
            pieces = whole_pieces([p.numel() for p in self.params], self._split)
        else:
            pieces = self._value_pieces()
        self.fragments = [Fragment(i, [piece_view(self.params[x.tensor], x) for x in own], i * H // P)
                          for i, own in enumerate(pieces)]
        for f, stats in zip(self.fragments, buffers_by_fragment(model, pieces), strict=True):
            f.running_stats = BufferMean(stats)
        return module

    def _value_pieces(self) -> list[list[Piece]]:
        """cut="values": equal parts; a tensor that cannot be viewed flat (not contiguous) is kept whole."""
        sizes = [p.numel() for p in self.params]
        whole = {i for i, p in enumerate(self.params) if not p.is_contiguous()}
        pieces = value_split(sizes, self.num_fragments, whole)
        if any(not own for own in pieces):
            raise ConfigError(usage(f"StreamingDiLoCo(fragments={self.num_fragments}, cut='values') for a model of "
                                    f"{sum(sizes)} values, {len(whole)} of its tensors not contiguous (kept whole)",
                                    "a non-empty part per fragment",
                                    "Pass fewer fragments, or make the parameters contiguous "
                                    "(model.to(memory_format=torch.contiguous_format))."))
        return pieces

    def after_step(self, step: int, taken: bool) -> None:
        self._resend()
        for f in self.fragments if taken and self.moments else ():  # a skipped step left the states as they were
            if f.sent_at >= 0:
                f.moment_steps += 1
        weight = self.clock.step_weight  # a skipped step still held its samples
        for f in self.fragments:
            f.share += weight
            if step % self.every == f.offset:
                self._send(f, step)
        for f in self.fragments:
            if f.sent_at >= 0 and step >= f.sent_at + self.overlap:
                self._apply(f)

    def on_shards(self) -> bool:
        """``sharding.layout.OnShards``: each fragment is exchanged as this rank's rows of its parameters, with
        the same shard of the other replica groups, over the mesh's "replicate" group (as :class:`~.DiLoCo`).

        Not with an all-gathered compressor (``quantize=4``, ``px.SparseLoCo()``): their messages are not laid
        out by rows; nor with ``cut="values"``, whose pieces are flat values, not rows: ``shard=`` refuses them."""
        return not isinstance(self.compression, Gathered) and self.cut == "tensors"

    def _sharded(self) -> bool:
        return getattr(self, "sharded_by", None) is not None  # set by px.FullyShard.apply

    def commit_point(self) -> None:
        """``elastic.rule.CommitPoint``, a sharded model only: every exchange in flight lands before the commit.

        It is waited for, not applied (it is applied at its own step, as ever): the commit then holds the average,
        rows every replica group shares (:meth:`row_state`), which a regroup moves by the model's own plan onto
        any layout, where a message in flight is one replica group's and only its layout could send it again."""
        if not self._sharded():
            return
        for f in self.fragments:
            if f.sent_at >= 0 and f.result is None:
                f.result = self._wait(f)
                f.pending, f.buffer = None, None

    def row_state(self) -> dict[str, list[torch.Tensor]]:
        """``sharding.reshard.RowState``: per parameter (this rank's rows), the anchor, the outer momentum and the
        average of the exchange in flight (zeros where its fragment has none; every one has landed at a commit of a
        sharded model, :meth:`commit_point`). A pure read.

        Refuses ``mixing="eager"`` and ``moments=``: their stand-ins and sent states are one replica group's, which
        no regroup moves yet."""
        if self.mixing == "eager" or self.moments:
            raise ConfigError(usage(f"shard=FullyShard(...) with {self!r} under `phalanx run --elastic`",
                                    "StreamingDiLoCo with a numeric mixing and no moments= (a regroup re-shards its "
                                    "anchors, momentum and exchanges in flight, not an eager stand-in or the sent "
                                    "optimizer states)", "Pass a numeric mixing (e.g. 0.5) and no moments=, or "
                                    "drop --elastic, or drop shard=."))
        result = [r for f in self.fragments for r in (f.result[:len(f.anchor)] if f.result is not None
                                                      else [torch.zeros_like(a) for a in f.anchor])]
        return {"anchor": [a for f in self.fragments for a in f.anchor],
                "momentum": [b for f in self.fragments for b in f.momentum], "result": result}

    def load_row_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """After a reshard: each fragment takes the new layout's parameters (``self.params``) and rows; an exchange
        sent before the commit (``sent_at``, shared state) takes its average's rows, applied at its own step."""
        for f, idx in zip(self.fragments, self._split, strict=True):
            f.params = [self.params[j] for j in idx]
            f.anchor, f.momentum = [state["anchor"][j] for j in idx], [state["momentum"][j] for j in idx]
            f.result = [state["result"][j] for j in idx] if f.sent_at >= 0 else None
            f.message, f.buffer, f.pending, f.resend, f.eager = None, None, None, False, None
        pieces = whole_pieces([p.numel() for p in self.params], self._split)
        for f, stats in zip(self.fragments, buffers_by_fragment(self.model, pieces), strict=True):
            f.running_stats = BufferMean(stats)

    def replicas_agree(self, step: int) -> bool:
        """Always: each replica's own weights and message are in its replica state, the rest is shared;
        a commit taken with an exchange in flight sends it again after a rollback."""
        return True

    def finish(self) -> None:
        """Close a skipped last step; apply what is in flight, then every fragment whose replicas differ (local
        steps, or a mix, since the anchor was last copied into it) takes the replicas' mean: every replica ends
        on the anchors.

        The mean, not an outer step: Nesterov's look-ahead would add 0.81x the last outer momentum to a
        pseudo-gradient of a few steps and overshoot (as :class:`phalanx.DiLoCo`)."""
        super().finish()
        self._resend()
        for f in self.fragments:
            if f.sent_at >= 0:  # sent at the last step: no local step to keep, the anchor replaces the replica
                self._apply(f, mixing=0.0 if f.sent_at == self.steps else None)
        for f in self.fragments:
            if self.steps and f.synced_at != self.steps:  # the same on every rank: shared state
                self._send(f, self.steps)
                self._apply(f, mixing=0.0, outer=False)

    # -- one fragment's exchange -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _send(self, f: Fragment, step: int) -> None:
        f.running_stats.average_(self.comm)  # its modules' BatchNorm statistics: small, so not overlapped
        delta = [a - p.to(a.dtype) for a, p in zip(f.anchor, f.params, strict=True)]  # the pseudo-gradient
        if self.mixing == "eager":
            self._eager_step(f, delta)
        states = self.moments.take(f.params) if self.moments else []
        # kept apart: the float exchange scales the message's own copies in place by this worker's share
        f.moments_sent, f.moment_steps = ([t.clone() for t in states] if states else None), 0
        delta += states  # one message: the pseudo-gradient, then the optimizer states (moments=)
        share, f.share = f.share, 0.0
        f.sent_at, f.result, f.resend = step, None, False
        comm, c = self.comm, self.compression
        if c is None:
            if comm.world_size == 1:
                f.result, f.message = delta, None
                return
            # DiLoCo's share-weighted mean, as one flat message: the shares ride at its end.
            for d in delta:
                d.zero_() if share == 0 else d.mul_(share)
            f.message = torch.cat([*(d.reshape(-1) for d in delta),
                                   torch.tensor([float(share)], dtype=delta[0].dtype, device=delta[0].device)])
            f.pending = self._start(f)
        elif isinstance(c, Gathered):  # the weight travels inside the message: no extra collective
            f.message = c.encode(torch.cat([d.reshape(-1) for d in delta]), f"fragment{f.index}", share)
            f.pending = c.send(f.message, self._numel(f), comm)
        else:  # a compressor without an asynchronous exchange: as DiLoCo, finished now
            total = share_total(comm, share)
            weight = share * comm.world_size / total if total > 0 else 1.0
            if weight != 1.0:
                for d in delta:
                    d.zero_() if weight == 0 else d.mul_(weight)
            c.average_(delta, comm, key=f"fragment{f.index}")
            f.result, f.message = delta, None

    def _numel(self, f: Fragment) -> int:
        """Values in one fragment's message (before the weight): its pseudo-gradient and its states."""
        return f.numel + self.moments.numel(f.params)

    def _start(self, f: Fragment) -> Any:
        # A copy is summed, so the message stays this worker's own part: an abandoned handle may still write.
        f.buffer = f.message.clone()
        with guarded("the streaming outer all-reduce"):
            return self.comm.all_reduce_async(f.buffer)

    def _resend(self) -> None:
        """After a regroup or restore: send the messages in flight again, in fragment order, on every worker."""
        for f in self.fragments:
            if not f.resend:
                continue
            f.resend = False
            if f.message is None:  # a joiner took part in none: an empty message of weight 0
                f.message = self._empty_message(f)
            if isinstance(self.compression, Gathered):
                f.pending = self.compression.send(f.message, self._numel(f), self.comm)
            else:
                f.buffer = None
                f.pending = self._start(f) if self.comm.world_size > 1 else None

    def _empty_message(self, f: Fragment) -> torch.Tensor:
        if isinstance(self.compression, Gathered):
            return torch.zeros(self.compression.message_bytes(self._numel(f)), dtype=torch.uint8,
                               device=f.anchor[0].device)
        return torch.zeros(self._numel(f) + 1, dtype=f.anchor[0].dtype, device=f.anchor[0].device)

    def _eager_step(self, f: Fragment, delta: list[torch.Tensor]) -> None:
        """The outer step with this worker's own pseudo-gradient, on a copy of the anchor and momentum: the
        weights the inner steps go on from until the average lands."""
        f.eager = []
        for a, buf, d, p in zip(f.anchor, f.momentum, delta, f.params, strict=True):
            w = a - self.outer_lr * outer_direction(d, buf.clone(), self.outer_momentum, self.nesterov)
            p.copy_(w)
            f.eager.append(w)

    @torch.no_grad()
    def _apply(self, f: Fragment, mixing: float | None = None, outer: bool = True) -> None:
        """The average has landed: the outer step on the anchor (``outer=False``: the anchor becomes the mean),
        then mix it into the worker's fragment."""
        delta = f.result if f.result is not None else self._wait(f)
        delta, states = delta[:len(f.anchor)], delta[len(f.anchor):]
        alpha = self.mixing if mixing is None else mixing
        eager = f.eager if alpha == "eager" else None
        for i, (a, buf, d, p) in enumerate(zip(f.anchor, f.momentum, delta, f.params, strict=True)):
            if not outer:
                a.sub_(d)
            else:
                a.sub_(outer_direction(d, buf, self.outer_momentum, self.nesterov), alpha=self.outer_lr)
            if eager is not None:  # the average replaces the stand-in; the local steps since the send stay
                p.copy_(a + (p.to(a.dtype) - eager[i]))
            elif alpha == "eager" or alpha == 0:  # eager with no stand-in (a joiner: rank 0's weights, not its
                p.copy_(a)  # stand-in), or a restore onto another world size: the anchor, as mixing 0
            else:
                p.copy_(torch.lerp(a, p.to(a.dtype), alpha))
        if f.moments_sent is not None:  # a joiner sent none: it keeps its own states
            self.moments.correct(f.params, f.moments_sent, states, f.moment_steps)
        if alpha == 0:  # shared state: only what every rank decides alike (a joiner alone lacks a stand-in)
            f.synced_at = self.steps
        f.sent_at, f.message, f.result, f.pending, f.buffer, f.eager = -1, None, None, None, None, None
        f.moments_sent = None

    def _wait(self, f: Fragment) -> list[torch.Tensor]:
        if isinstance(self.compression, Gathered):
            flat = f.pending.wait() if f.pending is not None else self.compression.sum_messages([f.message],
                                                                                                self._numel(f))
        else:
            if f.pending is not None:
                start = time.perf_counter()
                with guarded("the streaming outer all-reduce"):
                    f.pending.wait("the streaming outer all-reduce")
                self.comm.stats.seconds += time.perf_counter() - start  # what the overlap did not hide
            flat = f.buffer if f.buffer is not None else f.message
            # no rank held a sample since the send (weights 0 everywhere): nothing to average, not a NaN
            flat = flat[:-1] / flat[-1] if float(flat[-1]) != 0 else torch.zeros_like(flat[:-1])
        out, offset = [], 0
        for a in [*f.anchor, *(p for _ in self.moments.keys for p in f.params)]:  # the layout _send made
            out.append(flat[offset:offset + a.numel()].view_as(a).to(_outer_dtype(a)))
            offset += a.numel()
        return out

    # -- state ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per fragment: anchor, outer momentum, the step its exchange in flight was sent at (-1: none) and,
        where every worker already holds it, that exchange's result; the compressor's shared state."""
        state: dict[str, Any] = {"fragments": [
            {"anchor": [a.clone() for a in f.anchor], "momentum": [b.clone() for b in f.momentum],
             "sent_at": f.sent_at, "synced_at": f.synced_at,
             "result": None if f.result is None else [r.clone() for r in f.result]}
            for f in self.fragments]}
        if self._sharded():  # what a worker entering a sharded layout counts since each send: rank 0's (its own
            state["shares"] = [f.share for f in self.fragments]  # replica state replaces it on every other worker)
        if self.compression is not None:
            state["compression"] = self.compression.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "compression" in state and self.compression is not None:
            self.compression.load_state_dict(state["compression"])
        for i, (f, saved) in enumerate(zip(self.fragments, state["fragments"], strict=True)):
            # rank 0's rows of another layout (a sharded model's commit) are taken as they are: the reshard that
            # follows replaces them with this rank's (row_state)
            f.anchor, f.momentum = load_rows(f.anchor, saved["anchor"]), load_rows(f.momentum, saved["momentum"])
            if "shares" in state:
                f.share = float(state["shares"][i])
            f.sent_at, f.pending, f.message = int(saved["sent_at"]), None, None
            f.synced_at = int(saved.get("synced_at", 0))
            f.result = None if saved["result"] is None else [r.clone() for r in saved["result"]]
            f.resend = f.sent_at >= 0 and f.result is None  # sent again at the next step, by every worker

    def replica_state_dict(self) -> dict[str, Any]:
        """This worker's weights, optimizer state, shares and the messages it has in flight."""
        return {**compressor_replica_state(self), **drifting_replica_state(self),
                "shares": [f.share for f in self.fragments],
                "messages": [None if f.message is None or f.result is not None else f.message.clone()
                             for f in self.fragments],
                "eager": [None if f.eager is None else [w.clone() for w in f.eager] for f in self.fragments],
                "moments_sent": [None if f.moments_sent is None else [t.clone() for t in f.moments_sent]
                                 for f in self.fragments],
                "moment_steps": [f.moment_steps for f in self.fragments]}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        load_compressor_replica_state(self, state)
        load_drifting_replica_state(self, state)
        eager = state.get("eager", [None] * len(self.fragments))
        sent = state.get("moments_sent", [None] * len(self.fragments))
        taken = state.get("moment_steps", [0] * len(self.fragments))
        for f, share, message, stand_in, states, k in zip(self.fragments, state["shares"], state["messages"], eager,
                                                          sent, taken, strict=True):
            f.share = float(share)
            f.eager = None if stand_in is None else [w.clone() for w in stand_in]
            f.moments_sent, f.moment_steps = (None if states is None else [t.clone() for t in states]), int(k)
            if f.resend:
                f.message = None if message is None else message.clone()

    def regroup(self) -> None:
        """The group was rebuilt: drop every handle in flight (a lost worker's part is not waited for); each
        worker sends its message again at its next step."""
        for f in self.fragments:
            if f.sent_at >= 0 and f.result is None:
                f.pending, f.resend = None, True

    def __repr__(self) -> str:
        mixing = repr(self.mixing) if isinstance(self.mixing, str) else format(self.mixing, "g")
        return (f"StreamingDiLoCo(every={self.every}, fragments={self.num_fragments}, overlap={self.overlap}, "
                f"mixing={mixing}, outer_lr={self.outer_lr:g}, outer_momentum={self.outer_momentum:g}, "
                f"quantize={self.compression!r}" + (f", moments={self.moments!r}" if self.moments else "")
                + (f", cut={self.cut!r})" if self.cut != "tensors" else ")"))


__all__ = ["Fragment", "StreamingDiLoCo", "balanced_split"]
