"""px.Tracker: what it writes is read back with TensorBoard's event reader, MLflow's client and W&B's run file.

Unit tests drive one process; one 2-worker run (tests/workers/tracking.py) checks that
a Trainer fit, a plain loop across a real regroup, and a Keras fit (px.Tracker and
Keras's own TensorBoard callback) write one set of files, from the main worker only.
"""
from __future__ import annotations

import glob
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.errors import ConfigError
from support.procs import run_workers

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def texts(log_dir: str, tag: str) -> list[str]:
    acc = EventAccumulator(log_dir)
    acc.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")]


def _train(tracker: px.Tracker, steps: int = 3) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.125))
    tracker.optimizer = opt
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.randn(4, 3)), torch.tensor([0, 1, 0, 1]))
        loss.backward()
        opt.step()
        tracker.log(step, loss=loss, batch_size=4, accuracy=0.5)
    return opt


def test_tensorboard_holds_loss_lr_rate_bytes_and_world_size(tmp_path) -> None:
    with px.Tracker("tensorboard", tmp_path) as tracker:
        _train(tracker)
    got = scalars(str(tmp_path))
    assert {"loss", "accuracy", "lr", "world_size", "bytes_sent", "samples_per_s"} <= set(got)
    assert [s for s, _ in got["loss"]] == [1, 2, 3] and got["lr"][0][1] == 0.125 and got["world_size"][0][1] == 1
    assert len(got["samples_per_s"]) == 2 and all(v > 0 for _, v in got["samples_per_s"])  # from the 2nd log on


