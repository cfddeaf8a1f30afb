"""Each data chunk of a checkpoint is hashed as DCP writes it; the seal reads no data byte back (issue 39, item 2).

The oracle: SHA-256 of each chunk's bytes read from the sealed file here, with hashlib, against what the marker
records. A writer that does not hash (any other DCP writer) still gets every chunk hashed, read back.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle

import pytest
import torch

import phalanx as px
import phalanx.sealed as sealed
from phalanx.checkpoint import saver
from phalanx.checkpoint.dcp import DIGEST
from phalanx.checkpoint.dcp_reader import _MetadataUnpickler


def _state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.ones(2, 16)).sum().backward()
    opt.step()
    return net, opt


def _chunks(path: str) -> list[tuple[str, int, int, object]]:
    """Every data chunk of the checkpoint at ``path``: its file, offset, length and the digest .metadata carries."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        storage = _MetadataUnpickler(f).load().storage_data
    return [(i.relative_path, i.offset, i.length, getattr(i, DIGEST, None)) for i in storage.values()]


def _check_marker(path: str) -> int:
    """Every data chunk the marker lists against hashlib over the file's bytes; returns how many were checked."""
    with open(os.path.join(path, px.checkpoint.MARKER)) as f:
        files = json.load(f)["files"]
    checked = 0
    for name, entry in files.items():
        for offset, length, digest in entry.get("chunks", []):
            with open(os.path.join(path, name), "rb") as f:
                f.seek(offset)
                assert hashlib.sha256(f.read(length)).hexdigest() == digest, (name, offset)
            checked += 1
    return checked


@pytest.fixture
def reads(monkeypatch) -> list[tuple[int, int]]:
    """The (offset, length) of every range the seal hashes by reading it back."""
    seen: list[tuple[int, int]] = []
    real = sealed._hash_range

    def counting(fd: int, offset: int, length: int) -> str:
        seen.append((offset, length))
        return real(fd, offset, length)

    monkeypatch.setattr(sealed, "_hash_range", counting)
    return seen


def test_a_save_hashes_each_chunk_as_written_and_its_seal_reads_back_only_the_small_files(tmp_path, reads):
    net, opt = _state()
    path = str(tmp_path / "ckpt")
    px.save_checkpoint(path, net, opt, step=2)
    chunks = _chunks(path)
    assert chunks and all(isinstance(d, str) and len(d) == 64 for *_, d in chunks)
    sizes = {os.path.getsize(os.path.join(path, n)) for n in (".metadata", "rank-0.pt")}
    assert sorted(n for _, n in reads) == sorted(sizes)  # the two small files, whole; no data chunk
    assert _check_marker(path) == len(chunks)
    fresh, fresh_opt = _state(seed=1)
    px.load_checkpoint(path, fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values()))


def test_an_asynchronous_save_carries_the_digests_its_writer_process_took(tmp_path):
    net, opt = _state()
    path = str(tmp_path / "ckpt")
    px.save_checkpoint(path, net, opt, step=2, blocking=False).wait()
    chunks = _chunks(path)
    assert chunks and all(isinstance(d, str) and len(d) == 64 for *_, d in chunks)
    assert _check_marker(path) == len(chunks)


def test_a_writer_that_does_not_hash_gets_every_chunk_read_back(tmp_path, monkeypatch, reads):
    from phalanx.checkpoint.dcp import _dcp
    monkeypatch.setattr(saver, "_writer", lambda tmp: _dcp().FileSystemWriter(tmp, sync_files=True))
    net, opt = _state()
    path = str(tmp_path / "ckpt")
    px.save_checkpoint(path, net, opt, step=2)
    chunks = _chunks(path)
    assert all(d is None for *_, d in chunks)
    assert len(reads) == 2 + len({(o, n) for _, o, n, _ in chunks})
    assert _check_marker(path) == len(chunks)


def test_a_data_file_cut_short_after_its_write_is_not_sealed(tmp_path, monkeypatch):
    """The seal takes the writer's digests only for chunks that lie within the file as it stands."""
    from phalanx.checkpoint import dcp
    real = dcp._seal

    def truncating(tmp: str, path: str, world: int, step: int) -> None:
        name = next(n for n in os.listdir(tmp) if n.endswith(".distcp"))
        os.truncate(os.path.join(tmp, name), os.path.getsize(os.path.join(tmp, name)) - 1)
        real(tmp, path, world, step)

    monkeypatch.setattr(dcp, "_seal", truncating)
    monkeypatch.setattr("phalanx.checkpoint.handle._seal", truncating)
    net, opt = _state()
    path = str(tmp_path / "ckpt")
    with pytest.raises(EOFError):
        px.save_checkpoint(path, net, opt, step=2)
    assert not os.path.exists(path)


def test_the_digest_survives_dcps_metadata_round_trip():
    """DCP drops None fields when it pickles a storage entry (``__getstate__``); a digest is kept."""
    from phalanx.checkpoint.dcp import _dcp
    info = _dcp().filesystem._StorageInfo("__0_0.distcp", 0, 3)
    setattr(info, DIGEST, "0" * 64)
    assert getattr(pickle.loads(pickle.dumps(info)), DIGEST) == "0" * 64
