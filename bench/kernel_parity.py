"""The engine on the Pallas kernel against the engine on the jnp reference, same GPU, same model.

Greedy continuations of held-out prompts from each domain, compared token for token. Where they
part, both engines score the common prefix and the table gives, under each engine, the logit of
the reference engine's token minus that of the kernel engine's (and the logits' spread): two
float32 computations that differ in rounding (~1e-5 relative for the kernel's bf16 dots, ~1e-7
for its GEMV) can only part at a near tie, and the margins say how near. Decode speed of both paths is reported too. Run on a GPU:

    python3 -m bench.kernel_parity [--model models/demo] [--experts bf16|mxfp4]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

import tidejax
from tidejax.runtime.scheduler import ErrorEvent, GenerationRequest, TokenEvent
from tools.corpus import HELDOUT_DIR as HELDOUT



def prompts(n_chars: int = 300) -> dict[str, str]:
    return {p.stem: p.read_text()[:n_chars] for p in sorted(HELDOUT.glob("*.txt"))}


def run(model: str, kernel: str, experts: str, texts: dict[str, str], new_tokens: int):
    """(engine, {domain: (prompt ids, greedy ids)}, median decode tok/s)."""
    engine = tidejax.load(model, model={"dtype": "bfloat16", "experts": experts},
                          engine={"kernel": kernel, "lanes": 1})
    engine.warmup()
    out, speeds = {}, []
    for domain, text in texts.items():
        prompt, tokens = engine.tokenizer.encode(text), []

        def on_event(event, tokens=tokens):
            if isinstance(event, ErrorEvent):
                raise RuntimeError(f"engine error: {event.message}")
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)

        engine.scheduler.submit(GenerationRequest(prompt, new_tokens, ignore_eos=True), on_event)
        engine.scheduler.run_until_idle()
        speeds.append(engine.scheduler.last_stats["decode_tps"])
        out[domain] = (prompt, tokens)
    return engine, out, sorted(speeds)[len(speeds) // 2]


def margin(engine, context: list[int], mine: int, other: int) -> tuple[float, float]:
    """engine's next-token logit of `mine` minus that of `other` after `context`, and the logits'
    spread (max - min) for scale."""
    logits = engine.logits(context)[-1]
    return float(logits[mine] - logits[other]), float(np.ptp(logits))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--experts", default="bf16", choices=("bf16", "mxfp4", "checkpoint"))
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    texts = prompts()
    ref_engine, ref, ref_speed = run(args.model, "reference", args.experts, texts, args.new_tokens)
    ker_engine, ker, ker_speed = run(args.model, "pallas", args.experts, texts, args.new_tokens)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, model {args.model}, "
          f"experts {args.experts}, {args.new_tokens} greedy tokens a prompt")
    print("| domain | identical | first difference (token) | reference's margin there: reference engine "
          "| kernel engine | logit spread |")
    print("| --- | --- | --- | --- | --- | --- |")
    for domain in texts:
        prompt, a = ref[domain]
        b = ker[domain][1]
        if a == b:
            print(f"| {domain} | yes | | | | |")
            continue
        j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        context = prompt + a[:j]
        m_ref, spread = margin(ref_engine, context, a[j], b[j])
        m_ker, _ = margin(ker_engine, context, a[j], b[j])
        print(f"| {domain} | no | {j} | {m_ref:.2e} | {m_ker:.2e} | {spread:.1f} |")
    print(f"decode tok/s (1 lane, median over prompts): reference {ref_speed:.1f}, "
          f"pallas {ker_speed:.1f}")


if __name__ == "__main__":
    main()
