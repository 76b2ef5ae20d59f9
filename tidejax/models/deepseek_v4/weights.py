"""DeepSeek-V4 params, declared (the tree the flax model consumes; transformers' module names,
`deepseek_v4`, transformers 5.23+), and the checkpoint table that fills them from the checkpoint
names (DeepSeek's published ones, which transformers also writes); loading, test init and memory
estimates come from these declarations. The routed experts (`ffn.experts.{e}.w1/w3/w2`) are
emitted as host-pool rows (layer * E + expert) for residency.
"""

from __future__ import annotations

import jax.numpy as jnp

from tidejax.checkpoint import Experts, Rule, Table
from tidejax.models.deepseek_v4.config import CSA, V4Config
from tidejax.models.deepseek_v4.model import ATTN_NAMES, pooler_specs, router_spec
from tidejax.models.layers.latent_window import attention_specs
from tidejax.models.layers.linear import embedding_specs, linear_specs
from tidejax.models.layers.mhc import mhc_specs
from tidejax.models.layers.moe import moe_specs, routed_expert_specs
from tidejax.models.layers.norm import norm_specs
from tidejax.models.loading import load_by_table
from tidejax.residency.serve import ServeOptions

F32 = jnp.float32


def _attn_specs(cfg: V4Config, layer: int, dtype) -> dict:
    d, k, q = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    specs = attention_specs(cfg, ATTN_NAMES, dtype, F32)
    rate, csa = cfg.rate(layer), cfg.layer_types[layer] == CSA
    if rate:
        specs["compressor"] = {"main": pooler_specs(cfg, rate, k, csa, dtype)}
        if csa:
            ik, ih = cfg.index_head_dim, cfg.index_heads
            specs["compressor"]["indexer"] = {
                "keys": pooler_specs(cfg, rate, ik, True, dtype),
                "q_b_proj": linear_specs(ih * ik, q, (None, "q_lora"), dtype),
                "weights_proj": linear_specs(ih, d, (None, "embed"), dtype)}
    return specs


def param_specs(cfg: V4Config, dtype) -> dict:
    """The dense params (everything but the routed experts) as ParamSpecs, in `dtype` but for
    what the reference keeps float32 (transformers' `_keep_in_fp32_modules_strict`): the norms,
    the mHC params and hyper head, the sinks, the compressors' position biases; and the routers
    (float32 in every family)."""
    d, n = cfg.hidden_size, cfg.hc_mult
    specs = {**embedding_specs(cfg.vocab_size, d, dtype, cfg.tie_word_embeddings),
             "norm": norm_specs(d, "embed", F32), **mhc_specs("hc_head", n, d, head=True)}
    for i in range(cfg.num_layers):
        specs |= {**mhc_specs(f"layers_{i}_attn_hc", n, d), **mhc_specs(f"layers_{i}_ffn_hc", n, d),
                  f"layers_{i}_input_layernorm": norm_specs(d, "embed", F32),
                  f"layers_{i}_self_attn": _attn_specs(cfg, i, dtype),
                  f"layers_{i}_post_attention_layernorm": norm_specs(d, "embed", F32),
                  f"layers_{i}_mlp": moe_specs(router_spec(cfg, i), d, cfg.moe_intermediate_size,
                                               dtype)}
    return specs


def expert_dims(cfg: V4Config) -> tuple[int, int, int, int]:
    """Every layer is a MoE layer: (layers, experts, hidden, expert intermediate)."""
    return cfg.num_layers, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size


def expert_specs(cfg: V4Config, dtype) -> dict:
    """The routed experts as host-pool rows (layer * n_routed_experts + expert)."""
    n_moe, n_experts, hidden, inter = expert_dims(cfg)
    return routed_expert_specs(n_moe * n_experts, hidden, inter, dtype)


