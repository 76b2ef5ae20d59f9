"""python -m tidejax.server --profile NAME|PATH [--host H] [--port P] [--set table.key=value ...]
[--trace-dir DIR]

Start-up order: bind the socket (so /health answers "loading" at once), load the weights (with
progress), compile the warm-up shapes, then report ready.

Several processes ([distributed] num_processes > 1, one per box): process 0 binds the socket,
waits for its peers (tidejax.distributed.start: the boot guard, jax.distributed) and serves;
every other process binds nothing, joins, loads the same model and replays process 0's steps
(tidejax.distributed.peer.follow) until process 0 stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from tidejax import distributed
from tidejax.errors import CheckpointError
from tidejax.config import API_KEYS_ENV, EngineConfig, parse_set
from tidejax.distributed.peer import follow
from tidejax.errors import ConfigError
from tidejax.runtime.client import LocalEngineClient
from tidejax.runtime.engine import Engine, resolve_profile
from tidejax.server.app import Server, api_keys, build_app

log = logging.getLogger("tidejax.server")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load_config(args: argparse.Namespace) -> EngineConfig:
    """The profile, the [distributed] environment (TIDEJAX_*), then each --set, --host, --port
    and --trace-dir on top; an error names the argument that gave the value (or the profile
    file, or the variable)."""
    config = EngineConfig.from_toml(resolve_profile(args.profile)).with_environment()
    for item in args.set:
        config = config.with_overrides(parse_set(item), source=f"--set {item}")
    for flag, table, key, value in (("--host", "server", "host", args.host),
                                    ("--port", "server", "port", args.port),
                                    ("--trace-dir", "engine", "trace_dir", args.trace_dir)):
        if value is not None:
            config = config.with_overrides({table: {key: value}}, source=f"{flag} {value}")
    return config


def bind_host(config: EngineConfig) -> str:
    """The configured host, else loopback (API keys never widen it)."""
    return config.server.host or "127.0.0.1"


def keys_line(config: EngineConfig) -> str:
    n = len(api_keys(config))
    env = config.server.api_keys_env
    if n:
        return f"API keys on ({n} from server.api_keys and ${env or '(no variable)'})"
    return (f"API keys off: every route is open (set ${env} or server.api_keys)" if env
            else "API keys off: every route is open (server.api_keys_env is empty)")


async def serve(config: EngineConfig) -> None:
    server = Server(config)
    runner = web.AppRunner(build_app(server), handler_cancellation=True, access_log=None)
    await runner.setup()
    host, port = bind_host(config), config.server.port
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:  # a host that does not resolve or is not this machine's, a port in use
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port} (server.host or --host, server.port or "
                      f"--port): {e.strerror or e}") from None
    log.info("listening on http://%s:%d, %s; loading %s from %s", host, port, keys_line(config),
             server.name, config.model.path)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    client = None
    try:
        # its peers, if any; first: jax.distributed takes SIGTERM for its preemption notifier
        channel = await loop.run_in_executor(None, distributed.start, config)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # the engine traces from here on
        client = LocalEngineClient(await loop.run_in_executor(None, Engine, config, channel))
        await client.start()
        server.attach(client)
        context = client.info.max_context
        clamped = (f" (engine.max_context {config.engine.max_context} is above the model's "
                   f"limit)" if context < config.engine.max_context else "")
        log.info("ready on http://%s:%d: %s, %d lanes, context %d%s", host, port, server.name,
                 client.info.lanes, context, clamped)
        await stop.wait()
    finally:
        log.info("shutting down")
        await runner.cleanup()
        if client is not None:
            client.stop()  # writes the profiler trace, when one runs


def _profiles() -> str:
    """configs/*.toml by name, each with the first line of its header comment."""
    lines = []
    for path in sorted(CONFIGS.glob("*.toml")):
        head = next((ln.lstrip("# ").strip() for ln in path.read_text().splitlines()
                     if ln.startswith("#")), "")
        lines.append(f"  {path.stem:<12} {head}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tidejax.server", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"profiles ({CONFIGS}):\n{_profiles()}\n\nAPI keys: server.api_keys in the profile "
               f"and the comma-separated keys in ${API_KEYS_ENV} (the variable "
               "server.api_keys_env names); without any, every route is open. The server binds "
               "127.0.0.1 unless --host (or server.host) says otherwise.")
    parser.add_argument("--profile", default="default",
                        help="a profile name (configs/NAME.toml) or a path to a .toml")
    parser.add_argument("--host", help="address to bind (overrides server.host)")
    parser.add_argument("--port", type=int, help="port to bind (overrides server.port)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="override one profile setting (a TOML value, else a string); "
                             "repeatable")
    parser.add_argument("--trace-dir", help="write a JAX profiler trace here (engine.trace_dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = load_config(args)
        distributed.check(config)
        if config.distributed.process_id > 0:
            follow(config, distributed.start(config))
        else:
            asyncio.run(serve(config))
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
