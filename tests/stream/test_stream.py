"""Streaming input in one process: a real redis-server (unix socket, temporary directory), no fakes.

Multi-worker runs, crashes and restarts are in test_stream_multiproc.py.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from phalanx.errors import ConfigError
from phalanx.stream import Deadline, RedisStream, Stop, StreamError, StreamLoader, WaitFull, decode_sample
from phalanx.stream.plan import END, STEP, Plan, split
from phalanx.stream.source import MAX_SEQ, before
from support.paths import REPO


# -- units: no broker -----------------------------------------------------------------------------
def test_split_is_contiguous_and_gives_a_worker_without_events_a_weightless_stand_in():
    ids = [f"{i}-0" for i in range(1, 8)]
    assert split(ids, 3) == (("1-0", "3-0", 3), ("4-0", "5-0", 2), ("6-0", "7-0", 2))
    assert split(ids[:1], 2) == (("1-0", "1-0", 1), ("1-0", "1-0", 0))


def test_plan_survives_the_broadcast_tensor_including_the_largest_sequence():
    plan = Plan(STEP, total=3, final=True, consumed=4, lag=9, dead=1, position=f"7-{MAX_SEQ}", offset=12,
                parts=(("1-0", "2-5", 2), ("3-0", "3-0", 1)))
    assert Plan.unpack(plan.pack(2), 2) == plan
    assert before("7-0") == f"6-{MAX_SEQ}"


def test_policies_never_step_on_nothing():
    assert not WaitFull().ready(have=0, want=8, waited_s=99, world_size=2)
    assert not Deadline(0.1).ready(have=1, want=8, waited_s=99, world_size=2)  # one worker would have no event
    assert Deadline(0.1).ready(have=2, want=8, waited_s=0.2, world_size=2)
    with pytest.raises(ConfigError, match="Deadline"):
        Deadline(0)
    with pytest.raises(ConfigError, match="steps"):
        Stop(steps=-1)


def test_import_phalanx_does_not_import_redis():
    code = "import sys, phalanx; phalanx.stream.RedisStream; print('redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_redis_absent_at_start_is_one_line_naming_the_url(tmp_path):
    url = f"unix://{tmp_path}/no-such.sock"
    with pytest.raises(StreamError) as err:
        RedisStream(url, stream="events", decode=decode_sample, timeout_s=1)
    assert url in str(err.value) and "\n" not in str(err.value) and "expected a running redis-server" in str(err.value)


def test_a_malformed_url_is_a_usage_error():
    with pytest.raises(ConfigError, match="Redis URL 'http://x'"):
        RedisStream("http://x", stream="events", decode=decode_sample)


# -- with a real redis-server -------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make setup installs it as root: apt-get install -y "
                    "redis-server)")
    from phalanx.stream.broker import RedisServer
    s = RedisServer()
    yield s
    s.stop()


def publish(server, stream, count, **kwargs):
    from phalanx.stream.producer import publish as _publish
    return _publish(server.url, stream, count=count, **kwargs)


def loader_for(server, stream, batch_size=10, group="g", **kwargs):
    source = RedisStream(server.url, stream=stream, group=group, decode=decode_sample, create=True)
    return StreamLoader(source, batch_size, block_s=0.05, **kwargs)


def stream_ids(server, stream):
    import redis
    r = redis.Redis.from_url(server.url)
    return [i.decode() for i, f in r.xrange(stream) if b"phalanx-end" not in f]


def test_every_event_once_and_nothing_pending_after_the_final_commit(server):
    publish(server, "once", 95, end=True)
    loader = loader_for(server, "once")
    seen, sizes = [], []
    for x, _ in loader:
        seen += loader.ids
        sizes.append(len(x))
    loader.state_dict()
    loader.close()
    assert seen == stream_ids(server, "once") and sizes == [10] * 9 + [5]
    assert loader.source.pending() == 0


def test_events_after_the_commit_are_trained_again_once_after_a_crash(server):
    publish(server, "crash", 60, end=True)
    first = loader_for(server, "crash")
    history, committed = [], None
    for step, _ in enumerate(first, 1):
        if step <= 2:
            history += first.ids
            committed = first.state_dict()  # the commit after step 2 ...
        if step == 4:
            break  # ... then a crash after step 4: steps 3 and 4 were never committed
    # steps 3-4 and the steps planned ahead of them (all 61 entries were claimed in one read): claimed after the
    # commit, so never acknowledged; the restart plans them again
    assert first.source.pending() == 61 - 20
    second = loader_for(server, "crash")
    second.load_state_dict(committed)
    for _ in second:
        history += second.ids
    second.state_dict()
    second.close()
    assert history == stream_ids(server, "crash") and second.source.pending() == 0


def test_a_restart_without_a_checkpoint_resumes_after_what_was_acknowledged(server):
    publish(server, "ack", 40, end=True)
    first = loader_for(server, "ack")
    for step, _ in enumerate(first, 1):
        if step == 1:
            first.state_dict()
        if step == 3:
            break  # step 1's commit is acknowledged when step 2 is claimed; steps 2-3 are not
    second = loader_for(server, "ack")
    assert [i for _ in second for i in second.ids] == stream_ids(server, "ack")[10:]


def test_undecodable_events_go_to_the_dead_letter_stream_and_training_goes_on(server):
    import redis
    publish(server, "bad", 50, bad_every=10, end=True)
    loader = loader_for(server, "bad")
    seen = [i for _ in loader for i in loader.ids]
    assert len(seen) == 45 and loader.dead == 5
    dead = redis.Redis.from_url(server.url).xrange("bad:dead")
    bad_ids = sorted(set(stream_ids(server, "bad")) - set(seen))
    assert sorted(f[b"phalanx-id"].decode() for _, f in dead) == bad_ids
    assert all(b"expected fields x" in f[b"phalanx-reason"] for _, f in dead)


def test_progress_shows_lag_events_per_second_and_the_acknowledged_position(server):
    publish(server, "lag", 100, end=True)
    loader = loader_for(server, "lag", ahead=1)  # one step per plan: the planner's reads are deterministic
    it = iter(loader)
    next(it)
    assert loader.stats()["lag"] == 91  # 100 events and the marker, 10 trained
    committed = loader.state_dict()["position"]
    next(it)  # step 2 was planned before the commit; the planner acknowledges it before it claims step 3
    next(it)
    stats = loader.stats()
    assert stats["acknowledged"] == committed and stats["lag"] == 71 and stats["events"] == 30
    assert stats["events_per_s"] > 0


def test_stop_by_steps_by_idle_time_and_by_time_budget(server):
    publish(server, "live", 100, end=False)  # no marker: a live stream that just goes quiet
    assert sum(1 for _ in loader_for(server, "live", group="a", stop=Stop(steps=3))) == 3
    idle = loader_for(server, "live", group="b", policy=Deadline(0.05), stop=Stop(idle_s=0.3), batch_size=30)
    assert sum(len(idle.ids) for _ in idle) == 100  # the short tail is trained before the idle stop
    budget = loader_for(server, "live", group="c", stop=Stop(seconds=0.5), batch_size=30)
    assert [len(budget.ids) for _ in budget] == [30, 30, 30, 10]  # the tail waited, then ended the run


def test_wrong_stream_name_and_a_group_used_by_someone_else_are_clear_errors(server):
    import redis
    with pytest.raises(ConfigError, match="no stream 'nosuch' at unix://.*create=True"):
        RedisStream(server.url, stream="nosuch", decode=decode_sample)
    publish(server, "shared", 5)
    r = redis.Redis.from_url(server.url)
    r.xgroup_create("shared", "billing", id="0")
    r.xreadgroup("billing", "invoice-service", {"shared": ">"}, count=1)
    with pytest.raises(ConfigError, match="'billing' on 'shared' .* also read by invoice-service"):
        RedisStream(server.url, stream="shared", group="billing", decode=decode_sample)


def test_a_stream_trimmed_past_the_committed_position_is_reported_not_skipped(server):
    import redis
    publish(server, "trim", 100, end=True)
    loader = loader_for(server, "trim")
    it = iter(loader)
    next(it)
    committed = loader.state_dict()
    redis.Redis.from_url(server.url).xtrim("trim", maxlen=50, approximate=False)  # deletes 40 events never trained
    again = loader_for(server, "trim")
    again.load_state_dict(committed)
    lost = "lost entries that were never trained: 51 of its 101 entries were deleted or trimmed, but training " \
           "had committed only 10"
    with pytest.raises(StreamError, match=lost):
        next(iter(again))
    assert again.steps == 1


def test_weights_of_an_uneven_step_give_one_process_gradient():
    # n_i * N / total per worker: the plain mean of the weighted local means is the global mean
    parts = split([f"{i}-0" for i in range(1, 6)], 2)
    local_means = [torch.tensor([1.0, 2.0, 3.0]).mean(), torch.tensor([4.0, 5.0]).mean()]
    weights = [count * 2 / 5 for _, _, count in parts]
    assert torch.allclose(sum(w * m for w, m in zip(weights, local_means)) / 2, torch.tensor(3.0))
    assert Plan(END).status == END


def test_the_trainer_fits_on_a_stream_and_its_history_shows_the_stream(server, one_thread, tmp_path):
    import torch.nn.functional as F

    import phalanx as px
    publish(server, "fit", 64, end=True)
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 3)
    ckpt = str(tmp_path / "ckpt.pt")
    commit = px.LambdaCallback(on_step_end=lambda t, step, logs: (step + 1) % 2 or t.save_checkpoint(ckpt))
    trainer = px.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), F.cross_entropy, metrics=["accuracy"],
                         callbacks=[commit])
    held_out = torch.utils.data.TensorDataset(torch.randn(20, 8), torch.randint(0, 3, (20,)))
    loader = loader_for(server, "fit", batch_size=16)
    row = trainer.fit(loader, epochs=1, val_data=held_out, progress=False)[-1]
    assert row["steps"] == 4 and row["events"] == 64 and row["lag"] == 0 and row["dead_letters"] == 0
    assert row["events_per_s"] > 0 and row["val_samples"] == 20
    # step 4's commit (by the callback) is acknowledged once the step's body ran; the last step covers the marker
    import redis
    assert row["acknowledged"] == redis.Redis.from_url(server.url).xrevrange("fit", count=1)[0][0].decode()
    trainer.save_checkpoint(ckpt)
    loader.close()
    assert loader.source.pending() == 0


def test_planning_ahead_reads_several_steps_at_once_and_trains_the_same_batches(server):
    publish(server, "ahead", 95, end=True)
    batches, reads, planned = {}, {}, {}
    for ahead in (1, 4):
        loader = loader_for(server, "ahead", group=f"a{ahead}", ahead=ahead)
        claim, reads[ahead], planned[ahead] = loader.source.claim, [], []
        loader.source.claim = lambda n, block_s, claim=claim, log=reads[ahead]: log.append(n) or claim(n, block_s)
        decide = loader._decide
        loader._decide = lambda decide=decide, log=planned[ahead]: log.append(len(plans := decide())) or plans
        batches[ahead] = [list(loader.ids) for _ in loader]
        loader.state_dict()
        loader.close()
        assert loader.source.pending() == 0
    assert batches[1] == batches[4] and [len(b) for b in batches[4]] == [10] * 9 + [5]
    assert max(planned[1]) == 1 and planned[4] == [4, 4, 2]  # up to 4 steps per plan (one broadcast)
    assert max(reads[1] + reads[4]) == 10  # read one step's worth at a time (the GIL goes back in between)
    with pytest.raises(ConfigError, match="ahead=0"):
        loader_for(server, "ahead", ahead=0)


def test_a_commit_is_acknowledged_only_after_the_loop_body_that_took_it(server):
    import threading
    publish(server, "late", 40, end=True)
    loader = loader_for(server, "late", ahead=1)
    decide, calls = loader._decide, []
    taken, planned = threading.Event(), threading.Event()

    def late_decide():  # the 3rd plan (step 2's) is decided in the background while step 1's body runs
        calls.append(1)
        if len(calls) != 3:
            return decide()
        assert taken.wait(30)  # ... and starts only once that body has taken a commit
        plans = decide()
        planned.set()
        return plans

    loader._decide = late_decide
    for step, _ in enumerate(loader):
        if step == 1:
            pending = loader.source.pending()
            loader.state_dict()  # a commit is taken ...
            taken.set()
            assert planned.wait(30)  # ... and while it is written, the planner acknowledges and claims
            assert loader.source.pending() >= pending  # claimed more, acknowledged nothing before the save is done
    loader.state_dict()
    loader.close()
    assert loader.source.pending() == 0 and len(calls) > 3


def test_before_batch_runs_before_each_batch_with_the_step_befores_position_and_a_raise_there_replans_from_it(server):
    """The loader's commit point (px.elastic registers on it): once per batch, before the position moves past it;
    a BaseException raised there leaves the loop, and the next iteration goes on from the position of the step
    before, every event once."""
    publish(server, "hooked", 35, end=True)
    loader = loader_for(server, "hooked")
    steps_at, positions, trained = [], [], []

    class Change(BaseException):
        pass

    def hook() -> None:
        steps_at.append(loader.steps)
        positions.append(loader.state_dict()["position"])  # a commit taken here
        if len(steps_at) == 3:
            raise Change  # e.g. px.elastic.JoinersAdmitted

    handle = loader.before_batch(hook)
    with pytest.raises(Change):
        for _ in loader:
            trained.append(loader.ids)
    assert steps_at == [0, 1, 2] and len(trained) == 2
    for _ in loader:  # re-entered, as @px.elastic.run does: planned from the position of step 2
        trained.append(loader.ids)
    assert steps_at == [0, 1, 2, 2, 3] and [len(ids) for ids in trained] == [10, 10, 10, 5]
    assert positions[1:] == [trained[0][-1], trained[1][-1], trained[1][-1], trained[2][-1]]
    assert [i for ids in trained for i in ids] == stream_ids(server, "hooked")
    handle.remove()
    loader.state_dict()
    loader.close()
    assert len(steps_at) == 5 and loader.source.pending() == 0


def test_acknowledging_takes_exactly_the_claimed_entries_up_to_a_position_claimed_or_not(server):
    import redis
    from phalanx.stream.codec import encode_sample
    ids = ["5-8", "5-9", "5-20", "5-100", "5-101", "5-102"]  # ordered as numbers, not as strings
    for i in ids:
        redis.Redis.from_url(server.url).xadd("acks", encode_sample(torch.zeros(2), 0), id=i)
    source = RedisStream(server.url, stream="acks", group="g", decode=decode_sample)
    assert [e.id for e in source.claim(4, 0.05) + source.claim(2, 0.05)] == ids  # two reads, in order
    source.acknowledge("5-9")  # a claimed id: it and the ones before
    assert source.pending() == 4
    source.acknowledge("5-50")  # between two claimed ids
    assert source.pending() == 3
    source.acknowledge("5-102")
    assert source.pending() == 0
    source.close()


def test_decoding_a_part_at_once_equals_decoding_each_event_and_refuses_a_mixed_part():
    from torch.utils.data import default_collate

    from phalanx.stream.codec import decode_samples, encode_sample
    events = [encode_sample(torch.randn(3, 2), i % 3, index=i) for i in range(5)]
    x, y = decode_samples(events)
    ex, ey = default_collate([decode_sample(f) for f in events])
    assert torch.equal(x, ex) and torch.equal(y, ey) and y.dtype == ey.dtype
    with pytest.raises(ConfigError, match="different shapes"):
        decode_samples(events + [encode_sample(torch.randn(2, 3), 0)])  # same size, another shape
    with pytest.raises(ConfigError):
        decode_samples(events + [{b"x": b"not a tensor", b"shape": b"3,2", b"y": b"1"}])


# -- bad events: a poisoned stream must not stop training, nor a restart ----------------------------
def json_decode(fields):
    """The docs' custom decode (docs/streaming.md): fields arrive with bytes keys and bytes values."""
    import json
    x = torch.tensor(json.loads(fields[b"x"]), dtype=getattr(torch, fields.get(b"dtype", b"float32").decode()))
    return x, int(fields[b"y"])


