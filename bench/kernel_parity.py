"""The engine on the Pallas kernel against the engine on the jnp reference, same GPU, same model.

Greedy continuations of held-out prompts from each domain must be identical token for token
(the kernel's bf16 dots may flip a near tie; any mismatch is printed with its position), and the
decode speed of both paths is reported. Run on a GPU:

    PYTHONPATH=. python3 bench/kernel_parity.py [--model models/demo] [--experts bf16|mxfp4]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax

import tidejax

HELDOUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "heldout"


def prompts(n_chars: int = 300) -> dict[str, str]:
    return {p.stem: p.read_text()[:n_chars] for p in sorted(HELDOUT.glob("*.txt"))}


def run(model: str, kernel: str, experts: str, texts: dict[str, str], new_tokens: int):
    engine = tidejax.load(model, model={"dtype": "bfloat16", "experts": experts},
                          engine={"kernel": kernel, "lanes": 1})
    engine.warmup()
    out, speeds = {}, []
    for domain, text in texts.items():
        tokens = []
        start = time.perf_counter()
        engine.generate(text, max_new_tokens=new_tokens, on_text=lambda i, t: tokens.append(t))
        speeds.append(engine.scheduler.last_stats["decode_tps"])
        out[domain] = "".join(tokens)
    return out, sorted(speeds)[len(speeds) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--experts", default="bf16", choices=("bf16", "mxfp4", "checkpoint"))
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    texts = prompts()
    ref, ref_speed = run(args.model, "reference", args.experts, texts, args.new_tokens)
    ker, ker_speed = run(args.model, "pallas", args.experts, texts, args.new_tokens)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, model {args.model}, "
          f"experts {args.experts}, {args.new_tokens} greedy tokens a prompt")
    print("| domain | identical | first difference (chars) |")
    print("| --- | --- | --- |")
    for domain in texts:
        a, b = ref[domain], ker[domain]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same = a == b
        print(f"| {domain} | {'yes' if same else 'no'} | {'' if same else first} |")
    print(f"decode tok/s (1 lane, median over prompts): reference {ref_speed:.1f}, "
          f"pallas {ker_speed:.1f}")


if __name__ == "__main__":
    main()
