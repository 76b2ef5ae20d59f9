"""Routing traces: the bundled demo model's expert picks on held-out text, per domain, and their
scaling to a larger (synthetic) model for `Engine.set_routing_replay`.

    python -m bench.traces record [--model models/demo] [--tokens 4096] [--out data/traces]

`record` runs the demo model's own forward (tidejax's DeepSeek-V3 with its trained params) over
windows of each data/heldout/<domain>.txt and keeps, per token and MoE layer, the top-k
expert ids its router picks (tidejax.models.layers.moe.route on the MoE layer's input, taken with a
flax method interceptor). Saved as <out>/<domain>.npy: uint8 [tokens, L_moe, k] in the demo's
expert ids, the router's order (best first).

`scale(trace, n_layers, n_experts, top_k)` maps a trace to another model: layer l replays demo
layer l mod L_demo; demo expert e of E_demo becomes one expert of its block
[e*E/E_demo, (e+1)*E/E_demo), chosen by a fixed hash of (token, layer, pick), so each demo
expert's demand spreads evenly over its block and skew and domain shifts keep their shape.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from tools.corpus import HELDOUT_DIR as HELDOUT, REPO

TRACES = REPO / "data" / "traces"


def domains(folder: Path = TRACES) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.npy"))


def load(domain: str, folder: Path = TRACES) -> np.ndarray:
    path = folder / f"{domain}.npy"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no routing trace (python -m bench.traces record)")
    return np.load(path)


# -- recording -----------------------------------------------------------------------------------

def record_picks(engine, token_ids: list[int], window: int = 256, batch: int = 8) -> np.ndarray:
    """The router's picks [len(token_ids) // window * window, L_moe, k] over consecutive windows
    of `token_ids`, each window a fresh sequence (positions from 0)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from tidejax.models.layers.moe import MoE, route

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, MoE) and context.method_name == "__call__":
            x = args[0]  # [b, t, d], the MoE layer's input
            bias = module.get_variable("params", "gate_bias") if module.router.use_bias else None
            ids, _, _ = route(x.reshape(-1, x.shape[-1]), module.get_variable("params", "gate_weight"),
                              bias, module.router)
            module.sow("intermediates", "picks", ids.reshape(*x.shape[:2], -1))
        return next_fun(*args, **kwargs)

    n_moe = engine.family.expert_dims(engine.cfg)[0]
    moe_layers = [i for i in range(engine.cfg.num_layers) if i in engine.cfg.moe_layers]

    @jax.jit
    def picks(params, tokens, experts):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cache = engine.family.create_cache(engine.cfg, b, t, engine.loaded.dtype)
        with nn.intercept_methods(interceptor):
            _, found = engine.loaded.module.apply({"params": params}, tokens, positions,
                                                  tokens >= 0, cache, experts,
                                                  mutable=["intermediates"])
        layers = found["intermediates"]
        return jnp.stack([layers[f"layers_{i}"]["moe"]["picks"][0] for i in moe_layers], axis=2)

    n = len(token_ids) // window
    if n == 0:
        raise ValueError(f"{len(token_ids)} tokens: fewer than one window of {window}")
    windows = np.asarray(token_ids[:n * window], np.int32).reshape(n, window)
    out = []
    for start in range(0, n, batch):
        chunk = windows[start:start + batch]
        pad = np.zeros((batch - len(chunk), window), np.int32)  # one compiled shape
        got = np.asarray(picks(engine.loaded.params, np.concatenate([chunk, pad]),
                               engine.state.experts))
        out.append(got[:len(chunk)].reshape(-1, n_moe, got.shape[-1]))
    return np.concatenate(out)


def record(model: str, out: Path, tokens: int, window: int) -> None:
    import tidejax

    engine = tidejax.load(model)
    n_experts = engine.family.expert_dims(engine.cfg)[1]
    if n_experts > 256:
        raise SystemExit(f"error: {model} has {n_experts} experts; traces are stored as uint8")
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(HELDOUT.glob("*.txt")):
        start = time.perf_counter()
        ids = engine.tokenizer.encode(path.read_text())[:tokens]
        trace = record_picks(engine, ids, window).astype(np.uint8)
        np.save(out / f"{path.stem}.npy", trace)
        top = np.bincount(trace[:, 0].reshape(-1), minlength=n_experts)
        print(f"{path.stem}: {trace.shape} picks in {time.perf_counter() - start:.1f} s; layer 0's "
              f"busiest 8 experts take {np.sort(top)[::-1][:8].sum() / top.sum():.0%} of its picks")


# -- scaling -------------------------------------------------------------------------------------

def _hash(*keys: np.ndarray) -> np.ndarray:
    """A fixed integer hash (splitmix64 finaliser) of broadcast integer arrays."""
    h = np.zeros(np.broadcast_shapes(*(k.shape for k in keys)), np.uint64)
    with np.errstate(over="ignore"):
        for k in keys:
            h = (h ^ k.astype(np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
            h ^= h >> np.uint64(31)
            h = h * np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(29)
    return h


def scale(trace: np.ndarray, n_layers: int, n_experts: int, top_k: int,
          n_demo_experts: int | None = None) -> np.ndarray:
    """trace [N, L_demo, k_demo] (demo expert ids) -> [N, n_layers, top_k] int32 ids below
    n_experts, distinct within each (token, layer). Pick j replays demo pick j mod k_demo (a
    further expert of the same block when top_k > k_demo)."""
    trace = np.asarray(trace).astype(np.int64)
    n, l_demo, k_demo = trace.shape
    e_demo = n_demo_experts or int(trace.max()) + 1
    picks = trace[:, np.arange(n_layers) % l_demo][:, :, np.arange(top_k) % k_demo]  # [N, L, k]
    lo = picks * n_experts // e_demo
    size = np.maximum((picks + 1) * n_experts // e_demo - lo, 1)
    pos = np.arange(n)[:, None, None]
    layer = np.arange(n_layers)[None, :, None]
    source = (np.arange(top_k) % k_demo)[None, None, :]
    repeat = (np.arange(top_k) // k_demo)[None, None, :]
    ids = lo + (_hash(pos, layer, source) % size.astype(np.uint64)).astype(np.int64)
    ids = lo + (ids - lo + repeat) % size
    return _distinct(ids % n_experts, n_experts).astype(np.int32)


def _distinct(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """Moves a pick that repeats an earlier pick of its (token, layer) to the next free expert
    (only happens when a model has fewer experts than the demo)."""
    ids = ids.copy()
    for j in range(1, ids.shape[-1]):
        for _ in range(n_experts):
            clash = (ids[..., j:j + 1] == ids[..., :j]).any(-1)
            if not clash.any():
                break
            ids[..., j] = np.where(clash, (ids[..., j] + 1) % n_experts, ids[..., j])
    return ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record the demo model's picks on held-out text")
    rec.add_argument("--model", default=str(REPO / "models" / "demo"))
    rec.add_argument("--tokens", type=int, default=4096, help="tokens per domain")
    rec.add_argument("--window", type=int, default=256, help="tokens per sequence")
    rec.add_argument("--out", type=Path, default=TRACES)
    args = parser.parse_args(argv)
    record(args.model, args.out, args.tokens, args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
