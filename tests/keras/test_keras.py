"""px.keras: data-parallel ``model.fit`` for Keras 3 models on the torch backend.

Unit checks run here; every 2-worker scenario runs in ONE group
(tests/workers/keras_fit.py), because each process pays Keras's import. The
oracles are plain Keras on one process with the global batch, computed on rank 0.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import phalanx as px
from phalanx.errors import ConfigError
from phalanx.keras import detect
from support import lazy
from support.procs import run_workers

os.environ.setdefault("KERAS_BACKEND", "torch")
# imported by the first test that reads them: every xdist worker collects this file, one runs it
keras = lazy.module("keras")
keras_api = lazy.module("phalanx.keras.keras_api")
fit = lazy.module("phalanx.keras.fit")


def _compiled(optimizer: str = "sgd") -> keras.Model:
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    m.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


# -- unit -------------------------------------------------------------------------------
def test_import_phalanx_does_not_import_keras() -> None:
    code = ("import sys, phalanx; print('keras' in sys.modules, 'phalanx.keras' in sys.modules); "
            "import phalanx.keras.detect; print('keras' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]
    assert px.keras.wrap is not None  # the lazy attribute


def test_keras_calls_what_phalanx_relies_on() -> None:
    """The Keras behaviour phalanx.keras builds on; a Keras upgrade that changes it fails here."""
    assert keras.version() == keras_api.TESTED_KERAS
    model = px.keras.wrap(_compiled())
    calls = {"apply": 0, "evaluate": 0}
    run = fit.run_of(model)
    keras_apply, keras_evaluate = run._keras_apply, model.evaluate

    def apply(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["apply"] += 1
        return keras_apply(*a, **k)

    def evaluate(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["evaluate"] += 1
        return keras_evaluate(*a, **k)

    run._keras_apply, model.evaluate = apply, evaluate
    x, y = np.random.default_rng(0).normal(size=(12, 3)).astype("float32"), np.arange(12) % 2
    model.fit(px.keras.shard(x, y, batch_size=4), epochs=2, verbose=0,
              validation_data=px.keras.shard(x, y, batch_size=6))
    assert calls == {"apply": 6, "evaluate": 2}  # one optimizer.apply per train_step; validation via evaluate
    assert px.keras.strategy_of(model).steps == 6
    model.fit(px.keras.shard(x, y, batch_size=4), None, None, 1, 0)  # Keras's positional order: epochs=1, verbose=0
    assert calls["apply"] == 9


def test_shard_gives_every_sample_once_and_equal_steps() -> None:
    x = np.arange(101, dtype="float32").reshape(101, 1)
    y = np.arange(101)
    parts = [px.keras.shard(x, y, batch_size=8, rank=r, world_size=2, seed=1) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == 7
    seen = np.concatenate([p[i][1] for p in parts for i in range(len(p))])
    assert sorted(seen.tolist()) == list(range(101))
    parts[0].set_epoch(1)
    assert parts[0][0][1].tolist() != px.keras.shard(x, y, batch_size=8, rank=0, world_size=2, seed=1)[0][1].tolist()
    # a torch Dataset: samples collated
    ds = torch.utils.data.TensorDataset(torch.arange(10.).unsqueeze(1), torch.arange(10))
    tparts = [px.keras.shard(ds, batch_size=2, rank=r, world_size=2, shuffle=False) for r in range(2)]
    assert sorted(torch.cat([p[i][1] for p in tparts for i in range(len(p))]).tolist()) == list(range(10))

    class Batches(keras.utils.PyDataset):  # 5 batches of 3: dealt round-robin, the last one split by rows
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int):  # noqa: ANN204
            rows = np.arange(3 * i, 3 * i + 3)
            return rows.astype("float32").reshape(3, 1), rows

    bparts = [px.keras.shard(Batches(), rank=r, world_size=2) for r in range(2)]
    assert len(bparts[0]) == len(bparts[1]) == 3
    assert sorted(np.concatenate([p[i][1] for p in bparts for i in range(3)]).tolist()) == list(range(15))


def test_bad_input_gets_one_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ConfigError, match="before model.compile"):
        px.keras.wrap(raw)
    with pytest.raises(ConfigError, match="For a torch.nn.Module use px.wrap"):
        px.keras.wrap(torch.nn.Linear(2, 2))
    model = px.keras.wrap(_compiled())
    x, y = np.zeros((8, 3), "float32"), np.zeros(8, "int64")
    with pytest.raises(ConfigError, match="validation_data=px.keras.shard"):
        model.fit(px.keras.shard(x, y, batch_size=4), validation_split=0.2, verbose=0)

    FakeTF = type("DatasetV2", (), {"__module__": "tensorflow.python.data.ops.dataset_ops"})  # noqa: N806
    with pytest.raises(ConfigError, match="tf.data"):
        model.fit(FakeTF(), verbose=0)
    with pytest.raises(ConfigError, match="tf.data"):
        px.keras.shard(FakeTF(), batch_size=4)
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ConfigError, match="KERAS_BACKEND=torch"):
        px.keras.wrap(_compiled())


def test_keras_optimizer_recognised_without_importing_keras() -> None:
    assert detect.is_keras_optimizer(keras.optimizers.Adam())
    assert not detect.is_keras_optimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
    assert detect.is_keras_model(_compiled()) and not detect.is_keras_model(torch.nn.Linear(1, 1))
    net = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match="px.keras.wrap"):
        px.wrap(net, keras.optimizers.Adam())


def test_a_model_that_keras_already_wraps_in_ddp_is_refused() -> None:
    from torch.nn.parallel import DistributedDataParallel
    model = _compiled()
    object.__setattr__(model, "_ddp", DistributedDataParallel.__new__(DistributedDataParallel))  # as a trainer would
    assert detect.ddp_inside(model) == "model._ddp"
    with pytest.raises(ConfigError, match="averaging gradients twice|Averaging gradients twice"):
        px.keras.wrap(model)


# -- two real workers ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], str]:
    tmp = str(tmp_path_factory.mktemp("keras"))
    return run_workers("workers.keras_fit:everything", world_size=2, timeout=300, tmp=tmp).results, tmp


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((u - v).abs().max().item() for u, v in zip(a, b))


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_two_workers_equal_one_process_with_twice_the_batch(two: tuple, optimizer: str) -> None:
    """24 steps of Adam / SGD+momentum, both with clipnorm: 2 x b equals plain Keras 1 x 2b.

    The SGD run's last step of each epoch is uneven (5 samples: 3 on one worker, 2 on the other).
    """
    r = two[0][0][optimizer]
    assert r["overlapped"]  # AllReduce's buckets went out during Keras's loss.backward(), with no DDP wrapper
    assert _max_diff(r["final"], r["oracle_final"]) < 1e-5
    assert _max_diff(r["final"], two[0][1][optimizer]["final"]) == 0.0  # AllReduce: replicas stay identical
    assert _max_diff(r["optimizer"], two[0][1][optimizer]["optimizer"]) == 0.0


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_reported_metrics_equal_one_process_on_uneven_validation(two: tuple, optimizer: str) -> None:
    """101 validation samples over 2 workers (the last global batch splits 3 / 2), counted once each."""
    r = two[0][0][optimizer]
    assert r["history"].keys() == r["oracle_history"].keys() == {"loss", "accuracy", "val_loss", "val_accuracy"}
    for key, values in r["history"].items():
        assert values == pytest.approx(r["oracle_history"][key], abs=1e-6), key
        assert values == two[0][1][optimizer]["history"][key]  # every worker reports the same
    for key, value in r["evaluate"].items():  # evaluate() of the same weights: exact
        assert value == pytest.approx(r["oracle_evaluate"][key], abs=1e-6), key


@pytest.mark.multiproc
def test_differently_seeded_workers_start_identical(two: tuple) -> None:
    r0, r1 = two[0][0]["adam"], two[0][1]["adam"]
    assert _max_diff(r0["before"], r1["before"]) > 0.01  # the seeds did differ
    assert _max_diff(r0["after_wrap"], r1["after_wrap"]) == 0.0
    assert _max_diff(r0["after_wrap"], r0["before"]) == 0.0  # rank 0's weights are the ones kept
    w0, w1 = two[0][0]["local_sgd"]["at_wrap"], two[0][1]["local_sgd"]["at_wrap"]  # LocalSGD: no DDP involved
    assert _max_diff(w0["weights"], w1["weights"]) == 0.0
    assert _max_diff(w0["optimizer"], w1["optimizer"]) == 0.0  # moments, iteration count: rank 0's
    iteration, lr, *slots = w1["optimizer"]
    assert int(iteration) == 1 and all(torch.allclose(t, torch.full_like(t, 0.01)) for t in slots)


@pytest.mark.multiproc
def test_local_sgd_replicas_identical_at_sync_points_only(two: tuple) -> None:
    s0, s1 = two[0][0]["local_sgd"]["steps"], two[0][1]["local_sgd"]["steps"]
    assert sorted(map(int, s0)) == list(range(1, 13))
    for step in s0:
        d = _max_diff(s0[step], s1[step])
        assert (d == 0.0) if int(step) % 4 == 0 else (d > 0.0), (step, d)


@pytest.mark.multiproc
def test_compressors_diloco_and_easgd_drive_keras_through_the_same_objects(two: tuple) -> None:
    r0, r1 = two[0][0]["strategies"], two[0][1]["strategies"]
    for name in ("fp16", "diloco", "easgd", "allreduce"):
        assert r0[name]["steps"] == r1[name]["steps"] == 12, name
        assert _max_diff(r0[name]["final"], r1[name]["final"]) == 0.0, name  # one model after fit (finish)
    assert _max_diff(r0["fp16"]["final"], r0["allreduce"]["final"]) < 1e-2  # fp16 gradients: close to exact
    assert _max_diff(r0["diloco"]["final"], r0["allreduce"]["final"]) > 1e-3  # local steps really differ


@pytest.mark.multiproc
def test_one_keras_file_written_and_it_loads_without_phalanx(two: tuple, tmp_path) -> None:  # noqa: ANN001
    results, _ = two
    f0, f1 = results[0]["files"], results[1]["files"]
    assert f0["files"] == ["best.keras", "final.keras", "log.csv"] and f1["files"] == []
    probe = tmp_path / "probe.npy"
    np.save(probe, f0["probe"].numpy())
    code = textwrap.dedent(f"""
        import os, sys
        sys.modules["phalanx"] = None  # importing phalanx now fails: the file must stand alone
        os.environ["KERAS_BACKEND"] = "torch"
        import numpy as np, keras
        model = keras.models.load_model({os.path.join(f0['dir'], 'final.keras')!r})
        np.save({str(tmp_path / 'out.npy')!r}, model.predict(np.load({str(probe)!r}), verbose=0))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), f0["predictions"].numpy(), rtol=0, atol=1e-6)


