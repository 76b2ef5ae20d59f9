"""Faults: a failed step leaves the engine serving (the real app over a real engine in this
process, the fault injected where the scheduler calls the jitted step), an engine held still
there meets the server's admission bounds and deadlines (429 with Retry-After, 504 with the
request cancelled and its pages freed), a state dir that cannot be written fails no request,
and SIGTERM saves the demand history and the residency stats, which a restarted server counts
on from (a server process on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import openai
import pytest

import tidejax
from tests.support.server_fixtures import (launch_server, serve_app, server_log, stop_server,
                                           write_chat_model, write_profile)
from tidejax.runtime.client import LocalEngineClient
from tidejax.runtime.scheduler import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent
from tidejax.server.app import Server

# one page a request and one prompt bucket: the warm-up compiles every step these tests run
ENGINE = {"lanes": 1, "max_context": 64, "prefill_chunk": 16, "page_size": 64}
# half the experts resident, misses fetched exactly (the tokens do not depend on the map), the
# map moving every few steps
RESIDENCY = {"budget_experts": 4, "miss_policy": "exact", "drain_every": 2, "hysteresis": 1.0}
PROMPT = np.random.RandomState(21).randint(20, 200, 6).tolist()
GENERIC = "the engine failed on this request (the server's log has the details)"
SECRET = "injected fault: XlaRuntimeError at 0xdeadbeef"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("faults") / "model")


def load(model_dir):
    return tidejax.load(model_dir, model={"served_name": "tiny"}, engine=ENGINE,
                        residency=RESIDENCY)


def greedy(engine, ids, n):
    """The request's events through the scheduler (on its thread where it runs)."""
    events, done = [], threading.Event()

    def on_event(event):
        events.append(event)
        if isinstance(event, (DoneEvent, ErrorEvent)):
            done.set()

    engine.scheduler.submit(GenerationRequest(ids, n, ignore_eos=True), on_event)
    if engine.scheduler.thread is None:
        engine.scheduler.run_until_idle()
    assert done.wait(60)
    return [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1]


class FailingStep:
    """Stands in for the jitted step where the scheduler calls it: `arm("after")` makes the
    next call run the real step (its buffers donated) and then raise, `arm("before")` raise
    without running it; `hold` keeps the failing call waiting until a request is queued.
    `pause(after=n)` lets n more calls through, then holds every call until `resume()`: an
    engine as slow as a test needs."""

    def __init__(self, engine):
        self.engine, self.real = engine, engine.loaded.steps.step
        self.armed: list[tuple[str, bool]] = []
        self.turn = threading.Condition()
        self.left: int | None = None  # calls to let through before holding; None: all
        engine.loaded.steps.step = self

    def arm(self, when: str, hold: bool = False) -> None:
        self.armed.append((when, hold))

    def pause(self, after: int = 0) -> None:
        with self.turn:
            self.left = after

    def resume(self) -> None:
        with self.turn:
            self.left = None
            self.turn.notify_all()

    def __call__(self, params, state, inputs):
        with self.turn:
            self.turn.wait_for(lambda: self.left is None or self.left > 0)
            if self.left is not None:
                self.left -= 1
        if not self.armed:
            return self.real(params, state, inputs)
        when, hold = self.armed.pop(0)
        while hold and not self.engine.scheduler.queued:
            time.sleep(0.01)
        if when == "after":
            self.real(params, state, inputs)  # donates the state; its outputs are dropped
        raise RuntimeError(SECRET)


