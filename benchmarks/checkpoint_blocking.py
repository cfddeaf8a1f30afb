"""What a checkpoint costs training: ``px.save_checkpoint`` synchronous vs asynchronous, side by side in one run.

A model of about 100M parameters (a stack of square linear layers) trains with AdamW in one
process. Each repeat times, in this order, the same ``--steps`` training steps three ways:

* plain: the steps alone (the baseline, measured in every repeat, next to the others);
* asynchronous (``blocking=False``), by fork and by copy (the default): the save's call, the steps (run
  while the writer process writes; more, up to 4 times as many, until the write is done), and the handle's
  ``wait()`` at the end (zero when the write finished during the steps), against as many plain steps;
* synchronous (``blocking=True``): the save, then the steps.

and reports, as medians over the repeats:

* **blocking**: how long the save held the training loop: the call (the fork, or the copy into shared memory of
  what is not copied beside training), plus the next step's wait for the copy beside training, if any
  (:mod:`phalanx.checkpoint.staging`);
* **total cost to training**: the wall time the steps with the save took beyond the plain steps
  (the call, every step's slow-down while the files were written, and any wait at the end).

The asynchronous save is timed three ways, side by side in each repeat: ``fork`` (the default: the
call forks the worker, whose child copies the state, copy-on-write; training pays the page faults of
its first writes, counted), ``copy`` (the fallback: the call copies the state into shared memory), and
``copy-readback``: the copy, written by DCP's own ``FileSystemWriter``, whose chunks are not hashed as
written, so the seal reads every data file back to hash it (as before :mod:`phalanx.checkpoint.hashing`).

Both are given as fractions of the synchronous save's cost, beside the **floor**: one ``memcpy``
of the state (every tensor of the model and AdamW copied into memory allocated and touched before),
and the torch thread counts of the training process and of the writer process.

The first asynchronous save of a run also starts the writer process and allocates the shared
region (both kept for the next saves); it is done once before the repeats and reported apart.

    python benchmarks/checkpoint_blocking.py [--width 2048] [--layers 24] [--repeat 3] [--steps 0] [--nice N]
        [--threads T]

``--steps 0`` (default) picks enough steps to cover two synchronous saves' time.
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

import phalanx as px


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="steps timed after each save (0: cover 2 sync saves)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--nice", type=int, default=None, help="the writer process's nice (default: phalanx's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="training's intra-op threads (default torch's: every core; a phalanx worker runs with 1 "
                             "unless told otherwise; a GPU job's training leaves the cores to the writer)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.nice is not None:
        import phalanx.checkpoint.writer as writer
        writer.NICE = args.nice

    load0 = os.getloadavg()
    px.init()
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    model, opt = px.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    def steps(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            step()
        return time.perf_counter() - started

    for _ in range(2):
        step()  # warm-up, and AdamW's moments exist
    floor = memcpy_floor(model, opt)
    where = args.dir or tempfile.mkdtemp(prefix="phalanx-ckpt-bench-")
    path = os.path.join(where, "ckpt")

    started = time.perf_counter()
    px.save_checkpoint(path, model, opt, step=0)
    first_sync = time.perf_counter() - started
    started = time.perf_counter()
    handle = px.save_checkpoint(path, model, opt, step=0, blocking=False)
    first_call = time.perf_counter() - started
    handle.wait()
    first_async = time.perf_counter() - started
    plain_step = statistics.median(steps(1) for _ in range(3))
    n = args.steps or max(3, math.ceil(2 * first_sync / plain_step))

    import phalanx.checkpoint.writer as writer
    from phalanx.checkpoint import saver
    from phalanx.group import group
    writers = writer.WRITERS
    import torch.distributed.checkpoint as dcp
    hashing_writer, default_fork = saver._writer, writer.FORK

    def reading_back(tmp: str):  # DCP's own writer: no digest taken as written, so the seal hashes every file back
        return dcp.FileSystemWriter(tmp, sync_files=True)
    # the snapshot by fork (the default) and the copy in the call (fallback), both hashing as they write; and the
    # copy sealed as before chunks were hashed as written (the files read back to hash them), side by side
    modes = {"fork": (True, hashing_writer), "copy": (False, hashing_writer), "copy-readback": (False, reading_back)}
    per_mode = ("call", "fence", "held", "cost", "wait", "first", "faults")
    keys = ["plain", "plain_faults", "sync", "sync_cost"] + [f"{m}_{k}" for m in modes for k in per_mode]
    rows: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(args.repeat):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        rows["plain"].append(steps(n))
        rows["plain_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        for mode, (fork, make_writer) in modes.items():
            writer.FORK = fork
            saver._writer = make_writer
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            handle = px.save_checkpoint(path, model, opt, step=2 * r + 1, blocking=False)
            call = time.perf_counter() - started
            rows[f"{mode}_first"].append(steps(1))  # the step that writes every parameter first after the fork
            taken = 1
            while taken < n or (not handle.done() and taken < 4 * n):  # until the write is done (at most 4 n steps)
                steps(1)
                taken += 1
            waited = time.perf_counter()
            handle.wait()
            rows[f"{mode}_wait"].append(time.perf_counter() - waited)
            rows[f"{mode}_call"].append(call)
            # the copy beside training (phalanx.checkpoint.staging): how long its fences held the next step
            rows[f"{mode}_fence"].append(getattr(writers.of(group.current()).value.copy, "waited", 0.0))
            rows[f"{mode}_held"].append(call + rows[f"{mode}_fence"][-1])
            rows[f"{mode}_cost"].append(time.perf_counter() - started - rows["plain"][-1] * taken / n)
            rows[f"{mode}_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        writer.FORK, saver._writer = default_fork, hashing_writer
        started = time.perf_counter()
        px.save_checkpoint(path, model, opt, step=2 * r + 2)
        rows["sync"].append(time.perf_counter() - started)
        steps(n)
        rows["sync_cost"].append(time.perf_counter() - started - rows["plain"][-1])
        assert px.read_checkpoint(path)["step"] == 2 * r + 2

    med = {k: statistics.median(v) for k, v in rows.items()}
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**20
    state_mib = sum(t.numel() * t.element_size() for t in state_tensors(model, opt)) / 2**20
    load = os.getloadavg()
    plain = med["plain"] / n
    print(f"model: {params / 1e6:.1f}M parameters, AdamW; state {state_mib:,.0f} MiB, checkpoint {size:,.0f} MiB; "
          f"plain step {plain:.3f} s ({med['plain_faults'] / n:,.0f} minor page faults); {n} steps timed after each "
          f"save; median of {args.repeat}")
    print(f"threads: training process torch.get_num_threads()={torch.get_num_threads()}; {writer_threads(args.nice)}; "
          f"the snapshot's forked child: one thread, no torch calls; {os.cpu_count()} CPUs; load average "
          f"{load0[0]:.1f} at the start, {load[0]:.1f} (1 min) / {load[1]:.1f} (5 min) at the end")
    print(f"floor (one memcpy of the state): {floor:.3f} s = {floor / med['sync']:.1%} of a synchronous save")
    print(f"synchronous:  save {med['sync']:.3f} s; total cost to training {med['sync_cost']:.3f} s")
    for mode in modes:
        held = med[mode + '_held']
        print(f"asynchronous, {mode}: blocking {held:.3f} s = {held / med['sync']:.1%} of synchronous (the call "
              f"{med[mode + '_call']:.3f} s, then the next step's wait for the copy {med[mode + '_fence']:.3f} s); "
              f"total cost to training {med[mode + '_cost']:.3f} s = "
              f"{med[mode + '_cost'] / med['sync']:.1%} of a synchronous save (final wait {med[mode + '_wait']:.3f} s; "
              f"first step after the call {med[mode + '_first']:.3f} s vs plain {plain:.3f} s; "
              f"{med[mode + '_faults']:,.0f} minor page faults in the training process over the save and its steps)")
    print(f"first asynchronous save of the run (starts the writer, allocates the region): call {first_call:.3f} s, "
          f"written in {first_async:.3f} s")
    print(f"per repeat (plain, sync cost, then blocking and cost of {', '.join(modes)}): " + "; ".join(
        " ".join(f"{v:.3f}" for v in vals) for vals in
        zip(rows["plain"], rows["sync_cost"], *[rows[f"{m}_{k}"] for m in modes for k in ("held", "cost")],
            strict=True)))
    if args.dir is None:
        shutil.rmtree(where, ignore_errors=True)
    px.shutdown()


def writer_threads(nice: int | None) -> str:
    """Where the asynchronous write runs (a phalanx without the writer process writes from a thread)."""
    try:
        from phalanx.checkpoint.writer import NICE
    except ImportError:
        return "asynchronous write: a thread of the training process"
    return f"asynchronous write: the writer process, torch.get_num_threads()=1, nice {NICE if nice is None else nice}"


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint holds: the parameters and the optimizer's state."""
    out = [p.detach() for p in px.unwrap(model).parameters()]
    for s in opt.state.values():
        out += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def memcpy_floor(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """Seconds of one copy of the state into memory allocated and touched before (median of 3)."""
    src = state_tensors(model, opt)
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)  # touched: no page faults in the timed copies

    def once() -> float:
        started = time.perf_counter()
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
        return time.perf_counter() - started
    return statistics.median(once() for _ in range(3))


if __name__ == "__main__":
    main()
