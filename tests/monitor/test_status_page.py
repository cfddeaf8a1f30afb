"""The status page as a user sees it: a real job, a real headless Chromium, /metrics read by Prometheus's parser.

- An elastic job of three loses worker 2 (SIGKILL) and gains a joiner (``phalanx join``): one page,
  opened before and never reloaded, shows the right members and generation after each change,
  lists both changes, and says how the job ended; ``/metrics`` agrees with the workers' own record.
- A job with one slow worker (compute, then its input pipeline) names that rank and the cause on the
  page and in ``/metrics``.
- Without the job's token: 401 and an empty body; a page left open on a port a new job took over shows
  nothing of the new job.

Chromium is Debian's (``/usr/bin/chromium``, installed by ``make setup``), driven by Playwright over the
DevTools protocol; nothing is downloaded.
"""
from __future__ import annotations

import os
import signal

import pytest

from support.forked_launch import start_cli  # a joiner's launcher forked, its worker from one server
from support.status_job import BOUND_S, SECRET, WORKER, StatusJob

pytestmark = pytest.mark.multiproc
CHROMIUM = "/usr/bin/chromium"
HEARTBEAT_S = 4.0


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM}: apt-get install -y chromium (make setup does as root)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def metrics(job: StatusJob) -> dict:
    """``/metrics`` read by prometheus_client's parser: {(name, frozen labels): value}."""
    parser = pytest.importorskip("prometheus_client.parser", reason="pip install prometheus-client (the dev extra)")
    code, body = job.get("/metrics")
    assert code == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in parser.text_string_to_metric_families(body.decode()) for s in family.samples}


