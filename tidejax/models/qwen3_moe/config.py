"""Qwen3-MoE family config, read from config.json."""

from __future__ import annotations

import dataclasses

from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.models.layers.gqa import read_heads
from tidejax.models.layers.moe import read_top_k
from tidejax.models.layers.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    """Qwen3-30B-A3B / 235B-A22B and their 2507 updates (model_type qwen3_moe): GQA attention
    with q/k norm over each head and every channel rotated, no biases; a softmax-routed MoE of
    num_experts (top-k, renormalized where norm_topk_prob) with no shared expert, in every layer
    but mlp_only_layers and those decoder_sparse_step skips (those have a dense MLP)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP of the layers that have no MoE
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
    moe_layers: tuple[int, ...]
    norm_topk_prob: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""
    # what layers/gqa.py and layers/decoder.py read, fixed for this family
    qk_norm_span: str = "head"
    use_qk_norm: bool = True
    attention_bias: bool = False
    shared_intermediate_size: int = 0
    num_mtp_layers: int = 0

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "Qwen3MoeConfig":
        """Reads a published config.json or one transformers 5 wrote; the defaults are
        transformers'. What this family does not compute is refused naming the field."""
        f = Fields(raw, source)
        heads, kv_heads, head_dim = read_heads(f)
        for name, unsupported in (("attention_bias", True), ("use_sliding_window", True)):
            if f.opt(name, False, bool) == unsupported:
                raise ConfigError(f"{source}: field {name!r} = true is not supported (no "
                                  "published Qwen3-MoE checkpoint sets it)")
        f.one_of("hidden_act", "silu", ("silu",))
        n_layers = f.req("num_hidden_layers")
        step = f.opt("decoder_sparse_step", 1)
        if step < 1:
            raise ConfigError(f"{source}: field 'decoder_sparse_step' = {step} must be >= 1")
        dense = set(f.opt("mlp_only_layers", None, list) or ())
        # published configs name it num_experts; transformers 5 writes num_local_experts
        n_experts = f.req("num_experts" if raw.get("num_local_experts") is None
                          else "num_local_experts")
        moe_layers = tuple(i for i in range(n_layers)
                           if i not in dense and n_experts > 0 and (i + 1) % step == 0)
        top_k = read_top_k(f, n_experts)
        max_pos = f.opt("max_position_embeddings", 32768)
        return Qwen3MoeConfig(
            model_type=f.req("model_type", str),
            vocab_size=f.req("vocab_size"),
            hidden_size=f.req("hidden_size"),
            intermediate_size=f.req("intermediate_size"),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope=RopeConfig.from_hf(raw, head_dim, max_pos, source),
            rms_norm_eps=f.opt("rms_norm_eps", 1e-6, float),
            max_position_embeddings=max_pos,
            n_routed_experts=n_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=f.req("moe_intermediate_size"),
            moe_layers=moe_layers,
            norm_topk_prob=f.opt("norm_topk_prob", False, bool),
            tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
            eos_token_ids=f.token_ids("eos_token_id"),
            source=source,
        )
