"""`python -m tidejax generate --model DIR|PROFILE --prompt TEXT` (or --messages JSON).

Prints text as it is generated, then the speed on stderr; a TidejaxError (a bad profile or
checkpoint, a sampling setting out of range) as one line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tidejax.errors import TidejaxError
from tidejax.runtime import load


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidejax")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text from a prompt or chat messages")
    gen.add_argument("--model", default="default",
                     help="checkpoint directory, profile .toml, or profile name (default: default)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="plain text prompt")
    source.add_argument("--messages", help='chat messages as JSON: [{"role": "user", "content": "..."}]')
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    args = parser.parse_args(argv)

    prompt = args.prompt
    if args.messages is not None:
        try:
            prompt = json.loads(args.messages)
        except json.JSONDecodeError as e:
            parser.error(f"--messages is not valid JSON: {e}")
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
            parser.error("--messages must be a JSON list of {role, content} objects")
    try:
        return _generate(args, prompt)
    except TidejaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace, prompt: str | list[dict]) -> int:
    engine = load(args.model)
    ids = (engine.tokenizer.encode(prompt) if isinstance(prompt, str)
           else engine.tokenizer.encode_chat(prompt))
    engine.warmup(prompt_lengths=[len(ids)])  # the printed speeds leave compilation out
    pieces = []

    def on_text(_, text):
        pieces.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()

    start = time.perf_counter()
    engine.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                    on_text=on_text)
    elapsed = time.perf_counter() - start
    stats = engine.scheduler.last_stats
    sys.stdout.write("\n")
    print(f"[{stats['prompt_tokens']} prompt tokens at {stats['prefill_tps']:.1f} tok/s, "
          f"{stats['completion_tokens']} generated at {stats['decode_tps']:.1f} tok/s, "
          f"{elapsed:.2f} s in all]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
