"""broadcast_state: a large state streamed as raw tensor bytes in chunks, exactly, in bounded memory (2 gloo ranks)."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from support.procs import run_workers

from phalanx.group.transfer import _chunks


def _same(a, b) -> bool:
    """Equal in structure, container kinds, dtypes, shapes and bytes (torch.equal ignores dtype; bytes do not)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_the_byte_stream_is_cut_into_chunks_that_cover_every_tensor_once():
    sizes = [5, 3, 1, 10, 0, 2, 4]
    chunks = list(_chunks(sizes, 4))
    assert all(size <= 4 and size == sum(b - a for _, a, b in pieces) for pieces, size in chunks)
    # a tensor larger than a chunk crosses alone (no buffer); smaller ones are packed whole
    assert [[i for i, _, _ in pieces] for pieces, _ in chunks] == [[0], [0], [1, 2], [3], [3], [3], [5], [6]]
    assert all(b - a == sizes[i] for pieces, _ in chunks if len(pieces) > 1 for i, a, b in pieces)
    covered = [(i, a, b) for pieces, _ in chunks for i, a, b in pieces]
    for i, n in enumerate(sizes):
        spans = [(a, b) for j, a, b in covered if j == i]
        assert sum(b - a for a, b in spans) == n and all(b1 == a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))


@pytest.mark.multiproc
def test_a_streamed_state_arrives_exactly_whole_tensors_and_packed_small_ones_alike():
    # 5000 floats in 1000-byte chunks: the big tensor crosses in 20 direct chunks, the small ones packed together
    for r in run_workers("workers.group:streamed_state", world_size=2, n_big=5000, chunk_bytes=1000).results:
        assert _same(r["got"], r["expected"]), r["got"]
        assert isinstance(r["got"]["model"], OrderedDict) and isinstance(r["got"]["pair"], tuple)


@pytest.mark.multiproc
def test_a_streamed_state_costs_the_receiver_its_state_and_the_sender_one_chunk():
    mib, chunk = 64, 16 << 20  # the default chunk: 16 MiB tensors behind a small one
    sender, receiver = run_workers("workers.group:streamed_state_memory", world_size=2, mib=mib,
                                   chunk_bytes=chunk).results
    assert receiver["numel"] == mib << 18  # 64 MiB of float32
    slack = 8 << 20  # the allocator's and gloo's own buffers
    assert receiver["grown"] <= (mib << 20) + chunk + slack, receiver
    assert sender["grown"] <= chunk + slack, sender
