"""The status page's parts without a job: who is named a straggler, who gets an answer, a port in use."""
from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request

import pytest

from phalanx.monitor import StatusServer, attribute, token
from phalanx.monitor.metrics import render
from support.status_job import WORKER


def worker(wid: str, compute: float, input_: float, exchange: float, steps: int = 50) -> dict:
    return {"worker": wid, "rank": int(wid), "compute_s": compute, "input_s": input_, "exchange_s": exchange,
            "step_s": compute + input_ + exchange, "steps": steps}


def test_the_slow_rank_is_named_by_its_own_work_not_by_the_others_waiting_for_it():
    # two workers: the fast one waits in the exchange exactly as long as the slow one computes more
    s = attribute([worker("0", 0.010, 0.0, 0.030), worker("1", 0.040, 0.0, 0.0)])
    assert (s["rank"], s["cause"]) == (1, "compute") and s["ratio"] == pytest.approx(4.0)
    s = attribute([worker("0", 0.010, 0.0001, 0.0), worker("1", 0.010, 0.0001, 0.03), worker("2", 0.01, 0.03, 0.0)])
    assert (s["rank"], s["cause"]) == (2, "input")
    assert s["text"].startswith("rank 2: input 300.0x the median of the others over the last 50 steps")


def test_nobody_is_named_when_the_workers_are_alike_or_have_too_few_steps():
    assert attribute([worker("0", 0.010, 0.001, 0.002), worker("1", 0.012, 0.001, 0.001)]) is None
    assert attribute([worker("0", 0.010, 0.0, 0.0, steps=2), worker("1", 0.1, 0.0, 0.0, steps=2)]) is None
    assert attribute([worker("0", 0.010, 0.0, 0.0)]) is None


def test_a_slow_link_alone_is_named_as_the_exchange():
    s = attribute([worker("0", 0.01, 0.0, 0.002), worker("1", 0.01, 0.0, 0.002), worker("2", 0.01, 0.0, 0.02)])
    assert (s["rank"], s["cause"]) == (2, "exchange")


def test_metrics_text_names_the_straggler_with_its_cause():
    status = {"generation": 3, "members": ["0", "1"], "changes": [], "throughput": [[1.0, 50.0]], "ended": None,
              "checkpoint": None, "workers": [dict(worker("0", 0.01, 0, 0.03), step=9),
                                              dict(worker("1", 0.04, 0, 0), step=9)]}
    status["straggler"] = attribute(status["workers"])
    text = render(status)
    assert 'phalanx_worker_straggler{worker="1",rank="1",generation="3",cause="compute"} 1' in text
    assert 'phalanx_worker_straggler{worker="0",rank="0",generation="3"} 0' in text
    assert "phalanx_samples_per_second 50.0" in text


def _get(url: str, **headers: str) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def test_only_the_token_of_the_jobs_secret_gets_an_answer():
    server = StatusServer("127.0.0.1", 0)
    server.serve(lambda: {"generation": 1, "members": [], "workers": [], "straggler": None, "changes": [],
                          "throughput": [], "ended": None, "checkpoint": None}, token("the secret"))
    server.actions["stacks"] = lambda: "stacks of every worker"  # the hook the stacks button uses
    base = f"http://127.0.0.1:{server.port}"
    try:
        for path in ("/", "/status.json", "/metrics", "/nothing"):
            assert _get(base + path)[:2] == (401, b"")
            assert _get(base + path, Authorization="Bearer " + token("another secret"))[:2] == (401, b"")
            assert _get(base + path, Cookie=f"phalanx_status_{server.port}={token('another')}")[:2] == (401, b"")
        assert _get(base + "/?token=" + token("another secret"))[:2] == (401, b"")
        good = {"Authorization": "Bearer " + token("the secret")}
        assert json.loads(_get(base + "/status.json", **good)[1])["actions"] == ["stacks"]
        assert _get(base + "/status.json", Cookie=f"phalanx_status_{server.port}={token('the secret')}")[0] == 200
        request = urllib.request.Request(base + "/action/stacks", data=b"", headers=good, method="POST")
        assert urllib.request.urlopen(request, timeout=10).read() == b"stacks of every worker"
        try:
            urllib.request.urlopen(urllib.request.Request(base + "/action/stacks", data=b"", method="POST"),
                                   timeout=10)
            raise AssertionError("an action without the token ran")
        except urllib.error.HTTPError as err:
            assert (err.code, err.read()) == (401, b"")
    finally:
        server.close()


def test_a_port_in_use_refuses_the_job_before_it_starts(tmp_path, capsys):
    from phalanx.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        code = main(["run", "-n", "2", "--status", str(port), WORKER, "--out", str(tmp_path)])
    finally:
        taken.close()
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "nothing was started" in lines[0], lines
    assert os.listdir(tmp_path) == []  # no worker started


def test_a_bad_status_flag_is_one_line():
    from phalanx import ConfigError
    from phalanx.launch.config import RunConfig

    with pytest.raises(ConfigError, match=r"--status abc; expected \[HOST:\]PORT"):
        RunConfig.from_argv(["--status", "abc", WORKER])
    with pytest.raises(ConfigError, match="where the launcher holds the job's store"):
        RunConfig.from_argv(["--status", "8080", "--nnodes", "2", "--master-addr", "10.0.0.1", WORKER])
    assert RunConfig.from_argv(["--status", "0.0.0.0:8080", WORKER]).status == ("0.0.0.0", 8080)


def test_a_worker_reports_its_rule_and_exchange_schedule(one_thread):
    import torch

    import phalanx as px
    from phalanx.step.telemetry import Reporter

    net = torch.nn.Linear(4, 1)
    rule = px.StreamingDiLoCo(every=2, fragments=2)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=rule)
    reporter = Reporter(None, "0")
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        reporter.closed(px.strategy_of(opt).clock)
    s = reporter.summary()
    assert s["strategy"] == "StreamingDiLoCo" and s["schedule"].startswith("StreamingDiLoCo(every=2, fragments=2")
    assert s["step"] == 3 and s["steps"] == 2 and isinstance(s["in_flight"], list)
