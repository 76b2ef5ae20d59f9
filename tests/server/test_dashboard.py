"""The residency dashboard (server/dashboard.py) in a real headless Chromium over the DevTools
protocol, against `python -m tidejax.server` serving the tiny DeepSeek-V3 checkpoint with half its
experts resident: after a few requests the page's numbers are /metrics' and its heatmap is the
demand history the server saved, its polls after the first asking only for the rows changed
since (none at rest; the changed one after another request, which the page then shows). The
heatmap's wire form on a DeepSeek-V3-size map: its bytes, rows and versions. One server for the
module; routing traces left off (their default), so it also shows that a server with a state_dir
writes no trace."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from tidejax.config import EngineConfig
from tidejax.errors import RequestError
from tidejax.residency.history import History
from tidejax.runtime.api import EngineInfo, EngineStats
from tidejax.server.app import Server
from tidejax.server.dashboard import Heatmap
from tests.support.browser import Page, chromium_path
from tests.support.server_fixtures import (live_server, serve_app, server_log, write_chat_model,
                                           write_profile)

KEY = "sk-dashboard-test"
PROMPT = "The tide comes in over the flats and the boats lift from the mud"  # 36 tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    model_dir = write_chat_model(root / "tiny")
    state_dir = root / "state"
    # drain_every 1 and no decay: the history saved at each drain is every step's demand;
    # chunks of 16 tokens: every prompt's steps are one shape (a compile each costs seconds)
    profile = write_profile(root / "dash.toml", model_dir,
                            engine={"max_context": 256, "lanes": 2, "prefill_chunk": 16,
                                    "page_size": 16},
                            residency={"budget_experts": 4, "miss_policy": "substitute",
                                       "drain_every": 1, "half_life": 1e9,
                                       "state_dir": str(state_dir)},
                            server={"api_keys": [KEY]})
    with live_server(profile) as url:
        yield {"url": url, "root": root, "state_dir": state_dir, "profile": profile}
    assert (state_dir / "history.npz").exists(), server_log(profile)
    assert not (state_dir / "routing").exists()  # traces are off unless trace_every_steps is set


def settled_metrics(url: str, prefix: str = "residency_") -> dict[str, float]:
    """/metrics once two reads 0.2 s apart agree on the samples named `prefix`...: the step in
    flight when the last response went out is read (its picks counted) after the client has that
    response."""
    last = metrics(url)
    for _ in range(50):
        time.sleep(0.2)
        now = metrics(url)
        if {k: v for k, v in now.items() if k.startswith(prefix)} == {
                k: v for k, v in last.items() if k.startswith(prefix)}:
            return now
        last = now
    raise AssertionError("/metrics kept changing for 10 s on an idle server")


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name without the prefix: value}, labelled samples summed."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, value in re.findall(r"^tidejax_(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


READ_PAGE = """(() => {
  const value = id => Number(document.getElementById(id).dataset.value);
  const ids = ["cold-window", "cold-total", "swaps", "kv-pages", "preemptions", "cache-hits",
               "lanes", "queued", "decode-tps", "miss-exact", "miss-cpu", "miss-substitute",
               "miss-ring", "resident", "map-poll"];
  const series = id => Number(document.getElementById(id).dataset.last);
  const grid = document.getElementById("heatmap");
  return JSON.stringify({
    status: document.getElementById("status").textContent,
    values: Object.fromEntries(ids.map(id => [id, value(id)])),
    series: {cold: series("series-cold"), swaps: series("series-swaps")},
    map: {version: grid.dataset.version, most: Number(grid.dataset.most),
          levels: Number(grid.dataset.levels)},
    cells: [...grid.querySelectorAll(".cell")].map(c => [
      Number(c.dataset.layer), Number(c.dataset.expert), Number(c.dataset.heat),
      c.dataset.resident === "true" && c.classList.contains("resident")]),
  });
})()"""


def state_json(url: str, since: str | None = None) -> tuple[dict, int]:
    """/dashboard/state.json as a script reads it: (the state, its bytes)."""
    query = "" if since is None else f"?since={since}"
    request = urllib.request.Request(url + "/dashboard/state.json" + query,
                                     headers={"x-api-key": KEY})
    with urllib.request.urlopen(request, timeout=10) as r:
        body = r.read()
    return json.loads(body), len(body)


async def read_dashboard(url: str, folder, ask) -> tuple[dict, dict, list[str], list[str], object]:
    """Opens the dashboard as a browser does (?key= once, then its cookie), waits for three
    polls and reads what it shows; then runs `ask` (requests to the server: the demand
    changes) and, once the page has the server's new heatmap version, reads it again: (the
    two readings, console errors, the URLs it asked for, its screenshot)."""
    async with Page.open(folder) as page:
        await page.goto(f"{url}/dashboard?key={KEY}")
        await page.wait_for("Number(document.getElementById('series-cold').dataset.points) >= 3")
        before = json.loads(await page.evaluate(READ_PAGE))
        await asyncio.to_thread(ask)
        version = state_json(url)[0]["experts"]["version"]
        await page.wait_for(f"document.getElementById('heatmap').dataset.version === '{version}'")
        after = json.loads(await page.evaluate(READ_PAGE))
        shot = await page.screenshot(folder / "dashboard.png")
        return before, after, page.errors, page.requests, shot


def check_heatmap(shown: dict, history: History) -> np.ndarray:
    """The page's heatmap against a history the server saved: the scale its most demand, each
    cell's heat sqrt(demand / most) to within half a step; half of each layer resident. The
    heats shown [L_moe, E]."""
    heat = np.full(history.demand.shape, -1.0)
    resident = np.zeros(heat.shape, bool)
    for layer, expert, value, is_resident in shown["cells"]:
        heat[layer, expert], resident[layer, expert] = value, is_resident
    assert len(shown["cells"]) == heat.size
    most, levels = shown["map"]["most"], shown["map"]["levels"]
    assert most == pytest.approx(history.demand.max(), rel=1e-9) and most > 0
    np.testing.assert_allclose(heat / levels, np.sqrt(history.demand / most),
                               atol=0.5 / levels + 1e-9)
    assert resident.sum(axis=1).tolist() == [heat.shape[1] // 2] * len(heat)
    return heat


@pytest.mark.skipif(chromium_path() is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_page_shows_the_engines_numbers(served):
    url = served["url"]
    oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    for _ in range(2):  # the second prefills only past the first's cached pages
        oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    oai.chat.completions.create(model="tiny", max_tokens=6, temperature=0,
                                messages=[{"role": "user", "content": "Tell me about the sea."}])
    engine = settled_metrics(url)  # the server is idle: nothing changes until `more`
    saved = {}

    def more():  # the history the first reading shows kept, then the demand changes
        saved["before"] = History.read(served["state_dir"] / "history.npz")
        oai.completions.create(model="tiny", prompt="Boats", max_tokens=4, temperature=0)
        settled_metrics(url)

    shown, after, errors, requested, shot = asyncio.run(read_dashboard(url, served["root"],
                                                                       more))
    print(f"dashboard screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    assert errors == []
    assert requested and all(u.startswith(url + "/dashboard") for u in requested), requested
    assert shown["status"] == "ready"
    values = shown["values"]
    expected = {
        "cold-window": engine["residency_cold_share_window"],
        "cold-total": engine["residency_cold_share_total"],
        "swaps": engine["residency_swaps_applied"],
        "resident": engine["residency_resident"],
        "kv-pages": engine["kv_pages_in_use"],
        "preemptions": engine["kv_preemptions"],
        "cache-hits": engine["prompt_cache_matched_tokens_total"],
        "lanes": engine["lanes_active"],
        "queued": engine["queue_waiting"],
        "decode-tps": engine["decode_tokens_per_second"],
        # "substitute" serves every miss with a resident expert
        "miss-exact": 0, "miss-cpu": engine["residency_cpu_picks"],
        "miss-substitute": engine["residency_misses"], "miss-ring": engine["residency_ring_hits"],
        "map-poll": 0,  # the third poll at rest: no row changed since the second
    }
    assert values == pytest.approx(expected, rel=1e-9)
    assert values["miss-substitute"] > 0 and values["cache-hits"] > 0
    assert values["decode-tps"] > 0 and values["cold-total"] > 0
    assert shown["series"] == pytest.approx({"cold": expected["cold-window"],
                                             "swaps": expected["swaps"]})
    heat = check_heatmap(shown, saved["before"])
    # the first poll took every row; each later one only the rows changed since its version,
    # and the page drew the ones `more` changed from them
    states = [u for u in requested if "/state.json" in u]
    assert "since=" not in states[0] and len(states) > 3
    assert all(re.search(r"\?since=[0-9a-f]+\.\d+$", u) for u in states[1:]), states
    new_heat = check_heatmap(after, History.read(served["state_dir"] / "history.npz"))
    assert after["map"]["version"] != shown["map"]["version"] and (new_heat != heat).any()


def test_keys_guard_the_dashboard(served):
    url = served["url"]
    for path in ("/dashboard/state.json?key=wrong", "/dashboard", "/dashboard/state.json"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url + path, timeout=10)
        assert refused.value.code == 401
    assert "/dashboard?key=KEY" in refused.value.read().decode()  # the missing key's hint
    state, full = state_json(url)
    experts = state["experts"]
    assert state["model"] == "tiny" and (experts["layers"], experts["experts"]) == (1, 8)
    assert list(experts["rows"]) == ["0"]
    at_rest, fewer = state_json(url, experts["version"])
    assert at_rest["experts"]["rows"] == {} and fewer < full
    with pytest.raises(urllib.error.HTTPError) as bad:
        state_json(url, "latest")
    assert bad.value.code == 400 and json.load(bad.value)["error"]["param"] == "since"
    # the key in a query opens the page only through the cookie, for /dashboard alone
    with pytest.raises(urllib.error.HTTPError) as elsewhere:
        urllib.request.urlopen(f"{url}/v1/models?key={KEY}", timeout=10)
    assert elsewhere.value.code == 401


def test_a_profile_switch_leaves_the_dashboard_out():
    for on in (True, False):
        server = Server(EngineConfig.from_dict({"server": {"dashboard": on}}))
        with serve_app(server) as url:
            try:
                with urllib.request.urlopen(url + "/dashboard", timeout=10) as r:
                    status, page = r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                status, page = e.code, ""
        assert status == (200 if on else 404)
        if on:  # one page: no script, style or font from elsewhere
            assert "<script>" in page and not re.search(r"""(src|href)=["']?(https?:)?//""", page)


