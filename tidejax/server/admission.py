"""Admission: how many engine requests the server holds at once (a request's `n` choices are n),
in all and per API key.

The server holds at most `lanes + server.max_queued` (beyond the lanes they wait in the engine's
queue) and, where `server.max_requests_per_key` is set, that many for one API key. A request
takes one place on arrival, before its body is read, so an overload is refused without parsing
anything, and its other choices' places once parsed; past either bound it gets a 429 with a
Retry-After: the seconds until a lane is likely to free (a served request's recent time held,
over the lanes busy with the requests in the way), at least 1. Until an engine is attached
(lanes 0) only the per-key bound holds: a request then gets its 503 from the route.
"""

from __future__ import annotations

import asyncio
import collections
import math

from tidejax.config import ServerSection
from tidejax.server.errors import APIError
from tidejax.server.metrics import Metrics

SMOOTHING = 0.2  # weight of the latest served request in the moving average of the time held


class Admission:
    def __init__(self, server: ServerSection, metrics: Metrics):
        self.max_queued, self.per_key = server.max_queued, server.max_requests_per_key
        self.metrics = metrics
        self.lanes = 0  # the engine's, once attached
        self.held = 0  # engine requests held: in a lane, waiting, or being parsed
        self.by_key: collections.Counter = collections.Counter()  # key index -> requests held
        self.held_s = 1.0  # how long a served request was held lately (a moving average)

    def ticket(self, key: int | None) -> Ticket:
        """One place for a request just arrived with API key number `key` (None: keys off), or
        a 429."""
        return Ticket(self, key)

    def _take(self, key: int | None, n: int) -> None:
        if self.lanes and self.held + n > self.lanes + self.max_queued:  # 0: still loading
            self._refuse("queue_full", self.held,
                         f"the server is full: it holds {self.held} requests for "
                         f"{self.lanes} lanes and server.max_queued = {self.max_queued}")
        if self.per_key and key is not None and self.by_key[key] + n > self.per_key:
            self._refuse("key_limit", self.by_key[key],
                         f"this API key holds {self.by_key[key]} requests, "
                         f"server.max_requests_per_key = {self.per_key}")
        self.held += n
        if key is not None:
            self.by_key[key] += n

    def _give_back(self, key: int | None, n: int, served_s: float | None) -> None:
        self.held -= n
        if key is not None:
            self.by_key[key] -= n
            if not self.by_key[key]:
                del self.by_key[key]
        if served_s is not None:
            self.held_s += SMOOTHING * (served_s - self.held_s)

    def _refuse(self, reason: str, ahead: int, message: str) -> None:
        """A 429: `ahead` requests are in the way."""
        self.metrics.rejected[reason] += 1
        busy = max(min(ahead, self.lanes), 1)
        retry = max(1, math.ceil(self.held_s / busy))
        raise APIError(429, f"{message}; retry in {retry} s", code="rate_limit_exceeded",
                       headers={"Retry-After": str(retry)})


class Ticket:
    """A request's places, from its arrival to its response (`with` gives them back)."""

    def __init__(self, admission: Admission, key: int | None):
        self.admission, self.key = admission, key
        admission._take(key, 1)
        self.places = 1
        self.loop = asyncio.get_running_loop()
        self.arrived = self.loop.time()  # the event loop's clock: deadlines are set on it

    def need(self, n: int) -> None:
        """Holds `n` places (the request's choices, once parsed), or a 429."""
        self.admission._take(self.key, n - self.places)
        self.places = n

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        served = self.loop.time() - self.arrived if kind is None else None
        self.admission._give_back(self.key, self.places, served)
