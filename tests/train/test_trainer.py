"""The Trainer, its metrics and callbacks, and the demo.

Distributed parts run on 2 real gloo workers (tests/workers/trainer.py), checked
against a single-process oracle computed here. All 2-worker scenarios share one
group, because starting processes is what costs time.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from workers import trainer as W

import phalanx as px
from phalanx.train.callbacks import Callback, LambdaCallback, ModelCheckpoint
from phalanx.train.metrics import Accuracy, MeanLoss, ThroughputMeter, reduce_all, resolve
from support.procs import run_workers
from phalanx.train.trainer import SUPERVISOR, History

TIMING_KEYS = {"samples_per_s", "time_s"}
HISTORY_KEYS = {"epoch", "loss", "accuracy", "top2_accuracy", "val_loss", "val_accuracy", "val_top2_accuracy",
                "val_samples", "samples_per_s", "bytes_sent", "steps", "step", "time_s"}


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_workers("workers.trainer:everything", world_size=2, timeout=120,
                       tmp=str(tmp_path_factory.mktemp("trainer"))).results


def same_rows(a: list[dict], b: list[dict], skip: set[str] = TIMING_KEYS) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra.keys() - skip:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), k


# -- distributed validation ---------------------------------------------------------------------------------------
@pytest.mark.multiproc
def test_distributed_validation_equals_one_process_exactly_on_an_uneven_split(two_workers):
    oracle = W.trainer(W.net(seed=10)).evaluate(W.val_set(), batch_size=16)  # rank 0's weights, one process
    assert oracle["samples"] == W.VAL_N == 101
    for rank in (0, 1):
        assert two_workers[rank]["validation"] == oracle  # exact: same counts, same float64 sums


def test_metrics_count_every_sample_once_across_uneven_shards():
    out, target = torch.randn(101, 3), torch.randint(0, 3, (101,))
    whole, halves = [Accuracy(), MeanLoss()], [[Accuracy(), MeanLoss()], [Accuracy(), MeanLoss()]]
    for m in whole:
        m.update(out, target)
    for part, (lo, hi) in zip(halves, ((0, 50), (50, 101))):
        for m in part:
            m.update(out[lo:hi], target[lo:hi])
    for i, m in enumerate(whole):  # what the all-reduce computes: the sum of the shards' sums
        combined = halves[0][i].fresh()
        combined.sums = halves[0][i].sums + halves[1][i].sums
        assert combined.compute() == m.compute()
        assert combined.sums[1].item() == 101
    assert whole[1].compute() == pytest.approx(F.cross_entropy(out, target).item(), rel=1e-6)


def test_metric_names_and_single_process_reduce():
    assert isinstance(resolve("accuracy"), Accuracy) and isinstance(resolve("loss"), MeanLoss)
    with pytest.raises(px.ConfigError, match="expected a phalanx.train.metrics.Metric"):
        resolve("f1")
    acc = Accuracy(top_k=2)
    acc.update(torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]]), torch.tensor([1, 0]))
    assert acc.name == "top2_accuracy" and acc.reduce().compute() == 0.5
    extra = reduce_all([acc], extra=torch.tensor([1.0, 2.0]))
    assert extra.tolist() == [1.0, 2.0]


# -- throughput ------------------------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throughput_meter_leaves_out_warmup_steps():
    clock = FakeClock()
    meter = ThroughputMeter(warmup_steps=3, clock=clock)
    meter.start()
    for seconds in (5.0, 3.0, 2.0):  # slow warm-up steps: timed, not counted
        clock.now += seconds
        meter.step(32)
    assert math.isnan(meter.rate)
    for _ in range(4):  # then 32 samples every 0.5 s
        clock.now += 0.5
        meter.step(32)
    assert meter.rate == 64.0 and meter.samples == 128 and meter.steps == 7
    clock.now += 100.0  # a pause (validation) between start() calls is not counted
    meter.start()
    clock.now += 0.5
    meter.step(32)
    assert meter.rate == 64.0
    assert meter.global_rate() == 64.0  # a group of one: the global rate is the local one


def test_throughput_meter_rejects_a_negative_warmup():
    with pytest.raises(px.ConfigError, match="warmup_steps=-1"):
        ThroughputMeter(warmup_steps=-1)


# -- Trainer on 2 workers ----------------------------------------------------------------------------------------------
@pytest.mark.multiproc
def test_history_has_the_expected_keys_and_is_the_same_on_every_worker(two_workers):
    history = two_workers[0]["history"]
    assert [row["epoch"] for row in history] == [1, 2, 3]
    for row in history:
        assert set(row) == HISTORY_KEYS
        assert row["val_samples"] == W.VAL_N
        assert row["steps"] == 7  # 100 samples in global batches of 2 x 8
        assert row["bytes_sent"] > 0 and row["samples_per_s"] > 0
    assert history[-1]["step"] == 21
    same_rows(history, two_workers[1]["history"], skip=set())  # every value reduced: identical on both ranks
    assert two_workers[0]["history_rate"] > 0


@pytest.mark.multiproc
def test_two_workers_equal_one_process_with_twice_the_batch(two_workers):
    t = W.trainer(W.net(seed=0))
    oracle = t.fit(W.train_set(), epochs=W.EPOCHS, batch_size=2 * W.BATCH, val_data=W.val_set(), seed=3,
                   progress=False)
    torch.testing.assert_close(two_workers[0]["fit_weights"], W.weights(t.model), rtol=1e-5, atol=1e-6)
    assert torch.equal(two_workers[0]["fit_weights"], two_workers[1]["fit_weights"])
    for mine, theirs in zip(oracle, two_workers[0]["history"]):
        for key in ("loss", "accuracy", "val_loss", "val_accuracy", "val_samples", "steps"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key


@pytest.mark.multiproc
def test_callbacks_fire_in_order_with_step_timings(two_workers):
    expected = ["train_begin"]
    step = 0
    for epoch in range(W.EPOCHS):
        expected.append(f"epoch_begin {epoch}")
        for _ in range(7):
            expected += [f"step_begin {step}", f"step_end {step}"]
            step += 1
        expected.append(f"epoch_end {epoch}")
    expected.append("train_end")
    for rank in (0, 1):
        assert two_workers[rank]["events"] == expected
        for logs in two_workers[rank]["step_logs"]:
            assert set(logs) == {"loss", "batch_size", "data_s", "forward_backward_s", "optimizer_s", "step_s"}
            assert min(logs["data_s"], logs["forward_backward_s"], logs["optimizer_s"]) >= 0
            assert logs["step_s"] == pytest.approx(logs["data_s"] + logs["forward_backward_s"] + logs["optimizer_s"])


@pytest.mark.multiproc
@pytest.mark.parametrize("where", ["epoch", "mid"])
def test_fit_resumed_from_a_checkpoint_equals_the_uninterrupted_fit(two_workers, where):
    for rank in (0, 1):
        run = two_workers[rank]
        torch.testing.assert_close(run[f"resumed_{where}_weights"], run["full_weights"], rtol=1e-6, atol=1e-7)
        assert run[f"resumed_{where}_step"] == 21
        resumed, full = run[f"resumed_{where}_history"], run["full_history"]
        if where == "epoch":
            same_rows(resumed, full)
        else:  # the interrupted epoch's training averages cover only the steps after the checkpoint
            same_rows(resumed[::2], full[::2])
            same_rows([{k: v for k, v in r.items() if k.startswith("val_")} for r in resumed[1:2]],
                      [{k: v for k, v in r.items() if k.startswith("val_")} for r in full[1:2]])


# -- Trainer in one process ----------------------------------------------------------------------------------
def test_trainer_stops_when_a_callback_asks_and_history_reads_by_column():
    stop = LambdaCallback(on_epoch_end=lambda t, epoch, logs: setattr(t, "stop_training", epoch == 1))
    t = W.trainer(W.net(seed=0), callbacks=[stop])
    history = t.fit(W.train_set(), epochs=5, batch_size=16, progress=False)
    assert isinstance(history, History) and len(history) == 2
    assert history["epoch"] == [1, 2] and history["steps"] == [7, 7]  # counted from 1, as the progress bar


def test_trainer_refuses_bad_arguments_clearly():
    model = W.net(seed=0)
    with pytest.raises(px.ConfigError, match="a phalanx.train.callbacks.Callback"):
        W.trainer(model, callbacks=[object()])
    with pytest.raises(px.ConfigError, match="on_epoch_ended"):
        LambdaCallback(on_epoch_ended=print)
    with pytest.raises(px.ConfigError, match="every=0"):
        ModelCheckpoint("x.pt", every=0)
    t = W.trainer(W.net(seed=1))
    with pytest.raises(px.ConfigError, match="epochs=-1"):
        t.fit(W.train_set(), epochs=-1)
    with pytest.raises(px.ConfigError, match="batch_size=0"):
        t.fit(W.train_set(), batch_size=0)
    with pytest.raises(px.ConfigError, match=r"expected a tuple \(inputs..., target\)"):
        t.fit(torch.utils.data.TensorDataset(torch.randn(8, W.IN)), batch_size=4, progress=False)


def test_callback_base_hooks_are_no_ops():
    cb = Callback()
    for hook in LambdaCallback.HOOKS:
        assert hasattr(cb, hook)


# -- the demo -------------------------------------------------------------------------------------------------
def test_demo_table_has_speedup_and_efficiency():
    from phalanx.bench.demo import table
    text = table([{"workers": 1, "test_accuracy": 0.981, "samples_per_s": 1000.0},
                  {"workers": 2, "test_accuracy": 0.975, "samples_per_s": 1700.0}])
    assert "| workers | test accuracy | samples/s | speedup | efficiency |" in text
    assert "1.70x" in text and "85%" in text and "0.975" in text


@pytest.mark.multiproc
def test_demo_runs_end_to_end_on_one_then_two_worker_processes(capsys):
    # its workers fork from the server that imported torch once (conftest's PHALANX_START_METHOD=forkserver)
    from phalanx.bench.demo import main
    assert main(["--epochs", "1", "--batch-size", "16", "--limit", "256", "--no-progress"]) == 0  # 16 / 8 steps
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("|") and line[2:].strip()[:1].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]
    assert "1.00x" in rows[0]


def test_demo_refuses_bad_options(capsys, monkeypatch):
    from phalanx.bench.demo import main
    assert main(["--epochs", "0"]) == 2
    assert "--epochs=0" in capsys.readouterr().err
    monkeypatch.setenv("PHALANX_START_METHOD", "fork")
    assert main(["--epochs", "1"]) == 2
    assert "PHALANX_START_METHOD=fork; expected spawn or forkserver" in capsys.readouterr().err


def test_progress_is_plain_lines_when_stdout_is_not_a_terminal(capsys):
    t = W.trainer(W.net(seed=0))
    t.fit(W.train_set(), epochs=2, batch_size=16, val_data=W.val_set(), progress=True)
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]  # one line per epoch, from 1
    assert "7/7 steps" in lines[0] and "val_loss=" in lines[0]


def test_plain_progress_prints_every_so_often_and_at_the_end(capsys):
    from phalanx.train.progress import PlainProgress
    clock = FakeClock()
    bar = PlainProgress(total=10, desc="epoch 1/1", every_s=30.0, clock=clock)
    for _ in range(10):
        clock.now += 10.0
        bar.update(1)
    bar.close()
    assert capsys.readouterr().out.splitlines() == ["epoch 1/1: 3/10 steps", "epoch 1/1: 6/10 steps",
                                                    "epoch 1/1: 9/10 steps", "epoch 1/1: 10/10 steps"]


def test_an_elastic_fit_runs_its_epochs_through_the_groups_supervisor(monkeypatch):
    # The Trainer imports no feature: under --elastic, phalanx.elastic puts its State on the group (px.init()) and
    # the Trainer hands it the epoch loop. A stand-in supervisor re-enters the loop once, at epoch 1's commit.
    from phalanx.errors import ConfigError

    g = px.init()
    made = []

    class Supervisor:
        def __init__(self, model, optimizer, loader, *, commit_every, resize):
            made.append((commit_every, resize))
            self.history, self.epoch = [{"generation": 1}], 1

        def supervise(self, loop):
            loop(self)

    net = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = px.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), F.cross_entropy)
    monkeypatch.setattr(SUPERVISOR.of(g), "value", Supervisor)
    history = trainer.fit(data, epochs=2, batch_size=8, elastic=3, resize="policy", progress=False)
    assert made == [(3, "policy")] and history.membership == [{"generation": 1}]
    assert history["epoch"] == [2] and history["world_size"] == [1]  # entered at the commit's epoch
    monkeypatch.setattr(SUPERVISOR.of(g), "value", None)
    with pytest.raises(ConfigError, match="elastic"):
        trainer.fit(data, epochs=1, batch_size=8, elastic=-2, progress=False)
