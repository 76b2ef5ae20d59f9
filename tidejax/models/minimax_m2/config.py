"""MiniMax-M2 family config, read from config.json."""

from __future__ import annotations

import dataclasses

from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.models.layers.gqa import read_heads
from tidejax.models.layers.moe import read_top_k
from tidejax.models.layers.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class MiniMaxM2Config:
    """MiniMax-M2 (model_type minimax_m2): GQA attention with q/k norm over the whole projection
    of all heads and partial rotary, no biases; in every layer a MoE of num_local_experts SwiGLU
    experts of intermediate_size, sigmoid scores with a correction bias that shifts the choice,
    top-k renormalized, no shared expert (transformers' MiniMaxM2ForCausalLM)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading channels of each head that are rotated
    rope: RopeConfig
    rms_norm_eps: float
    max_position_embeddings: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""
    # what layers/gqa.py and layers/decoder.py read, fixed for this family
    use_qk_norm: bool = True
    qk_norm_span: str = "projection"
    attention_bias: bool = False
    shared_intermediate_size: int = 0
    intermediate_size: int = 0  # no dense layer
    num_mtp_layers: int = 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "MiniMaxM2Config":
        """Reads a published config.json (rope_theta and rotary_dim at the top) or one
        transformers 5 wrote (rope_parameters with partial_rotary_factor); the defaults are
        transformers'. What this family does not compute is refused naming the field."""
        f = Fields(raw, source)
        heads, kv_heads, head_dim = read_heads(f)
        rope_parameters = Fields(raw.get("rope_parameters") or {}, f"{source}: rope_parameters")
        factor = rope_parameters.opt("partial_rotary_factor", None, float)
        rotary_dim = f.opt("rotary_dim", head_dim) if factor is None else int(head_dim * factor)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ConfigError(f"{source}: field 'rotary_dim' = {rotary_dim} (or "
                              "partial_rotary_factor x head_dim) must be even and in "
                              f"2..head_dim ({head_dim})")
        f.one_of("hidden_act", "silu", ("silu",))
        f.one_of("scoring_func", "sigmoid", ("sigmoid",))
        f.one_of("qk_norm_type", "per_layer", ("per_layer",))  # over the whole projection
        for name, default in (("use_qk_norm", True), ("use_routing_bias", True)):
            if f.opt(name, default, bool) != default:
                raise ConfigError(f"{source}: field {name!r} = {not default} is not supported "
                                  "(transformers' MiniMax-M2 always has it)")
        n_experts = f.opt("num_local_experts", 256)
        max_pos = f.opt("max_position_embeddings", 196608)
        if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
            raw = {**raw, "rope_theta": 5e6}  # transformers' default
        return MiniMaxM2Config(
            model_type=f.req("model_type", str),
            vocab_size=f.req("vocab_size"),
            hidden_size=f.req("hidden_size"),
            num_layers=f.req("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope=RopeConfig.from_hf(raw, rotary_dim, max_pos, source),
            rms_norm_eps=f.opt("rms_norm_eps", 1e-6, float),
            max_position_embeddings=max_pos,
            n_routed_experts=n_experts,
            num_experts_per_tok=read_top_k(f, n_experts, 8),
            moe_intermediate_size=f.req("intermediate_size"),
            tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
            eos_token_ids=f.token_ids("eos_token_id"),
            source=source,
        )
