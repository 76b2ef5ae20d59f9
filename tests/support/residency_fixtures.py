"""A toy stack of MoE layers for the residency tests: random routers and random experts, served
through tidejax.residency.serve_routed and the real grouped kernel (reference on CPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.checkpoint import mxfp4
from tidejax.residency.serve import serve_routed
from tidejax.residency.swap import apply_batch, finish_batch

L, E, D, I, K = 3, 8, 32, 32, 2  # MoE layers, experts, hidden, intermediate, top-k


def make_pool(fmt: str = "dense", seed: int = 0) -> dict:
    """Host arrays [L*E, ...] in a bank format."""
    r = np.random.default_rng(seed)
    gate_up = (r.standard_normal((L * E, 2 * I, D)) * 0.3).astype(np.float32)
    down = (r.standard_normal((L * E, D, I)) * 0.3).astype(np.float32)
    if fmt == "dense":
        return {"gate_up": gate_up, "down": down}
    gb, gs = mxfp4.quantize(gate_up)
    db, ds = mxfp4.quantize(down)
    return {"gate_up_blocks": np.asarray(gb), "gate_up_scales": np.asarray(gs),
            "down_blocks": np.asarray(db), "down_scales": np.asarray(ds)}


def make_router(seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((L, E, D)) * 0.5).astype(np.float32)


def _layers(state, x, token_mask, router, bias, options):
    for layer in range(L):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)  # as an RMSNorm
        logits = jnp.einsum("td,ed->te", h, router[layer], precision="highest") + bias  # [T, E]
        top, ids = jax.lax.top_k(logits, K)
        weights = jax.nn.softmax(top, axis=-1)
        y, state = serve_routed(layer, x, ids.astype(jnp.int32), weights, logits, token_mask,
                                state, options)
        x = x + y
    return x, state


@functools.partial(jax.jit, static_argnames="options", donate_argnums=0)
def toy_step(state, x, token_mask, router, bias, options):
    """x [T, D] through L residual MoE layers; router [L, E, D]; bias [E] added to every router's
    logits (a 'domain' that favours some experts). Returns (x, state)."""
    return _layers(state, x, token_mask, router, bias, options)


@functools.partial(jax.jit, static_argnames="options", donate_argnums=0)
def toy_batch_step(state, batch, x, token_mask, router, bias, options):
    """toy_step as the engine's steps run: residency's swap batch applied at the start, the
    step's Tallies returned. Returns (x, state, tallies)."""
    x, state = _layers(apply_batch(state, batch), x, token_mask, router, bias, options)
    return (x, *finish_batch(state, batch))


def tokens(seed: int, t: int = 4) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((t, D)), jnp.float32)
