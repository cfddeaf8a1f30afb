"""phalanx bench: statistics on known inputs, warm-up exclusion, the step-time breakdown, the projection,
clear errors, and a smoke run of `phalanx bench --quick` (reduced by flags)."""
from __future__ import annotations

import itertools
import json
import math
import os
import statistics

import pytest
import torch
import torch.nn.functional as F

from phalanx.bench import projection, report, stats
from benchmarks import targets
from phalanx.bench.breakdown import PHASES, StepProbe
from phalanx.bench.spec import Setup, check_setup, parse_setup, plan, split_list
from phalanx.errors import ConfigError
from support.procs import run_workers


# -- statistics on known inputs ------------------------------------------------------------------
def test_summary_on_known_inputs():
    s = stats.summary([1.0, 2.0, 3.0, 4.0])
    assert s["median"] == 2.5 and s["mean"] == 2.5 and s["n"] == 4
    assert s["std"] == pytest.approx(math.sqrt(5 / 3))  # sample std (n - 1)
    assert (s["low"], s["high"]) == pytest.approx((1.075, 3.925))  # 2.5th and 97.5th percentiles, as numpy's
    assert stats.summary([7.0]) == {"median": 7.0, "mean": 7.0, "std": 0.0, "low": 7.0, "high": 7.0, "n": 1}
    assert math.isnan(stats.summary([])["median"])


def test_speedup_efficiency_and_windows():
    assert stats.speedup(180.0, 100.0, 2) == pytest.approx((1.8, 0.9))
    assert all(math.isnan(x) for x in stats.speedup(1.0, 0.0, 2))
    assert stats.windows([1, 2, 3, 4, 5], 2) == [3, 7]  # the short tail is dropped
    # two synchronous workers, 0.5 s per step, batch 10: 2 * 10 / 0.5 = 40 samples/s per window
    assert stats.window_throughput([[0.5, 0.5], [0.5, 0.5]], batch=10, size=1) == [40.0, 40.0]
    # a local step then a slow sync step: a window of 2 holds one sync
    assert stats.window_throughput([[0.1, 0.9]], batch=10, size=2) == [20.0]


def test_warmup_steps_are_left_out_of_the_statistics():
    step_s = [2.0, 1.0, 0.1, 0.1, 0.1, 0.1]  # the first steps are slow
    assert stats.timed(step_s, 2) == [0.1] * 4
    thpt = stats.window_throughput([stats.timed(step_s, 2)], batch=10, size=1)
    assert stats.summary(thpt)["median"] == pytest.approx(100.0) and stats.summary(thpt)["std"] == pytest.approx(0.0)


def test_a_real_run_times_every_step_and_the_row_leaves_the_warmup_out():
    from phalanx.bench.worker import run

    # Synthetic step times through the injected clock: slow warm-up steps (allocation, lazy init), then steady
    # ones. The real loop runs; only its clock is scripted, so no load on the machine can reorder the times.
    given = [0.5, 0.3, 0.2, 0.125, 0.25, 0.125, 0.0625, 0.125, 0.125]
    readings = iter(itertools.accumulate([10.0, *given]))
    threads = torch.get_num_threads()
    try:
        raw = run({"model": "mlp", "setup": {"name": "plain"}, "batch": 32, "threads": 1, "warmup": 3, "steps": 6},
                  clock=lambda: next(readings))
    finally:
        torch.set_num_threads(threads)
    assert raw["step_s"] == pytest.approx(given) and len(raw["phases"]) == 9
    record = {"run": {"model": "mlp", "setup": {"name": "plain", "label": "plain", "kwargs": {}}, "workers": 1,
                      "threads": 1, "link": "loopback", "batch": 32}, "repeat": 0, "error": None, "ranks": [raw]}
    row = report.aggregate([record])[0]
    assert row["windows"] == pytest.approx([256, 128, 256, 512, 256, 256])  # batch 32 / each step after warm-up
    assert row["samples_per_s"]["median"] == pytest.approx(256)


# -- the breakdown -------------------------------------------------------------------------------
def _ratios(result: dict) -> list[float]:
    w = result["warmup"]
    return [sum(p[k] for k in PHASES) / s for p, s in zip(result["phases"][w:], result["step_s"][w:], strict=True)]


def _total_ratio(result: dict) -> float:
    """All timed steps' phases over the loop's own time for them. A single step can be off under load: a worker
    descheduled between the probe's last hook and the loop's clock moves time into the next step, not out of the sum."""
    w = result["warmup"]
    return sum(p[k] for p in result["phases"][w:] for k in PHASES) / sum(result["step_s"][w:])


