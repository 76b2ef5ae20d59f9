"""The DeepSeek-V3 family: DeepSeek-V2-Lite shape, V3, R1, V3.1, Kimi K2.

Multi-head latent attention (MLA) with the compressed latent as the KV cache (kv_lora_rank +
qk_rope_head_dim values per token, as DeepSeek's own inference keeps it) and the weight-absorbed
attention product; DeepSeekMoE with shared experts; dense MLPs in the first_k_dense_replace
layers.

`DeepseekV3.__call__(tokens, positions, token_mask, cache, experts)` is the one forward used for
prefill chunks, decode steps and full-sequence scoring: keys are written into the cache at their
positions first, then every query attends to the cache entries at positions <= its own.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from tidejax.config import ModelConfig
from tidejax.models.layers import (HIGHEST, Linear, RMSNorm, SwiGLU, apply_rope, rope_cos_sin,
                                   rope_frequencies)
from tidejax.models.moe import MoE, RouterSpec
from tidejax.models.loading import load_by_table
from tidejax.models.registry import Family, register
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState, all_resident_state


@flax.struct.dataclass
class MLACache:
    """Per layer: latent [b, s, c] (normalized kv latent) and rope_k [b, s, r] (rotated key)."""

    latent: tuple
    rope_k: tuple

    @staticmethod
    def create(cfg: ModelConfig, batch: int, length: int, dtype) -> "MLACache":
        return MLACache(
            latent=tuple(jnp.zeros((batch, length, cfg.kv_lora_rank), dtype)
                         for _ in range(cfg.num_layers)),
            rope_k=tuple(jnp.zeros((batch, length, cfg.qk_rope_head_dim), dtype)
                         for _ in range(cfg.num_layers)))

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype) -> int:
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * jnp.dtype(dtype).itemsize


def write_positions(cache_arr, values, positions):
    """cache_arr [b, s, ...] <- values [b, t, ...] at positions [b, t]; out-of-range writes drop."""
    rows = jnp.arange(cache_arr.shape[0])[:, None]
    return cache_arr.at[rows, positions].set(values.astype(cache_arr.dtype), mode="drop")


class MLAttention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, cos, sin, latent_cache, rope_cache):
        cfg, dt = self.cfg, self.dtype
        b, t, _ = x.shape
        h, nope, r, v, c = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
        if cfg.q_lora_rank is None:
            q = Linear(h * (nope + r), dt, name="q_proj")(x)
        else:
            q = Linear(cfg.q_lora_rank, dt, name="q_a_proj")(x)
            q = RMSNorm(cfg.rms_norm_eps, dt, name="q_a_norm")(q)
            q = Linear(h * (nope + r), dt, name="q_b_proj")(q)
        q = q.reshape(b, t, h, nope + r)
        q_nope, q_rope = q[..., :nope], apply_rope(q[..., nope:], cos, sin, cfg.rope_interleave)

        kv = Linear(c + r, dt, name="kv_a_proj")(x)  # [b, t, c + r]
        latent = RMSNorm(cfg.rms_norm_eps, dt, name="kv_a_norm")(kv[..., :c])
        rope_k = apply_rope(kv[..., c:], cos, sin, cfg.rope_interleave)
        latent_cache = write_positions(latent_cache, latent, positions)
        rope_cache = write_positions(rope_cache, rope_k, positions)

        # Absorb kv_b into the query (keys) and the output (values): attention runs on the latent.
        kv_b = self.param("kv_b_proj", nn.initializers.normal(0.02), (h * (nope + v), c), dt)
        kv_b = kv_b.reshape(h, nope + v, c).astype(x.dtype)
        w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [h, k, c], [h, v, c]
        q_latent = jnp.einsum("bthk,hkc->bthc", q_nope, w_uk, precision=HIGHEST)
        scores = (jnp.einsum("bthc,bsc->bhts", q_latent, latent_cache, precision=HIGHEST)
                  + jnp.einsum("bthr,bsr->bhts", q_rope, rope_cache, precision=HIGHEST))
        scores = scores.astype(jnp.float32) * cfg.softmax_scale
        visible = jnp.arange(latent_cache.shape[1])[None, None, :] <= positions[:, :, None]  # [b,t,s]
        scores = jnp.where(visible[:, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out_latent = jnp.einsum("bhts,bsc->bthc", probs, latent_cache, precision=HIGHEST)
        out = jnp.einsum("bthc,hvc->bthv", out_latent, w_uv, precision=HIGHEST)
        out = Linear(cfg.hidden_size, dt, name="o_proj")(out.reshape(b, t, h * v))
        return out, latent_cache, rope_cache


def router_spec(cfg: ModelConfig) -> RouterSpec:
    return RouterSpec(
        n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring=cfg.scoring_func,
        n_group=cfg.n_group, topk_group=cfg.topk_group,
        group_score="top2_sum" if cfg.topk_method == "noaux_tc" else "max",
        use_bias=cfg.topk_method == "noaux_tc", norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    layer: int
    serve: ServeOptions
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, token_mask, cos, sin, latent_cache, rope_cache, experts):
        cfg, dt = self.cfg, self.dtype
        attn, latent_cache, rope_cache = MLAttention(cfg, dt, name="attn")(
            RMSNorm(cfg.rms_norm_eps, dt, name="input_norm")(x), positions, cos, sin,
            latent_cache, rope_cache)
        x = x + attn
        h = RMSNorm(cfg.rms_norm_eps, dt, name="post_attn_norm")(x)
        if self.layer in cfg.moe_layers:
            y, experts = MoE(router_spec(cfg), cfg.moe_layers.index(self.layer),
                             cfg.moe_intermediate_size * cfg.n_shared_experts, self.serve, dt,
                             name="moe")(h, token_mask, experts)
        else:
            y = SwiGLU(cfg.intermediate_size, dt, name="mlp")(h)
        return x + y, latent_cache, rope_cache, experts


class DeepseekV3(nn.Module):
    cfg: ModelConfig
    serve: ServeOptions
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens, positions, token_mask, cache: MLACache, experts: ExpertState):
        """tokens, positions [b, t] int32; token_mask [b, t] bool (False = padding)
        -> logits [b, t, vocab] float32, cache, experts."""
        cfg, dt = self.cfg, self.dtype
        embed = self.param("embed", nn.initializers.normal(1.0), (cfg.vocab_size, cfg.hidden_size), dt)
        x = jnp.take(embed, tokens, axis=0)
        inv_freq, attention_factor = rope_frequencies(cfg.rope)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
        latents, ropes = list(cache.latent), list(cache.rope_k)
        for i in range(cfg.num_layers):
            x, latents[i], ropes[i], experts = DecoderLayer(cfg, i, self.serve, dt, name=f"layers_{i}")(
                x, positions, token_mask, cos, sin, latents[i], ropes[i], experts)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="norm")(x)
        if cfg.tie_word_embeddings:
            head = embed
        else:
            head = self.param("lm_head", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size), dt)
        logits = jnp.einsum("btd,vd->btv", x.astype(jnp.float32), head.astype(jnp.float32),
                            precision=HIGHEST)
        return logits, MLACache(tuple(latents), tuple(ropes)), experts


def checkpoint_table(cfg: ModelConfig) -> dict[str, tuple]:
    """Hugging Face tensor name -> our param path, for everything but the routed experts."""
    table = {"model.embed_tokens.weight": ("embed",), "model.norm.weight": ("norm", "weight")}
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = ("lm_head",)
    attn = {"q_a_proj": "q_a_proj", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b_proj"}
    if cfg.q_lora_rank is None:
        attn = {"q_proj": "q_proj"}
    attn |= {"kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm", "o_proj": "o_proj"}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}", f"layers_{i}"
        table[f"{src}.input_layernorm.weight"] = (dst, "input_norm", "weight")
        table[f"{src}.post_attention_layernorm.weight"] = (dst, "post_attn_norm", "weight")
        for hf, ours in attn.items():
            table[f"{src}.self_attn.{hf}.weight"] = (dst, "attn", ours, "weight")
        table[f"{src}.self_attn.kv_b_proj.weight"] = (dst, "attn", "kv_b_proj")
        if i in cfg.moe_layers:
            table[f"{src}.mlp.gate.weight"] = (dst, "moe", "gate_weight")
            if cfg.topk_method == "noaux_tc":
                table[f"{src}.mlp.gate.e_score_correction_bias"] = (dst, "moe", "gate_bias")
            if cfg.n_shared_experts:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    table[f"{src}.mlp.shared_experts.{proj}.weight"] = (dst, "moe", "shared", proj, "weight")
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                table[f"{src}.mlp.{proj}.weight"] = (dst, "mlp", proj, "weight")
    return table


def expert_prefixes(cfg: ModelConfig) -> list[str]:
    """The checkpoint prefix of each MoE layer's routed experts, in rowmap order."""
    return [f"model.layers.{i}.mlp" for i in cfg.moe_layers]


