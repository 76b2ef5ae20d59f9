"""Speculative decoding on a profile's model (issue 33): acceptance and decode tok/s with
speculation off and with the model's MTP layer drafting k tokens, on held-out text.

    python -m bench.speculation [--profile default] [--tokens 128] [--prompts 2] [--ks 1,2]

Prompts: --prompts a domain of data/heldout, 64 tokens of held-out text at evenly spaced
offsets. Each is decoded --tokens tokens alone (eos ignored), greedy and sampled at the server's
default sampling (temperature 1; seed i for prompt i), by the profile's engine with
`[speculative] method = "none"`, then `"mtp"` with tokens = k for each of --ks (one engine at a
time, each warmed by one request of each mode first). Prints a markdown table: per
configuration and mode, the engine's decode tok/s (its own `decode_tps`, median over the
prompts), the acceptance (accepted / drafted tokens, all prompts) and the tokens a decode step
yields, and for greedy whether every output equals speculation off's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

import tidejax
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import DoneEvent, GenerationRequest, TokenEvent
from tools.corpus import HELDOUT_DIR

PROMPT_TOKENS = 64
MODES = {"greedy": lambda seed: SamplingParams(),
         "sampled": lambda seed: SamplingParams(temperature=1.0, seed=seed)}


def prompts(engine, per_domain: int) -> list[list[int]]:
    """per_domain prompts of PROMPT_TOKENS held-out tokens from each domain's file."""
    out = []
    for path in sorted(HELDOUT_DIR.glob("*.txt")):
        ids = engine.tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        step = (len(ids) - PROMPT_TOKENS) // per_domain
        out += [ids[i * step:i * step + PROMPT_TOKENS] for i in range(per_domain)]
    return out


def decode(engine, prompt: list[int], tokens: int, sampling: SamplingParams) -> tuple[list, dict]:
    """One request alone to its end: its tokens and its stats."""
    events = []
    engine.scheduler.submit(GenerationRequest(prompt, tokens, sampling, ignore_eos=True),
                            events.append)
    engine.scheduler.run_until_idle()
    if not isinstance(events[-1], DoneEvent) or events[-1].finish_reason != "length":
        raise RuntimeError(f"a request ended with {events[-1]}")
    return [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1].stats


def measure(profile: str, speculative: dict, texts_of, tokens: int, per_domain: int) -> dict:
    """{mode: (median decode tok/s, accepted, drafted, steps, outputs)} of one configuration."""
    engine = tidejax.load(profile, speculative=speculative)
    try:
        batch = texts_of(engine, per_domain)
        out = {}
        for mode, sampling in MODES.items():
            decode(engine, batch[0], tokens, sampling(0))  # compiles this mode's steps
            steps = engine.scheduler.totals["steps"]
            rates, accepted, drafted, outputs = [], 0, 0, []
            for i, prompt in enumerate(batch):
                got, stats = decode(engine, prompt, tokens, sampling(i))
                rates.append(stats["decode_tps"])
                accepted += stats.get("accepted_tokens", 0)
                drafted += stats.get("drafted_tokens", 0)
                outputs.append(got)
            out[mode] = (statistics.median(rates), accepted, drafted,
                         engine.scheduler.totals["steps"] - steps, outputs)
        return out
    finally:
        engine.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="default")
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded a request")
    ap.add_argument("--prompts", type=int, default=2, help="prompts a held-out domain")
    ap.add_argument("--ks", default="1,2", help="drafted tokens a step to measure, comma-separated")
    args = ap.parse_args(argv)
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    configs = [("off", {"method": "none"})] + [
        (f"mtp k={k}", {"method": "mtp", "tokens": k}) for k in map(int, args.ks.split(","))]
    results = {name: measure(args.profile, spec, prompts, args.tokens, args.prompts)
               for name, spec in configs}
    n = len(results["off"]["greedy"][4])
    print(f"{start}, jax {jax.__version__} on {jax.devices()[0].device_kind}, profile "
          f"{args.profile}: {n} prompts of {PROMPT_TOKENS} held-out tokens, {args.tokens} "
          f"tokens each, one lane\n")
    print("| speculation | mode | decode tok/s (median) | vs off | acceptance | tokens a decode "
          "step | greedy output = off |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, modes in results.items():
        for mode, (rate, accepted, drafted, steps, outputs) in modes.items():
            base = results["off"][mode][0]
            share = f"{accepted / drafted:.3f} ({accepted}/{drafted})" if drafted else "-"
            same = "-" if mode != "greedy" else str(outputs == results["off"]["greedy"][4])
            # each request's steps: one prefill step, the rest decode (or verify) steps
            per_step = n * (args.tokens - 1) / (steps - n)
            print(f"| {name} | {mode} | {rate:.1f} | {rate / base:.2f}x | {share} | "
                  f"{per_step:.2f} | {same} |")


if __name__ == "__main__":
    main()
