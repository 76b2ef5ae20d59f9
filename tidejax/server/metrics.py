"""Counters for GET /metrics, written in the Prometheus text format (no client library needed)."""

from __future__ import annotations

import collections
import os

from tidejax.runtime.api import EngineStats


def resident_bytes() -> int | None:
    """This process's resident set size now (Linux: /proc/self/statm); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# the prompt cache's host and disk tiers of each process (Tiers.stats)
_TIER_FIELDS = (("pages", "gauge", "prompt cache pages a tier holds"),
                ("bytes", "gauge", "bytes of the prompt cache pages a tier holds"),
                ("hits", "counter", "prompt cache pages restores wrote back from a tier"),
                ("evictions", "counter", "prompt cache pages a tier pushed out"))


class Metrics:
    def __init__(self):
        self.responses = collections.Counter()  # (route, status) -> count
        self.finished = collections.Counter()  # finish reason -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.last = {"prefill_tps": 0.0, "decode_tps": 0.0, "cold_share": 0.0}
        # admission (server/admission.py): 429s by the bound that refused them
        self.rejected = collections.Counter({"queue_full": 0, "key_limit": 0})
        self.timeouts = 0  # engine requests cancelled at server.request_timeout_s
        self.body_timeouts = 0  # bodies not received within server.body_timeout_s

    def record_response(self, route: str, status: int) -> None:
        self.responses[(route, status)] += 1

    def record_generation(self, prompt_tokens: int, generated: int, finish_reason: str,
                          stats: dict) -> None:
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated
        self.finished[finish_reason] += 1
        for key in self.last:
            if stats.get(key):
                self.last[key] = float(stats[key])

    def render(self, stats: EngineStats, held: int) -> str:
        """The metrics; `held`: the engine requests the server holds now (Admission.held)."""
        out = []

        def metric(name, kind, help_text, samples):
            out.append(f"# HELP tidejax_{name} {help_text}")
            out.append(f"# TYPE tidejax_{name} {kind}")
            for labels, value in samples:
                label = ",".join(f'{k}="{v}"' for k, v in labels.items())
                out.append(f"tidejax_{name}{{{label}}} {value}" if label
                           else f"tidejax_{name} {value}")

        metric("http_responses_total", "counter", "HTTP responses by route and status",
               [({"route": r, "status": s}, n) for (r, s), n in sorted(self.responses.items())])
        metric("generations_total", "counter", "finished generations by finish reason",
               [({"reason": r}, n) for r, n in sorted(self.finished.items())])
        metric("prompt_tokens_total", "counter", "prompt tokens prefilled",
               [({}, self.prompt_tokens)])
        metric("generated_tokens_total", "counter", "tokens generated",
               [({}, self.generated_tokens)])
        metric("prefill_tokens_per_second", "gauge", "prefill speed of the last request",
               [({}, self.last["prefill_tps"])])
        metric("decode_tokens_per_second", "gauge", "decode speed of the last request",
               [({}, self.last["decode_tps"])])
        metric("cold_share", "gauge", "wanted expert picks served by a miss (last request)",
               [({}, self.last["cold_share"])])
        if stats.cache:
            metric("prompt_cache_matched_tokens_total", "counter",
                   "prompt tokens found in the prompt cache (not prefilled), by tier",
                   [({"tier": tier}, counts["matched_tokens"])
                    for tier, counts in stats.cache["tiers"].items()])
            metric("prompt_cache_evictions_total", "counter",
                   "cached KV pages evicted from a tier (device: to host memory where that "
                   "tier is on; host: to disk where that is; disk: deleted; process 0's "
                   "count: every process evicts its shards of the same pages), by tier",
                   [({"tier": tier}, counts["evictions"])
                    for tier, counts in stats.cache["tiers"].items()])
        for field, kind, help_text in _TIER_FIELDS if stats.cache.get("processes") else ():
            metric(f"prompt_cache_tier_{field}" + ("_total" if kind == "counter" else ""), kind,
                   f"{help_text}, by process and tier",
                   [({"process": process, "tier": tier}, counts[field])
                    for process, tiers in stats.cache["processes"].items()
                    for tier, counts in tiers.items()])
        if stats.speculative:
            metric("speculative_drafted_tokens_total", "counter",
                   "drafted tokens the verify steps judged", [({}, stats.speculative[
                       "drafted_tokens"])])
            metric("speculative_accepted_tokens_total", "counter",
                   "drafted tokens the verify steps kept", [({}, stats.speculative[
                       "accepted_tokens"])])
        metric("lanes_active", "gauge", "requests decoding now", [({}, stats.active)])
        metric("queue_waiting", "gauge", "requests waiting for a lane", [({}, stats.queued)])
        metric("requests_held", "gauge", "engine requests the server holds (in lanes, waiting, "
               "being parsed)", [({}, held)])
        metric("requests_rejected_total", "counter", "requests refused with 429 by the bound "
               "that refused them", [({"reason": r}, n) for r, n in sorted(self.rejected.items())])
        metric("request_timeouts_total", "counter", "engine requests cancelled at "
               "server.request_timeout_s", [({}, self.timeouts)])
        metric("body_timeouts_total", "counter", "request bodies not received within "
               "server.body_timeout_s", [({}, self.body_timeouts)])
        rss = resident_bytes()
        if rss is not None:
            metric("process_resident_memory_bytes", "gauge", "the server's resident memory",
                   [({}, rss)])
        for prefix, table in (("residency", stats.residency), ("kv", stats.kv)):
            for key, value in sorted(table.items()):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metric(f"{prefix}_{key}", "gauge", f"{prefix} statistic '{key}'",
                           [({}, value)])
        return "\n".join(out) + "\n"
