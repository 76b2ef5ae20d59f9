"""GLM-5 family config, read from config.json."""

from __future__ import annotations

import dataclasses

from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.models.layers.moe import read_groups
from tidejax.models.layers.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class GlmMoeDsaConfig:
    """GLM-5.x (model_type glm_moe_dsa): MLA with DeepSeek Sparse Attention (a lightning indexer
    in the `index_layers`, its pick reused by the "shared" layers after each), sigmoid-routed
    MoE with a correction bias, group-limited top-k and a shared expert after the dense layers;
    num_mtp_layers multi-token-prediction layers after the last decoder layer (DSA layers with
    an indexer each, drafting for speculative decoding)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    rms_norm_eps: float
    max_position_embeddings: int
    # DSA
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    # the layers with an indexer: the "full" decoder layers (the others reuse the pick of the one
    # before) and the MTP layers after the last (each has its own, as published)
    index_layers: tuple[int, ...]
    # MoE
    moe_layers: tuple[int, ...]  # the layers whose MLP is the routed MoE ("sparse")
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    tie_word_embeddings: bool
    num_mtp_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""

    rope_interleave = True  # MLA's rotary pairs are interleaved (transformers has no other)
    latent_norm_eps = 1e-6  # MLA's q_a and kv_a norms (transformers' GlmMoeDsaRMSNorm default)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared experts' SwiGLU (0: none)."""
        return self.moe_intermediate_size * self.n_shared_experts

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "GlmMoeDsaConfig":
        """Reads a published config.json or one transformers 5 wrote; the defaults and the
        per-layer patterns are transformers' (GlmMoeDsaConfig)."""
        f = Fields(raw, source)
        layers, heads = f.req("num_hidden_layers"), f.req("num_attention_heads")
        for field, value in (("rope_interleave", True), ("indexer_rope_interleave", True),
                             ("attention_bias", False), ("mlp_bias", False),
                             ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                             ("hidden_act", "silu"), ("num_key_value_heads", heads)):
            if raw.get(field, value) != value:
                raise ConfigError(f"{source}: field '{field}' = {raw[field]!r} is not supported "
                                  f"(GLM-5 has {value!r})")
        n_routed = f.req("n_routed_experts")
        n_group, topk_group = read_groups(f, n_routed)
        rope_dim = f.req("qk_rope_head_dim")
        index_head_dim = f.opt("index_head_dim", 128)
        if index_head_dim < rope_dim:
            raise ConfigError(f"{source}: field 'index_head_dim' = {index_head_dim} is below "
                              f"qk_rope_head_dim = {rope_dim} (the indexer rotates that many)")
        max_pos = f.opt("max_position_embeddings", 202752)
        dense = min(f.opt("first_k_dense_replace", 3), layers)
        mlp_types = _per_layer(raw, "mlp_layer_types", ("dense", "sparse"), layers, source,
                               ["dense"] * dense + ["sparse"] * (layers - dense))
        index_types = _per_layer(raw, "indexer_types", ("full", "shared"), layers, source,
                                 _index_pattern(raw, layers))
        if index_types[0] != "full":
            raise ConfigError(f"{source}: field 'indexer_types' starts with a shared layer (it "
                              "reuses the pick of an indexer layer before it)")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        n_mtp = f.opt("num_nextn_predict_layers", 0)
        return GlmMoeDsaConfig(
            model_type=f.req("model_type", str),
            vocab_size=f.req("vocab_size"),
            hidden_size=f.req("hidden_size"),
            intermediate_size=f.req("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            q_lora_rank=f.req("q_lora_rank"),
            kv_lora_rank=f.req("kv_lora_rank"),
            qk_nope_head_dim=f.req("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.req("v_head_dim"),
            rope=RopeConfig.from_hf(raw, rope_dim, max_pos, source),
            rms_norm_eps=f.opt("rms_norm_eps", 1e-5, float),
            max_position_embeddings=max_pos,
            index_topk=f.opt("index_topk", 2048),
            index_head_dim=index_head_dim,
            index_n_heads=f.opt("index_n_heads", 32),
            index_layers=tuple(i for i, kind in enumerate(index_types) if kind == "full")
            + tuple(range(layers, layers + n_mtp)),
            moe_layers=tuple(i for i, kind in enumerate(mlp_types) if kind == "sparse"),
            n_routed_experts=n_routed,
            num_experts_per_tok=f.req("num_experts_per_tok"),
            moe_intermediate_size=f.req("moe_intermediate_size"),
            n_shared_experts=f.opt("n_shared_experts", 1),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=f.opt("norm_topk_prob", True, bool),
            routed_scaling_factor=f.opt("routed_scaling_factor", 2.5, float),
            tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
            num_mtp_layers=n_mtp,
            eos_token_ids=eos_ids,
            source=source,
        )


def _index_pattern(raw: dict, layers: int) -> list[str]:
    """transformers' default indexer_types: index_topk_pattern ("FSSF..." or a list), else
    index_topk_freq / index_skip_topk_offset (every layer "full" by default)."""
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return ([{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
                if isinstance(pattern, str) else list(pattern))
    freq = max(raw.get("index_topk_freq", 1), 1)
    offset = raw.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def _per_layer(raw: dict, field: str, kinds: tuple[str, str], layers: int, source: str,
               default: list[str]) -> list[str]:
    """A per-layer list of `kinds` (config field `field`, else `default`), checked."""
    value = raw.get(field) or default
    if (not isinstance(value, list) or len(value) != layers
            or any(kind not in kinds for kind in value)):
        raise ConfigError(f"{source}: field '{field}' must list one of {kinds} for each of the "
                          f"{layers} layers (got {value!r})")
    return value