@pytest.mark.multiproc
def test_stopping_is_agreed_by_every_worker(two: tuple) -> None:
    results, _ = two
    for r in results:
        assert r["files"]["epochs_run"] == [0, 1, 2]  # a callback stopped rank 0 only; rank 1 stopped with it
        assert r["files"]["history_epochs"] == 3
        assert r["files"]["early_epochs"] == 2         # EarlyStopping(patience=1): the same epoch everywhere


@pytest.mark.multiproc
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(two: tuple) -> None:
    for r in two[0]:
        assert r["resume"]["epoch"] == 2
        assert _max_diff(r["resume"]["resumed"], r["resume"]["straight"]) < 1e-6


@pytest.mark.multiproc
def test_unsharded_arrays_and_inexact_metrics_are_called_out(two: tuple) -> None:
    for r in two[0]:
        assert "px.keras.shard" in r["bad"]["raw_arrays"]
        assert len(r["bad"]["warnings"]) == 1 and "'peak'" in r["bad"]["warnings"][0]


def test_demo_flag_reaches_the_keras_demo(capsys: pytest.CaptureFixture[str]) -> None:
    from phalanx.bench import demo
    with pytest.raises(SystemExit) as stop:
        demo.main(["--keras", "--help"])
    assert stop.value.code == 0 and "phalanx demo --keras" in capsys.readouterr().out