@pytest.mark.multiproc
def test_breakdown_sums_to_the_measured_step_time():
    # local SGD talks through phalanx.Comm inside optimizer.step(); DDP-based all-reduce is in the smoke test below
    results = run_workers("workers.bench:bench_run", world_size=2, setup="local-sgd[every=2]", steps=6).results
    for res in results:
        ratios = _ratios(res)
        assert abs(statistics.median(ratios) - 1) < 0.10, ratios
        assert abs(_total_ratio(res) - 1) < 0.10, ratios
        assert res["bytes_per_step"] > 0
    comm = [p["comm_s"] for res in results for p in res["phases"][2:]]
    assert max(comm) > 0  # two processes talked, and the probe saw the exposed part


def test_probe_on_a_plain_loop_sees_no_communication():
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    probe = StepProbe(net, opt)
    try:
        probe.mark()
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(net(torch.randn(16, 8)), torch.randint(0, 2, (16,))).backward()
            opt.step()
        other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        other.step()  # another optimizer's step is not ours
    finally:
        probe.close()
    assert len(probe.records) == 4
    for r in probe.records:
        assert r["comm_s"] == 0 and r["compute_s"] > 0
        assert sum(r[k] for k in PHASES) == pytest.approx(r["step_s"], rel=1e-6)


def test_trainer_callback_in_a_group_of_one():
    from workers.bench import trainer_breakdown

    out = trainer_breakdown(strategy="allreduce", epochs=1)
    assert len(out["records"]) == len(out["logged_step_s"]) == 16
    for r, logged in zip(out["records"], out["logged_step_s"], strict=True):
        assert r["step_s"] == logged
    ratios = [sum(r[k] for k in PHASES) / r["step_s"] for r in out["records"]]
    assert abs(statistics.median(ratios) - 1) < 0.10, ratios
    assert set(out["summary"]) == {*PHASES, "step_s"}


@pytest.mark.multiproc
def test_trainer_callback_on_two_workers_sees_communication():
    results = run_workers("workers.bench:trainer_breakdown", world_size=2, strategy="allreduce").results
    for out in results:
        ratios = [sum(r[k] for k in PHASES) / r["step_s"] for r in out["records"][2:]]
        assert abs(statistics.median(ratios) - 1) < 0.10
        assert out["summary"]["comm_s"] > 0


# -- specs, plan, projection, targets --------------------------------------------------------------
def test_setup_specs_and_the_plan():
    assert split_list("allreduce[bucket_mb=2,static=True],ddp") == ["allreduce[bucket_mb=2,static=True]", "ddp"]
    assert parse_setup("local_sgd[every=4]") == Setup("local-sgd", {"every": 4})
    assert parse_setup("ddp").kind == "ddp" and parse_setup("plain").kind == "plain"
    runs = plan(["mlp"], [Setup("allreduce")], [1, 2], [2], ["loopback", "100mbit"])
    assert [r.title for r in runs] == ["mlp plain 1x1 loopback", "mlp plain 1x2 loopback",
                                       "mlp allreduce 1x1 loopback", "mlp allreduce 2x1 loopback",
                                       "mlp allreduce 2x1 100mbit"]


def test_unknown_names_get_one_clear_error(capsys):
    with pytest.raises(ConfigError, match="unknown strategy 'no-such-rule'.*not be registered"):
        check_setup(parse_setup("no-such-rule"))
    with pytest.raises(ConfigError, match="unknown argument"):
        check_setup(parse_setup("ddp[nope=1]"))
    from phalanx.bench.cli import main

    for argv, text in ((["--strategies", "allreduce,no-such-rule"], "unknown strategy"),
                       (["--models", "vgg"], "--models vgg"), (["--link", "fast"], "link 'fast'"),
                       (["--workers", "0"], "--workers")):
        with pytest.raises(ConfigError, match=text):
            main(argv + ["--out", "unused"])


def test_a_link_without_root_says_why(monkeypatch):
    from phalanx.launch import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "root" in netns.why_not()
    with pytest.raises(netns.LinkError, match="needs root"):
        netns.Link("100mbit").up()
    from phalanx.bench.cli import main
    with pytest.raises(netns.LinkError, match="cannot build the 100mbit link.*root"):
        main(["--link", "loopback,100mbit", "--out", "unused"])


def test_link_rates_parse():
    from phalanx.launch import netns

    assert netns.parse_rate("100Mbit") == "100mbit" and netns.parse_rate(" 1.5gbit") == "1.5gbit"
    with pytest.raises(ValueError, match="loopback or a rate"):
        netns.parse_rate("100 furlongs")