def ignored_tensors(cfg: ModelConfig) -> tuple[str, ...]:
    """Checkpoint tensors this family does not use: the multi-token-prediction layers after the
    last decoder layer, and the rotary caches some exports include."""
    mtp = tuple(rf"^model\.layers\.{cfg.num_layers + j}\." for j in range(cfg.num_mtp_layers))
    return mtp + (r"rotary_emb\.inv_freq$",)


def expert_dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    return len(cfg.moe_layers), cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size


def build(cfg: ModelConfig, serve: ServeOptions, dtype) -> DeepseekV3:
    return DeepseekV3(cfg, serve, dtype)


def param_shapes(cfg: ModelConfig, serve: ServeOptions, dtype) -> dict:
    """The params pytree as ShapeDtypeStructs (nothing is allocated)."""
    n_moe, n_experts, hidden, inter = expert_dims(cfg)

    def init():
        pool = {"gate_up": jnp.zeros((n_moe * n_experts, 2 * inter, hidden), dtype),
                "down": jnp.zeros((n_moe * n_experts, hidden, inter), dtype)}
        experts = all_resident_state(pool, max(n_moe, 1))
        tokens = jnp.zeros((1, 1), jnp.int32)
        cache = MLACache.create(cfg, 1, 1, dtype)
        serve_all = dataclasses.replace(serve, all_resident=True)  # the bank does not shape params
        return build(cfg, serve_all, dtype).init(jax.random.key(0), tokens, tokens, tokens > -1,
                                             cache, experts)["params"]
    return jax.eval_shape(init)


def replay_variables(cfg: ModelConfig, ids) -> dict:
    """Recorded picks ids [b, t, L_moe, k] as the MoE layers' "replay" variables."""
    return {f"layers_{layer}": {"moe": {"ids": ids[:, :, m]}} for m, layer in enumerate(cfg.moe_layers)}


def load_weights(cfg: ModelConfig, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(
        model_dir, raw_config, param_shapes=param_shapes(cfg, serve, dtype),
        table=checkpoint_table(cfg), ignored=ignored_tensors(cfg),
        expert_prefixes=expert_prefixes(cfg), expert_dims=expert_dims(cfg), dtype=dtype,
        put_row=put_row)
    return params, None


register(Family(
    name="deepseek_v3",
    model_types=("deepseek_v3", "deepseek_v2", "kimi_k2"),
    config_from_hf=ModelConfig.from_hf,
    build=build,
    load_weights=load_weights,
    expert_dims=expert_dims,
    top_k=lambda cfg: cfg.num_experts_per_tok,
    create_cache=MLACache.create,
    cache_bytes_per_token=MLACache.bytes_per_token,
    replay_variables=replay_variables,
))
