"""The chaos soak's training job: ``phalanx run -n 3 --elastic --replace tests/workers/chaos_job.py --out DIR ...``.

A small GPT (``phalanx.bench.models.gpt``) trained with AdamW on synthetic token
windows, ``px.elastic.State`` committing every ``--commit-every`` steps and a
``px.save_checkpoint`` every ``--ckpt-every`` commits (or ``State(checkpoint=...)``
with ``--state-checkpoint``). It trains epoch after epoch until the harness asks it to
stop (the file ``DIR/stop``, agreed by an all-reduce at the end of an epoch, so every
worker stops after the same whole epoch) or ``--max-epochs``.

What the harness watches (``tests/support/chaos.py``) is this job's own structured
event output: one JSON line per event, appended to ``DIR/events/<id>-<pid>.jsonl`` with
one ``write`` each (whole lines even when the writer is SIGKILLed). A phase is a pair
``<name>+`` / ``<name>-``: ``commit`` (the in-memory commit), ``ckpt`` (a disk
checkpoint write), ``regroup`` (after a lost peer: quorum, rebuild, rollback), ``grow``
(members admitting a joiner) and ``join`` (a joiner taking its place); a joiner also
writes ``placed`` when ``px.init()`` returns. ``step`` after every optimizer step.
They are written by wrapping the State's public methods in this script, so nothing in
phalanx changes for the soak. ``--hold PHASES`` (the short test) makes a worker that
enters one of those phases wait, bounded, for ``DIR/release/<id>-<n>`` after its ``+``
event: the harness then kills it or releases it, so a kill lands inside the phase every time.

Each worker records the global batch of every step (``workers.elastic.Record``, rolled
back with the commits); rank 0 writes ``DIR/final.pt`` with the final parameters, the
record and ``state.history``. SIGUSR2 dumps every thread's stack to ``DIR/stacks/``.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time
import traceback

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.bench.models import gpt
from support.loop import whole
from workers.elastic import Record

SIZES = {  # name -> (gpt kwargs, samples, batch per worker)
    # about 1M parameters in float64: a checkpoint (weights + AdamW's two moments) of about 23 MB
    "small": (dict(vocab=256, context=64, dim=160, layers=3, heads=4), 384, 8),
    "tiny": (dict(vocab=64, context=16, dim=32, layers=1, heads=2), 96, 4),
}


def dataset(size: str) -> torch.utils.data.TensorDataset:
    """Token windows ``(x, y = x shifted by one, id)``, the same on every worker and in the oracle."""
    spec, n, _ = SIZES[size]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec["vocab"], (n, spec["context"] + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(n))


def model(size: str) -> torch.nn.Module:
    """In float64: AdamW divides by the root of its second moment, which turns float32's different summation
    orders (one process vs an all-reduce) into differences above 1e-5 within 16 steps; in float64 the oracle
    stays near 1e-12, so a sample trained twice or skipped stands out by orders of magnitude."""
    torch.manual_seed(0)
    return gpt(**SIZES[size][0]).double()


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.01)


def loss_fn(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten())


def oracle(size: str, record: list) -> list[torch.Tensor]:
    """One process trained on the record's global batches, in order (N workers x b == 1 process x N*b)."""
    net, data = model(size), dataset(size)
    opt = optimizer(net)
    for _epoch, _world, ids in record:
        x, y, _ = data[torch.tensor(ids)]
        opt.zero_grad()
        loss_fn(net, x, y).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


