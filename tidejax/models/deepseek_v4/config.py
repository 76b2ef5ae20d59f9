"""DeepSeek-V4 config, read from a transformers config.json (`deepseek_v4`)."""

from __future__ import annotations

import dataclasses
import math

from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.models.layers.rope import RopeConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclasses.dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[int, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    source: str = ""

    def rate(self, layer: int) -> int:
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer]]

    @property
    def page_multiple(self) -> int:
        """A KV page must hold whole entries of every compressed layer: page_size is a multiple
        of this (the least common multiple of their rates; 128 for the published HCA layers)."""
        return math.lcm(1, *(self.rate(i) for i in range(self.num_layers) if self.rate(i)))

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "V4Config":
        f = Fields(raw, source)
        if raw.get("model_type") != "deepseek_v4":
            raise ConfigError(f"{source}: field 'model_type' = {raw.get('model_type')!r}, "
                              "expected 'deepseek_v4'")
        n = f.req("num_hidden_layers")
        head_dim = f.req("head_dim")
        factor = f.opt("partial_rotary_factor", None, float)
        rope_dim = int(head_dim * factor) if factor else int(f.opt("qk_rope_head_dim", 0) or 64)
        layer_types = tuple(f.req("layer_types", list))[:n]
        mlp_types = tuple(f.opt("mlp_layer_types", None, list) or ["hash_moe"] * 3 + ["moe"] * n)[:n]
        for field, values, allowed in (("layer_types", layer_types, (SLIDING, CSA, HCA)),
                                       ("mlp_layer_types", mlp_types, ("hash_moe", "moe"))):
            bad = [v for v in values if v not in allowed]
            if len(values) != n or bad:
                raise ConfigError(f"{source}: field '{field}' needs {n} entries from {allowed}")
        rates = f.opt("compress_rates", None, dict) or {CSA: 4, HCA: 128}
        scoring = f.opt("scoring_func", "sqrtsoftplus", str)
        if scoring != "sqrtsoftplus":
            raise ConfigError(f"{source}: field 'scoring_func' = {scoring!r} is not supported "
                              "(sqrtsoftplus)")
        rope = f.opt("rope_parameters", {}, dict)
        if not isinstance(rope.get("main"), dict) or not isinstance(rope.get("compress"), dict):
            raise ConfigError(f"{source}: field 'rope_parameters' needs 'main' and 'compress'")
        max_pos = f.opt("max_position_embeddings", 4096)
        main = RopeConfig.from_hf({"rope_parameters": rope["main"]}, rope_dim, max_pos, source)
        compress = dataclasses.replace(
            RopeConfig.from_hf({"rope_parameters": rope["compress"]}, rope_dim, max_pos, source),
            attention_factor=1.0)
        return V4Config(
            vocab_size=f.req("vocab_size"), hidden_size=f.req("hidden_size"), num_layers=n,
            num_heads=f.req("num_attention_heads"), head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=f.req("q_lora_rank"), o_groups=f.req("o_groups"),
            o_lora_rank=f.req("o_lora_rank"), sliding_window=f.req("sliding_window"),
            rms_norm_eps=f.opt("rms_norm_eps", 1e-6, float), main_rope=main, compress_rope=compress,
            layer_types=layer_types, csa_rate=rates[CSA], hca_rate=rates[HCA],
            index_heads=f.req("index_n_heads"), index_head_dim=f.req("index_head_dim"),
            index_topk=f.req("index_topk"), hc_mult=f.req("hc_mult"),
            hc_sinkhorn_iters=f.opt("hc_sinkhorn_iters", 20), hc_eps=f.opt("hc_eps", 1e-6, float),
            hash_layers=tuple(i for i, t in enumerate(mlp_types) if t == "hash_moe"),
            n_routed_experts=f.req("n_routed_experts"),
            num_experts_per_tok=f.req("num_experts_per_tok"),
            moe_intermediate_size=f.req("moe_intermediate_size"),
            routed_scaling_factor=f.opt("routed_scaling_factor", 1.0, float),
            swiglu_limit=f.opt("swiglu_limit", 0.0, float),
            max_position_embeddings=max_pos,
            tie_word_embeddings=f.opt("tie_word_embeddings", False, bool), source=source)
