"""gpt-oss: GQA with biases, attention sinks and alternating sliding-window / full layers
(layers/gqa.py) on the shared decoder stack (layers/decoder.py); a router with a bias whose top-k
logits are softmaxed (transformers' GptOssTopKRouter); the experts' biases and clamped SwiGLU
(g * sigmoid(alpha * g) * (u + 1)) through residency (tidejax.contract)."""

from __future__ import annotations

from tidejax.models.gpt_oss.config import GptOssConfig
from tidejax.models.layers.decoder import Decoder
from tidejax.models.layers.gqa import GQAttention
from tidejax.models.layers.moe import RouterSpec
from tidejax.residency.serve import ServeOptions


def router_spec(cfg: GptOssConfig) -> RouterSpec:
    return RouterSpec(n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                      scoring="topk_softmax", use_bias=False, logit_bias=True,
                      norm_topk_prob=False)


def build(cfg: GptOssConfig, serve: ServeOptions, dtype) -> Decoder:
    return Decoder(cfg, router_spec(cfg), lambda name, layer: GQAttention(
        cfg, dtype, window=cfg.window(layer), sinks=True, o_bias=True, name=name), serve, dtype)
