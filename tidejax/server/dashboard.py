"""The residency dashboard (issue 36): GET /dashboard is one HTML page (dashboard.html: inline CSS
and JS, nothing fetched from the network) that polls GET /dashboard/state.json every second and
draws the demand heatmap, the series it keeps and the counters. The state holds what /metrics
renders, read from the same places (the engine client's stats, the server's Metrics), plus the
engine's expert map (decayed demand and the resident set) for the heatmap. `[server] dashboard =
false` leaves both routes out.

Keys are the API's: a header (Server.check_key), or, for a browser, `GET /dashboard?key=KEY`
once, which sets a cookie good for the /dashboard routes alone and redirects to the bare URL.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from aiohttp import web

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


def dashboard_state(server) -> dict:
    """What the page draws, as JSON: where /metrics reads it."""
    client = server.client
    stats = client.stats() if client is not None else EngineStats(status=server.status)
    metrics = server.metrics
    return {"model": server.name, "status": stats.status, "time": time.time(),
            "lanes": {"active": stats.active, "queued": stats.queued,
                      "lanes": client.info.lanes if client is not None else 0},
            "tokens": {"prompt": metrics.prompt_tokens, "generated": metrics.generated_tokens},
            "speed": dict(metrics.last), "residency": stats.residency,
            "misses_by_policy": misses_by_policy(stats.residency), "kv": stats.kv,
            "cache": stats.cache,
            "experts": (client.expert_map() if client is not None
                        else {"demand": [], "resident": []})}


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
    async def state(request: web.Request) -> web.Response:
        return web.json_response(dashboard_state(server), headers={"Cache-Control": "no-store"})

    app.router.add_get(PATH, page)
    app.router.add_get(PATH + "/state.json", state)