class Events:
    """This process's event stream: one JSON line per ``write`` on an O_APPEND descriptor."""

    def __init__(self, out: str, me: str) -> None:
        os.makedirs(os.path.join(out, "events"), exist_ok=True)
        self.me, self.out = me, out
        self.fd = os.open(os.path.join(out, "events", f"{me}-{os.getpid()}.jsonl"),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.holds: set[str] = set()
        self.held = 0

    def __call__(self, ev: str, **fields: object) -> None:
        line = json.dumps({"t": time.time(), "id": self.me, "pid": os.getpid(), "ev": ev, **fields})
        os.write(self.fd, (line + "\n").encode())
        if ev.endswith("+") and ev[:-1] in self.holds:
            self.hold(ev[:-1], step=fields.get("step"))

    def hold(self, phase: str, step: object = None, timeout_s: float = 60.0) -> None:
        """Wait for the harness's word (``release/<id>-<n>``) inside ``phase``: it kills us or lets us go."""
        self.held += 1
        mark = os.path.join(self.out, "release", f"{self.me}-{self.held}")
        self("held", phase=phase, n=self.held, step=step)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(mark) and time.monotonic() < deadline:
            time.sleep(0.002)  # sleep: a held worker polls for the harness's marker file (bounded above)


def phase(events: Events, name: str, fn, after=None, **fields):  # noqa: ANN001, ANN201 - wraps a State method
    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        events(f"{name}+", **fields)
        result = fn(*args, **kwargs)
        events(f"{name}-", **fields)
        if after is not None:
            after()
        return result
    return wrapped


def timed(events: Events, name: str, fn):  # noqa: ANN001, ANN201 - wraps a State's or a worker's part
    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        began = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            events("part", name=name, began=began, s=round(time.time() - began, 4))
    return wrapped


def parts(events: Events, state) -> None:  # noqa: ANN001 - a px.elastic.State
    """A ``part`` event as each part of a regroup, grow or join ends (its name, when it began, its seconds), for
    ``benchmarks/chaos_gaps.py``'s breakdown of a stretch without a step: the quorum (``next_generation``), forming
    the generation's groups (``rebuild``: leaving the old group, ``leave_group``, the quorum and the forming,
``form``), the rollback (``restore``), sending the
    state (``send``), the shards' move (``reshard``), a reload from the checkpoint (``from_disk``), the resumed
    commit's write (``ckpt_resumed``), waiting to be admitted (``admission``). Private names: this is the soak's
    probe, and a name that is gone is skipped (the events are for reading, nothing depends on them)."""
    worker = state.worker
    if worker is None:
        return
    for obj, attr, name in ((worker.membership, "next_generation", "quorum"), (worker, "rebuild", "rebuild"),
                            (worker, "grow", "grow_rebuild"), (worker, "wait_for_admission", "admission"),
                            (state, "_restore", "restore"), (state, "_send_state", "send"),
                            (state, "_reshard", "reshard"), (state, "_from_disk", "from_disk"),
                            (state, "_checkpoint_resumed", "ckpt_resumed"), (state, "_resplit", "resplit")):
        if hasattr(obj, attr):
            setattr(obj, attr, timed(events, name, getattr(obj, attr)))
    from phalanx.elastic import admission, worker as elastic_worker  # the module names the worker calls
    for module in (elastic_worker, admission):
        for attr, name in (("destroy", "leave_group"), ("rebuild", "form")):
            if hasattr(module, attr):
                setattr(module, attr, timed(events, name, getattr(module, attr)))


def fingerprint(net: torch.nn.Module, opt: torch.optim.Optimizer, record: list) -> dict:
    """What ``--digest`` writes: the record's length and hash, and 4 random projections of the parameters and of
    each of AdamW's moments (the same projections in the oracle's replay), plus AdamW's step count."""
    import hashlib
    flat = torch.cat([p.detach().flatten() for p in net.parameters()])
    g = torch.Generator().manual_seed(7)
    proj = torch.randn(4, flat.numel(), generator=g, dtype=torch.float64)
    states = [opt.state.get(p, {}) for p in net.parameters()]

    def moment(name: str) -> list[float]:
        if not all(name in s for s in states):
            return []
        return (proj @ torch.cat([s[name].detach().flatten() for s in states]).double()).tolist()
    steps = sorted({float(s["step"]) for s in states if "step" in s})
    return {"n": len(record), "rh": hashlib.md5(json.dumps(record).encode()).hexdigest()[:12],
            "p": (proj @ flat.double()).tolist(), "m": moment("exp_avg"), "v": moment("exp_avg_sq"), "st": steps}


def census() -> dict:
    """What this process holds: live tensors and the bytes of their distinct storages, tracked objects, threads."""
    import gc
    import threading
    tensors, storages = 0, {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                tensors += 1
                st = obj.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001, S112 - a tensor subclass (DTensor) or a freed storage: not counted
            continue
    return {"tensors": tensors, "tensor_mb": round(sum(storages.values()) / 2 ** 20, 2),
            "objects": len(gc.get_objects()), "threads": threading.active_count()}


def main(argv: list[str] | None = None) -> dict:
    """The job, from its command line (``argv``; the process's own by default): what rank 0 ran, in brief."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=3, help="a px.save_checkpoint every this many commits (0: none)")
    p.add_argument("--state-checkpoint", action="store_true", help="State(checkpoint=DIR): every commit on disk")
    p.add_argument("--strategy", default="allreduce", choices=("allreduce", "diloco"))
    p.add_argument("--diloco-every", type=int, default=4)
    p.add_argument("--shard", type=int, default=0, help="shard=px.FullyShard(group_size=S)")
    p.add_argument("--max-epochs", type=int, default=1000)
    p.add_argument("--hold", default="", help="comma-separated phases a worker waits in for the harness's word")
    p.add_argument("--digest", action="store_true",
                   help="a 'digest' event after every commit, regroup and join: the record's length and hash and "
                        "projections of the model and AdamW's moments, to find where a worker left the oracle")
    p.add_argument("--census", action="store_true",
                   help="a 'census' event after every commit, regroup and join: live tensors (count, bytes of their "
                        "storages), Python objects the collector tracks, threads (benchmarks/regroup_memory.py)")
    args = p.parse_args(argv)
    me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
    os.makedirs(os.path.join(args.out, "stacks"), exist_ok=True)
    stacks = open(os.path.join(args.out, "stacks", f"{me}-{os.getpid()}.txt"), "w")  # noqa: SIM115 - for good
    faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)  # before "start": the harness may ask
    events = Events(args.out, me)
    events.holds = {h for h in args.hold.split(",") if h}
    events("start")
    torch.set_num_threads(1)
    g = px.init()
    events("placed" if me[:1] in "rs" else "init", gen=g.generation, rank=px.rank(), world=px.world_size())
    net, data = model(args.size), dataset(args.size)
    shard = px.FullyShard(group_size=args.shard) if args.shard else None
    strategy = px.DiLoCo(every=args.diloco_every) if args.strategy == "diloco" else px.AllReduce()
    model_, opt = px.wrap(net, optimizer(net), strategy=strategy, shard=shard)
    loader = px.shard(data, batch_size=SIZES[args.size][2], seed=0)
    record = Record()
    ckpt = os.path.join(args.out, "ckpt")
    state = px.elastic.State(model_, opt, loader, commit_every=args.commit_every, extra={"record": record},
                             checkpoint=ckpt if args.state_checkpoint else None)
    joining = [False]  # a joiner's own commit inside join() is not collective: no checkpoint there
    every = args.commit_every * args.ckpt_every

    def digest(where: str) -> None:
        if args.census:
            events("census", where=where, **census())
        if args.digest:
            events("digest", where=where, step=state.step, gen=g.generation, rank=px.rank(),
                   world=px.world_size(), **fingerprint(px.unwrap(model_), opt, record.steps))

    def commit() -> None:
        events("commit+", step=state.step)
        real_commit()
        events("commit-", step=state.step)
        digest("commit")
        # the script's own disk checkpoint every few commits (by step, so every member agrees), where a DDP port
        # puts its torch.save
        if (every and not args.state_checkpoint and state.elastic and not joining[0] and state.step > 0
                and state.step % every == 0):
            events("ckpt+", step=state.step)
            px.save_checkpoint(ckpt, model_, opt, step=state.step)
            events("ckpt-", step=state.step)

    real_commit = state.commit
    state.commit = commit  # type: ignore[method-assign]
    if args.state_checkpoint:
        # State(checkpoint=...) saves right after the in-memory commit, inside phalanx: mark that save through the
        # name the elastic package calls (this script's marker, nothing changes in phalanx)
        from phalanx.elastic import state as elastic_state
        elastic_state.save_checkpoint = phase(events, "ckpt", elastic_state.save_checkpoint)
    parts(events, state)
    state.recover = phase(events, "regroup", state.recover, after=lambda: digest("regroup"))  # type: ignore
    state.grow = phase(events, "grow", state.grow, after=lambda: digest("grow"))  # type: ignore[method-assign]
    real_join = phase(events, "join", state.join)

    def join() -> bool:
        joining[0] = True
        try:
            return real_join()
        finally:
            joining[0] = False
            digest("join")

    state.join = join  # type: ignore[method-assign]
    comm = px.Comm()
    batch = SIZES[args.size][2]

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch in range(state.epoch, args.max_epochs):
            loader.set_epoch(epoch)
            for x, y, ids in loader:
                padded = torch.cat([ids, torch.full((batch - len(ids),), -1, dtype=ids.dtype)])
                everyone = torch.cat(comm.all_gather(padded))  # what the whole group trains on at this step
                record.steps.append([epoch, px.world_size(), everyone[everyone >= 0].tolist()])
                opt.zero_grad()
                loss_fn(model_, x, y).backward()
                opt.step()
                events("step", step=state.step, epoch=epoch, world=px.world_size(), gen=g.generation)
            # stop after a whole epoch, all together: rank 0 reads the harness's word, everyone takes its answer
            flag = torch.tensor([float(px.rank() == 0 and os.path.exists(os.path.join(args.out, "stop")))])
            comm.all_reduce_([flag], op="sum")
            if flag.item() > 0:
                return

    try:
        train(state)
    except BaseException as err:  # what ended this worker, in its own event stream (the launcher may not say)
        events("error", type=type(err).__name__, message=str(err)[:2000], traceback=traceback.format_exc()[-6000:])
        raise
    params = [whole(t).detach().clone() for t in px.unwrap(model_).parameters()]  # collective when sharded
    if px.rank() == 0:
        torch.save({"params": params, "record": record.steps, "history": state.history, "size": args.size,
                    "strategy": args.strategy, "step": state.step}, os.path.join(args.out, "final.pt.tmp"))
        os.replace(os.path.join(args.out, "final.pt.tmp"), os.path.join(args.out, "final.pt"))
    events("end", step=state.step, world=px.world_size())
    return {"id": me, "step": state.step}


if __name__ == "__main__":
    main()
