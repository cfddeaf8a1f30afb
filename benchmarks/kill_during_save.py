"""kill -9 a process in the middle of checkpoint writes, many times; count what is left on disk.

Each trial starts a process that writes a ~50 MB checkpoint to the same path in a loop,
waits until one of its writes is in flight (its temporary file exists), and kills it
with SIGKILL. After every trial there must be at most one temporary file (the new
writer removes the dead ones' before writing), the checkpoint, if any, must verify,
and after one more successful save no temporary may be left.

    python benchmarks/kill_during_save.py [--trials 20] [--mb 50] [--dir DIR]
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

SAVER = """
import sys, torch
from phalanx.framing import write_verified
body = {"w": torch.randn(int(sys.argv[2]) * 2**20 // 4)}
print("ready", flush=True)
while True:
    write_verified(sys.argv[1], body)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--mb", type=int, default=50, help="checkpoint size in MiB")
    parser.add_argument("--dir", default=None, help="where to write (default: a fresh temporary directory)")
    args = parser.parse_args(argv)
    from phalanx.framing import read_verified, write_verified

    directory = args.dir or tempfile.mkdtemp(prefix="kill-during-save-")
    path = os.path.join(directory, "ckpt.pt")
    rng = random.Random(0)
    worst, hits = 0, 0
    for trial in range(args.trials):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, path, str(args.mb)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 1.0))
        deadline = time.monotonic() + 30
        while not glob.glob(os.path.join(directory, f".*.tmp-*-{proc.pid}-*")) and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        temporaries = glob.glob(os.path.join(directory, ".*.tmp-*"))
        hits += bool(temporaries)
        worst = max(worst, len(temporaries))
        if os.path.exists(path):
            read_verified(path)  # the checkpoint itself is always whole
        print(f"trial {trial + 1}: {len(temporaries)} temporary file(s) left", flush=True)
    write_verified(path, {"step": 1})
    after = glob.glob(os.path.join(directory, ".*.tmp-*"))
    print(f"{args.trials} kills ({hits} mid-write): at most {worst} temporary file(s) after a kill, "
          f"{len(after)} after the next save")
    return 0 if worst <= 1 and not after else 1


if __name__ == "__main__":
    sys.exit(main())
