"""A soak of a tidejax server: N streaming clients (the openai client) for T minutes.

    python -m bench.soak --profile default --clients 4 --minutes 10 [--greedy 0.3 --drop 0.1]
        [--set table.key=value ...]
    python -m bench.soak --url http://127.0.0.1:8000 [--api-key KEY] --clients 4 --minutes 10

A request is greedy (--greedy of them: a prompt of the mix at temperature 0 for --greedy-tokens,
its text compared with the same request served alone before the clients start), dropped (--drop
of them: the client closes the stream after its first text), or sampled (the rest: temperature
0.7, a seeded length). A greedy text that differs from the one served alone is an error.
With `--set engine.kv_pool_tokens=N` below what the clients hold, the server preempts: the report
gives its preemptions (/metrics) and the memory after the run against the first sample (taken once
the references are served, the server warm).

Without --url it starts `python -m tidejax.server --profile P` on a free loopback port (its log
goes to --log) and stops it with SIGTERM at the end. Each client streams chat completions back to
back until the time is up: a prompt, a length (up to --max-tokens, `ignore_eos`) and a
temperature drawn from a seeded mix. Reports requests, errors by kind, latency percentiles (time
to the first text, and to the last chunk), generated tokens a second (all clients together, over
the run) and the server's resident memory (`tidejax_process_resident_memory_bytes` from /metrics
every --rss-every seconds): at the start, the end, its peak, and its least-squares slope in MiB a
minute over the whole run and over its second half (past the warm-up). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import openai


from bench.bench import PROMPTS, stream_chat

REPO = Path(__file__).resolve().parent.parent
MIX = [*PROMPTS.values(), "Hello!", "What makes the tide turn?",
       "List five uses of a lighthouse, one a line.", "def fibonacci(n):"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(profile: str, sets: list[str], log: Path, timeout: float):
    """The server process and its base URL, once /health says ready."""
    port = free_port()
    args = [sys.executable, "-m", "tidejax.server", "--profile", profile, "--host", "127.0.0.1",
            "--port", str(port)] + [a for s in sets for a in ("--set", s)]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}; its log: {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if json.load(r)["status"] == "ready":
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    sys.exit(f"the server was not ready in {timeout:.0f} s; its log: {log}")


def metric(url: str, api_key: str | None, name: str) -> float | None:
    """One unlabelled sample of the server's /metrics, or None."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers),
                                timeout=30) as r:
        found = re.search(rf"^tidejax_{name} (\S+)$", r.read().decode(), re.M)
    return float(found.group(1)) if found else None


def resident_mib(url: str, api_key: str | None) -> float | None:
    found = metric(url, api_key, "process_resident_memory_bytes")
    return None if found is None else found / 2**20


def served_alone(oai, model: str, tokens: int) -> dict[str, str]:
    """Each prompt of the mix at temperature 0, one request at a time: the greedy references."""
    return {prompt: stream_chat(oai, model, prompt, tokens, 0.0, 0).text for prompt in MIX}


def dropped(oai, model: str, prompt: str, tokens: int, seed: int) -> None:
    """A streamed request the client closes after its first text."""
    chunks = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
        temperature=0.7, seed=seed, stream=True, extra_body={"ignore_eos": True})
    with chunks:
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                return


class GreedyDiffers(Exception):
    """A greedy text under load that is not the one the same request got alone."""


class Soak:
    """The clients' results and the memory samples, shared by the threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.streams = []  # bench.bench.Stream of each request that ended well
        self.errors = collections.Counter()  # kind -> count
        self.first_error: dict[str, str] = {}
        self.rss: list[tuple[float, float]] = []  # (seconds since the start, MiB)
        self.greedy = self.drops = 0  # greedy texts compared with the references; streams dropped

    def client(self, oai, model: str, seed: int, until: float, args,
               references: dict[str, str]) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            prompt, kind = rng.choice(MIX), rng.random()
            greedy = kind < args.greedy
            tokens = args.greedy_tokens if greedy else rng.randint(8, args.max_tokens)
            try:
                if args.greedy <= kind < args.greedy + args.drop:
                    dropped(oai, model, prompt, tokens, rng.randrange(2**31))
                    with self.lock:
                        self.drops += 1
                    continue
                stream = stream_chat(oai, model, prompt, tokens, 0.0 if greedy else 0.7,
                                     rng.randrange(2**31))
                if stream.tokens != tokens:
                    raise RuntimeError(f"{stream.tokens} of {tokens} tokens")
                if greedy:
                    with self.lock:
                        self.greedy += 1
                    if stream.text != references[prompt]:
                        raise GreedyDiffers(f"{prompt!r}: {stream.text[:60]!r} alone "
                                            f"{references[prompt][:60]!r}")
            except Exception as e:  # every failure is a figure of the soak
                kind = type(e).__name__ + (f" {e.status_code}" if hasattr(e, "status_code") else "")
                with self.lock:
                    self.errors[kind] += 1
                    self.first_error.setdefault(kind, str(e)[:200])
                continue
            with self.lock:
                self.streams.append(stream)

    def sample(self, url: str, api_key: str | None, start: float, until: float,
               every: float) -> None:
        while True:
            mib = resident_mib(url, api_key)
            if mib is not None:
                self.rss.append((time.monotonic() - start, mib))
            if time.monotonic() >= until:
                return
            time.sleep(min(every, max(until - time.monotonic(), 0.0)))


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares MiB a minute; 0 with fewer than two points."""
    if len(points) < 2:
        return 0.0
    t, y = np.asarray(points).T
    return float(np.polyfit(t / 60, y, 1)[0])