def test_projection_follows_the_ring_model():
    # 2 workers, 10 MB at 1 Gbit/s: 2*(1/2)*1e7/1.25e8 = 0.08 s, plus 2*1*alpha per call
    assert projection.ring_seconds(2, 1e7, 1.25e8, alpha=0.0) == pytest.approx(0.08)
    assert projection.ring_seconds(4, 1e7, 1.25e8, alpha=1e-3, calls=2) == pytest.approx(1.5 * 0.08 + 12e-3)
    rows = [{"model": "m", "setup": "allreduce", "kind": "phalanx", "workers": w, "threads": 1, "batch": 10,
             "samples_per_s": {"median": 100.0 * w, "n": 5}, "bytes_per_step": 1e7 if w > 1 else 0.0,
             "calls_per_step": 1.0, "grad_bytes": 1e7} for w in (1, 2)]
    proj = projection.project(rows, alpha=0.0)
    m = proj["models"]["m"]
    assert m["compute_s"] == pytest.approx(0.1)
    assert m["setups"]["allreduce"]["links"][1.0][2]["efficiency"] == pytest.approx(0.1 / 0.18)
    assert "PROJECTION" in projection.markdown(proj) and "allreduce on" in m["recommendation"][100.0]


def test_targets_are_checked_when_their_rows_exist():
    def row(setup, n, **kw):
        return {"model": "resnet20", "setup": setup, "workers": n, "threads": 1, "link": "loopback",
                "vs_plain": kw.get("vs_plain", math.nan), "vs_ddp": kw.get("vs_ddp", math.nan),
                "efficiency": kw.get("eff", math.nan), "samples_per_s": {"median": 1.0}}
    got = targets.check([row("allreduce", 1, vs_plain=0.99), row("allreduce", 2, vs_ddp=0.97, eff=0.91)])
    assert [(t["goal"], t["ok"]) for t in got] == [(0.98, True), (1.0, False), (0.9, True)]
    assert "**missed**" in targets.markdown(got)


# -- the smoke test: the real command, reduced -------------------------------------------------------
@pytest.mark.multiproc
def test_quick_bench_smoke(tmp_path, capsys):
    from phalanx.cli import main

    out = tmp_path / "results"
    code = main(["bench", "--quick", "--models", "mlp", "--workers", "1,2", "--strategies", "allreduce",
                 "--warmup", "2", "--steps", "3", "--batch", "16", "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    for name in ("bench.md", "bench.json", "throughput.png", "efficiency.png", "breakdown.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "bench.json").read_text())
    assert data["environment"]["torch"] == torch.__version__ and data["environment"]["cpu_count"] == os.cpu_count()
    titles = [(r["setup"], r["workers"], r["threads"]) for r in data["rows"]]
    assert titles == [("plain", 1, 1), ("plain", 1, 2), ("allreduce", 1, 1), ("allreduce", 2, 1)]
    for rec in data["raw"]:
        assert rec["error"] is None
        assert all(len(r["step_s"]) == 5 for r in rec["ranks"])  # every raw step, warm-up included
        for r in rec["ranks"]:  # the breakdown of DDP-based all-reduce sums to the loop's step time
            assert abs(_total_ratio(r) - 1) < 0.10 and abs(statistics.median(_ratios(r)) - 1) < 0.10, _ratios(r)
    two = data["rows"][3]
    assert two["samples_per_s"]["median"] > 0 and two["speedup"] > 0 and set(two["breakdown"]) == {"0", "1"}
    md = (out / "bench.md").read_text()
    assert "| mlp | phalanx allreduce | loopback | 2×1 |" in md and "PROJECTION (not a measurement)" in md
    again = tmp_path / "again"  # the report rebuilt from the raw records alone, nothing re-run
    assert main(["bench", "--from-json", str(out / "bench.json"), "--no-plots", "--out", str(again)]) == 0
    assert "| mlp | phalanx allreduce | loopback | 2×1 |" in (again / "bench.md").read_text()


# -- when the numbers cannot be trusted, the report says so ---------------------------------------------
def test_the_spread_of_a_throughput_never_goes_below_zero():
    windows = [174.0, 180.0, 15.0, 190.0, 400.0, 170.0, 20.0, 185.0]  # 8 skewed windows, as a busy --quick gives
    s = stats.summary(windows)
    assert s["mean"] - 1.96 * s["std"] < 0  # what the old "mean ± 1.96·std" printed
    assert 15.0 <= s["low"] <= s["median"] <= s["high"] <= 400.0


