"""A training script for elastic tests: run it with ``phalanx run --elastic -n 3 tests/workers/elastic.py ...``.

Each worker records, per optimizer step, the sample ids the whole group trained on
(gathered from every worker's loader), rolled back with the commit; at the end each
survivor writes its id, pid, final parameters and that record to ``--out``.
Failure injection is one flag: ``--kill 0@5`` kills the worker started as rank 0 at
step 5 with SIGKILL (``--stop`` sends SIGSTOP instead). ``--hold-at 11`` keeps the job
running for as long as a test needs: every worker stops before its step 11, writes
``held<id>``, and goes on once the test wrote ``OUT/release`` (or is killed there).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import sys
import time
from typing import Any, Callable
from support.wait import until

if "--fail-replacements" in sys.argv and os.environ.get("PHALANX_ELASTIC_ID", "").startswith("r"):
    # before importing torch: a script that fails at start usually fails fast (a typo, a missing file)
    raise SystemExit(f"replacement {os.environ['PHALANX_ELASTIC_ID']}: failing at start, as the test asked")

if "--replacement-after-regroup" in sys.argv and os.environ.get("PHALANX_ELASTIC_ID", "").startswith("r"):
    # A replacement enters only once the survivors have regrouped without the lost worker, so the loss and the
    # join are two regroups however fast the replacement starts (an event, not a race against the start-up).
    regrouped = os.path.join(sys.argv[sys.argv.index("--out") + 1], "regrouped")
    until(lambda: os.path.exists(regrouped), timeout=120,
          what=f"replacement {os.environ['PHALANX_ELASTIC_ID']}: a regroup ({regrouped})")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import phalanx as px  # noqa: E402
from support.loop import elastic_id, elastic_parser, epoch_batches, group_ids, take_step, write_worker  # noqa: E402

N, DIM, BATCH = 64, 5, 4


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    y = x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def plain_sgd(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=PLAIN_LR)


PLAIN_LR = 0.05


STRATEGIES = {
    "allreduce": lambda: px.AllReduce(),
    "fp16": lambda: px.AllReduce(compression=px.FP16()),
    "powersgd": lambda: px.AllReduce(compression=px.PowerSGD(rank=1)),
    "int8": lambda: px.AllReduce(compression=px.Quantize(8, block=16, error_feedback=True)),
    "local-sgd": lambda: px.LocalSGD(every=2),
    "diloco": lambda: px.DiLoCo(every=2),
    "easgd": lambda: px.EASGD(every=2),
    "streaming": lambda: px.StreamingDiLoCo(every=2, fragments=2, overlap=1),
    "diloco-sparseloco": lambda: px.DiLoCo(every=2, compression=px.SparseLoCo(topk=4, chunk=16)),
    "ps-sync": lambda: px.ParameterServer(sync=True),  # servers: --servers K, else colocated
    "downpour": lambda: px.Downpour(),
    "easgd-async": lambda: px.AsyncEASGD(every=2),
}


class Record:
    """Per step: (epoch, world size, the group's sample ids); rolled back with the state."""

    def __init__(self) -> None:
        self.steps: list[list] = []

    def state_dict(self) -> dict:
        return {"steps": [list(s) for s in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [list(s) for s in state["steps"]]


def oracle(record: list) -> list[torch.Tensor]:
    """The tests' oracle: one process trained on the same global batches (N workers x b == 1 process x N*b)."""
    net, data = model(), dataset()
    opt = optimizer(net)
    for _epoch, _world, ids in record:
        take_step(net, opt, *data[torch.tensor(ids)][:2], loss=F.mse_loss)
    return [p.detach() for p in net.parameters()]


def setup(commit_every: int, make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
          strategy: Any = None, shard: Any = None, batch: int = BATCH, extra: dict | None = None,
          **state: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Record, px.elastic.State]:
    """After ``px.init()``: this file's model and data made data-parallel, and an elastic state that commits them
    with a :class:`Record` (and ``extra``) every ``commit_every`` steps; ``state`` goes to ``px.elastic.State``.
    ``make_optimizer`` defaults to this module's ``optimizer``.

    Example:
        >>> # model_, opt, loader, record, state = setup(3, scaler=scaler, checkpoint=DIR)
    """
    net = model()  # model, dataset and optimizer looked up now: tests/workers/elastic_ps.py replaces them
    model_, opt = px.wrap(net, (make_optimizer or optimizer)(net), strategy=strategy, shard=shard)
    loader = px.shard(dataset(), batch_size=batch, seed=0)
    record = Record()
    elastic = px.elastic.State(model_, opt, loader, commit_every=commit_every,
                               extra={"record": record, **(extra or {})}, **state)
    return model_, opt, loader, record, elastic


def digest(net: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    """Sums of every parameter and momentum buffer, in float64: equal states give equal digests.

    Of this worker's shards when the model is sharded (summing a DTensor would be a collective)."""
    bufs = [s["momentum_buffer"] for s in opt.state.values() if s.get("momentum_buffer") is not None]
    return [float(local(t).detach().double().sum()) for t in [*px.unwrap(net).parameters(), *bufs]]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    p = elastic_parser(commit_every=2)
    p.add_argument("--stop", action="store_true", help="SIGSTOP instead of SIGKILL")
    p.add_argument("--term", action="store_true", help="SIGTERM instead of SIGKILL: a graceful leave (preemption)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="S: sleep S seconds after each step (benchmarks/elastic.py's step of known length; the tests "
                        "synchronise with --hold-at instead)")
    p.add_argument("--hold-at", type=int, default=0,
                   help="STEP: the first time a worker is about to take step STEP it writes OUT/held<its id> and waits "
                        "until the test writes OUT/release (or kills it there): the job is surely still running "
                        "while the test kills, joins or looks. Trains nothing differently")
    p.add_argument("--hold-again", type=int, default=0,
                   help="G: once the group is generation G (state.history's newest entry: a joiner's history starts "
                        "at its entry), every worker stops before its next step once more, writes OUT/again<its id> "
                        "and waits for OUT/release-again; past generation G, --wait-for-replacement waits no more")
    p.add_argument("--hold-timeout", type=float, default=180.0,
                   help="--hold-at's wait ends in an error after this many seconds without OUT/release")
    p.add_argument("--trainer", action="store_true", help="train with px.Trainer.fit(elastic=...) instead")
    p.add_argument("--strategy", default="allreduce",
                   help="allreduce, fp16, powersgd, local-sgd, diloco, easgd, streaming")
    p.add_argument("--kill-in-step", action="store_true", help="die after the step's gather, not before it")
    p.add_argument("--wait-for-replacement", type=int, default=0,
                   help="after a loss, while the group is smaller than this, the survivors wait before their next "
                        "step until the replacement asked to join, and after the next commit until it is ready")
    p.add_argument("--fail-replacements", action="store_true",
                   help="a replacement (r1, r2...) fails at start (checked at import)")
    p.add_argument("--replacement-after-regroup", action="store_true",
                   help="a replacement (r1, r2...) starts only once the survivors regrouped (checked at import)")
    p.add_argument("--mark-world", action="store_true", help="count the steps per world size in world<ID>-<SIZE>")
    p.add_argument("--shard", type=int, default=0, help="shard=px.FullyShard(group_size=S) (HSDP with allreduce)")
    p.add_argument("--plain-sgd", action="store_true", help="inner SGD without momentum: a periodic rule's oracle "
                   "then needs no replica's optimizer state")
    p.add_argument("--checkpoint", default=None, help="px.elastic.State(checkpoint=DIR): every commit on disk too")
    p.add_argument("--hold-in-grow", default="",
                   help="ID: the worker whose id starts with ID stops inside the first rebuild that grows the group, "
                        "writes holding<its id>.json and waits there to be killed (tests/elastic/test_grow_kill.py)")
    p.add_argument("--hold-in-admit", default="",
                   help="IDS: each member whose id starts with one of IDS (comma-separated) stops while it admits a "
                        "joiner, once the joiner claimed its place and before the members' answer (gen/<g>/go), "
                        "writes holding<its id>.json and waits there to be killed (test_joiner_left_alone.py)")
    for flag, text in {
        "--kill-again": "ID@STEP: after the first regroup, the worker started as rank ID dies before step STEP (a "
                        "second loss before the next commit: the survivors roll back to the same commit twice)",
        "--kill-after": "GLOB@STEP@N: the worker whose id matches GLOB (a joiner's id is random: j*-1) dies before "
                        "step STEP once the group changed N times (state.history), once",
        "--kill-in-commit": "ID@STEP[,ID@STEP...]: the worker started as rank ID dies inside the commit of step STEP, "
                            "after its in-memory commit and before State(checkpoint=...) writes that step (the others "
                            "hold the commit; the disk does not)"}.items():
        p.add_argument(flag, default="", help=text)
    p.add_argument("--wait-for-joiner", action="store_true",
                   help="the first workers wait before their 3rd step until a joiner asked to join, and before "
                        "their 5th until it is ready to enter (it enters at the commit of step 6)")
    p.add_argument("--joiners", type=int, default=1, help="--wait-for-joiner waits for this many joiners")
    args = p.parse_args()
    me = elastic_id()
    if args.hold_in_grow and me.startswith(args.hold_in_grow):
        hold_in_grow(args.out, me)
    if args.hold_in_admit and any(me.startswith(h) for h in args.hold_in_admit.split(",")):
        hold_in_admit(args.out, me)
    victim, _, at = args.kill.partition("@")
    again, _, again_at = args.kill_again.partition("@")
    late, late_at, late_changes = (args.kill_after.split("@") + ["", ""])[:3] if args.kill_after else ("", "0", "0")

    if args.trainer:
        return trainer_main(args, me, victim, int(at or 0))
    with open(os.path.join(args.out, f"start{me}-{os.getpid()}.json"), "w") as f:
        json.dump({"id": me, "pid": os.getpid()}, f)  # a restarted worker would leave a second one
    g = px.init()
    with open(os.path.join(args.out, f"init{me}.json"), "w") as f:  # what a script reads right after px.init()
        json.dump({"rank": px.rank(), "world_size": px.world_size(), "generation": g.generation,
                   "env": [os.environ.get("RANK"), os.environ.get("WORLD_SIZE")]}, f)
    shard = px.FullyShard(group_size=args.shard) if args.shard else None
    model_, opt, loader, record, state = setup(args.commit_every, strategy=STRATEGIES[args.strategy](), shard=shard,
                                               checkpoint=args.checkpoint, make_optimizer=plain_sgd if args.plain_sgd
                                               else None)
    if args.kill_in_commit:
        kill_in_commit(args.out, me, state, args.kill_in_commit)
    comm = px.Comm()
    first_after: list[float] = []
    held: list[int] = []  # --hold-at: the step this worker held before (once: not again when a rollback redoes it)
    held_again: list[int] = []  # --hold-again: the same, for the second hold
    digests: list[list] = []  # (step, world size, digest of the weights and optimizer state) before each step
    changes: list[list] = []  # (time, world size, step) at the first step after each membership change

    def die() -> None:
        if me == victim and state.step + 1 == int(at) and not state.history:
            wait_for_spares(state)  # so that the kill finds them parked (hot), not still importing
            with open(os.path.join(args.out, "killed.json"), "w") as f:
                json.dump({"id": me, "pid": os.getpid(), "time": time.time()}, f)
            if args.term:  # the handler only notes it; the worker leaves at the next commit
                os.kill(os.getpid(), signal.SIGTERM)
                return
            os.kill(os.getpid(), signal.SIGSTOP if args.stop else signal.SIGKILL)
            time.sleep(60)  # sleep: a stopped worker never gets here before the launcher kills it
        if me == again and state.step + 1 == int(again_at) and len(state.history) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if late and fnmatch.fnmatch(me, late) and state.step + 1 == int(late_at) \
                and len(state.history) == int(late_changes):
            os.kill(os.getpid(), signal.SIGKILL)

    waited: list[int] = []  # --wait-for-replacement: the steps where the survivors waited for the replacement

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch, x, y, ids in epoch_batches(state, loader, args.epochs):
            if args.wait_for_joiner and state.step in (2, 4) and not state.history:
                wait_for_joiner(state, "asked" if state.step == 2 else "ready", count=args.joiners)
            if args.hold_at and state.step + 1 == args.hold_at and not held:
                hold(args.out, me, args.hold_timeout)
                held.append(state.step + 1)
            if args.hold_again and state.history and state.history[-1]["generation"] == args.hold_again \
                    and not held_again:
                hold(args.out, me, args.hold_timeout, marker="again", release="release-again")
                held_again.append(state.step + 1)
            if not args.kill_in_step:
                die()
            digests.append([state.step, px.world_size(), digest(model_, opt)])
            if len(state.history) > len(changes):  # the first step after a membership change
                changes.append([time.time(), px.world_size(), state.step])
                open(os.path.join(args.out, "regrouped"), "a").close()  # --replacement-after-regroup
            if args.wait_for_replacement and state.history and px.world_size() < args.wait_for_replacement \
                    and not (args.hold_again and state.history[-1]["generation"] > args.hold_again):  # held again
                # however long the replacement takes to start: it asks, the next commit point offers it a place,
                # it gets ready, and the commit point after that admits it
                if not waited:
                    wait_for_joiner(state, "asked", timeout_s=240.0)
                    waited.append(state.step)
                elif len(waited) == 1 and max(state.commits, default=0) > waited[0]:
                    wait_for_joiner(state, "ready", timeout_s=240.0)
                    waited.append(state.step)
            record.steps.append([epoch, px.world_size(), group_ids(comm, ids, BATCH)])  # the whole group's
            if args.kill_in_step:  # past the gather: the others are left waiting in the step's exchange
                die()
            take_step(model_, opt, x, y, loss=F.mse_loss)
            if state.step == 1:
                open(os.path.join(args.out, f"training{me}"), "w").close()
            if args.mark_world:  # tests/elastic/test_elastic_hosts.py waits for these before it kills a host
                with open(os.path.join(args.out, f"world{me}-{px.world_size()}"), "a") as f:
                    f.write(".")  # one byte per step taken at that world size
            if state.history and not first_after:
                first_after.append(time.time())
            if args.step_sleep:
                time.sleep(args.step_sleep)  # sleep: benchmarks/elastic.py's step of known length (--step-sleep)

    started = time.perf_counter()
    train(state)
    write_worker(args.out, me, model_, record.steps, state.history, train_seconds=time.perf_counter() - started,
                 steps=state.step, pid=os.getpid(), rank=px.rank(), digests=digests, changes=changes,
                 first_step_after_recovery=first_after[0] if first_after else None)


def hold(out: str, me: str, timeout_s: float, marker: str = "held", release: str = "release") -> None:
    """``--hold-at``: write ``OUT/held<me>``, then wait until the test writes ``OUT/release``: what the test does
    meanwhile (a kill, a join, a look at the job's sockets) finds the job running, however slowly the machine goes.
    Bounded: past ``timeout_s`` this worker fails, saying what it waited for."""
    open(os.path.join(out, f"{marker}{me}"), "w").close()
    release = os.path.join(out, release)
    until(lambda: os.path.exists(release), timeout=timeout_s,
          what=f"worker {me}, held by --hold-at, waiting for the test's release file {release}")


def kill_in_commit(out: str, me: str, state: px.elastic.State, plan: str) -> None:
    """``--kill-in-commit``: this worker SIGKILLs itself where ``State(checkpoint=...)`` is about to write the commit
    of a step it was told (the name the elastic package calls, as tests/workers/chaos_job.py marks it): the kill is
    placed by the code point, not by a timer."""
    steps = {int(at) for who, _, at in (k.partition("@") for k in plan.split(",")) if who == me}
    if not steps:
        return
    from phalanx.elastic import state as elastic_state
    save = elastic_state.save_checkpoint

    def save_or_die(*args: Any, **kwargs: Any) -> Any:
        if state.step in steps:
            with open(os.path.join(out, f"killed{me}.json"), "w") as f:
                json.dump({"id": me, "pid": os.getpid(), "step": state.step, "time": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        return save(*args, **kwargs)

    elastic_state.save_checkpoint = save_or_die


def wait_for_joiner(state: px.elastic.State, stage: str, timeout_s: float = 120.0, count: int = 1) -> None:
    """Block until ``count`` joiners have ``asked`` to join (``elastic/joiners``: the next commit point offers them a
    place) or are ``ready`` to enter (``elastic/ready/<id>``: started up, waiting at the start of training; the next
    commit point admits them), whatever the time their start-up took."""
    from phalanx.elastic.membership import key

    from support.wait import until

    store = state.worker.store

    def there() -> bool:
        asked = json.loads(store.get(key("joiners"))) if store.check([key("joiners")]) else []
        return sum(stage == "asked" or store.check([key("ready", j)]) for j in asked) >= count

    until(there, timeout=timeout_s, what=f"{count} joiner(s) {stage}")


def _write_whole(path: str, value: dict) -> None:
    """``value`` as JSON at ``path``, whole or not at all: the test reads it as soon as the name exists."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def hold_in_grow(out: str, me: str) -> None:
    """Stop this worker inside the first rebuild that grows the group (a member's or a joiner's), past the
    agreement that it forms (``gen/<g>/go``), before it takes part in forming the group: it writes
    ``holding<me>.json`` (its pid) and waits to be killed there. The others are then forming that generation."""
    from phalanx.elastic import admission, worker as elastic_worker
    from phalanx.group import group

    rebuild = elastic_worker.rebuild

    def holding(base_store, generation: int, rank: int, world_size: int, **kwargs):  # noqa: ANN001, ANN202
        if world_size > group.current().world_size or group.current().entering:
            _write_whole(os.path.join(out, f"holding{me}.json"),
                         {"id": me, "pid": os.getpid(), "generation": generation, "time": time.time()})
            while True:
                signal.pause()  # until the test kills this process
        return rebuild(base_store, generation, rank, world_size, **kwargs)

    elastic_worker.rebuild = admission.rebuild = holding  # a regroup's rebuild, and a grow's (admission)


def hold_in_admit(out: str, me: str) -> None:
    """Stop this member while it admits joiners: once each of them claimed its place (``gen/<g>/entered/<id>`` holds
    "in"), before the members' answer (``gen/<g>/go``); it writes ``holding<me>.json`` (its pid) and waits to be
    killed there. The joiners are then waiting for an answer that only the members give."""
    from phalanx.elastic.membership import key
    from phalanx.elastic.worker import ElasticWorker

    entered = ElasticWorker._entered

    def holding(self, generation: int, joiners: list[str], *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if joiners:
            until(lambda: all(self.store.check([key("gen", generation, "entered", j)]) for j in joiners),
                  timeout=120, what="the joiners' claims")
            _write_whole(os.path.join(out, f"holding{me}.json"),
                         {"id": me, "pid": os.getpid(), "generation": generation, "time": time.time()})
            while True:
                signal.pause()  # until the test kills this process
        return entered(self, generation, joiners, *args, **kwargs)

    ElasticWorker._entered = holding


def wait_for_spares(state: px.elastic.State, timeout_s: float = 60.0) -> None:
    """Block until every spare of ``--spares`` has asked to join (it imported everything and waits)."""
    from phalanx.elastic.membership import key

    spares, store = set(state.worker.config.get("spares", [])), state.worker.store
    if spares:
        until(lambda: store.check([key("joiners")]) and spares <= set(json.loads(store.get(key("joiners")))),
              timeout=timeout_s, what="the spares' knock")


def trainer_main(args: argparse.Namespace, me: str, victim: str, at: int) -> None:
    px.init()
    net = model()
    killer = px.LambdaCallback(on_step_begin=lambda trainer, step: (
        os.kill(os.getpid(), signal.SIGKILL) if me == victim and step + 1 == at else None))
    trainer = px.Trainer(net, optimizer(net), F.mse_loss, callbacks=[killer])
    history = trainer.fit(dataset_xy(), epochs=args.epochs, batch_size=BATCH, progress=False,
                          elastic=args.commit_every)
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump({"id": me, "rows": [dict(r) for r in history], "membership": history.membership,
                   "params": [t.tolist() for t in px.unwrap(trainer.model).parameters()]}, f)


def dataset_xy() -> torch.utils.data.TensorDataset:
    x, y, _ = dataset().tensors
    return torch.utils.data.TensorDataset(x, y)


if __name__ == "__main__":
    main()
