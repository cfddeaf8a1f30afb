"""``phalanx demo --stream``: train from a live Redis stream, crash a worker midway, lose nothing.

1. A real redis-server starts on a unix socket in a temporary directory (no persistence).
2. A producer process publishes scikit-learn's bundled digits images as events at a set rate.
3. Two workers train a small CNN from the stream, committing a checkpoint every few steps.
4. Midway one worker is killed (SIGKILL). The group restarts from the last checkpoint, with a new
   worker in the dead one's place; the stream is rewound to the committed position.
5. The end table counts events produced, trained, trained twice and lost, from the ids every
   worker logged per step, and gives the test accuracy on the held-out digits.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

STREAM, GROUP = "digits", "trainer"


def _worker(args: argparse.Namespace) -> int:
    import phalanx as px
    try:
        return _train(args)
    except (px.PhalanxError, RuntimeError) as err:  # the survivor of the kill: one line, not a traceback
        print(f"  worker {px.rank()}: {str(err).splitlines()[0][:160]}", file=sys.stderr, flush=True)
        return 1


def _train(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    import phalanx as px
    from phalanx.models import digits_cnn, load_digits_split
    from phalanx.stream import Deadline, RedisStream, Stop, StreamLoader, decode_sample

    px.init()
    torch.manual_seed(args.seed)
    model = digits_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, opt = px.wrap(model, opt)
    source = RedisStream(args.url, stream=STREAM, group=GROUP, decode=decode_sample, create=True)
    loader = StreamLoader(source, args.batch_size, policy=Deadline(0.5), stop=Stop(idle_s=args.idle))
    ckpt = os.path.join(args.dir, "ckpt.pt")
    if os.path.exists(ckpt):
        px.load_checkpoint(ckpt, model, opt, loader=loader)  # the stream rewinds to the committed position
    log = open(os.path.join(args.dir, f"ids.inc{args.incarnation}.rank{px.rank()}.log"), "a")
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log.write(f"{loader.steps} {' '.join(loader.ids)}\n")
        log.flush()
        if loader.steps % args.every == 0:
            px.save_checkpoint(ckpt, model, opt, loader=loader, step=loader.steps)
            if px.is_main():
                s = loader.stats()
                print(f"  step {loader.steps:4d}  loss {loss.item():.3f}  {s['events_per_s']:6.0f} events/s  "
                      f"lag {s['lag']:5d}  committed {s['events']:5d} events up to {loader.position}", flush=True)
    px.save_checkpoint(ckpt, model, opt, loader=loader, step=loader.steps)
    loader.close()
    if px.is_main():
        _, test = load_digits_split()
        with torch.no_grad():
            accuracy = (px.unwrap(model)(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
        with open(os.path.join(args.dir, "summary.json"), "w") as f:
            json.dump({"test_accuracy": accuracy, "steps": loader.steps, "dead": loader.dead,
                       "pending": source.pending()}, f)
    px.shutdown()
    return 0


def _launch(args: argparse.Namespace, incarnation: int) -> list[subprocess.Popen]:
    from ..testing import free_port
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    base.update(OMP_NUM_THREADS="1", PHALANX_THREADS="1", CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.workers), LOCAL_WORLD_SIZE=str(args.workers))
    argv = [sys.executable, "-m", "phalanx.stream.demo", "--worker", "--url", args.url, "--dir", args.dir,
            "--incarnation", str(incarnation), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
            "--every", str(args.every), "--idle", str(args.idle), "--seed", str(args.seed)]
    return [subprocess.Popen(argv, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(args.workers)]


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


def _history(directory: str) -> tuple[list[str], int]:
    """The ids behind the final model (each step as last trained), and how many events were trained twice
    in all, counting the steps a crash threw away."""
    steps: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
    for name in os.listdir(directory):
        if name.startswith("ids.inc"):
            inc = int(name.split(".")[1][3:])
            with open(os.path.join(directory, name)) as f:
                for line in f:
                    step, *ids = line.split()
                    steps[inc, int(step)] += ids
    last: dict[int, tuple[int, list[str]]] = {}
    for (inc, step), ids in steps.items():
        if step not in last or inc > last[step][0]:
            last[step] = (inc, ids)
    final = [i for step in sorted(last) for i in last[step][1]]
    everything = [i for ids in steps.values() for i in ids]
    return final, len(everything) - len(final)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx demo --stream", description="Train from a live Redis stream with "
                                "2 workers; one dies midway and the group restarts from the last commit.")
    p.add_argument("--events", type=int, default=8000, help="digits images the producer publishes (default 8000)")
    p.add_argument("--rate", type=float, default=1500.0, help="events per second (default 1500)")
    p.add_argument("--batch-size", type=int, default=32, help="events per worker per step (default 32)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--every", type=int, default=10, help="commit (checkpoint) every N steps (default 10)")
    p.add_argument("--idle", type=float, default=20.0, help="end after this many seconds without events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    for name in ("--worker", "--stream"):
        p.add_argument(name, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the streaming demo; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    from .broker import RedisServer
    from .source import END_FIELD

    print(f"phalanx demo --stream: a producer publishes {args.events} digits images at {args.rate:.0f}/s to a "
          f"Redis stream;\n{args.workers} workers train a small CNN from it (batch {args.batch_size} each, a commit "
          f"every {args.every} steps). Midway one worker is killed.", flush=True)
    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="phalanx-stream-demo-") as tmp:
        args.url, args.dir = server.url, tmp
        print(f"redis-server on {server.url}\n\n== {args.workers} workers ==", flush=True)
        producer = subprocess.Popen([sys.executable, "-m", "phalanx.stream.producer", server.url, STREAM, "--data",
                                     "digits", "--count", str(args.events), "--rate", str(args.rate), "--end"])
        try:
            procs = _launch(args, 0)
            half = args.events // 2
            deadline = time.monotonic() + 300
            while _trained(tmp) < half and time.monotonic() < deadline and all(p.poll() is None for p in procs):
                time.sleep(0.1)
            victim = procs[-1]
            victim.send_signal(signal.SIGKILL)
            print(f"\n** killed worker {len(procs) - 1} (pid {victim.pid}) after about {_trained(tmp)} events **",
                  flush=True)
            _wait(procs, 30)  # the survivor sees its peer gone and exits
            print("\n== the group restarts from the last commit: a new worker takes the dead one's place ==",
                  flush=True)
            codes = _wait(_launch(args, 1), 600)
            producer.wait(timeout=60)
        finally:
            if producer.poll() is None:
                producer.kill()
        if any(codes):
            print(f"phalanx demo --stream: the restarted workers failed ({codes}); see above.", file=sys.stderr)
            return 1
        import redis
        produced = [i.decode() for i, f in redis.Redis.from_url(server.url).xrange(STREAM) if END_FIELD not in f]
        final, retrained = _history(tmp)
        with open(os.path.join(tmp, "summary.json")) as f:
            summary = json.load(f)
    counts = collections.Counter(final)
    rows = [("events produced", len(produced)), ("events trained", len(counts)),
            ("trained twice", sum(1 for n in counts.values() if n > 1)),
            ("lost", len(set(produced) - set(counts))),
            ("re-read after the crash (trained by steps no commit covered)", retrained),
            ("pending in the broker at the end", summary["pending"]),
            ("test accuracy (held-out digits)", f"{summary['test_accuracy']:.3f}")]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows), flush=True)
    return 0 if rows[2][1] == 0 and rows[3][1] == 0 else 1


def _trained(directory: str) -> int:
    total = 0
    for name in os.listdir(directory):
        if name.startswith("ids.inc0."):
            with open(os.path.join(directory, name)) as f:
                total += sum(len(line.split()) - 1 for line in f)
    return total


if __name__ == "__main__":
    sys.exit(main())
