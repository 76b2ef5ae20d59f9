"""python -m tidejax.server --profile NAME|PATH [--host H] [--port P] [--set table.key=value ...]
[--trace-dir DIR]

Start-up order: bind the socket (so /health answers "loading" at once), load the weights (with
progress), compile the warm-up shapes, then report ready.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from tidejax.config import EngineConfig
from tidejax.runtime.client import LocalEngineClient
from tidejax.fields import ConfigError
from tidejax.runtime.engine import Engine, resolve_profile
from tidejax.server.app import Server, api_keys, build_app

log = logging.getLogger("tidejax.server")


def parse_set(items: list[str]) -> dict:
    """["engine.lanes=8", ...] -> {"engine": {"lanes": "8"}} (the profile types the strings)."""
    tables: dict = {}
    for item in items:
        key, eq, value = item.partition("=")
        table, dot, name = key.strip().partition(".")
        if not eq or not dot or not table or not name:
            raise ConfigError(f"--set {item!r}: expected table.key=value")
        tables.setdefault(table, {})[name] = value.strip()
    return tables


def load_config(args: argparse.Namespace) -> EngineConfig:
    overrides = parse_set(args.set)
    server = overrides.setdefault("server", {})
    if args.host is not None:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if args.trace_dir is not None:
        overrides.setdefault("engine", {})["trace_dir"] = args.trace_dir
    config = EngineConfig.from_toml(resolve_profile(args.profile))
    return config.with_overrides(overrides)


def bind_host(config: EngineConfig) -> str:
    """The configured host; without one, loopback unless API keys protect the server."""
    return config.server.host or ("0.0.0.0" if api_keys(config) else "127.0.0.1")


async def serve(config: EngineConfig) -> None:
    server = Server(config)
    runner = web.AppRunner(build_app(server), handler_cancellation=True, access_log=None)
    await runner.setup()
    host, port = bind_host(config), config.server.port
    await web.TCPSite(runner, host, port).start()
    log.info("listening on http://%s:%d (loading %s from %s)", host, port, server.name,
             config.model.path)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    client = None
    try:
        # the engine traces from here on
        client = LocalEngineClient(await loop.run_in_executor(None, Engine, config))
        await client.start()
        server.attach(client)
        log.info("ready: %s, %d lanes, context %d", server.name, client.info.lanes,
                 client.info.max_context)
        await stop.wait()
    finally:
        log.info("shutting down")
        await runner.cleanup()
        if client is not None:
            client.stop()  # writes the profiler trace, when one runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidejax.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="default",
                        help="a profile name (configs/NAME.toml) or a path to a .toml")
    parser.add_argument("--host", help="address to bind (overrides server.host)")
    parser.add_argument("--port", type=int, help="port to bind (overrides server.port)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="override one profile setting; repeatable")
    parser.add_argument("--trace-dir", help="write a JAX profiler trace here (engine.trace_dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = load_config(args)
        asyncio.run(serve(config))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