@pytest.mark.multiproc
def test_the_bench_setup_trains_and_times_both_paths_on_two_workers(two: tuple) -> None:
    for rank in (0, 1):
        assert two[0][rank]["bench"]["keras"] > 0 and two[0][rank]["bench"]["torch"] > 0


def test_the_bench_setup_reports_overhead_and_efficiency_side_by_side(tmp_path) -> None:  # noqa: ANN001
    from phalanx.bench import cli
    from phalanx.bench.keras_setup import SETUPS, markdown, parser, summarise
    rates = dict(zip(SETUPS, ([100.0], [97.0, 99.0], [150.0], [200.0], [200.0], [320.0]), strict=True))
    summary = summarise(rates)  # type: ignore[arg-type]
    assert summary["overhead_1_worker"] == pytest.approx(0.02)  # median 98 against 100
    assert summary["efficiency_2_workers"] == pytest.approx({"keras": 0.75, "torch": 0.8})
    assert summary["gap_points"] == pytest.approx(-5.0)
    text = markdown(summary, parser().parse_args([]))
    assert "| phalanx-Keras | 1 | 98 | 97-99 |" in text and "Keras 75%, PyTorch 80%: -5 points" in text
    with pytest.raises(px.ConfigError, match="--steps 0"):
        cli.main(["--keras", "--steps", "0", "--out", str(tmp_path)])


@pytest.fixture(scope="module")
def tail(two: tuple) -> list[dict]:
    """workers.keras_fit.short_tail's result on each rank, run by the module's one pair of workers (``two``)."""
    return [r["tail"] for r in two[0]]


@pytest.mark.multiproc
def test_a_tail_smaller_than_the_workers_is_its_own_step_as_in_plain_keras(tail: list[dict]) -> None:
    """89 samples, 2 x 4: plain Keras takes 12 steps, the last on 1 sample; so do the workers (one on nothing)."""
    r = tail[0]
    assert _max_diff(r["final"], r["oracle_final"]) < 1e-5
    assert _max_diff(r["final"], tail[1]["final"]) == 0.0
    for key, values in r["history"].items():
        assert all(np.isfinite(values)), key
        assert values == pytest.approx(r["oracle_history"][key], abs=1e-6), key