def xadd_json(server, stream, rows):
    import json

    import redis
    r = redis.Redis.from_url(server.url)
    for row in rows:
        r.xadd(stream, {k: (v if isinstance(v, bytes) else json.dumps(v)) for k, v in row.items()})
    r.xadd(stream, {b"phalanx-end": b"1"})


def dead_letters(server, stream):
    import redis
    return [(f[b"phalanx-id"].decode(), f[b"phalanx-reason"].decode())
            for _, f in redis.Redis.from_url(server.url).xrange(f"{stream}:dead")]


def test_a_well_formed_event_of_another_shape_is_dead_lettered_and_a_restart_goes_on_past_it(server):
    import redis

    from phalanx.stream.codec import encode_sample
    r = redis.Redis.from_url(server.url)
    publish(server, "odd", 25, end=False)
    odd = r.xadd("odd", encode_sample(torch.zeros(3), 1)).decode()  # decodes fine alone; stacks with nothing
    publish(server, "odd", 25, end=True)
    loader = loader_for(server, "odd")
    seen = [i for _ in loader for i in loader.ids]
    assert odd not in seen and len(seen) == 50 and loader.dead == 1
    assert [i for i, _ in dead_letters(server, "odd")] == [odd]
    assert "shape" in dead_letters(server, "odd")[0][1]
    again = loader_for(server, "odd", group="again")  # a restart reads it again: no crash, no second letter
    assert sum(len(again.ids) for _ in again) == 50 and [i for i, _ in dead_letters(server, "odd")] == [odd]