def test_a_busy_machine_and_a_wide_spread_are_warned_about():
    from phalanx.bench import sanity

    assert "load average 3.60 on 2 cores" in sanity.busy((3.6, 3.0, 2.0), 2)
    assert sanity.busy((0.3, 0.2, 0.1), 16) is None
    wide = {"model": "mlp", "setup": "ddp", "workers": 2, "threads": 1,
            "samples_per_s": stats.summary([174.0, 180.0, 15.0, 190.0, 400.0, 170.0, 20.0, 185.0])}
    tight = {**wide, "setup": "allreduce", "samples_per_s": stats.summary([100.0, 101.0, 99.0, 100.5])}
    found = sanity.warnings([wide, tight], {"loadavg_at_start": [3.6], "cpu_count": 2})
    assert len(found) == 2 and "busy" in found[0] and "mlp ddp 2×1" in found[1]
    assert sanity.within_noise(wide["samples_per_s"], tight["samples_per_s"])
    assert not sanity.within_noise(tight["samples_per_s"], stats.summary([200.0, 201.0, 199.0]))


def _record(setup: str, workers: int, step_s: list[float], threads: int = 1) -> dict:
    ranks = [{"rank": r, "warmup": 0, "step_s": step_s, "period": 1, "params": 10, "grad_bytes": 40,
              "bytes_per_step": 4e6 if workers > 1 else 0.0, "calls_per_step": 1.0,
              "phases": [{"data_s": 0.0, "compute_s": t * 0.8, "comm_s": t * 0.2 if workers > 1 else 0.0,
                          "optimizer_s": 0.0, "step_s": t} for t in step_s]} for r in range(workers)]
    return {"run": {"model": "mlp", "setup": {"name": setup, "label": setup, "kwargs": {}}, "workers": workers,
                    "threads": threads, "link": "loopback", "batch": 10}, "repeat": 0, "error": None, "ranks": ranks}


def test_ratios_inside_the_noise_are_marked():
    rows = report.aggregate([_record("allreduce", 2, [0.10, 0.11, 0.09, 0.10]),
                             _record("ddp", 2, [0.10, 0.12, 0.08, 0.10])])
    assert rows[0]["vs_ddp_within_noise"]
    assert "| 1.000 ~ |" in report.throughput_table(rows) or " ~ |" in report.throughput_table(rows)


def test_projection_keeps_efficiency_at_most_one_and_gives_no_recommendation_from_noise():
    # the setup's own 1-worker run came out faster than the reference: noise, not a speedup
    recs = [_record("plain", 1, [0.10] * 6), _record("allreduce", 1, [0.10, 0.10, 0.11, 0.10, 0.10, 0.10]),
            _record("ddp", 1, [0.05] * 6), _record("ddp", 2, [0.06] * 6)]
    proj = projection.project(report.aggregate(recs))
    effs = [p["efficiency"] for s in proj["models"]["mlp"]["setups"].values() for per_n in s["links"].values()
            for p in per_n.values()]
    assert max(effs) <= 1.0
    noisy = [_record("allreduce", 1, [0.10, 0.02, 0.30, 0.05, 0.20, 0.10]), _record("allreduce", 2, [0.1] * 6)]
    proj = projection.project(report.aggregate(noisy))
    assert all(text.startswith("none: the 1-worker measurement") for text in
               proj["models"]["mlp"]["recommendation"].values())


def test_projection_check_compares_the_model_with_measured_points():
    recs = [_record("allreduce", 1, [0.10] * 6), _record("allreduce", 2, [0.125] * 6),
            _record("allreduce", 4, [0.14] * 6)]
    points = projection.check(report.aggregate(recs))
    assert [(p["workers"], round(p["measured"], 3)) for p in points] == [(4, round(0.10 / 0.14, 3))]
    p = points[0]
    assert p["after"] <= p["before"] <= 1.0 and p["slowdown_2"] == pytest.approx(0.125 / 0.10)
    assert "| mlp | allreduce | 4 |" in projection.check_markdown(points)


def test_efficiency_plot_keeps_thread_rows_apart_and_breakdown_labels_match_the_table(tmp_path):
    from phalanx.bench import plots

    recs = [_record("plain", 1, [0.1] * 4), _record("plain", 1, [0.06] * 4, threads=2),
            _record("allreduce", 1, [0.1] * 4), _record("allreduce", 2, [0.12] * 4)]
    rows = report.aggregate(recs)
    series = plots.efficiency_series(rows)["mlp"]
    assert list(series["processes"]) == ["phalanx allreduce (loopback)"]
    assert series["processes"]["phalanx allreduce (loopback)"][0] == (1, 1.0)
    assert [n for n, _ in series["threads"]["plain PyTorch loop, 1 process"]] == [1, 2]
    assert plots.efficiency(rows, str(tmp_path / "e.png"))
    table = report.breakdown_table(rows)
    for label in plots.breakdown_labels(rows):  # every plot label is a table row's first columns
        assert "| " + label.rsplit(" (", 1)[0].replace("worker ", "") + " |" in table, label
