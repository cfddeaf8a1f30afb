"""What a joiner receives and how fast: rank 0's commit (model + AdamW) sent to a new worker, at a real model's size.

    sudo python benchmarks/joiner_rate.py                              # 1 GB state, loopback and a 1 Gbit/s link
    python benchmarks/joiner_rate.py --links loopback --params 8       # a quick look (100 MB), no root needed
    python benchmarks/joiner_rate.py --modes streamed                  # the path phalanx takes alone

Two real processes talk gloo: rank 0 holds a commit as ``px.elastic.State`` takes it
(``training.capture``'s CPU copies of an MLP's state_dict and of its AdamW's, one step taken:
``--params`` million fp32 parameters, so 4 bytes each of parameters and 8 of Adam moments: 85 M is
1.02 GB); rank 1 is the joiner (a hot spare takes the very same call, :meth:`Recovery._send_state`,
at the regroup that admits it). Per mode, in fresh processes:

- ``streamed``: what a joiner takes today, ``phalanx.group.transfer.broadcast_state``: the
  commit's layout weights-only, then its tensors as raw bytes in 16 MiB chunks into tensors the
  joiner allocated;
- ``pickled``: what it took before, ``broadcast_object``: the whole commit ``torch.save``-d into
  one bytes object, broadcast, and loaded weights-only.

Links: ``loopback`` (both processes in this namespace) and a shaped one (``--rate``, default 1gbit):
two network namespaces joined by a veth pair with ``tc tbf`` on both ends
(:class:`phalanx.launch.netns.Link`, root needed), each process in its own namespace.

Per run it reports the seconds from the joiner's admission (both ranks at a barrier in the group
that admits it) until it holds the whole commit, the payload bytes (the commit's tensors), the
bytes that crossed the veth pair (headers and the other direction's acks included), the payload
rate as a fraction of the link's (loopback: GB/s only), and each process's peak RSS above its
baseline (VmHWM, reset through /proc/self/clear_refs after the group is formed and the commit
built). The bound the joiner should meet: its own state (the commit it receives) plus one chunk.
Results print as a table and go as JSON to ``--out`` (default results/joiner_rate).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 4096  # Linear(4096, 4096): 16.8 M parameters a layer


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from the present RSS (Linux >= 4.0)


def build(params_m: float):
    """An MLP of about ``params_m`` M parameters (Linear(4096, 4096) layers) and its AdamW."""
    import torch
    torch.manual_seed(0)
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def commit(params_m: float) -> dict:
    """The commit ``px.elastic.State`` would hold for that MLP after one AdamW step (its moments then exist)."""
    import torch
    from phalanx.checkpoint.training_state import cpu_copy
    net, opt = build(params_m)
    for p in net.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    snap = {"model": cpu_copy(net.state_dict()), "optimizer": cpu_copy(opt.state_dict()), "elastic_step": 1}
    del net, opt
    return snap


def first_step(net, opt, snap: dict) -> None:
    """What a joiner does once it holds the commit (Recovery.join): restore it, commit its own, take a step."""
    import torch
    from phalanx.checkpoint.training_state import cpu_copy
    net.load_state_dict(snap["model"])
    opt.load_state_dict(snap["optimizer"])
    mine = {"model": cpu_copy(net.state_dict()), "optimizer": cpu_copy(opt.state_dict())}  # its own commit
    x = torch.randn(8, WIDTH)
    opt.zero_grad()
    net(x).square().mean().backward()
    opt.step()
    del mine


def worker(mode: str, params_m: float, out: str) -> None:
    import torch
    import phalanx as px
    from phalanx.group import collectives, transfer
    g = px.init()
    snap = commit(params_m) if g.rank == 0 else None
    own = build(params_m) if g.rank == 1 else None  # the joiner built its model and optimizer before admission
    payload = 0 if snap is None else sum(t.numel() * t.element_size() for t in _tensors(snap))
    collectives.broadcast_object(torch.ones(1), src=0)  # the group's connections exist before the baseline
    _reset_peak()
    base = _peak_kib()
    px.barrier()  # admission: from here the joiner waits only for the commit
    t0 = time.perf_counter()
    if mode == "streamed":
        got = transfer.broadcast_state(snap, 0, "newest commit")
    else:
        got = collectives.broadcast_object(snap, 0, "newest commit")
    seconds = time.perf_counter() - t0
    received = sum(t.numel() * t.element_size() for t in _tensors(got))
    grown = (_peak_kib() - base) << 10
    if own is not None:
        first_step(*own, got)
    to_step = time.perf_counter() - t0
    px.barrier()
    with open(out, "w") as f:
        json.dump({"rank": g.rank, "seconds": seconds, "to_first_step": to_step, "payload": payload or received,
                   "grown": grown, "base_rss": base << 10}, f)


def _tensors(obj):
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def run(mode: str, params_m: float, link, timeout: float) -> dict:
    """Sender and joiner in fresh processes (each in its namespace on a shaped link); both ranks' results."""
    from phalanx.bench.procs import free_port
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="phalanx-joiner-rate-") as tmp:
        procs, outs = [], []
        before = link.tx_bytes() if link is not None else 0
        for rank in range(2):
            outs.append(os.path.join(tmp, f"rank{rank}.json"))
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                   **(link.env(rank) if link is not None else {})}
            argv = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--params", str(params_m),
                    "--result", outs[-1]]
            procs.append(subprocess.Popen((link.prefix(rank) if link is not None else []) + argv, env=env))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()  # the run is over: the other rank waits on this one
                raise SystemExit(f"{mode}: no result within {timeout:.0f}s") from None
        if any(p.returncode for p in procs):
            raise SystemExit(f"{mode}: a worker failed (exit codes {[p.returncode for p in procs]})")
        sender, joiner = (json.load(open(o)) for o in outs)
        wire = (link.tx_bytes() - before) if link is not None else None
    return {"mode": mode, "seconds": joiner["seconds"], "to_first_step": joiner["to_first_step"],
            "payload": sender["payload"], "wire_bytes": wire,
            "sender_grown": sender["grown"], "joiner_grown": joiner["grown"], "joiner_base_rss": joiner["base_rss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=85.0, help="millions of fp32 parameters (85: 1.02 GB with AdamW)")
    ap.add_argument("--links", default="loopback,shaped", help="loopback, shaped, or both (comma-separated)")
    ap.add_argument("--rate", default="1gbit", help="the shaped link's rate (tc tbf)")
    ap.add_argument("--burst", default="1mb", help="tbf's burst (at least rate/HZ: 500 kB at 1 Gbit/s and HZ=250)")
    ap.add_argument("--modes", default="streamed,pickled")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "joiner_rate"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.params, args.result)
    from phalanx.launch.netns import Link
    rows = []
    for which in args.links.split(","):
        for mode in args.modes.split(","):
            if which == "loopback":
                rows.append({"link": "loopback", **run(mode, args.params, None, args.timeout)})
                continue
            with Link(args.rate, burst=args.burst) as link:
                rows.append({"link": f"{link.rate} (tbf, 2 netns)", "rate_bits": _bits(link.rate),
                             **run(mode, args.params, link, args.timeout)})
    print(f"state: {rows[0]['payload'] / 1e9:.3f} GB ({rows[0]['payload'] / 12e6:.1f} M fp32 parameters + AdamW's "
          "2 moments); "
          f"chunk 16 MiB; {os.cpu_count()} cores (shared with other engineers' jobs when it says so below)")
    print(f"{'link':<26} {'mode':<9} {'s':>7} {'1st step':>8} {'GB/s':>6} {'of link':>8} {'wire GB':>8} "
          f"{'joiner +RSS':>12} {'x state':>8} {'sender +RSS':>12}")
    for r in rows:
        rate = r["payload"] / r["seconds"]
        frac = f"{100 * rate * 8 / r['rate_bits']:.0f}%" if "rate_bits" in r else "-"
        wire = f"{r['wire_bytes'] / 1e9:.3f}" if r["wire_bytes"] is not None else "-"
        print(f"{r['link']:<26} {r['mode']:<9} {r['seconds']:>7.2f} {r['to_first_step']:>8.2f} {rate / 1e9:>6.3f} "
              f"{frac:>8} {wire:>8} "
              f"{r['joiner_grown'] / 2**20:>9.0f}MiB {r['joiner_grown'] / r['payload']:>8.2f} "
              f"{r['sender_grown'] / 2**20:>9.0f}MiB")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "joiner_rate.json"), "w") as f:
        json.dump({"params_m": args.params, "rows": rows, "time": time.time()}, f, indent=1)


def _bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"rate {rate!r}; expected a number followed by kbit, mbit or gbit")


if __name__ == "__main__":
    main()
