"""``phalanx demo --stream``: train from a live Redis stream; a worker dies, a new one joins, nothing is lost.

1. A real redis-server starts on a unix socket in a temporary directory (no persistence).
2. A producer process publishes scikit-learn's bundled digits images as events at a set rate.
3. ``phalanx run -n 2 --elastic --min-workers 1 --replace`` starts two workers that train a small
   CNN from the stream (:mod:`phalanx.bench.stream_demo_worker`), committing in memory every few steps.
   The lone survivor may go on because the launcher saw its peer die: the split-brain guard counts
   only the members not known dead.
4. Midway one worker is killed (SIGKILL). The survivors roll back to the last commit, rewind the
   stream to the committed position and go on; the launcher starts a new worker, which joins the
   group at a later commit point with rank 0's state.
5. The end table counts events produced, trained, trained twice and lost, from the ids of every
   step of the final model's history, and gives the test accuracy on the held-out digits.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from typing import Iterator, Sequence

import torch

STREAM, GROUP = "digits", "trainer"


def digits(count: int) -> Iterator[tuple[torch.Tensor, int]]:
    """``count`` images of scikit-learn's bundled digits training split, cycled: what the demo publishes."""
    from .models import load_digits_split
    train, _ = load_digits_split()
    x, y = train.tensors
    for i in range(count):
        yield x[i % len(x)], int(y[i % len(y)])


def produce(url: str, stream: str, count: int, rate: float) -> int:
    """The demo's producer process: publish ``count`` digits at ``rate`` per second, then the end marker."""
    from phalanx.stream.producer import publish
    return publish(url, stream, data=digits(count), count=count, rate=rate, end=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx demo --stream", description="Train from a live Redis stream with "
                                "2 workers; one dies midway, a new one joins, and no event is lost or repeated.")
    p.add_argument("--events", type=int, default=8000, help="digits images the producer publishes (default 8000)")
    p.add_argument("--rate", type=float, default=400.0, help="events per second (default 400)")
    p.add_argument("--batch-size", type=int, default=32, help="events per worker per step (default 32)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--every", type=int, default=10, help="commit every N steps (default 10)")
    p.add_argument("--idle", type=float, default=20.0, help="end after this many seconds without events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the streaming demo; returns the exit status."""
    args = _parser().parse_args(argv)
    from phalanx.stream.broker import RedisServer
    from phalanx.stream.source import END_FIELD

    kill_after = args.events // 3
    print(f"phalanx demo --stream: a producer publishes {args.events} digits images at {args.rate:.0f}/s to a "
          f"Redis stream;\n3 elastic workers train a small CNN from it (batch {args.batch_size} each, a commit "
          f"every {args.every} steps).\nAfter about {kill_after} events one worker is killed; a new one takes "
          "its place.", flush=True)
    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="phalanx-stream-demo-") as tmp:
        print(f"redis-server on {server.url}\n", flush=True)
        producer = subprocess.Popen([sys.executable, "-c", "import sys; from phalanx.bench.stream_demo import produce; "
                                     "produce(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))",
                                     server.url, STREAM, str(args.events), str(args.rate)])
        script = os.path.join(tmp, "stream_demo_worker.py")  # not run from the package folder: its redis.py
        with open(script, "w") as f:                              # would shadow redis-py on sys.path
            f.write("import sys\nfrom phalanx.bench.stream_demo_worker import main\nsys.exit(main())\n")
        cli = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]
        try:
            run = subprocess.run([*cli, "run", "-n", "2", "--elastic", "--min-workers", "1", "--replace", script,
                                  "--url", server.url, "--dir", tmp, "--stream", STREAM,
                                  "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                                  "--every", str(args.every), "--idle", str(args.idle), "--seed", str(args.seed),
                                  "--kill", "1", "--kill-after", str(kill_after)], timeout=600)
            producer.wait(timeout=60)
        finally:
            if producer.poll() is None:
                producer.kill()
        if run.returncode or not os.path.exists(os.path.join(tmp, "summary.json")):
            print(f"phalanx demo --stream: the workers failed (exit {run.returncode}); see above.", file=sys.stderr)
            return 1
        import redis
        produced = [i.decode() for i, f in redis.Redis.from_url(server.url).xrange(STREAM) if END_FIELD not in f]
        with open(os.path.join(tmp, "summary.json")) as f:
            summary = json.load(f)
        every_training = 0  # what every worker trained, including steps a rollback threw away
        for name in os.listdir(tmp):
            if name.startswith("ids."):
                with open(os.path.join(tmp, name)) as f:
                    every_training += sum(len(line.split()) for line in f)
    final = [i for step in summary["record"] for i in step]  # the final model's history
    counts = collections.Counter(final)
    changes = "; ".join(f"left {', '.join(h['left'])}" if h.get("left") else f"joined {', '.join(h['joined'])}"
                        for h in summary["history"]) or "none"
    rows = [("events produced", len(produced)), ("events trained", len(counts)),
            ("trained twice", sum(1 for n in counts.values() if n > 1)),
            ("lost", len(set(produced) - set(counts))),
            ("re-read after the loss (trained by steps no commit covered)", every_training - len(final)),
            ("pending in the broker at the end", summary["pending"]),
            ("group changes", changes), ("workers at the end", summary["world_size"]),
            ("test accuracy (held-out digits)", f"{summary['test_accuracy']:.3f}")]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows), flush=True)
    return 0 if rows[2][1] == 0 and rows[3][1] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
