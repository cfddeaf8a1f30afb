"""A checkpoint never loads corrupted or mixed state (issue 36, items 9, 10, 11, 13).

* Every byte used from a checkpoint directory is checked against the SHA-256 its marker
  records (data files per chunk) before anything is applied: bit flips are refused by
  ``px.load_checkpoint``, ``px.read_checkpoint`` and ``phalanx export`` alike.
* A load that overlaps saves of the same path by another process reads one save or refuses.
* ``latest_checkpoint`` (``--resume-from auto``) takes the newest checkpoint that verifies and
  puts back the one a save killed between its two renames left as ``.old-*``.
* Crafted metadata (an editor who rewrote the marker too): a FIFO, ``..``, a symlink out of
  the directory, a size larger than what is stored: refused, never waited on, never read.

The marker is rewritten here by hand (``_reseal``), as an editor would, without phalanx's code.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import threading

import pytest
import torch
from support.paths import TESTS
from workers import overlapping_saver as S

import phalanx as px
from phalanx.cli import main as cli
from phalanx.launch.workers import start_worker
from phalanx.step.preempt import latest_checkpoint
from support.procs import reap
from support.wait import until

WORKERS = os.path.join(TESTS, "workers")


def _net(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.ones(2, 6)).sum().backward()
    opt.step()
    return net, opt


def _flat(net: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """Weights and optimizer state as one vector: what a load changes."""
    state = [v.flatten().float() for p in net.parameters() for v in opt.state[p].values()]
    return torch.cat([p.detach().flatten() for p in net.parameters()] + state)


def _saved(tmp_path, name: str = "ckpt", seed: int = 1, step: int = 3) -> str:
    net, opt = _net(seed)
    path = str(tmp_path / name)
    px.save_checkpoint(path, net, opt, step=step)
    return path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _metadata(path: str):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # our own file, in a test: DCP's classes


def _reseal(path: str, extra: dict | None = None) -> None:
    """Rewrite the marker of ``path`` so that it vouches for the files as they are now (and ``extra`` entries)."""
    marker = json.loads(open(os.path.join(path, "phalanx.json")).read())
    storage = _metadata(path).storage_data
    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == "phalanx.json" or not os.path.isfile(full):
            continue
        data = open(full, "rb").read()
        if name.endswith(".distcp"):
            spans = sorted({(i.offset, i.length) for i in storage.values() if i.relative_path == name})
            files[name] = {"size": len(data), "chunks": [[o, n, _sha(data[o:o + n])] for o, n in spans]}
        else:
            files[name] = {"size": len(data), "sha256": _sha(data)}
    files.update(extra or {})
    body = {"format": marker["format"], "world_size": marker["world_size"], "step": marker["step"], "files": files}
    digest = _sha(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    with open(os.path.join(path, "phalanx.json"), "w") as f:
        json.dump({**body, "sha256": digest}, f)


def _rewrite_metadata(path: str, edit) -> None:
    metadata = _metadata(path)
    edit(metadata)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


# -- item 9: every byte used is verified ---------------------------------------------------------------------------

def test_no_bit_flip_in_a_data_file_loads(tmp_path):
    """60 random single-bit flips in the data file: each refused by load (nothing changed), read and export."""
    ckpt = _saved(tmp_path)
    data_file = os.path.join(ckpt, "__0_0.distcp")
    size = os.path.getsize(data_file)
    rng = random.Random(36)
    net, opt = _net(2)
    before = _flat(net, opt)
    silent = []
    for n, bit in enumerate(rng.sample(range(size * 8), 60)):
        copy = str(tmp_path / f"flip{n}")
        shutil.copytree(ckpt, copy)
        with open(os.path.join(copy, "__0_0.distcp"), "r+b") as f:
            f.seek(bit // 8)
            byte = f.read(1)[0]
            f.seek(bit // 8)
            f.write(bytes([byte ^ (1 << bit % 8)]))
        try:
            px.load_checkpoint(copy, net, opt)
            silent.append(bit)
        except px.CheckpointError as err:
            assert "__0_0.distcp" in str(err) and "\n" not in str(err), err  # one line naming the file
            assert torch.equal(_flat(net, opt), before)  # refused before anything was applied
        shutil.rmtree(copy)
    assert silent == [], f"{len(silent)} of 60 bit flips loaded silently"


def test_a_flip_inside_a_model_tensor_is_refused_by_read_checkpoint_and_export(tmp_path, capsys):
    net, opt = _net(1)
    with torch.no_grad():
        net[0].weight.fill_(0.5)  # a byte pattern to find in the file: 0.5 as float32
    ckpt = str(tmp_path / "ckpt")
    px.save_checkpoint(ckpt, net, opt, step=3)
    data_file = os.path.join(ckpt, "__0_0.distcp")
    raw = bytearray(open(data_file, "rb").read())
    at = raw.find(torch.full((12 * 6,), 0.5).numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 0x10  # one bit of one weight
    open(data_file, "wb").write(bytes(raw))
    with pytest.raises(px.CheckpointError, match="__0_0.distcp"):
        px.read_checkpoint(ckpt)
    assert cli(["export", ckpt, str(tmp_path / "model.pt")]) == 1
    assert "__0_0.distcp" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "model.pt")  # the damaged weights are not written out


# -- item 10: a load overlapping saves of the same path reads one save -----------------------------------------------

def test_loads_overlapping_another_process_saving_the_same_path_each_read_one_save(tmp_path, one_thread):
    path, stop, log = str(tmp_path / "ckpt"), tmp_path / "stop", tmp_path / "saver.log"
    # the saver is its own process, forked from the server that imported torch once (no fresh interpreter)
    saver = start_worker("forkserver", [os.path.join(WORKERS, "overlapping_saver.py"), path, str(stop)],
                         dict(os.environ), log=str(log))
    try:
        until(lambda: log.exists() and "saved " in log.read_text(), timeout=60, what="the saver's first save",
              procs=[saver], detail=lambda: log.read_text() if log.exists() else "")  # the first save is in place
        net, opt = S.model()
        net(torch.ones(1, S.WIDTH)).sum().backward()
        opt.step()
        mixed, refused, loads, steps = [], 0, 0, set()
        for n in range(48):
            try:
                if n % 4 == 3:  # read_checkpoint too: every tensor of rank 0's part against the marker's step
                    got = px.read_checkpoint(path)
                    step = got["step"]
                    values = {float(v.flatten()[0]) for v in got["ranks"][0]["model"].values()}
                    same = values == {float(step)} and got["extra"] == {"i": step}
                else:
                    out = px.load_checkpoint(path, net, opt)
                    step = out["step"]
                    values = set(_flat(net, opt).unique().tolist())
                    same = values == {float(step)} and out["extra"] == {"i": step}
            except px.CheckpointError as err:  # allowed: a load that refuses rather than mixes
                assert "replaced by a newer save" in str(err), err
                refused += 1
                continue
            loads += 1
            steps.add(step)
            if not same:
                mixed.append((step, sorted(values)[:3]))
    finally:
        stop.touch()
        try:
            saver.wait(timeout=60)
        finally:
            reap(saver)
    assert mixed == [], f"{len(mixed)} of {loads} loads mixed two saves: {mixed[:5]}"
    assert loads >= 40 and len(steps) > 3, (loads, refused, steps)  # the loads did overlap many saves


@pytest.mark.parametrize("reader", ["load_checkpoint", "read_checkpoint"])
def test_a_save_renaming_its_directory_in_between_looking_and_reading_gets_the_new_one_read(tmp_path, monkeypatch,
                                                                                             reader):
    # The race, placed at its instruction: the reader finds the path, the save moves the old checkpoint aside (the
    # path is missing when the reader asks whether it is a directory, so it takes it for a one-file checkpoint), and
    # the new directory lands before the file is opened: EISDIR, where a reader must read the new save whole.
    from phalanx.checkpoint import loader as L
    path, new = _saved(tmp_path, "ckpt", step=3), _saved(tmp_path, "next", step=4)
    resolve, moves = L._resolve, []

    def resolve_then_move_aside(p):
        found = resolve(p)
        if not moves:
            moves.append(os.replace(path, path + ".old-1"))
        return found

    def land_then_read(found, *args, **kwargs):
        if len(moves) == 1:
            moves.append(os.replace(new, path))
            shutil.rmtree(path + ".old-1")
        return file_reader(found, *args, **kwargs)

    file_reader = L._load_file if reader == "load_checkpoint" else L.read_verified
    monkeypatch.setattr(L, "_resolve", resolve_then_move_aside)
    monkeypatch.setattr(L, "_load_file" if reader == "load_checkpoint" else "read_verified", land_then_read)
    if reader == "load_checkpoint":
        net, opt = _net(9)
        assert px.load_checkpoint(path, net, opt)["step"] == 4
    else:
        assert px.read_checkpoint(path)["step"] == 4
    assert len(moves) == 2  # the race did happen


# -- item 11: --resume-from auto takes the newest checkpoint that verifies ------------------------------------------

def _two_checkpoints(tmp_path) -> tuple[str, str]:
    old, new = _saved(tmp_path, "step-1", step=1), _saved(tmp_path, "step-2", step=2)
    os.utime(old, (1, 1))
    return old, new


@pytest.mark.parametrize("damage", ["no .metadata", "truncated rank-0.pt", "no data file", "a flipped bit"])
def test_latest_checkpoint_passes_over_a_newest_one_that_does_not_verify(tmp_path, damage):
    old, new = _two_checkpoints(tmp_path)
    if damage == "no .metadata":
        os.remove(os.path.join(new, ".metadata"))
    elif damage == "truncated rank-0.pt":
        with open(os.path.join(new, "rank-0.pt"), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(new, "rank-0.pt")) // 2)
    elif damage == "no data file":
        os.remove(os.path.join(new, "__0_0.distcp"))
    else:
        with open(os.path.join(new, "__0_0.distcp"), "r+b") as f:
            f.seek(-40, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-40, os.SEEK_END)
            f.write(bytes([byte ^ 1]))
    assert latest_checkpoint(tmp_path) == old


def test_latest_checkpoint_puts_back_the_checkpoint_a_save_killed_between_its_renames_left(tmp_path):
    from phalanx.launch.run import RunConfig
    older, newest = _two_checkpoints(tmp_path)
    os.rename(newest, newest + ".old-0123abcd")  # the first rename of a replacing save; then it was killed
    config = RunConfig.from_argv(["--checkpoint-dir", str(tmp_path), "--resume-from", "auto",
                                  os.path.join(WORKERS, "preempt.py")])
    assert config.resume_from == newest and px.read_checkpoint(newest)["step"] == 2
    assert not any(".old-" in n for n in os.listdir(tmp_path))


def test_latest_checkpoint_removes_an_old_copy_left_beside_a_finished_replace(tmp_path):
    _, newest = _two_checkpoints(tmp_path)
    shutil.copytree(newest, newest + ".old-4567cdef")  # the replace finished; removing the old one did not
    assert latest_checkpoint(tmp_path) == newest
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2"]


# -- item 13: crafted metadata --------------------------------------------------------------------------------------

def _point_first_chunk_at(path: str, name: str) -> tuple[str, int, int]:
    """Make DCP's metadata read model/0.weight from ``name``; returns what it pointed at before."""
    def edit(metadata):
        for index, info in metadata.storage_data.items():
            if index.fqn == "model/0.weight":
                edit.before = (info.relative_path, info.offset, info.length)
                info.relative_path = name
    _rewrite_metadata(path, edit)
    return edit.before


