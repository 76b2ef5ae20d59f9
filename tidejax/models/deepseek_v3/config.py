"""DeepSeek-V3 family config, read from config.json."""

from __future__ import annotations

import dataclasses

from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.models.layers.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """The DeepSeek-V3 family (DeepSeek-V2-Lite shape, V3, R1, V3.1, Kimi K2): MLA + DeepSeekMoE."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP of the first_k_dense_replace layers
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    rope_interleave: bool
    rms_norm_eps: float
    max_position_embeddings: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str  # "sigmoid" | "softmax"
    topk_method: str  # "noaux_tc" (bias for selection) | "greedy" | "group_limited_greedy"
    tie_word_embeddings: bool
    num_mtp_layers: int = 0
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared experts' SwiGLU (0: none)."""
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers whose MLP is a routed MoE."""
        return tuple(i for i in range(self.num_layers)
                     if i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0)

    @property
    def latent_norm_eps(self) -> float:
        """MLA's q_a and kv_a norms: rms_norm_eps, as the published configs' (1e-6) give them."""
        return self.rms_norm_eps

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "DeepseekV3Config":
        f = Fields(raw, source)
        heads = f.req("num_attention_heads")
        rope_dim = f.req("qk_rope_head_dim")
        max_pos = f.opt("max_position_embeddings", 4096)
        n_routed = f.req("n_routed_experts")
        n_group = f.opt("n_group", 1) or 1
        if n_routed % n_group:
            raise ConfigError(f"{source}: field 'n_group' = {n_group} does not divide "
                              f"n_routed_experts = {n_routed}")
        # DeepSeek-V2 routes by softmax (transformers' DeepseekV2TopkRouter has no other scoring),
        # and its published configs name no scoring_func; V3 and Kimi K2 by sigmoid
        v2 = f.req("model_type", str) == "deepseek_v2"
        scoring = f.opt("scoring_func", "softmax" if v2 else "sigmoid", str)
        if scoring not in (("softmax",) if v2 else ("sigmoid", "softmax")):
            raise ConfigError(f"{source}: field 'scoring_func' = {scoring!r} is not supported"
                              + (" (DeepSeek-V2 routes by softmax)" if v2 else ""))
        topk_method = f.opt("topk_method", "noaux_tc" if scoring == "sigmoid" else "greedy", str)
        if topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ConfigError(f"{source}: field 'topk_method' = {topk_method!r} is not supported "
                              "(noaux_tc, greedy, group_limited_greedy)")
        act = f.opt("hidden_act", "silu", str)
        if act != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' = {act!r} is not supported (silu)")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return DeepseekV3Config(
            model_type=f.req("model_type", str),
            vocab_size=f.req("vocab_size"),
            hidden_size=f.req("hidden_size"),
            intermediate_size=f.req("intermediate_size"),
            num_layers=f.req("num_hidden_layers"),
            num_heads=heads,
            q_lora_rank=f.opt("q_lora_rank", None),
            kv_lora_rank=f.req("kv_lora_rank"),
            qk_nope_head_dim=f.req("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.req("v_head_dim"),
            rope=RopeConfig.from_hf(raw, rope_dim, max_pos, source),
            rope_interleave=f.opt("rope_interleave", True, bool),
            rms_norm_eps=f.opt("rms_norm_eps", 1e-6, float),
            max_position_embeddings=max_pos,
            n_routed_experts=n_routed,
            num_experts_per_tok=f.req("num_experts_per_tok"),
            moe_intermediate_size=f.req("moe_intermediate_size"),
            n_shared_experts=f.opt("n_shared_experts", 0),
            first_k_dense_replace=f.opt("first_k_dense_replace", 0),
            moe_layer_freq=f.opt("moe_layer_freq", 1),
            n_group=n_group,
            topk_group=f.opt("topk_group", 1) or 1,
            norm_topk_prob=f.opt("norm_topk_prob", not v2, bool),
            routed_scaling_factor=f.opt("routed_scaling_factor", 1.0, float),
            scoring_func=scoring,
            topk_method=topk_method,
            tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
            num_mtp_layers=f.opt("num_nextn_predict_layers", f.opt("num_mtp_layers", 0)),
            hidden_act=act,
            eos_token_ids=eos_ids,
            source=source,
        )