def percentiles(values: list[float]) -> str:
    if not values:
        return "- | - | - | -"
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return f"{p50:.2f} | {p90:.2f} | {p99:.2f} | {max(values):.2f}"


def report(soak: Soak, seconds: float, clients: int, preemptions: float | None = None) -> str:
    streams = soak.streams
    tokens = sum(s.tokens for s in streams)
    errors = sum(soak.errors.values())
    rss = soak.rss
    rows = [
        f"{clients} clients for {seconds / 60:.1f} min: {len(streams) + errors + soak.drops} "
        f"requests, {errors} errors, {tokens} tokens generated, {tokens / seconds:.1f} tokens/s",
        f"greedy texts compared with the same request alone: {soak.greedy} "
        f"({soak.errors['GreedyDiffers']} differ); streams dropped by the client: {soak.drops}; "
        f"preemptions: {'-' if preemptions is None else f'{preemptions:.0f}'}",
        "",
        "| latency s | p50 | p90 | p99 | max |", "| --- | --- | --- | --- | --- |",
        f"| TTFT | {percentiles([s.ttft for s in streams])} |",
        f"| total | {percentiles([s.last - s.sent for s in streams])} |",
    ]
    if rss:
        half = [p for p in rss if p[0] >= rss[-1][0] / 2]
        peak = max(m for _, m in rss)
        rows += ["", "| server RSS MiB: start | end | peak | slope MiB/min | slope, 2nd half |",
                 "| --- | --- | --- | --- | --- |",
                 f"| {rss[0][1]:.1f} | {rss[-1][1]:.1f} | {peak:.1f} | {slope(rss):+.2f} | "
                 f"{slope(half):+.2f} |",
                 f"({len(rss)} samples; end / start {rss[-1][1] / rss[0][1]:.2f}, peak / start "
                 f"{peak / rss[0][1]:.2f})"]
    for kind, n in soak.errors.most_common():
        rows.append(f"error {kind} x{n}: {soak.first_error[kind]}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--profile", default="default", help="the profile of the server started")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="passed to the server started; repeatable")
    parser.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "tidejax_soak.log"),
                        help="the started server's log")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=96, help="the longest request")
    parser.add_argument("--greedy", type=float, default=0.3,
                        help="share of greedy requests, each compared with the same one alone")
    parser.add_argument("--greedy-tokens", type=int, default=32, help="a greedy request's length")
    parser.add_argument("--drop", type=float, default=0.1,
                        help="share of streams the client closes after their first text")
    parser.add_argument("--rss-every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.clients < 1 or args.minutes <= 0 or args.max_tokens < 8:
        parser.error("--clients >= 1, --minutes > 0 and --max-tokens >= 8")
    if not (0 <= args.greedy and 0 <= args.drop and args.greedy + args.drop <= 1
            and args.greedy_tokens >= 1):
        parser.error("--greedy and --drop in 0..1, their sum at most 1; --greedy-tokens >= 1")
    proc, url = None, args.url
    if url is None:
        proc, url = start_server(args.profile, args.set, Path(args.log), args.ready_timeout)
    url = url.rstrip("/")
    oai = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0,
                        timeout=600)
    model = oai.models.list().data[0].id
    print(f"{url}: model {model}, {args.clients} clients for {args.minutes} min", flush=True)
    references = served_alone(oai, model, args.greedy_tokens) if args.greedy else {}
    soak = Soak()
    start = time.monotonic()
    until = start + args.minutes * 60
    threads = [threading.Thread(target=soak.client, args=(oai, model, args.seed + i, until, args,
                                                          references))
               for i in range(args.clients)]
    threads.append(threading.Thread(target=soak.sample,
                                    args=(url, args.api_key, start, until, args.rss_every)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(report(soak, time.monotonic() - start, args.clients,
                 metric(url, args.api_key, "kv_preemptions")), flush=True)
    if proc is not None:
        proc.terminate()
        print(f"server stopped (SIGTERM): exit code {proc.wait(120)}; its log: {args.log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
