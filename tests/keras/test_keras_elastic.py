"""px.keras under ``phalanx run --elastic``: a Keras ``model.fit`` survives a SIGKILLed worker.

Three real workers train tests/workers/keras_elastic.py for 3 epochs (48 samples, batch 4
per worker, momentum SGD, commits every 2 steps); worker 2 is killed with SIGKILL as step 7
begins, so the survivors roll back to the commit of step 6 and redo it over 2 workers. A
replacement (``--replace``) is offered a place at the commit of step 11 and enters at step 13.
The oracle is plain Keras on one process, ``fit`` on exactly the global batches the survivors
recorded (the same world sizes at the same steps), one ``fit`` per epoch. Before all that, each
worker first calls ``fit`` on its own shuffle of the arrays, which every worker refuses.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess

import numpy as np
import pytest

import phalanx as px
from support import lazy
from support.forked_launch import run_cli  # the launcher forked, its workers from one server
from support.paths import TESTS

os.environ.setdefault("KERAS_BACKEND", "torch")
# imported by the first test that reads them: every xdist worker collects this file, one runs it
keras = lazy.module("keras")
worker = lazy.module("workers.keras_elastic")

WORKER = os.path.join(TESTS, "workers", "keras_elastic.py")
EPOCHS = 3


def _launch(tmp_path, n: int, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    flags, rest = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else ((), args)
    proc = run_cli(["run", "-n", str(n), "--elastic", *flags, WORKER, "--out", str(tmp_path), *rest], str(tmp_path),
                   timeout=300)
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    return proc, results


def _effective(steps: list[list]) -> list[list]:
    """The steps the run kept: a step redone after a rollback replaces the one that was lost."""
    kept: dict[int, list] = {}
    for row in steps:
        kept[row[0]] = row
    return [kept[s] for s in sorted(kept)]


def _oracle(steps: list[list]) -> tuple[dict, list, list, list]:
    """Plain Keras, one process, on the recorded global batches: history, calls, weights per epoch, final weights."""

    class _Replay(keras.utils.PyDataset):
        """One epoch's recorded global batches, for plain Keras on one process."""

        def __init__(self, x: np.ndarray, y: np.ndarray, batches: list[list[int]]) -> None:
            super().__init__()
            self.x, self.y, self.batches = x, y, batches

        def __len__(self) -> int:
            return len(self.batches)

        def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
            return self.x[self.batches[i]], self.y[self.batches[i]]

    class _Weights(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.at_epoch_end: list[list[np.ndarray]] = []

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            self.at_epoch_end.append([np.asarray(w) for w in self.model.get_weights()])

    x, y, xv, yv = worker.data()
    model, recorder, snap = worker.model(), worker.Recorder(), _Weights()
    history: dict[str, list] = {}
    for epoch in range(EPOCHS):
        batches = [ids for _, e, _, _, ids in steps if e == epoch]
        h = model.fit(_Replay(x, y, batches), epochs=epoch + 1, initial_epoch=epoch, shuffle=False, verbose=0,
                      callbacks=[recorder, snap], validation_data=(xv, yv))
        for k, v in h.history.items():
            history.setdefault(k, []).extend(v)
    calls = [c for i, c in enumerate(recorder.calls)  # one fit per epoch: its train begins once and ends once
             if not (c[0] == "train_begin" and i > 0) and not (c[0] == "train_end" and i < len(recorder.calls) - 1)]
    return history, calls, snap.at_epoch_end, model.get_weights()


def _close(a: object, b: object) -> None:
    if isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, (list, tuple)) and a and not isinstance(a[0], (int, float)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _close(u, v)
    else:
        np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=2e-5, atol=2e-6)


def test_shard_position_resplits_the_rest_of_the_epoch_over_the_new_world() -> None:
    x, y = np.arange(30, dtype="float32").reshape(30, 1), np.arange(30)
    three = [px.keras.shard(x, y, batch_size=2, rank=r, world_size=3, seed=5) for r in range(3)]
    done = [int(i) for d in three for step in range(2) for i in d[step][1]]  # two steps over 3 workers
    three[0].begin(2)
    state = three[0].state_dict()
    assert state == {"epoch": 0, "samples": 12, "steps": 2, "n": 30}
    two = [px.keras.shard(x, y, batch_size=2, rank=0, world_size=3, seed=5) for _ in range(2)]
    for r, d in enumerate(two):
        d.load_state_dict(state)
        d.reassign(r, 2)
    rest = [int(i) for d in two for step in range(len(d)) for i in d[step][1]]
    assert len(two[0]) == 5 and two[0].step_in_epoch == 2  # 18 samples left, global batch 4: 5 steps
    assert sorted(done + rest) == list(range(30))  # every sample once, none dropped or read twice
    live = [px.keras.shard(x, y, batch_size=2, rank=0, world_size=3, seed=5) for _ in range(2)]
    for r, d in enumerate(live):  # members that go on without a rollback (joiners admitted): from the live position
        d.begin(2)
        d.reassign(r, 2)
    assert sorted(done + [int(i) for d in live for step in range(len(d)) for i in d[step][1]]) == list(range(30))


