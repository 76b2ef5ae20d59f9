"""End-to-end benchmark of a running tidejax server, through the OpenAI API as a user drives it.

    python -m tidejax.server --profile NAME &           # any server speaking the OpenAI API
    python -m bench.bench [--url http://127.0.0.1:8000] [--api-key KEY] [--model NAME]
        [--tokens 1024] [--runs 3] [--lanes 1,2,4] [--ttft-tokens 8192]

A warm-up request first; then for a prose and a code prompt, at each concurrency (streams at
once), --runs runs of --tokens tokens at temperature 0.6 (with `ignore_eos`, so each stream runs
to its length on servers that honour it). Per configuration, medians over the runs of:
  stream tok/s      one stream's tokens after its first / seconds from its first to its last chunk
  aggregate tok/s   all streams' tokens / seconds from the first stream's first token to the
                    last stream's last chunk
  engine tok/s      the server's own decode rate (`x_engine_stats.decode_tps` of the last chunk)
  TTFT              seconds from sending to the first streamed text
Then the time to first token of a --ttft-tokens prompt (held-out English text, sized with the
server's own token count from a probe request). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import statistics
import sys
import time

import openai

from tools.corpus import HELDOUT_DIR

HELDOUT = HELDOUT_DIR / "en.txt"
PROMPTS = {
    "prose": "Write a long, detailed essay on the history of lighthouses: how they were built, "
             "who kept them, how their lamps and lenses changed, and what replaced them.",
    "code": "Write a complete Python module that implements a small key-value store with a "
            "write-ahead log, snapshots, and a command-line interface. Include docstrings "
            "and tests.",
}


@dataclasses.dataclass
class Stream:
    sent: float
    first: float | None = None  # first streamed text
    last: float | None = None  # last chunk
    tokens: int = 0  # completion tokens (the server's usage count)
    text: str = ""  # the streamed content
    engine_tps: float = 0.0  # x_engine_stats.decode_tps

    @property
    def tok_s(self) -> float:
        span = (self.last or 0) - (self.first or 0)
        return (self.tokens - 1) / span if self.first and span > 0 and self.tokens > 1 else 0.0

    @property
    def ttft(self) -> float:
        return (self.first or self.last or self.sent) - self.sent


def stream_chat(client, model: str, prompt: str, max_tokens: int, temperature: float,
                seed: int) -> Stream:
    s = Stream(sent=time.perf_counter())
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=temperature, seed=seed, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    for chunk in chunks:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            s.first = now if s.first is None else s.first
            s.text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            s.tokens = chunk.usage.completion_tokens
        stats = (chunk.model_extra or {}).get("x_engine_stats")
        if stats:
            s.engine_tps = float(stats.get("decode_tps", 0.0))
        s.last = now
    return s


def run_streams(client, model: str, prompt: str, lanes: int, tokens: int, temperature: float,
                seed: int) -> list[Stream]:
    with concurrent.futures.ThreadPoolExecutor(lanes) as pool:
        futures = [pool.submit(stream_chat, client, model, prompt, tokens, temperature, seed + i)
                   for i in range(lanes)]
        return [f.result() for f in futures]


def aggregate_tok_s(streams: list[Stream]) -> float:
    firsts = [s.first for s in streams if s.first]
    if not firsts:
        return 0.0
    span = max(s.last for s in streams) - min(firsts)
    return sum(max(s.tokens - 1, 0) for s in streams) / span if span > 0 else 0.0


def ttft_long(client, model: str, n_tokens: int) -> tuple[float, int] | str:
    """TTFT of a prompt of about n_tokens tokens (held-out text), and its exact token count."""
    text = HELDOUT.read_text()
    probe = client.completions.create(model=model, prompt=text[:1000], max_tokens=1)
    chars_per_token = 1000 / probe.usage.prompt_tokens
    want = int(n_tokens * chars_per_token * 0.98)
    prompt = (text * (want // len(text) + 1))[:want]
    try:
        sent = time.perf_counter()
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                           temperature=0.6, stream=True,
                                           stream_options={"include_usage": True})
        first, used = None, 0
        for chunk in chunks:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - sent
            if chunk.usage is not None:
                used = chunk.usage.prompt_tokens
                first = first if first is not None else time.perf_counter() - sent
        return first, used
    except openai.BadRequestError as e:  # e.g. the prompt does not fit the server's context
        return f"not measured: {e.message}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument("--model", default=None, help="model id (default: the server's first)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per stream")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lanes", default="1,2,4", help="concurrent streams, comma-separated")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--ttft-tokens", type=int, default=8192, help="0 = skip")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "none",
                           max_retries=0, timeout=3600)
    model = args.model or client.models.list().data[0].id
    print(f"{args.url}: model {model}", flush=True)
    stream_chat(client, model, "Hello!", 8, args.temperature, 0)  # warm-up
    header = ("| prompt | streams | tokens/stream | stream tok/s | aggregate tok/s | engine tok/s | "
              "TTFT s |")
    rows = [header, "| --- | --- | --- | --- | --- | --- | --- |"]
    print(header, flush=True)
    for kind, prompt in PROMPTS.items():
        for lanes in (int(x) for x in args.lanes.split(",")):
            runs = [run_streams(client, model, prompt, lanes, args.tokens, args.temperature,
                                seed=100 * r) for r in range(args.runs)]
            flat = [s for run in runs for s in run]
            row = (f"| {kind} | {lanes} | {statistics.median(s.tokens for s in flat):.0f} | "
                   f"{statistics.median(s.tok_s for s in flat):.1f} | "
                   f"{statistics.median(aggregate_tok_s(run) for run in runs):.1f} | "
                   f"{statistics.median(s.engine_tps for s in flat):.1f} | "
                   f"{statistics.median(s.ttft for s in flat):.2f} |")
            rows.append(row)
            print(row, flush=True)
    if args.ttft_tokens:
        result = ttft_long(client, model, args.ttft_tokens)
        rows += ["", f"TTFT, prompt of {args.ttft_tokens} tokens: {result}" if isinstance(result, str)
                 else f"TTFT, prompt of {result[1]} tokens: {result[0]:.2f} s"]
    print("\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
