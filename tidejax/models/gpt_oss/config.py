"""gpt-oss family config, read from config.json."""

from __future__ import annotations

import dataclasses

from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.models.layers.gqa import read_heads
from tidejax.models.layers.moe import read_top_k
from tidejax.models.layers.rope import RopeConfig

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """gpt-oss-20b / 120b (model_type gpt_oss): GQA with biases on q, k, v and o, a learned sink
    logit per head, sliding-window and full layers (layer_types), YaRN rope over every channel;
    every layer a MoE of num_local_experts experts with biases (top-k of the router's biased
    logits, softmax over the k picked), their clamped SwiGLU g * sigmoid(alpha * g) * (u + 1)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    rms_norm_eps: float
    max_position_embeddings: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    sliding_window: int
    layer_types: tuple[str, ...]
    swiglu_alpha: float
    swiglu_limit: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""
    # what layers/gqa.py and layers/decoder.py read, fixed for this family
    attention_bias: bool = True
    use_qk_norm: bool = False
    qk_norm_span: str = "head"
    shared_intermediate_size: int = 0
    num_mtp_layers: int = 0

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))

    @property
    def intermediate_size(self) -> int:  # the decoder's dense MLP: none here (every layer MoE)
        return self.moe_intermediate_size

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else 0

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "GptOssConfig":
        """Reads a published config.json or one transformers 5 wrote; the defaults are
        transformers'. What this family does not compute is refused naming the field."""
        f = Fields(raw, source)
        heads, kv_heads, head_dim = read_heads(f)
        if not f.opt("attention_bias", True, bool):
            raise ConfigError(f"{source}: field 'attention_bias' = false is not supported (every "
                              "gpt-oss checkpoint has the biases)")
        f.one_of("hidden_act", "silu", ("silu",))
        n_layers = f.req("num_hidden_layers")
        layer_types = tuple(f.opt("layer_types", None, list) or (
            LAYER_TYPES[(i + 1) % 2 == 0] for i in range(n_layers)))
        if len(layer_types) != n_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ConfigError(f"{source}: field 'layer_types' must name {n_layers} layers, each "
                              f"one of {LAYER_TYPES}")
        window = f.opt("sliding_window", 128) or 0
        if "sliding_attention" in layer_types and window < 1:
            raise ConfigError(f"{source}: field 'sliding_window' = {window}: sliding layers need "
                              "a window of at least 1")
        n_experts = f.req("num_local_experts")
        max_pos = f.opt("max_position_embeddings", 131072)
        return GptOssConfig(
            model_type=f.req("model_type", str),
            vocab_size=f.req("vocab_size"),
            hidden_size=f.req("hidden_size"),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope=RopeConfig.from_hf(raw, head_dim, max_pos, source),
            rms_norm_eps=f.opt("rms_norm_eps", 1e-5, float),
            max_position_embeddings=max_pos,
            n_routed_experts=n_experts,
            num_experts_per_tok=read_top_k(f, n_experts, 4),
            moe_intermediate_size=f.req("intermediate_size"),
            sliding_window=window,
            layer_types=layer_types,
            swiglu_alpha=f.opt("swiglu_alpha", 1.702, float),
            swiglu_limit=f.opt("swiglu_limit", 7.0, float),
            tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
            eos_token_ids=f.token_ids("eos_token_id"),
            source=source,
        )