def test_digest_tells_a_reshuffled_copy_from_the_same_arrays() -> None:
    x, y = np.random.default_rng(0).normal(size=(10, 2)), np.arange(10)
    same = px.keras.shard(x.copy(), y.copy(), batch_size=2).digest()
    order = np.random.default_rng(1).permutation(10)
    assert px.keras.shard(x, y, batch_size=2).digest() == same
    assert px.keras.shard(x[order], y[order], batch_size=2).digest() != same
    assert px.keras.shard(x, y.view("float64"), batch_size=2).digest() != same  # the same bytes as another dtype


def test_fit_survives_a_sigkilled_worker_and_a_replacement_joins_equal_to_plain_keras_replayed(tmp_path) -> None:  # noqa: ANN001,E501
    proc, results = _launch(tmp_path, 3, "--min-workers", "2", "--replace", "--", "--kill", "2@7", "--wait-at", "10,12",
                            "--commit-every", "2", "--epochs", str(EPOCHS), "--mismatch-first")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # first, each worker's own shuffle of the arrays: refused on every worker, in one line, under --elastic too
    for wid in "012":
        said = (tmp_path / f"refused{wid}.txt").read_text()
        assert "workers given different x arrays" in said and "\n" not in said and "seed" in said
    assert sorted(results) == ["0", "1", "r1"]  # the same processes went on without worker 2; r1 replaced it
    first = results["0"]
    for wid in ("0", "1"):
        changes = results[wid]["membership"]
        assert changes[0] == {"left": ["2"], "joined": [], "step": 6, "redone_steps": 1}
        assert [c["joined"] for c in changes[1:]] == [["r1"]] and changes[1]["redone_steps"] == 0
        assert results[wid]["steps"] == first["steps"]
    for r in results.values():
        assert r["world_size"] == 3 and r["history"] == first["history"]  # the joiner took rank 0's rows
    steps = _effective(first["steps"])
    joined_at = first["membership"][1]["step"]
    assert [w for _, _, _, w, _ in steps] == [3] * 6 + [2] * (joined_at - 6) + [3] * (len(steps) - joined_at)
    assert results["r1"]["steps"] == [s for s in steps if s[0] >= joined_at]  # it trained the rest with them
    for epoch in range(EPOCHS):  # every sample exactly once per epoch, re-split over whoever is there
        assert sorted(i for _, e, _, _, ids in steps if e == epoch for i in ids) == list(range(worker.N))
    history, calls, per_epoch, final = _oracle(steps)
    _close(first["history"], history)
    assert first["epochs"] == list(range(EPOCHS))
    for wid in ("0", "1"):
        r = results[wid]
        # epoch-level calls: once each, with plain Keras's logs; a step redone after the rollback is heard again at
        # batch level (its first hearing was lost with the step), so batch ends are compared as the run kept them
        heard = [c for c in r["calls"] if c[0] != "batch_end"]
        want = [c for c in calls if c[0] != "batch_end"]
        assert [c[:2] for c in heard] == [c[:2] for c in want]
        _close([c[2] for c in heard if c[0] == "epoch_end"], [c[2] for c in want if c[0] == "epoch_end"])
        ends = [tuple(c[1:]) for c in r["calls"] if c[0] == "batch_end"]
        assert list(dict.fromkeys(reversed(ends)))[::-1] == [tuple(c[1:]) for c in calls if c[0] == "batch_end"]
        assert len(ends) == len(steps) + 1  # step 6's first hearing, before the loss
    for r in results.values():
        _close(r["weights"], [w.tolist() for w in final])
    for epoch in range(EPOCHS):  # ModelCheckpoint: one plain .keras file per epoch, the replay's weights
        saved = keras.models.load_model(tmp_path / f"model-{epoch + 1}.keras")
        _close([w.tolist() for w in saved.get_weights()], [w.tolist() for w in per_epoch[epoch]])


def test_a_bad_commit_every_gets_one_clear_line() -> None:
    with pytest.raises(px.ConfigError, match="commit_every") as err:
        px.keras.wrap(worker.model(), commit_every=0)
    assert "\n" not in str(err.value)