def test_a_custom_decode_dead_letters_another_shape_another_dtype_and_its_own_exceptions(server):
    good = [{b"x": [float(i), 1.0], b"y": i % 3} for i in range(12)]
    rows = good[:4] + [{b"x": [1.0, 2.0, 3.0], b"y": 0},                     # another shape
                       {b"x": [1.0, 2.0], b"y": 1, b"dtype": b"float64"},  # another dtype
                       {b"x": [1.0, 2.0], b"y": b"not a number"}] + good[4:]  # decode raises
    xadd_json(server, "json", rows)
    source = RedisStream(server.url, stream="json", group="g", decode=json_decode)
    loader = StreamLoader(source, 4, block_s=0.05)
    batches = [(x.clone(), y.clone()) for x, y in loader]
    assert [tuple(x.shape) for x, _ in batches] == [(4, 2)] * 3 and loader.dead == 3
    assert torch.equal(torch.cat([x for x, _ in batches]), torch.tensor([r[b"x"] for r in good]))
    reasons = [why for _, why in dead_letters(server, "json")]
    assert len(reasons) == 3 and "shape" in reasons[0] and "float64" in reasons[1] and "ValueError" in reasons[2]


def test_dead_letters_are_written_once_after_a_rollback(server):
    publish(server, "twice", 60, bad_every=4, end=True)  # 15 bad events
    first = loader_for(server, "twice", ahead=2)
    committed = None
    for step, _ in enumerate(first, 1):
        if step == 1:
            committed = first.state_dict()
        if step == 3:
            break
    first.load_state_dict(committed)  # a rollback: steps 2-3 and their dead letters come again
    assert sum(len(first.ids) for _ in first) == 45 - 10 and first.dead == 15
    again = loader_for(server, "twice", group="restart")  # a restart from nothing reads all of them again
    assert sum(len(again.ids) for _ in again) == 45 and again.dead == 15
    assert len(dead_letters(server, "twice")) == 15


def test_dead_letters_take_no_room_a_step_needs(server):
    publish(server, "room", 30, bad_every=4, end=True)  # ahead=1 claims one step's worth: 10 entries, 8 good
    loader = loader_for(server, "room", ahead=1, stop=Stop(idle_s=5))  # (the stop only bounds a regression)
    assert [len(loader.ids) for _ in loader] == [10, 10, 3] and loader.dead == 7


def test_the_custom_decode_example_of_the_docs_runs_on_a_real_stream(server):
    import os
    import re
    docs = os.path.join(REPO, "docs", "streaming.md")
    text = open(docs).read()
    section = text[text.index("## Your own events"):]
    produce, consume = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:2]
    scope = {"url": server.url}
    exec(produce, scope)  # the producer's str keys ...
    exec(consume, scope)
    loader = scope["loader"]
    x, y = next(iter(loader))  # ... arrive as bytes keys in decode; the first step (the third event waits)
    assert x.shape == (2, 3) and y.tolist() == [1, 0] and loader.dead == 0
    loader.close()