def test_mlflow_file_store_read_back_with_its_client(tmp_path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracker = px.Tracker("mlflow", tmp_path / "mlruns", every=2)
    _train(tracker, steps=4)
    tracker.log_params({"lr": 0.125})
    tracker.close()
    client = MlflowClient(tracking_uri=tracker.backend.tracking_uri)
    history = client.get_metric_history(tracker.backend.run_id, "loss")
    assert [m.step for m in history] == [2, 4]  # every=2: one log call in two is written
    run = client.get_run(tracker.backend.run_id)
    assert run.data.params == {"lr": "0.125"} and run.info.status == "FINISHED"


def wandb_records(directory: str) -> list:
    """Every record of the one offline run under ``directory``, read from its ``run-*.wandb`` file.

    wandb keeps no Python reader of its own files (its core is in Go), so this reads the format it documents:
    a 7-byte header (``:W&B``, magic, version), then LevelDB-log chunks (crc32c, length, type) in 32 KiB blocks,
    each record a ``wandb_internal_pb2.Record``.
    """
    import struct

    from wandb.proto import wandb_internal_pb2
    (path,) = glob.glob(os.path.join(directory, "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_read_back_from_its_files(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'phalanx[wandb]')")
    import json

    import wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = px.Tracker("wandb", tmp_path)
    _train(tracker)
    tracker.log_params({"lr": 0.125})
    tracker.log(2, loss=0.5)  # a rollback: kept, because the x-axis is the logged "step", not wandb's own
    tracker.close()
    wandb.teardown()  # run.finish() can return before wandb's service has flushed the run file; its exit does not
    records = wandb_records(str(tmp_path))

    def items(update: Any) -> dict[str, Any]:  # wandb 0.31 names a key by nested_key, older ones by key
        return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in update}

    rows = [items(r.history.item) for r in records if r.HasField("history")]
    assert not tracker.failed and rows, [r.WhichOneof("record_type") for r in records]
    assert [(r["step"], r["loss"]) for r in rows][-1] == (2, 0.5)
    assert [r["step"] for r in rows] == [1, 2, 3, 2]
    assert rows[0]["lr"] == 0.125 and rows[0]["world_size"] == 1 and rows[0]["accuracy"] == 0.5
    assert "bytes_sent" in rows[0] and rows[1]["samples_per_s"] > 0
    config = {k: v for r in records if r.HasField("config") for k, v in items(r.config.update).items()}
    assert config["lr"] == 0.125
    assert any(r.HasField("exit") for r in records)  # finished


def test_a_membership_change_is_written_at_the_next_log(tmp_path) -> None:
    """Group.on_regroup drives it (a real rebuild is in the 2-worker run); here the subscribed callback runs."""
    elastic = type("History", (), {"history": []})()
    px.init()  # a group of one whose Group.on_regroup the tracker follows
    tracker = px.Tracker("tensorboard", tmp_path, elastic=elastic)
    tracker.log(5, loss=1.0)
    g = px.current_group()
    assert tracker._regrouped in g._on_regroup
    elastic.history.append({"generation": g.generation, "left": ["host-b"], "joined": []})
    tracker._regrouped(g)  # what Group.rebuild calls once it formed a generation (the same one, here)
    tracker.log(4, loss=1.0)  # rolled back to the commit at step 3
    tracker.close()
    assert tracker._regrouped not in g._on_regroup
    (line,) = texts(str(tmp_path), "membership")
    assert ("generation 0: 1 -> 1 workers; left: host-b; joined: -; last step logged before: 5; first after: 4 "
            "(2 step(s) redone)") in line


def test_bad_input_is_one_line_and_a_logging_failure_leaves_training_alone(tmp_path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="logger back end 'neptune'; expected one of mlflow, tensorboard, wandb"):
        px.Tracker("neptune", tmp_path)
    import importlib.util
    real = importlib.util.find_spec
    missing = ("tensorboard", "mlflow", "wandb")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    for name in missing:
        with pytest.raises(ConfigError, match=rf"the \w.* logger without the '{name}' package.*"
                                              rf"pip install 'phalanx\[{name}\]'"):
            px.Tracker(name, tmp_path)
    monkeypatch.undo()
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    if importlib.util.find_spec("mlflow") is not None:
        with pytest.raises(ConfigError, match="MLFLOW_ALLOW_FILE_STORE=true"):
            px.Tracker("mlflow", tmp_path / "mlruns")
    (tmp_path / "a-file").write_text("")
    tracker = px.Tracker("tensorboard", tmp_path / "a-file" / "runs")  # a directory that cannot be made
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = _train(tracker)  # training runs its three steps
        tracker.close()
    assert px.strategy_of(opt).steps == 3 and tracker.failed
    assert len([w for w in caught if "logging to" in str(w.message)]) == 1  # warned once


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> tuple[list[dict], str]:
    tmp = str(tmp_path_factory.mktemp("tracking"))
    return run_workers("workers.tracking:everything", world_size=2, timeout=300, tmp=tmp,
                       env={"MLFLOW_ALLOW_FILE_STORE": "true"}).results, tmp


def test_two_workers_write_one_set_of_files(two_workers) -> None:
    results, tmp = two_workers
    assert len(glob.glob(os.path.join(tmp, "tb", "events.*"))) == 1  # the Trainer callback: rank 0 only
    got = scalars(os.path.join(tmp, "tb"))
    steps = results[0]["trainer"]["steps"]
    assert [s for s, _ in got["loss"]] == list(range(1, steps + 1)) and got["world_size"][0][1] == 2
    assert {"lr", "bytes_sent", "samples_per_s", "epoch/val_accuracy", "epoch/samples_per_s"} <= set(got)
    assert got["epoch/val_accuracy"][-1] == (steps, pytest.approx(results[0]["trainer"]["val_accuracy"]))
    # Keras: one set of event files too, from px.Tracker and from Keras's own TensorBoard callback (which writes
    # through TensorFlow's tf.summary, or without TensorFlow through a torch stand-in: workers/tracking.py)
    assert len(glob.glob(os.path.join(tmp, "keras_tracker", "events.*"))) == 1
    assert "loss" in scalars(os.path.join(tmp, "keras_tracker"))
    for run in ("train", "validation"):
        assert len(glob.glob(os.path.join(tmp, "keras_tb", run, "events.*"))) == 1, run
    assert [s for s, _ in scalars(os.path.join(tmp, "keras_tb", "validation"))["epoch_loss"]] == [0, 1]
    assert [s for s, _ in scalars(os.path.join(tmp, "keras_tb", "train"))["epoch_loss"]] == [0, 1]


def test_a_real_regroup_is_logged_once_by_the_main_worker(two_workers, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient
    results, tmp = two_workers
    assert [r["loop"]["generation"] for r in results] == [1, 1]
    assert results[1]["loop"]["run_id"] is None  # rank 1 never opened a run
    client = MlflowClient(tracking_uri="file:" + os.path.join(tmp, "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("phalanx").experiment_id])
    assert run.info.run_id == results[0]["loop"]["run_id"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 2]
    (change,) = [v for k, v in run.data.tags.items() if k.startswith("membership.")]
    assert change.startswith("generation 1: 2 -> 2 workers; left: w1; joined: w2; last step logged before: 3; "
                             "first after: 2 (2 step(s) redone)")
