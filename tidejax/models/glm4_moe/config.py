"""GLM-4.5 family config, read from config.json."""

from __future__ import annotations

import dataclasses

from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.models.layers.gqa import read_heads
from tidejax.models.layers.moe import read_groups
from tidejax.models.layers.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig:
    """GLM-4.5 / 4.6 / 4.7 / 4.5-Air (model_type glm4_moe): GQA attention with partial rotary,
    optional q/k norm and q/k/v biases; sigmoid-routed MoE with a correction bias, group-limited
    top-k and shared experts after first_k_dense_replace dense layers."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP of the first_k_dense_replace layers
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading channels of each head that are rotated (partial rotary)
    rope: RopeConfig
    attention_bias: bool  # q, k and v projections have biases (o does not)
    use_qk_norm: bool  # RMSNorm over head_dim of every query and key head
    rms_norm_eps: float
    max_position_embeddings: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    tie_word_embeddings: bool
    num_mtp_layers: int = 0  # the multi-token-prediction layers after the last decoder layer
    qk_norm_span: str = "head"  # q/k norm over each head (layers/gqa.py)
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared experts' SwiGLU (0: none)."""
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers whose MLP is a routed MoE."""
        return tuple(range(self.first_k_dense_replace, self.num_layers))

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "Glm4MoeConfig":
        """Reads a published config.json (rope_theta, partial_rotary_factor at the top) or one
        transformers 5 wrote (both in rope_parameters); the defaults are transformers'."""
        f = Fields(raw, source)
        heads, kv_heads, head_dim = read_heads(f)
        rope_parameters = Fields(raw.get("rope_parameters") or {}, f"{source}: rope_parameters")
        factor = rope_parameters.opt("partial_rotary_factor",
                                     f.opt("partial_rotary_factor", 0.5, float), float)
        rotary_dim = int(head_dim * factor)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ConfigError(f"{source}: field 'partial_rotary_factor' = {factor} gives "
                              f"{rotary_dim} rotary channels of head_dim {head_dim} (need an even "
                              "number, at least 2)")
        n_routed = f.req("n_routed_experts")
        n_group, topk_group = read_groups(f, n_routed)
        f.one_of("hidden_act", "silu", ("silu",))
        max_pos = f.opt("max_position_embeddings", 131072)
        return Glm4MoeConfig(
            model_type=f.req("model_type", str),
            vocab_size=f.req("vocab_size"),
            hidden_size=f.req("hidden_size"),
            intermediate_size=f.req("intermediate_size"),
            num_layers=f.req("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope=RopeConfig.from_hf(raw, rotary_dim, max_pos, source),
            attention_bias=f.opt("attention_bias", False, bool),
            use_qk_norm=f.opt("use_qk_norm", False, bool),
            rms_norm_eps=f.opt("rms_norm_eps", 1e-5, float),
            max_position_embeddings=max_pos,
            n_routed_experts=n_routed,
            num_experts_per_tok=f.req("num_experts_per_tok"),
            moe_intermediate_size=f.req("moe_intermediate_size"),
            n_shared_experts=f.opt("n_shared_experts", 1),
            first_k_dense_replace=f.opt("first_k_dense_replace", 1),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=f.opt("norm_topk_prob", True, bool),
            routed_scaling_factor=f.opt("routed_scaling_factor", 1.0, float),
            tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
            num_mtp_layers=f.opt("num_nextn_predict_layers", f.opt("num_mtp_layers", 1)),
            eos_token_ids=f.token_ids("eos_token_id"),
            source=source,
        )
