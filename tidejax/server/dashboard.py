"""The residency dashboard (issue 36): GET /dashboard is one HTML page (dashboard.html: inline CSS
and JS, nothing fetched from the network) that polls GET /dashboard/state.json every second and
draws the demand heatmap, the series it keeps and the counters. The state holds what /metrics
renders, read from the same places (the engine client's stats, the server's Metrics), plus the
engine's expert map (decayed demand and the resident set) as the heatmap's rows (Heatmap: each
cell's heat in a byte, its residency in a bit; a poll that says which version it has,
`?since=VERSION`, gets only the rows changed after it). `[server] dashboard = false` leaves both
routes out.

Keys are the API's: a header (Server.check_key), or, for a browser, `GET /dashboard?key=KEY`
once, which sets a cookie good for the /dashboard routes alone and redirects to the bare URL.
"""

from __future__ import annotations

import base64
import functools
import re
import secrets
import time
from pathlib import Path

import numpy as np
from aiohttp import web

from tidejax.errors import RequestError
from tidejax.runtime.api import EngineStats

COOKIE = "tidejax_dashboard_key"
PATH = "/dashboard"


def is_dashboard(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


@functools.cache
def page_html() -> str:
    return Path(__file__).with_name("dashboard.html").read_text()


def misses_by_policy(residency: dict) -> dict:
    """The misses so far by how they were served, from the residency stats: `exact` (copied in:
    every miss under "exact"), `cpu` (computed on the host: cpu_picks), `substitute` (the misses
    a resident expert served: under "substitute", "ring" and "auto"), `ring` (wanted picks served
    from ring slots, the copies of earlier misses)."""
    policy, misses = residency.get("miss_policy", "exact"), residency.get("misses", 0)
    cpu = residency.get("cpu_picks", 0)
    return {"exact": misses if policy == "exact" else 0, "cpu": cpu,
            "substitute": misses - cpu if policy in ("substitute", "ring", "auto") else 0,
            "ring": residency.get("ring_hits", 0)}


class Heatmap:
    """The demand heatmap as the page draws it, a row (MoE layer) at a time: each cell's heat,
    sqrt(demand / the map's most), in LEVELS steps (a byte: the colours drawn from it have ~200
    steps a channel), then whether each cell is resident (a bit, np.packbits' order), as one
    base64 string. Each row keeps the version it last changed at, so a poll that gives the
    version it has gets only the rows changed since; a version of another Heatmap (the server
    restarted: another epoch) or none gets every row. Decay scales every cell alike and changes
    no heat, and the history changes only at drains: at rest and between drains no row is
    sent; a drain sends the rows whose bytes moved (a decode's sampled demand moves every row,
    a steady one none once the history has converged). A V3-size map (58 x 256): ~360 KB a poll
    as JSON numbers, ~24 KB as every row here, ~100 B unchanged (docs/DESIGN.md, "Routing
    traces and the dashboard")."""

    LEVELS = 255

    def __init__(self):
        self.epoch = secrets.token_hex(4)
        self.version = 0
        self.rows: list[str] = []
        self.changed: list[int] = []  # per row: the version it last changed at
        self.experts = 0
        self.most = 0.0  # the map's highest demand (the page's scale)

    @property
    def token(self) -> str:
        return f"{self.epoch}.{self.version}"

    def update(self, demand: np.ndarray, resident: np.ndarray) -> None:
        """The map now: demand [L_moe, E] (decayed routing weight), resident [L_moe, E] bool."""
        self.most = float(demand.max()) if demand.size else 0.0
        heat = np.rint(np.sqrt(np.maximum(demand, 0) / max(self.most, 1e-300)) * self.LEVELS)
        cells = np.concatenate([heat.astype(np.uint8), np.packbits(resident, axis=1)], axis=1)
        rows = [base64.b64encode(row.tobytes()).decode() for row in cells]
        if demand.shape != (len(self.rows), self.experts):
            self.rows, self.changed = [""] * len(rows), [0] * len(rows)
            self.experts = demand.shape[1]
        fresh = [layer for layer, row in enumerate(rows) if row != self.rows[layer]]
        if fresh:
            self.version += 1
        for layer in fresh:
            self.rows[layer], self.changed[layer] = rows[layer], self.version

    def since(self, token: str | None) -> dict:
        """The rows changed after version `token` (every row where it is None or another
        epoch's), as {layer: row}, with the version they bring the page to."""
        start = 0
        if token is not None:
            found = re.fullmatch(r"([0-9a-f]+)\.(\d+)", token)
            if not found:
                raise RequestError(f"'since' should be a version the state gave, got {token!r}",
                                   "since")
            epoch, version = found.group(1), int(found.group(2))
            start = version if epoch == self.epoch and version <= self.version else 0
        return {"version": self.token, "layers": len(self.rows), "experts": self.experts,
                "levels": self.LEVELS, "most": self.most,
                "rows": {str(layer): row for layer, (row, at) in
                         enumerate(zip(self.rows, self.changed)) if at > start}}


def dashboard_state(server, heatmap: Heatmap, since: str | None) -> dict:
    """What the page draws, as JSON: where /metrics reads it; the heatmap's rows changed after
    version `since` (Heatmap.since)."""
    client = server.client
    stats = client.stats() if client is not None else EngineStats(status=server.status)
    if client is not None:
        heatmap.update(*client.expert_map())
    metrics = server.metrics
    return {"model": server.name, "status": stats.status, "time": time.time(),
            "lanes": {"active": stats.active, "queued": stats.queued,
                      "lanes": client.info.lanes if client is not None else 0},
            "tokens": {"prompt": metrics.prompt_tokens, "generated": metrics.generated_tokens},
            "speed": dict(metrics.last), "residency": stats.residency,
            "misses_by_policy": misses_by_policy(stats.residency), "kv": stats.kv,
            "cache": stats.cache, "experts": heatmap.since(since)}


async def page(request: web.Request) -> web.Response:
    """The page; a key given as ?key= (checked by the middleware) becomes the cookie."""
    if "key" in request.query:
        response = web.Response(status=303, headers={"Location": PATH})
        response.set_cookie(COOKIE, request.query["key"], path=PATH, httponly=True,
                            samesite="Strict")
        return response
    return web.Response(text=page_html(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})


def add_routes(app: web.Application, server) -> None:
    heatmap = Heatmap()

    async def state(request: web.Request) -> web.Response:
        return web.json_response(dashboard_state(server, heatmap, request.query.get("since")),
                                 headers={"Cache-Control": "no-store"})

    app.router.add_get(PATH, page)
    app.router.add_get(PATH + "/state.json", state)