def test_the_heatmap_sends_the_rows_changed_since_a_version():
    """A DeepSeek-V3-size map (58 MoE layers x 256 experts): every row at a tenth of the bytes
    of the demand as JSON numbers; a version's poll gets no row while nothing changed, none
    after a decay (every cell scaled alike), one after one layer's demand changed or one
    expert was swapped; a version of another server gets every row; the rows decode to the
    heats and residency."""
    rng = np.random.default_rng(0)
    demand = rng.gamma(0.3, 20.0, (58, 256))  # a skewed decayed demand, float64 as History's
    resident = demand >= np.median(demand, axis=1, keepdims=True)
    heatmap = Heatmap()
    heatmap.update(demand, resident)
    full = heatmap.since(None)
    assert len(full["rows"]) == 58 and (full["layers"], full["experts"]) == (58, 256)
    as_lists = json.dumps({"demand": demand.tolist(), "resident": resident.tolist()})
    assert len(json.dumps(full)) * 10 < len(as_lists)
    for layer, row in full["rows"].items():
        cells = np.frombuffer(base64.b64decode(row), np.uint8)
        heat, bits = cells[:256], np.unpackbits(cells[256:])
        np.testing.assert_allclose(heat / full["levels"],
                                   np.sqrt(demand[int(layer)] / demand.max()), atol=0.5 / 255)
        np.testing.assert_array_equal(bits.astype(bool), resident[int(layer)])
    version = full["version"]
    heatmap.update(demand * 0.5 ** (64 / 500), resident)  # a drain's decay, nothing added
    assert heatmap.since(version)["rows"] == {} and heatmap.token == version
    assert len(json.dumps(heatmap.since(version))) < 200
    demand[7, :] = demand[7, ::-1]
    heatmap.update(demand, resident)
    assert list(heatmap.since(version)["rows"]) == ["7"]
    later = heatmap.token
    resident[30, 0] = not resident[30, 0]
    heatmap.update(demand, resident)
    assert list(heatmap.since(version)["rows"]) == ["7", "30"]
    assert list(heatmap.since(later)["rows"]) == ["30"]
    assert len(Heatmap().since(None)["rows"]) == 0  # no engine yet: no rows
    other = Heatmap()
    other.update(demand, resident)
    assert len(heatmap.since(other.token)["rows"]) == 58
    with pytest.raises(RequestError) as bad:
        heatmap.since("7")
    assert bad.value.field == "since"


