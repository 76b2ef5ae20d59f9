"""Mixtral family config, read from config.json."""

from __future__ import annotations

import dataclasses

from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.models.layers.gqa import read_heads
from tidejax.models.layers.moe import read_top_k
from tidejax.models.layers.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class MixtralConfig:
    """Mixtral 8x7B / 8x22B (model_type mixtral): GQA attention, every channel rotated, no
    biases, no q/k norm; in every layer a MoE of num_local_experts SwiGLU experts of
    intermediate_size, softmax top-k renormalized, no shared expert."""

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
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""
    # what layers/gqa.py and layers/decoder.py read, fixed for this family
    use_qk_norm: bool = False
    attention_bias: bool = False
    shared_intermediate_size: int = 0
    intermediate_size: int = 0  # no dense layer
    num_mtp_layers: int = 0

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "MixtralConfig":
        """Reads a published config.json or one transformers 5 wrote; the defaults are
        transformers'. What this family does not compute is refused naming the field."""
        f = Fields(raw, source)
        heads, kv_heads, head_dim = read_heads(f)
        if raw.get("sliding_window") is not None:
            raise ConfigError(f"{source}: field 'sliding_window' = {raw['sliding_window']} is not "
                              "supported (the published Mixtral checkpoints set null)")
        f.one_of("hidden_act", "silu", ("silu",))
        n_experts = f.opt("num_local_experts", 8)
        top_k = read_top_k(f, n_experts, 2)
        max_pos = f.opt("max_position_embeddings", 4096 * 32)
        return MixtralConfig(
            model_type=f.req("model_type", str),
            vocab_size=f.req("vocab_size"),
            hidden_size=f.req("hidden_size"),
            num_layers=f.req("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope=RopeConfig.from_hf(raw, head_dim, max_pos, source),
            rms_norm_eps=f.opt("rms_norm_eps", 1e-5, float),
            max_position_embeddings=max_pos,
            n_routed_experts=n_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=f.req("intermediate_size"),
            tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
            eos_token_ids=f.token_ids("eos_token_id"),
            source=source,
        )
