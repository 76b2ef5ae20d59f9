"""Driving an engine from a test: requests through its scheduler to idle (a prompt cached and
not, the prompt cache tiers' counts of each process), the cost of its compiled decode step, and
its GQA attention forced onto the paged kernel."""

from __future__ import annotations

import time

import numpy as np

from tidejax import ops
from tidejax.kv.pages import PageTable
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import DoneEvent, GenerationRequest, TokenEvent
from tidejax.runtime.steps import DecodeRows


def run(engine, requests: list[GenerationRequest], on_token=None) -> list[list]:
    """Submits the requests at once, runs to idle; the events of each request."""
    events = [[] for _ in requests]
    handles = []
    for i, request in enumerate(requests):
        def on_event(event, i=i):
            events[i].append(event)
            if on_token and isinstance(event, TokenEvent):
                on_token(i, handles[i], sum(isinstance(e, TokenEvent) for e in events[i]))
        handles.append(engine.scheduler.submit(request, on_event))
    engine.scheduler.run_until_idle()
    return events


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def serve(engine, prompt: list[int], n: int, sampling=SamplingParams()) -> tuple[list, dict]:
    """One request to its end (eos ignored): its tokens and its DoneEvent's stats."""
    events = run(engine, [GenerationRequest(prompt, n, sampling, ignore_eos=True)])[0]
    done = events[-1]
    assert isinstance(done, DoneEvent), done
    return tokens_of(events), done.stats


def prefilled(engine, fn):
    """fn()'s result and the prompt tokens the steps prefilled meanwhile."""
    before = engine.scheduler.totals["prefilled_tokens"]
    out = fn()
    return out, engine.scheduler.totals["prefilled_tokens"] - before


def tiered_turn(engine, prompt: list[int], n: int = 6) -> dict:
    """`prompt` served cached, then with the prompt cache off: whether their n greedy tokens are
    the same, the tokens cached and prefilled, and the tokens matched per tier meanwhile."""
    tiers = lambda: engine.scheduler.cache_stats()["tiers"]  # noqa: E731
    before = tiers()
    (tokens, stats), count = prefilled(engine, lambda: serve(engine, prompt, n))
    engine.scheduler.caching = False
    try:
        uncached, off = serve(engine, prompt, n)
    finally:
        engine.scheduler.caching = True
    assert off["cached_tokens"] == 0
    return {"same": tokens == uncached and len(tokens) == n,
            "cached": stats["cached_tokens"], "prefilled": count,
            **{tier: tiers()[tier]["matched_tokens"] - before[tier]["matched_tokens"]
               for tier in ("device", "host", "disk")}}


def tier_counts(engine, tier: str, field: str, least: int, process: int = 1) -> dict:
    """{process index: `field` of its `tier`} (Scheduler.cache_stats' per process), once
    `process`'s count is at least `least` (a peer reports after running the plan: waited for, up
    to a minute)."""
    def counts():
        return {index: tiers[tier][field]
                for index, tiers in engine.scheduler.cache_stats()["processes"].items()}
    deadline = time.monotonic() + 60
    while counts().get(process, -1) < least and time.monotonic() < deadline:
        time.sleep(0.1)
    return counts()


def decode_cost(engine, position: int) -> tuple[float, float]:
    """(flops, bytes accessed) of the compiled decode step, one lane at `position`."""
    pages = PageTable(engine.loaded.kv_pages, engine.loaded.page_size)
    held = pages.grow(0, position + 1)
    lanes = engine.lanes
    decode = DecodeRows(np.zeros(lanes, np.int32), np.ones(lanes, bool),
                        np.full(lanes, position, np.int32), np.arange(lanes) == 0,
                        [held] + [[]] * (lanes - 1))
    inputs = engine.loaded.step_inputs(decode, None, None, engine.residency.idle_batch())
    cost = engine.runner.lower(inputs).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["flops"], cost["bytes accessed"]


def force_gqa_kernel(monkeypatch) -> list:
    """ops.paged_gqa_prefill and paged_gqa_decode forced to "pallas" (Triton's interpreter off
    the GPU; the other ops as served) -> the list each call appends (op, the impl it was given)
    to, so a test sees that the forward went through them."""
    calls = []

    def forced(op):
        kernel = getattr(ops, op)

        def call(*args, **kwargs):
            calls.append((op, kwargs.pop("impl")))
            return kernel(*args, **kwargs, impl="pallas")
        return call

    for op in ("paged_gqa_prefill", "paged_gqa_decode"):
        monkeypatch.setattr(ops, op, forced(op))
    return calls
