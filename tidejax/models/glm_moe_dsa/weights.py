"""GLM-5 params, declared (the tree the flax model consumes; the MTP layers, kept on the host as
stored), and the checkpoint table that fills them from the published layout (per-expert tensors,
BF16 or FP8 with 128 x 128 block scales) or the one transformers 5 holds in memory (fused
experts)."""

from __future__ import annotations

from tidejax.checkpoint import Rule, Table
from tidejax.models.base import ParamSpec
from tidejax.models.glm_moe_dsa.config import GlmMoeDsaConfig
from tidejax.models.layers.decoder import decoder_expert_specs, decoder_specs, decoder_table
from tidejax.models.layers.dsa import DSA_RULES, dsa_specs
from tidejax.models.layers.linear import linear_specs
from tidejax.models.layers.moe import moe_specs, noaux_router
from tidejax.models.layers.norm import norm_specs
from tidejax.models.loading import load_by_table
from tidejax.residency.serve import ServeOptions


def param_specs(cfg: GlmMoeDsaConfig, dtype) -> dict:
    """The dense params (everything but the routed experts and the MTP layers) as ParamSpecs."""
    return decoder_specs(cfg, noaux_router(cfg),
                         lambda layer: dsa_specs(cfg, dtype, layer in cfg.index_layers), dtype)


def expert_specs(cfg: GlmMoeDsaConfig, dtype) -> dict:
    """The routed experts as host-pool rows (moe layer * n_routed_experts + expert)."""
    return decoder_expert_specs(cfg, dtype)


def mtp_layers(cfg: GlmMoeDsaConfig) -> tuple[int, ...]:
    """The checkpoint indices of the MTP layers (after the last decoder layer)."""
    return tuple(range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers))


def mtp_specs(cfg: GlmMoeDsaConfig, dtype) -> dict:
    """The MTP layers, kept on the host as stored (memory-mapped; FP8 as values and scales) for
    speculative decoding, which no step runs yet: {"layers_{i}": a decoder layer (DSA attention
    with its indexer, the MoE with its own routed experts by id) and the MTP glue (enorm, hnorm,
    eh_proj [d, 2d], shared_head_norm)}; the embedding and head are the main model's."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    experts = {str(e): {"gate_proj": ParamSpec((f, d), dtype, ("ffw", "embed")),
                        "up_proj": ParamSpec((f, d), dtype, ("ffw", "embed")),
                        "down_proj": ParamSpec((d, f), dtype, ("embed", "ffw"))}
               for e in range(cfg.n_routed_experts)}
    layer = {"input_norm": norm_specs(d, "embed", dtype),
             "attn": dsa_specs(cfg, dtype, indexer=True),
             "post_attn_norm": norm_specs(d, "embed", dtype),
             "moe": moe_specs(noaux_router(cfg), d, cfg.shared_intermediate_size, dtype)
             | {"experts": experts},
             "enorm": norm_specs(d, "embed", dtype), "hnorm": norm_specs(d, "embed", dtype),
             "eh_proj": linear_specs(d, 2 * d, ("embed", None), dtype),
             "shared_head_norm": norm_specs(d, "embed", dtype)}
    return {f"layers_{i}": layer for i in mtp_layers(cfg)}


def mtp_rules(cfg: GlmMoeDsaConfig) -> tuple:
    """The MTP layers' own tensors (the decoder's and DSA's rules fill the rest of them)."""
    mtp = "model.layers.{i:" + "|".join(map(str, mtp_layers(cfg))) + "}"
    return (
        Rule(mtp + ".{norm:enorm|hnorm}.weight", "layers_{i}.{norm}.weight"),
        Rule(mtp + ".eh_proj.weight", "layers_{i}.eh_proj.weight"),
        Rule(mtp + ".shared_head.norm.weight", "layers_{i}.shared_head_norm.weight"),
        Rule(mtp + ".mlp.experts.{expert}.{proj:gate|up|down}_proj.weight",
             "layers_{i}.moe.experts.{expert}.{proj}_proj"),
    )


def checkpoint_table(cfg: GlmMoeDsaConfig) -> Table:
    """Hugging Face tensor names -> the declared params, the routed-expert rows and the MTP
    layers (rotary caches ignored: layers/decoder.py)."""
    return decoder_table(cfg, DSA_RULES, mtp_rules(cfg) if cfg.num_mtp_layers else None)


def load_weights(cfg: GlmMoeDsaConfig, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    """(dense params, the MTP layers as the host-side aux: {"layers_{i}": their tensors})."""
    params = load_by_table(model_dir, raw_config, checkpoint_table(cfg), param_specs(cfg, dtype),
                           expert_specs(cfg, dtype), put_row, host_specs=mtp_specs(cfg, dtype))
    return params, {name: params.pop(name) for name in mtp_specs(cfg, dtype)}