_P = r"{p:(?:model\.)?}"  # transformers' save_pretrained writes it, the published names lack it
_LAYER = _P + "layers.{i}"
_EXPERT = _P + r"{layer:layers\.[0-9]+\.ffn}.experts.{expert}"
# the published module names -> ours (transformers' own module names, which the model keeps)
_ATTN = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
         "norm": "kv_norm", "wo_b": "o_b_proj"}
_POOLER = {"wkv": "kv_proj", "wgate": "gate_proj", "norm": "kv_norm"}
_SHARED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_TO_ATTN = "layers_{i}_self_attn"
RULES = (
    Rule(_P + "embed.weight", "embed"),
    Rule("model.embed_tokens.weight", "embed"),
    Rule("head.weight", "lm_head"),
    Rule(_P + "norm.weight", "norm.weight"),
    Rule(_P + "hc_head_{part:fn|base|scale}", "hc_head_{part}"),
    Rule(_P + "hc_head.hc_{part:fn|base|scale}", "hc_head_{part}"),
    Rule(f"{_LAYER}.hc_{{site:attn|ffn}}_{{part:fn|base|scale}}", "layers_{i}_{site}_hc_{part}"),
    Rule(f"{_LAYER}.attn_norm.weight", "layers_{i}_input_layernorm.weight"),
    Rule(f"{_LAYER}.ffn_norm.weight", "layers_{i}_post_attention_layernorm.weight"),
    Rule(f"{_LAYER}.attn.attn_sink", f"{_TO_ATTN}.sinks"),
    Rule(f"{_LAYER}.attn.wo_a.weight", f"{_TO_ATTN}.o_a_proj.weight"),
    *(Rule(f"{_LAYER}.attn.{theirs}.weight", f"{_TO_ATTN}.{ours}.weight")
      for theirs, ours in _ATTN.items()),
    *(Rule(f"{_LAYER}.attn.{where}.{theirs}.weight", f"{_TO_ATTN}.compressor.{to}.{ours}.weight")
      for where, to in (("compressor", "main"), ("indexer.compressor", "indexer.keys"))
      for theirs, ours in _POOLER.items()),
    Rule(f"{_LAYER}.attn.compressor.ape", f"{_TO_ATTN}.compressor.main.position_bias"),
    Rule(f"{_LAYER}.attn.indexer.compressor.ape", f"{_TO_ATTN}.compressor.indexer.keys.position_bias"),
    Rule(f"{_LAYER}.attn.indexer.wq_b.weight", f"{_TO_ATTN}.compressor.indexer.q_b_proj.weight"),
    Rule(f"{_LAYER}.attn.indexer.weights_proj.weight",
         f"{_TO_ATTN}.compressor.indexer.weights_proj.weight"),
    Rule(f"{_LAYER}.ffn.gate.weight", "layers_{i}_mlp.gate_weight"),
    Rule(f"{_LAYER}.ffn.gate.bias", "layers_{i}_mlp.gate_bias"),
    Rule(f"{_LAYER}.ffn.gate.tid2eid", "layers_{i}_mlp.tid2eid"),
    *(Rule(f"{_LAYER}.ffn.shared_experts.{theirs}.weight", f"layers_{{i}}_mlp.shared.{ours}.weight")
      for theirs, ours in _SHARED.items()),
    Experts(_EXPERT + ".w1.weight", part="gate"),
    Experts(_EXPERT + ".w3.weight", part="up"),
    Experts(_EXPERT + ".w2.weight", part="down"),
)


def checkpoint_table(cfg: V4Config) -> Table:
    """Checkpoint names (published, or as transformers' save_pretrained writes them: `model.`
    prefix, `embed_tokens`, `hc_head.hc_*`) -> the declared params and the routed-expert rows
    (every layer is a MoE layer). FP8 dense weights and FP4 experts pair in the reader."""
    return Table(RULES, expert_layers=[f"layers.{i}.ffn" for i in range(cfg.num_layers)])


def load_weights(cfg: V4Config, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(model_dir, raw_config, checkpoint_table(cfg), param_specs(cfg, dtype),
                           expert_specs(cfg, dtype), put_row)
    return params, None