def get(url, path):
    try:
        with urllib.request.urlopen(url + path, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def post(url, body, stream=False):
    """(status, [data events] when streaming else the parsed body)."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"model": "tiny", "prompt": PROMPT, "temperature": 0, "ignore_eos": True, "stream": stream,
         **body}).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not stream:
        return status, json.loads(text)
    return status, [json.loads(line[6:]) for line in text.splitlines()
                    if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture(scope="module")
def served(model_dir):
    engine = load(model_dir)
    client = LocalEngineClient(engine)
    asyncio.run(client.start())  # warm-up, then the scheduler thread
    server = Server(engine.config)
    server.attach(client)
    faults = FailingStep(engine)
    health = []  # /health as the rebuild starts
    freed = []  # whether the failed state's buffers (all but its expert rows) were freed
    rebuild = engine.loaded.rebuilt_state
    with serve_app(server) as url:
        def watched(failed):
            health.append(get(url, "/health"))
            state = rebuild(failed)
            rest = failed.replace(experts=failed.experts.without_rows())
            freed.append(all(leaf.is_deleted() for leaf in jax.tree.leaves(rest)))
            return state
        engine.loaded.rebuilt_state = watched
        yield {"engine": engine, "client": client, "url": url, "faults": faults,
               "health": health, "freed": freed}
    client.stop()


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(served):
    engine, url, faults, health = (served[k] for k in ("engine", "url", "faults", "health"))
    fresh, _ = greedy(engine, PROMPT, 8)  # the engine as loaded

    # after its buffers were donated: the request gets a generic 500, /health said recovering
    faults.arm("after")
    status, body = post(url, {"max_tokens": 8})
    assert status == 500 and body["error"]["message"] == GENERIC, body
    assert SECRET not in json.dumps(body)
    wait_for(lambda: get(url, "/health")[0] == 200)
    assert health == [(503, {"status": "recovering", "model": "tiny", "lanes": 1, "active": 0,
                             "queued": 0})]

    # before: the streaming request in the lane fails, the one waiting in the queue is served
    faults.arm("before", hold=True)
    result = {}
    streaming = threading.Thread(target=lambda: result.update(a=post(url, {"max_tokens": 40},
                                                                     stream=True)))
    streaming.start()
    wait_for(lambda: engine.scheduler.active)
    status, queued = post(url, {"max_tokens": 8})
    streaming.join(60)
    status_a, events = result["a"]
    assert status_a == 200 and events[-1] == {"error": {
        "message": GENERIC, "type": "server_error", "param": None, "code": None}}
    assert SECRET not in json.dumps(events)
    assert status == 200 and queued["usage"]["completion_tokens"] == 8
    assert health[1][1]["status"] == "recovering" and get(url, "/health")[0] == 200
    assert served["freed"] == [True, True]  # donated by the first step, freed before the second

    # the rebuilt state serves as the fresh engine did, its bank as residency's map says
    tokens, done = greedy(engine, PROMPT, 8)
    assert tokens == fresh and done.finish_reason == "length"
    res = engine.residency
    stats = res.stats()
    assert stats["rebuilds"] == 2 and stats["swaps_applied"] > 0, stats
    slot_rows = engine.scheduler.call(lambda: np.asarray(engine.state.experts.slot_rows))
    np.testing.assert_array_equal(slot_rows, res.slot_rows)


def test_a_failed_scoring_forward_rebuilds_the_state_without_a_scheduler_thread(model_dir):
    """An engine used from Python (no scheduler thread): a scoring forward that fails after
    donating the decode state raises to its caller, the state is rebuilt, and the next forward
    scores as the first did."""
    engine = load(model_dir)
    want, real = engine.logits(PROMPT), engine.loaded.steps.score

    def failing(params, state, inputs):
        real(params, state, inputs)  # donates the state; its outputs are dropped
        raise RuntimeError(SECRET)

    engine.loaded.steps.score = failing
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.logits(PROMPT)
    engine.loaded.steps.score = real
    assert engine.residency.stats()["rebuilds"] == 1
    np.testing.assert_allclose(engine.logits(PROMPT), want, rtol=1e-6, atol=1e-6)
    engine.close()


# ---------------------------------------------------------------------------------------------
# Admission and deadlines: another app over the same engine, with the bounds under test


@contextlib.contextmanager
def bounded(served, **server):
    """The URL of an app over the served engine whose [server] table has `server` on top; the
    engine moves again after (FailingStep.resume)."""
    bounded = Server(served["engine"].config.with_overrides({"server": server}))
    bounded.attach(served["client"])
    try:
        with serve_app(bounded) as url:
            yield url
    finally:
        served["faults"].resume()


def call(url, body, key=None):
    """A non-streaming completion with API key `key`: (status, headers, parsed body)."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"model": "tiny", "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **body}).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def in_thread(fn, *args):
    """fn(*args) started on a thread; join() returns its result."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()

    class Running:
        @staticmethod
        def join():
            thread.join(60)
            return result[0]
    return Running


def metrics(url, key=None) -> str:
    request = urllib.request.Request(url + "/metrics",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read().decode()


def idle(engine) -> bool:
    scheduler = engine.scheduler
    return (scheduler.active == 0 and scheduler.queued == 0
            and scheduler.pages.free == scheduler.pages.n_pages)


def test_a_burst_past_max_queued_gets_429_and_the_server_serves_on(served):
    """One lane and max_queued 1: with the engine held, a request in the lane and one waiting,
    the next (and one asking for 2 choices while one place is free) gets a 429 with a
    Retry-After at once; those held are served once the engine moves, and so is the next."""
    engine, faults = served["engine"], served["faults"]
    with bounded(served, max_queued=1) as url:
        faults.pause()
        first = in_thread(call, url, {"max_tokens": 8})
        wait_for(lambda: engine.scheduler.active == 1)
        status, headers, body = call(url, {"max_tokens": 8, "n": 2})  # 3 places for 2
        assert status == 429 and int(headers["Retry-After"]) >= 1, (status, body)
        second = in_thread(call, url, {"max_tokens": 8})
        wait_for(lambda: engine.scheduler.queued == 1)
        status, headers, body = call(url, {"max_tokens": 8})
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert "server.max_queued = 1" in body["error"]["message"]
        faults.resume()
        for held in (first, second):
            status, _, body = held.join()
            assert status == 200 and body["usage"]["completion_tokens"] == 8
        status, _, body = call(url, {"max_tokens": 8})
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        text = metrics(url)
        assert 'tidejax_requests_rejected_total{reason="queue_full"} 2' in text
        assert "tidejax_requests_held 0" in text


def test_a_key_past_its_limit_gets_429_and_another_key_is_served(served):
    engine, faults = served["engine"], served["faults"]
    with bounded(served, api_keys=["k1", "k2"], api_keys_env="", max_requests_per_key=1) as url:
        faults.pause()
        first = in_thread(call, url, {"max_tokens": 4}, "k1")
        wait_for(lambda: engine.scheduler.active == 1)
        status, headers, body = call(url, {"max_tokens": 4}, "k1")
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert "server.max_requests_per_key = 1" in body["error"]["message"]
        other = in_thread(call, url, {"max_tokens": 4}, "k2")
        wait_for(lambda: engine.scheduler.queued == 1)  # taken: waits for the lane
        faults.resume()
        assert first.join()[0] == 200 and other.join()[0] == 200
        assert 'tidejax_requests_rejected_total{reason="key_limit"} 1' in metrics(url, "k1")


def test_the_deadline_cancels_requests_and_frees_their_pages(served):
    """request_timeout_s 2: the engine stalls after a few steps; a streaming request that has
    had tokens ends with a 504's error event, one still waiting for the lane gets a 504, both
    within the deadline's time though the engine still holds the lane; once it moves, their
    lane and pages are free, and the next request is served."""
    engine, faults = served["engine"], served["faults"]
    with bounded(served, request_timeout_s=2.0) as url:
        faults.pause(after=6)
        start = time.monotonic()
        streaming = in_thread(post, url, {"max_tokens": 40}, True)
        wait_for(lambda: faults.left == 0)  # stalled with the request decoding
        assert engine.scheduler.lane_of[0].generated >= 3
        waiting = in_thread(call, url, {"max_tokens": 8})
        status, events = streaming.join()
        assert status == 200 and events[-1]["error"]["code"] == "timeout", events
        assert "server.request_timeout_s" in events[-1]["error"]["message"]
        status, _, body = waiting.join()
        assert status == 504 and body["error"]["code"] == "timeout", body
        assert time.monotonic() - start < 6
        assert engine.scheduler.active == 1  # the engine has not moved: the lane is still held
        faults.resume()
        wait_for(lambda: idle(engine))
        status, _, body = call(url, {"max_tokens": 8})
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        text = metrics(url)
        assert "tidejax_request_timeouts_total 2" in text
        assert 'tidejax_generations_total{reason="timeout"} 2' in text


def test_a_failed_rebuild_reports_failed_and_refuses_requests(served):
    """Last of the tests over `served`: the engine stays failed."""
    engine, url, faults = served["engine"], served["url"], served["faults"]

    def broken(failed):
        raise RuntimeError("no device")

    engine.loaded.rebuilt_state = broken
    faults.arm("after")
    status, body = post(url, {"max_tokens": 4})
    assert status == 500 and body["error"]["message"] == GENERIC
    wait_for(lambda: engine.scheduler.status == "failed")
    assert get(url, "/health") == (503, {
        "status": "failed", "model": "tiny", "lanes": 1, "active": 0, "queued": 0,
        "reason": "the decode state could not be rebuilt after a failed step (the log has the "
                  "details)"})
    status, body = post(url, {"max_tokens": 4})
    assert status == 500 and "no device" not in json.dumps(body)


# ---------------------------------------------------------------------------------------------
# A server process: an unwritable state dir, SIGTERM, a restart


@pytest.fixture(scope="module")
def live(model_dir, tmp_path_factory):
    """A server whose residency.state_dir is, to begin with, a file: nothing can be saved."""
    root = tmp_path_factory.mktemp("live")
    state_dir = root / "state"
    state_dir.write_text("a file where the state dir should be")
    profile = write_profile(root / "faults.toml", model_dir, engine=ENGINE,
                            residency={**RESIDENCY, "state_dir": str(state_dir)})
    # the restart reads the first start's compiled steps from a persistent cache
    env = {"JAX_COMPILATION_CACHE_DIR": str(root / "jit"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    proc, url = launch_server(profile, env=env, warmup=True)  # engine.warmup's default
    assert re.search(r"compiled \d+ step shapes", server_log(profile))
    live = {"proc": proc, "url": url, "profile": profile, "state_dir": state_dir, "env": env}
    yield live
    stop_server(live["proc"])


def traffic(url, n):
    """n streaming chats and n completions, each generating its 12 tokens."""
    oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    for i in range(n):
        chunks = list(oai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"tide {i}"}], max_tokens=12,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 12
        out = oai.completions.create(model="tiny", prompt=f"ebb {i}", max_tokens=12,
                                     extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"


def warnings(profile) -> int:
    return server_log(profile).count("could not save the history and stats")


def make_unwritable(state_dir):
    """The state folder replaced by a file. The server may be saving at rest (the scheduler
    reads residency's last step once it runs out of work), so files may come back until the
    folder is gone."""
    for _ in range(50):
        for f in state_dir.iterdir():
            f.unlink(missing_ok=True)
        try:
            state_dir.rmdir()
            break
        except OSError:
            time.sleep(0.1)
    state_dir.write_text("a file again")


def test_an_unwritable_state_dir_fails_no_request(live):
    url, profile, state_dir = live["url"], live["profile"], live["state_dir"]
    traffic(url, 4)  # every drain's save fails: one warning for the streak
    assert warnings(profile) == 1
    state_dir.unlink()  # writable: the next drain saves
    traffic(url, 1)
    assert (state_dir / "history.npz").exists() and (state_dir / "stats.json").exists()
    assert "saved under" in server_log(profile) and warnings(profile) == 1
    make_unwritable(state_dir)  # a second streak, a second warning
    traffic(url, 2)
    assert warnings(profile) == 2
    state_dir.unlink()


def metric(url, name) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return float(re.search(rf"^tidejax_{name} (\S+)$", r.read().decode(), re.M).group(1))


def test_sigterm_saves_the_history_and_the_stats_and_they_resume(live):
    url, profile, state_dir = live["url"], live["profile"], live["state_dir"]
    traffic(url, 1)
    before = {k: metric(url, f"residency_{k}") for k in ("steps", "misses", "hits", "drains")}
    live["proc"].send_signal(signal.SIGTERM)
    assert live["proc"].wait(30) == 0
    assert "saved the demand history and the residency stats under" in server_log(profile)
    saved = json.loads((state_dir / "stats.json").read_text())["counters"]
    assert saved["steps"] == before["steps"] > 0
    assert saved["misses"] >= before["misses"] > 0 and saved["drains"] > before["drains"]
    # the history's last stretch too: it covers every step the engine ran
    assert tidejax.residency.history.History.read(state_dir / "history.npz").steps == saved["steps"]

    live["proc"], url = launch_server(profile, env=live["env"], warmup=True)  # counts on from the saved stats
    assert metric(url, "residency_steps") == saved["steps"]
    assert metric(url, "residency_misses") == saved["misses"]
    assert metric(url, "residency_hits") == saved["wanted"] - saved["misses"]
    traffic(url, 1)
    assert metric(url, "residency_steps") > saved["steps"]