def test_a_data_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    ckpt = _saved(tmp_path)
    fifo = os.path.join(ckpt, "fifo")
    os.mkfifo(fifo)
    _, offset, length = _point_first_chunk_at(ckpt, "fifo")
    _reseal(ckpt, {"fifo": {"size": offset + length, "chunks": [[offset, length, "0" * 64]]}})
    outcome = []

    def read() -> None:
        try:
            px.read_checkpoint(ckpt)
            outcome.append("loaded")
        except px.CheckpointError as err:
            outcome.append(str(err))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)  # refused in well under a second; a build that opens the FIFO blocks here
    if reader.is_alive():  # release it (a writer that closes at once: the reader sees the end) to fail cleanly
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=60)
    assert len(outcome) == 1 and "fifo" in outcome[0] and "not a regular file" in outcome[0], outcome


def test_a_data_file_outside_the_directory_is_refused(tmp_path):
    ckpt, other = _saved(tmp_path, "a", seed=1), _saved(tmp_path, "b", seed=2)
    _point_first_chunk_at(ckpt, "../b/__0_0.distcp")  # the same layout: it would read b's weight
    _reseal(ckpt)
    assert os.path.exists(os.path.join(ckpt, "../b/__0_0.distcp")) and other
    net, opt = _net(3)
    with pytest.raises(px.CheckpointError):
        px.load_checkpoint(ckpt, net, opt)
    with pytest.raises(px.CheckpointError):
        px.read_checkpoint(ckpt)


def test_a_data_file_that_is_a_symlink_out_of_the_directory_is_refused(tmp_path):
    ckpt, other = _saved(tmp_path, "a", seed=1), _saved(tmp_path, "b", seed=2)
    os.remove(os.path.join(ckpt, "__0_0.distcp"))
    os.symlink(os.path.join(other, "__0_0.distcp"), os.path.join(ckpt, "__0_0.distcp"))
    _reseal(ckpt)
    net, opt = _net(3)
    with pytest.raises(px.CheckpointError, match="__0_0.distcp"):
        px.load_checkpoint(ckpt, net, opt)


def test_a_size_larger_than_the_stored_chunk_is_refused_not_filled_with_process_memory(tmp_path):
    ckpt = _saved(tmp_path)

    def edit(metadata):
        metadata.state_dict_metadata["model/0.weight"].size = torch.Size([24, 6])  # stored: one chunk of 12 x 6
    _rewrite_metadata(ckpt, edit)
    _reseal(ckpt)
    with pytest.raises(px.CheckpointError, match="model/0.weight"):
        px.read_checkpoint(ckpt)
    assert cli(["export", ckpt, str(tmp_path / "model.pt")]) == 1
    assert not os.path.exists(tmp_path / "model.pt")