def decoded(rows: dict, experts: int) -> dict[int, tuple[list[int], list[bool]]]:
    """A poll's rows as {layer: (heat bytes, residency bits)}."""
    out = {}
    for layer, row in rows.items():
        cells = np.frombuffer(base64.b64decode(row), np.uint8)
        out[int(layer)] = (cells[:experts].tolist(),
                           np.unpackbits(cells[experts:])[:experts].astype(bool).tolist())
    return out


def test_a_poll_after_a_drain_sends_the_rows_whose_heat_bytes_moved():
    """Steady traffic drained into a History: a drain whose demand quantizes to the same heat
    bytes (what it adds makes up the decay) moves the version on by nothing and sends no row,
    though the floats changed; one that adds to one layer sends exactly that row; and a client
    that keeps the rows of every earlier poll and overwrites the sent ones holds what a full
    poll sends, after drains of random demand too."""
    rng = np.random.default_rng(1)
    layers, experts, steps, half_life = 6, 32, 64, 500.0
    demand = rng.gamma(0.5, 10.0, (layers, experts))
    history = History(layers, experts, half_life)
    history.add(demand, demand, steps)
    resident = demand >= np.median(demand, axis=1, keepdims=True)
    heatmap = Heatmap()
    heatmap.update(history.demand, resident)
    shown = heatmap.since(None)["rows"]
    refill = demand * (1 - 0.5 ** (steps / half_life))  # what a drain's decay takes away

    def poll_after(counts) -> dict:
        version, before = heatmap.token, history.demand.copy()
        history.add(counts, counts, steps)
        heatmap.update(history.demand, resident)
        poll = heatmap.since(version)
        assert (history.demand != before).any()
        shown.update(poll["rows"])
        return poll

    same = poll_after(refill)
    assert same["rows"] == {} and same["version"] == heatmap.token
    one = refill.copy()  # the map's most stays (a new most rescales every row's heats)
    one[4, demand[4].argmin()] += demand.max() / 4
    assert list(poll_after(one)["rows"]) == ["4"]
    assert history.demand.max() == pytest.approx(demand.max())
    for _ in range(3):
        poll_after(rng.gamma(0.5, 1.0, (layers, experts)))
    full = heatmap.since(None)
    assert decoded(shown, experts) == decoded(full["rows"], experts)


