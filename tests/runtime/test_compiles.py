"""Nothing compiles after warm-up: requests of every prompt length class up to max_context
(crossing chunk and page boundaries, 1 token, max_context - 1), prompt chunks beside decoding
lanes, preemption and resume through a small KV pool, prompts prefilled past a cached prefix
(matched on the device, restored from host memory and from disk; after a warm-up for given
prompt lengths too), on a tiny DeepSeek-V3 (written by transformers) and a synthetic
DeepSeek-V4.1 (tools/make_synthetic.py: two layers, Engram and a compressed KV source with its
indexer), compiles counted by jax's own events. Two layers each: the compiles are the test's
time."""

from __future__ import annotations

import contextlib
import threading

import jax
import numpy as np
import pytest

import tidejax
from tidejax.kv.pages import pages_for
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import DoneEvent, GenerationRequest, TokenEvent
from tidejax.runtime.steps import DecodeRows, PrefillChunk
from tests.support.engine_probes import serve as serve_one
from tests.support.tiny_models import DEEPSEEK_V3_CONFIGS, write_deepseek_v3

COMPILE = "/jax/core/compile/backend_compile_duration"  # one event an XLA compilation


@contextlib.contextmanager
def counting_compiles():
    """The names of the functions XLA compiles inside the block."""
    names = []

    def listen(event, duration, **fields):
        if event == COMPILE:
            names.append(fields.get("fun_name"))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def prompt_lengths(engine) -> list[int]:
    """1, max_context - 1, and each side of every page, chunk and chunk bucket boundary below
    max_context."""
    loaded = engine.loaded
    top = loaded.max_context - 1
    edges = {k * step for step in (loaded.page_size, loaded.prefill_chunk)
             for k in range(1, top // step + 1)}
    edges |= {loaded.bucket(n) for n in range(1, loaded.prefill_chunk + 1)}
    return sorted({1, top} | {n + d for n in edges for d in (-1, 0, 1) if 0 < n + d <= top})


def serve(engine, monkeypatch, lengths: list[int]) -> dict:
    """Every prompt length at once (each decoding past a page boundary where the context lets
    it; every other one sampled with logprobs), all to the end; returns what the steps carried
    and the requests got."""
    mixed = []
    step_inputs = engine.loaded.step_inputs

    def spy(decode, prefill, *rest):  # a step carrying a chunk beside a decoding lane
        mixed.append(prefill is not None and decode is not None and bool(decode.active.any()))
        return step_inputs(decode, prefill, *rest)
    monkeypatch.setattr(engine.loaded, "step_inputs", spy)
    done, tokens = {}, {}
    for i, n in enumerate(lengths):
        def on_event(event, i=i):
            if isinstance(event, TokenEvent):
                tokens[i] = tokens.get(i, 0) + 1
            else:
                done[i] = event
        prompt = [3 + (7 * n + 5 * j) % 200 for j in range(n)]  # one prompt a length
        sampling = SamplingParams(temperature=0.8, top_p=0.9, logprobs=2, seed=i) if i % 2 else (
            SamplingParams())  # sampled with logprobs beside greedy: data, not shapes
        engine.scheduler.submit(GenerationRequest(prompt, 2 * engine.loaded.page_size, sampling,
                                                  ignore_eos=True), on_event)
    engine.scheduler.run_until_idle()
    return {"mixed": sum(mixed), "done": done, "tokens": tokens,
            "preemptions": engine.scheduler.kv_stats()["preemptions"],
            "matched": engine.scheduler.cache_stats()["matched_tokens"]}


def check_nothing_compiles_after_warmup(engine, monkeypatch):
    with counting_compiles() as warmup:
        engine.warmup()
    shapes = len(engine.loaded.warmup_shapes())
    assert warmup.count("jit(apart)") == shapes  # the counter sees every step compiled
    # a third of the prompts longer than a page come twice in a row: the second may match the
    # first's pages (prompt caching) and prefill from a page boundary
    page = engine.loaded.page_size
    lengths = [m for i, n in enumerate(prompt_lengths(engine))
               for m in ([n, n] if n > page and i % 3 == 0 else [n])]
    with counting_compiles() as serving:
        got = serve(engine, monkeypatch, lengths)
    assert serving == []
    assert got["mixed"] > 0 and got["preemptions"] > 0, got
    assert (got["matched"] > 0) == engine.loaded.prefix_caching, got
    assert sorted(got["done"]) == list(range(len(lengths)))
    assert all(isinstance(e, DoneEvent) and e.finish_reason == "length"
               for e in got["done"].values())
    assert all(got["tokens"].get(i, 0) >= 1 for i in range(len(lengths))), got["tokens"]


def test_deepseek_v3(tmp_path, monkeypatch):
    """Pages of 32, chunks of 16, a pool of 3 pages (a sequence at max_context holds 2):
    full-width prefill tables (MLA's prefill reads by length), decode tables a power of two of
    pages (the MLA decode reference gathers the whole table). One chunk bucket: the buckets'
    enumeration is test_warmup_shapes_are_those_of_every_prompt's. The shapes compile on two
    threads first (engine.compile_workers): the warm-up's runs compile nothing more."""
    write_deepseek_v3(tmp_path, seed=3, **dict(DEEPSEEK_V3_CONFIGS["qlora_groups"],
                                                num_hidden_layers=2))
    engine = tidejax.load(tmp_path, engine={"lanes": 2, "max_context": 64, "page_size": 32,
                                            "prefill_chunk": 16, "kv_pool_tokens": 96,
                                            "compile_workers": 2})
    assert engine.loaded.compile_workers(len(engine.loaded.warmup_shapes())) == 2
    assert (engine.loaded.full_prefill, engine.loaded.full_decode) == (True, False)
    threads = []

    def listen(event, duration, **fields):
        if event == COMPILE and fields.get("fun_name") == "jit(apart)":
            threads.append(threading.current_thread().name)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        check_nothing_compiles_after_warmup(engine, monkeypatch)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert threads and all(name.startswith("ThreadPoolExecutor") for name in threads), threads


def test_deepseek_v41(v41, monkeypatch):
    """Pages of 16, chunks of 16, a pool of 3 pages (a sequence at max_context holds 2): every
    table a power of two of pages (the indexers' reference scores the whole table)."""
    engine = tidejax.load(v41, engine={"lanes": 2, "max_context": 32, "page_size": 16,
                                       "prefill_chunk": 16, "kv_pool_tokens": 48})
    assert (engine.loaded.full_prefill, engine.loaded.full_decode) == (False, False)
    check_nothing_compiles_after_warmup(engine, monkeypatch)


@pytest.mark.parametrize("kernel", ["auto", "pallas"])
def test_warmup_shapes_are_those_of_every_prompt(v41, kernel):
    """V4.1 at max_context 200, pages of 16, chunks of 48 (buckets 16, 32, 48): warmup_shapes is
    the set of (chunk bucket, prefill width, decode width) the step inputs of every chunk of every
    prompt length take beside every decode width (the inputs' shapes, nothing compiled), a
    prompt's chunks past a cached prefix of any whole pages among them (those of one prompt
    length are warmup_shapes([n])'s chunks). Off the GPU every table is a power of two of
    pages; with the Pallas decode kernels (the GPU's choice) the decode tables are max_context
    wide, one decode width."""
    engine = tidejax.load(v41, engine={"lanes": 2, "max_context": 200, "page_size": 16,
                                       "prefill_chunk": 48, "kernel": kernel})
    loaded, idle = engine.loaded, engine.residency.idle_batch()
    of_length = {}  # prompt length -> its chunks' (bucket, width), past any cached prefix
    for n in range(1, loaded.max_context):
        pages = list(range(pages_for(n + 1, loaded.page_size)))
        for begin in range(0, n, loaded.page_size):
            for start, ids in loaded.chunks(list(range(n)), begin):
                chunk = loaded.step_inputs(None, PrefillChunk(0, ids, start, pages,
                                                              list(range(start))),
                                           None, idle).prefill
                of_length.setdefault(n, set()).add((chunk.tokens.shape[1], chunk.table.shape[1]))
    chunks = set().union(*of_length.values())
    for n in (5, 40, 100, 199):  # and those of one prompt length, the warm-up for it
        assert {shape[:2] for shape in loaded.warmup_shapes([n]) if shape[0]} == of_length[n]
    lanes = np.arange(loaded.lanes)
    decode = {loaded.step_inputs(DecodeRows(lanes, lanes >= 0, lanes, lanes == 0,
                                            [list(range(k))] * loaded.lanes), None, None,
                                 idle).decode.table.shape[1]
              for k in range(1, loaded.max_pages + 1)}
    assert decode == ({1, 2, 4, 8, 13} if kernel == "auto" else {13})
    assert {width for _, width in chunks} == {1, 2, 4, 8, 13}
    assert loaded.warmup_shapes() == ({(*c, d) for c in chunks for d in decode}
                                      | {(0, None, d) for d in decode})


def test_warmup_for_prompt_lengths_covers_a_prompt_served_alone(v41):
    """Engine.warmup with prompt lengths (python -m tidejax, the benches) compiles every step a
    prompt of those lengths meets when it is served alone: its chunks beside no decoding lane
    (the narrowest decode table: V4.1's tables are a power of two of pages off the GPU), then
    its decode steps. Nothing compiles while it is served."""
    engine = tidejax.load(v41, engine={"lanes": 1, "max_context": 64, "page_size": 16,
                                       "prefill_chunk": 16})
    n = 40  # chunks of 8, 16 and 16 tokens, tables of 1, 2 and 4 pages
    engine.warmup([n])
    with counting_compiles() as serving:
        engine.scheduler.submit(GenerationRequest(list(range(3, 3 + n)), 2, SamplingParams(),
                                                  ignore_eos=True), lambda event: None)
        engine.scheduler.run_until_idle()
    assert serving == []


def second_turns(engine) -> list[tuple]:
    """Conversations on a pool of 4 pages of 16 tokens: turns 1 of 37 tokens, turns 2 of 48
    (turn 1, its 8 tokens, 3 new) that match turn 1's first 2 pages and prefill the 16 past
    them. A's turn 2 matches on the device; B's is restored from host memory (C's turn 1 and
    two more evicted B's pages); C's from disk (the host tier's budget 0, so one more turn 1
    pushes every page spilled there). Per turn 2 (and first, the turns 1 together): the
    functions XLA compiled, the tokens cached and those matched per tier."""
    def matched():
        return {tier: counts["matched_tokens"]
                for tier, counts in engine.scheduler.cache_stats()["tiers"].items()}

    def turn_1(seed: int) -> list[int]:
        prompt = [3 + (11 * seed + 7 * j) % 200 for j in range(37)]
        return prompt + serve_one(engine, prompt, 8)[0] + [7, 8, 9]

    def turn_2(name: str, second: list[int]) -> tuple:
        before = matched()
        with counting_compiles() as names:
            cached = serve_one(engine, second, 4)[1]["cached_tokens"]
        return name, names, cached, {tier: n - before[tier] for tier, n in matched().items()}

    with counting_compiles() as names:
        a = turn_1(0)
    out = [("turns 1", names, 0, {})]
    out.append(turn_2("device", a))
    with counting_compiles() as names:
        b, c = turn_1(1), turn_1(2)
        for seed in (3, 4):
            turn_1(seed)
    out[0][1].extend(names)
    out.append(turn_2("host", b))
    engine.scheduler.tiers.host.budget = 0
    with counting_compiles() as names:
        turn_1(5)
    out[0][1].extend(names)
    engine.scheduler.tiers.disk.flush()  # its files are written on a thread of their own
    out.append(turn_2("disk", c))
    return out


@pytest.mark.parametrize("lengths", [None, [37, 48]], ids=["full", "lengths"])
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v41"])
def test_a_cached_second_turn_compiles_nothing_after_warmup(family, lengths, v41,
                                                            tiny_checkpoint, tmp_path):
    """A turn 2 that the prompt cache matches up to a page boundary, on the device, restored
    from host memory and from disk (second_turns), compiles nothing after the full warm-up
    or one for the lengths of the turns served (37 and 48 tokens): that one's chunks include
    those from each page boundary inside a prompt (chunks of 48, buckets 16, 32 and 48: a
    48-token prompt is one chunk of 48 from token 0, a chunk of 16 past 2 cached pages; for
    DeepSeek-V4.1 the chunk past its cut takes the bucket of its end, as served), and the page
    writes and V4.1's lane snapshot writes of a restore are the sequence copies' sizes."""
    model = v41 if family == "deepseek_v41" else tiny_checkpoint(
        "deepseek_v3", "qlora_groups", seed=3, num_hidden_layers=2)
    engine = tidejax.load(model, engine={"lanes": 1, "max_context": 64, "page_size": 16,
                                         "prefill_chunk": 48, "kv_pool_tokens": 64},
                          cache={"disk_dir": str(tmp_path)})
    engine.warmup(lengths)
    got = second_turns(engine)
    assert [(name, cached, tiers[name] > 0) for name, _, cached, tiers in got[1:]] == [
        ("device", 32, True), ("host", 32, True), ("disk", 32, True)], got
    assert [(name, names) for name, names, *_ in got] == [
        ("turns 1", []), ("device", []), ("host", []), ("disk", [])]