def value(m: dict, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in m.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def dom(page, selector: str) -> str:
    return page.locator(selector).inner_text()


def wait_dom(page, js: str) -> None:
    page.wait_for_function(js, timeout=BOUND_S * 1000)


def test_one_open_page_follows_a_kill_and_a_join_and_the_end(tmp_path, browser):
    with StatusJob(tmp_path, ["-n", "3", "--elastic", "--min-workers", "2", "--heartbeat-timeout",
                              str(HEARTBEAT_S)], forked=True) as job:
        job.training("0", "1", "2")
        # a request without the token, or with another, learns nothing
        for path in ("/", "/status.json", "/metrics", "/?token=0000"):
            assert job.get(path, token_=None) == (401, b""), path
        assert job.get("/metrics", token_="f" * 64) == (401, b"")
        page = browser.new_page()
        page.goto(f"{job.url}/?token={job.token}")  # the printed link: a cookie, then the page without the token
        assert page.url == f"{job.url}/"
        wait_dom(page, "document.getElementById('members').textContent === '0, 1, 2'")
        assert dom(page, "#generation") == "0"
        status = job.wait_for(lambda s: all(w["pid"] for w in s["workers"]), "every worker reported")

        os.kill(status["workers"][2]["pid"], signal.SIGKILL)  # kill worker 2
        wait_dom(page, "document.getElementById('generation').textContent === '1'")
        assert dom(page, "#members") == "0, 1"
        assert page.locator("#workers tbody tr").evaluate_all("rows => rows.map(r => r.dataset.worker)") == ["0", "1"]

        (tmp_path / "joiner").mkdir()  # its launcher.out and launcher.err
        joiner = start_cli(["join", "--rdzv-endpoint", f"127.0.0.1:{job.store_port}", "-n", "1", WORKER, "--out",
                            str(tmp_path)], str(tmp_path / "joiner"), env={"PHALANX_SECRET": SECRET})
        job.others.append(joiner)
        wait_dom(page, "document.getElementById('generation').textContent === '2'")
        members = dom(page, "#members").split(", ")
        assert members[:2] == ["0", "1"] and len(members) == 3
        # as the members report them (the joiner's own note, "0 -> 3", may come first and is then replaced)
        wait_dom(page, "[...document.querySelectorAll('#changes tbody tr')].map(r => r.cells[1].textContent).join()"
                       " === '2 → 3,3 → 2'")
        rows = page.locator("#changes tbody tr").evaluate_all(
            "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
        assert [r[:4] for r in rows] == [["2", "2 → 3", "–", members[2]], ["1", "3 → 2", "2", "–"]]  # newest first
        wait_dom(page, "[...document.querySelectorAll('#workers tbody tr')].every(r => r.cells[4].textContent !== '–')")

        # the stacks button: every member's Python stacks, naming the worker script's lines
        page.click("button[data-action='stacks']")
        wait_dom(page, "document.getElementById('action-output').textContent.split('-----').length >= 7")
        assert dom(page, "#action-output").count("status_job.py") >= 3, dom(page, "#action-output")

        # /metrics, read by Prometheus's own parser, against the job's own record (each worker's file at the end)
        job.wait_for(lambda s: all(w["generation"] == 2 and w["steps"] >= 5 for w in s["workers"]),
                     "every member reported from generation 2")
        m = metrics(job)
        assert value(m, "phalanx_generation") == 2 and value(m, "phalanx_workers") == 3
        assert value(m, "phalanx_membership_changes") == 2
        steps = {w: value(m, "phalanx_worker_step", worker=w, generation="2") for w in members}
        sent = {w: value(m, "phalanx_worker_sent_bytes_per_step", worker=w) for w in members}
        assert job.stop() == 0, job.log()
        results = job.results()
        assert sorted(results) == sorted(members)
        for w, r in results.items():
            assert r["generation"] == 2 and r["world_size"] == 3
            assert r["rank"] == members.index(w)
            assert steps[w] <= r["step"]
            assert sent[w] == pytest.approx(r["bytes_per_step"], rel=1e-6)  # every step sends the same
        # the page, never reloaded, says the job ended and how
        wait_dom(page, "!document.getElementById('ended').hidden")
        assert "exit status 0" in dom(page, "#ended")
        page.close()


# before the slow job's tests: that job (a module fixture) ends when the module's last test does, and its
# two busy workers with it
def test_a_page_left_open_shows_a_new_job_only_with_its_token(browser):
    from phalanx.monitor import StatusServer, token

    old = StatusServer("127.0.0.1", 0)
    old.serve(lambda: {"generation": 7, "members": ["a"], "workers": [], "straggler": None, "throughput": [],
                       "changes": [], "checkpoint": None, "ended": None, "strategy": "AllReduce"}, token("old"))
    port = old.port
    page = browser.new_page()
    page.goto(f"http://127.0.0.1:{port}/?token={token('old')}")
    wait_dom(page, "document.getElementById('generation').textContent === '7'")
    old.close()
    new = StatusServer("127.0.0.1", port)  # another job takes the port over, with another secret
    new.serve(lambda: {"generation": 5, "members": ["worker-of-the-new-job"], "workers": [], "straggler": None,
                       "throughput": [], "changes": [], "checkpoint": None, "ended": None, "strategy": "X"},
              token("new"))
    try:
        wait_dom(page, "document.getElementById('state').textContent === 'not authorized'")
        assert dom(page, "#generation") == "–" and "worker-of-the-new-job" not in page.content()
        assert "Not authorized" in dom(page, "#problem")
    finally:
        new.close()
        page.close()


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory, browser):
    """Two workers: worker 1 slow in compute, then (once the test writes ``next``) worker 0 slow in its input."""
    out = tmp_path_factory.mktemp("slow")
    with StatusJob(out, ["-n", "2"], ["--slow", "1:compute", "--then", "0:input"], forked=True) as job:
        job.training("0", "1")
        page = browser.new_page()
        page.goto(f"{job.url}/?token={job.token}")
        yield job, page
        assert job.stop() == 0, job.log()
        wait_dom(page, "!document.getElementById('ended').hidden")  # the page saw the end
        page.close()


def check_named(job: StatusJob, page, rank: int, cause: str) -> None:
    """The page and /metrics name ``rank`` as the straggler, slow in ``cause``, at least 3x the other."""
    status = job.wait_for(lambda s: (s["straggler"] or {}).get("rank") == rank, f"rank {rank} named ({cause})")
    assert status["straggler"]["cause"] == cause, status
    assert status["straggler"]["ratio"] is None or status["straggler"]["ratio"] >= 3
    wait_dom(page, f"document.getElementById('straggler').textContent.startsWith('Straggler: rank {rank}: ')")
    assert dom(page, "#straggler").startswith(f"Straggler: rank {rank}: {cause} ")
    row = page.locator(f"#workers tbody tr[data-worker='{rank}']")
    assert f"rank {rank}: {cause}" in row.inner_text() and row.get_attribute("class") == "strag"
    m = metrics(job)
    assert value(m, "phalanx_worker_straggler", worker=str(rank), cause=cause) == 1
    assert value(m, "phalanx_worker_straggler", worker=str(1 - rank)) == 0
    assert value(m, "phalanx_worker_straggler_ratio", rank=str(rank), cause=cause) >= 3


def test_a_rank_slow_in_compute_is_named_with_its_cause(slow_job):
    check_named(*slow_job, rank=1, cause="compute")


def test_a_rank_slow_in_its_input_pipeline_is_named_with_its_cause(slow_job):
    job, page = slow_job
    (job.out / "next").touch()  # worker 1 is fast again; worker 0's dataset spins for each batch
    check_named(job, page, rank=0, cause="input")