class MapClient:
    """An engine client for the dashboard alone: fixed counters, and an expert map the test
    sets (`demand`, `resident`)."""

    info = EngineInfo("map", None, None, None, lanes=2, max_context=256)

    def __init__(self, demand: np.ndarray, resident: np.ndarray):
        self.demand, self.resident = demand, resident

    def stats(self) -> EngineStats:
        residency = {"cold_share_window": 0.0, "cold_share_total": 0.0, "swaps_applied": 0,
                     "resident": int(self.resident.sum()), "experts": self.resident.size,
                     "miss_policy": "exact"}
        return EngineStats(residency=residency, kv={"pages_in_use": 0, "kv_pages": 8,
                                                     "preemptions": 0})

    def expert_map(self) -> tuple[np.ndarray, np.ndarray]:
        return self.demand.copy(), self.resident.copy()


READ_CELLS = """JSON.stringify([...document.getElementById("heatmap").querySelectorAll(".cell")]
  .map(c => [Number(c.dataset.layer), Number(c.dataset.expert), Number(c.dataset.heat),
             c.dataset.resident === "true"]))"""


@pytest.mark.skipif(chromium_path() is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_pages_heatmap_after_partial_polls_is_a_full_polls(tmp_path):
    """The page keeps the rows of its earlier polls: after its first poll (every row), drains
    that change one row at a time and one that changes no heat byte, the cells it draws are
    what a full poll of the same map decodes to."""
    rng = np.random.default_rng(2)
    demand = rng.gamma(0.5, 10.0, (4, 16))
    client = MapClient(demand, demand >= np.median(demand, axis=1, keepdims=True))
    server = Server(EngineConfig.from_dict({}))
    server.client, server.status = client, "ready"

    def full_cells(url) -> list[list]:
        experts = state_json(url)[0]["experts"]
        assert len(experts["rows"]) == 4
        rows = decoded(experts["rows"], 16)
        return [[layer, e, rows[layer][0][e], rows[layer][1][e]]
                for layer in range(4) for e in range(16)]

    async def drive(url):
        async with Page.open(tmp_path) as page:
            await page.goto(url + "/dashboard")
            for change in range(4):
                version = state_json(url)[0]["experts"]["version"]
                await page.wait_for(
                    f"document.getElementById('heatmap').dataset.version === '{version}'")
                assert json.loads(await page.evaluate(READ_CELLS)) == full_cells(url)
                if change < 3:  # layer 1's and 2's heats, then every float (no heat byte)
                    client.demand = (client.demand * 0.999 if change == 2 else
                                     np.where(np.arange(4)[:, None] == change + 1,
                                              client.demand[:, ::-1], client.demand))
            assert version.endswith(".3") and page.errors == []
            return page.requests

    with serve_app(server) as url:
        states = [u for u in asyncio.run(drive(url)) if "/state.json" in u]
    assert "since=" not in states[0] and all("?since=" in u for u in states[1:])
