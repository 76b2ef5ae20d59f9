"""Write a random-weight checkpoint of a real model's shape, routed experts in MXFP4 / FP4.

    python -m tools.make_synthetic OUT_DIR --shape v41-flash --layers 8 [--experts mxfp4|bf16]
    python -m tools.make_synthetic OUT_DIR --tiny
    python -m tools.make_synthetic OUT_DIR --shape ds41-flash --layers 6 [--engram-gib 4] [--vocab 129280]
    python -m tools.make_synthetic OUT_DIR --layers 40 --n-experts 16 --router-skew

A shape here is a config.json; the tensors follow from it as the loader reads them: each family's
declared params and checkpoint table name them, tools/synthetic_layout.py stores them as the
family's published checkpoints do (a new family needs a shape, and a Layout only where its
published format is not BF16 with fused experts).

Shapes of the DeepSeek-V3 family (MLA attention, DeepSeekMoE with a shared expert):
  v41-flash  hidden 5120, 384 routed experts of moe_intermediate 2304, 6 a token, 1 shared expert,
             MLA dims as DeepSeek-V3's (128 heads, q_lora 1536, kv_lora 512, rope 64)
  v3         DeepSeek-V3: hidden 7168, 256 experts of 2048, 8 a token, groups 8 / top 4
  tiny       hidden 64, 16 experts of 32, 4 a token (tests)
The first `--dense-layers` layers have a dense MLP (DeepSeek's first_k_dense_replace), the rest
are MoE. Routed experts of MoE layer i are stored fused per layer, in the bank's row convention
(gate rows 0..I-1, then up rows I..2I-1), gpt-oss style for MXFP4:
  model.layers.{i}.mlp.experts.gate_up_proj_blocks [E, 2I, D/32, 16] U8, ..._scales [E, 2I, D/32] U8
  model.layers.{i}.mlp.experts.down_proj_blocks    [E, D, I/32, 16] U8, ..._scales [E, D, I/32] U8
or with `--experts bf16` as transformers 5's fused `gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I].

Shapes of the GLM-4.5 family (model_type glm4_moe: GQA attention with q/k/v biases and half of
each head rotated, sigmoid-routed MoE with a shared expert), written as the published BF16
checkpoints are (`self_attn.{q,k,v}_proj.{weight,bias}`, `q_norm` / `k_norm` where the shape
has them), the routed experts fused per layer as for the V3 family (MXFP4 or `--experts bf16`):
  glm45-air  GLM-4.5-Air: 46 layers, hidden 4096, 96 heads of 128 over 8 KV heads, 128 routed
             experts of 1408, 8 a token, one shared expert, dense MLP 10944 in layer 0,
             routed_scaling 1.0, no q/k norm, rope theta 1e6 on 64 of the 128 channels
  glm45      GLM-4.5 / 4.6: 92 layers, hidden 5120, 96 heads of 128 over 8 KV heads, 160 experts
             of 1536, 8 a token, dense MLP 12288 in layers 0-2, routed_scaling 2.5, q/k norm
  glm-tiny   hidden 64, 4 heads of 16 over 2 KV heads, 16 experts of 32, 4 a token (tests)
`--layers` (default 4) and `--n-experts` cut a shape down; `--dense-layers` defaults to the
shape's own (1 for glm45-air, 3 for glm45). The MTP layer is left out unless --mtp-layers.

Shapes of the Qwen3-MoE family (model_type qwen3_moe: GQA attention with q/k norm, softmax-routed
MoE, no shared expert), written as the published BF16 checkpoints are, the routed experts fused
per layer as for the V3 family (MXFP4 or `--experts bf16`):
  qwen3-235b  Qwen3-235B-A22B: 94 layers, hidden 4096, 64 heads of 128 over 4 KV heads, 128
              experts of 1536, 8 a token, top-k renormalized, rope theta 1e6
  qwen3-30b   Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads of 128 over 4 KV heads, 128 experts
              of 768, 8 a token
  qwen3-tiny  hidden 64, 4 heads of 16 over 2 KV heads, 16 experts of 32, 4 a token (tests)
`--layers` (default 4) and `--n-experts` cut a shape down; `--dense-layers` (default 0, as
published) makes the first layers dense (mlp_only_layers).

Shapes of the gpt-oss family (model_type gpt_oss: GQA with biases and attention sinks,
sliding-window (128) and full layers alternating, YaRN rope; every layer a MoE with biases),
written as the published checkpoints are: the routed experts MXFP4 (`_blocks`, `_scales`, the
gate and up rows interleaved as published; `--experts mxfp4` only), their biases BF16:
  gpt-oss-120b  36 layers, hidden 2880, 64 heads of 64 over 8 KV heads, 128 experts of 2880,
                4 a token
  gpt-oss-20b   24 layers, the same widths, 32 experts of 2880, 4 a token
`--layers` (default 4) and `--n-experts` cut a shape down; no dense layers.

Shapes of the Mixtral family (model_type mixtral: GQA, every channel rotated; every layer a MoE
of 8 SwiGLU experts, softmax top-2) and of MiniMax-M2 (model_type minimax_m2: GQA with q/k norm
over the whole projection, half of each head rotated; every layer a MoE, sigmoid-routed with a
correction bias, top-8), written as the published BF16 checkpoints are, the routed experts per
expert (`block_sparse_moe.experts.{x}.w1 / w3 / w2`; `--experts bf16` only):
  mixtral-8x7b   Mixtral-8x7B: 32 layers, hidden 4096, 32 heads of 128 over 8 KV heads, 8 experts
                 of 14336, 2 a token, rope theta 1e6
  mixtral-8x22b  Mixtral-8x22B: 56 layers, hidden 6144, 48 heads of 128 over 8 KV heads, 8 experts
                 of 16384, 2 a token, rope theta 1e6
  minimax-m2     MiniMax-M2: 62 layers, hidden 3072, 48 heads of 128 over 8 KV heads (64 channels
                 rotated), 256 experts of 1536, 8 a token, rope theta 5e6 (its MTP modules left out)
`--layers` (default 4) and `--n-experts` cut a shape down; no dense layers.
What the whole shapes need in BF16, as published: the routed experts in host memory (the pool);
on the GPU the dense weights, the KV pool (bf16 keys and values of every layer and KV head) and
the expert bank. With 32,768 tokens of KV and ~8 GiB of working memory, the bank holds (`python -m
tools.memory_needs --shape S --experts bf16 --kv-tokens 32768` prints these, and any shape's
needs in any expert format):
  mixtral-8x7b   256 experts of 336 MiB (84 GiB), 3.0 GiB dense, KV 128 KiB a token: every
                 expert on one H200 (141 GB), ~70% of them on an 80 GB H100
  mixtral-8x22b  448 experts of 576 MiB (252 GiB), 9.9 GiB dense, KV 224 KiB a token: ~40% of
                 the experts on one H200, ~20% on an H100
  minimax-m2     15,872 experts of 27 MiB (418 GiB), 7.5 GiB dense, KV 248 KiB a token: ~25% of
                 the experts on one H200, ~12% on an H100

Shapes of the GLM-5 family (model_type glm_moe_dsa: MLA with DeepSeek Sparse Attention, a
lightning indexer a layer, sigmoid-routed MoE with a shared expert), written as the published BF16
checkpoint is (MLA's `self_attn.*` as DeepSeek-V3's, the indexer's `self_attn.indexer.{wq_b, wk,
k_norm, weights_proj}`), the routed experts fused per layer as for the V3 family:
  glm5       GLM-5: 78 layers, hidden 6144, 64 heads (q_lora 2048, kv_lora 512, nope 192, rope 64,
             v 256), an indexer in every layer (32 heads of 128, top-2048), 256 experts of 2048,
             8 a token, one shared expert, dense MLP 12288 in layers 0-2, routed_scaling 2.5,
             rope theta 1e6 (transformers' GlmMoeDsaConfig defaults; positions by --max-positions)
  glm5-tiny  hidden 64, 4 heads, indexer 4 heads of 16 (top-16), 16 experts of 32 (tests)
`--layers` (default 4) and `--n-experts` cut a shape down; `--dense-layers` defaults to the
shape's own (3 for glm5, 1 for glm5-tiny); the MTP layer is left out unless --mtp-layers.

Shapes of the DeepSeek-V4.1 family (model_type deepseek_v41: mHC streams, latent single-KV
attention with CSA2 compressed branches and indexers, Engram, sqrtsoftplus MoE), written as the
published DeepSeek-V4.1-Flash checkpoint is (no `model.` prefix, `head.weight`; composite
config.json with `text_config` and `quantization_config`):
  dense weights   `X.weight` F8_E4M3 + `X.scale` F8_E8M0 per 32 x 32 block (weight_block_size)
  routed experts  `layers.{i}.ffn.experts.{e}.w{1,2,3}.weight` I8 [out, in/2] (two e2m1 codes a
                  byte, low nibble first) + `.scale` F8_E8M0 [out, in/32]
  Engram tables   `layers.{i}.engram.embed.weight` F8_E4M3 [rows, 256] + `.scale` F8_E8M0 [rows, 8]
  kept wide       embed / head / norms / router / compressor / indexer keys and weights_proj /
                  Engram q,k weights in BF16; mHC params, attention sinks, router biases in F32
  also written    `ffn.gate.bias_vl` (image-token router bias) and `image_start/end/newline`, as
                  published; text decoding leaves them unused
  ds41-flash  the released model: 40 layers, hidden 5120, 64 heads of 512 (rope 64), q_lora 1280,
              o_groups 8 x o_lora 1024, window 128, compress ratios [0,0] + [2]x18 + [1]x20, KV
              sources 2 8 14 20, index sources 2 8 14 20 24 28 32 36, candidate source 20 (2048
              blocks of 8), indexer 32 heads x 128, top-512, hc_mult 4 (Sinkhorn 20), 384 routed
              experts of 2304, 6 a token, one shared expert, routed_scaling 1.5, swiglu_limit 10,
              Engram at layers 1 and 14 (n-grams 2..4, 8 heads, rows of 256), rms_norm_eps 1e-20,
              rope theta 10000 / compress 160000 with YaRN x16 from 65536, 1M positions.
              Known: the released config's values as the V4.1 goldens' ARCHITECTURE.md quotes them
              (in brackets there), and from public write-ups of the published config and tensor
              headers: Engram at layers 1 and 14 with rows of 256, hc_mult 4, 32 x 32 FP8
              blocks, I8 expert codes, which tensors stay BF16 / F32. Assumed: gate_temp 1.0;
              the vocabulary is the demo tokenizer's 4,096 ids unless `--vocab 129280` gives
              embed and head the real 129,280 rows (1.3 GB each).
  ds41-tiny   the same layout at hidden 64, 8 experts of 32 (tests)
`--layers N` keeps N of the 40 layers, first those of DS41_KEEP (one of each kind: Engram,
ratio-2 KV source, ratio-1 KV and candidate source, Reindex, Reuse), then the rest in order,
renumbered in order; the KV / index / candidate / Engram layer ids follow them. DSpark (MTP)
layers and the vision tower are left out (num_nextn_predict_layers 0). `--engram-gib` sizes each
Engram table (rows follow from the hash layout's primes, as in the real model: 94.4 GiB a table,
prime start 16,000,000); the default, 4 GiB for ds41-flash, suits a 128 GiB host.

--router-skew (both families) writes the routers' correction biases (`e_score_correction_bias`,
V4.1's `ffn.gate.bias`; selection only, never the weights) so that the 30% most picked of each
MoE layer's experts take about 70% of its picks, the same in tidejax and in llama.cpp (the GGUF
writer copies them as exp_probs_b). A fixed rule, not tuned to a measurement: round(0.3 E) experts
a layer, drawn per layer from --seed, get one bias b and the rest 0, where b is solved once
(bisection) so that they take 0.7 of the picks of independent N(0, s^2) logits through tidejax's
router (route, over an identity weight), s = sqrt(hidden * E[w^2]) the logit scale the synthetic
router weights give on unit-RMS hidden states. config.json records it (tidejax_synthetic
.router_skew). Every run then measures and prints the share the most picked 30% of each layer's
experts take on 4,096 random unit-RMS hidden states through the written routers (with the skew
about 0.69-0.71; without it 0.33 for --tiny, 0.36-0.41 for ds41-tiny, the random router rows'
own spread; on the tiny model's real forward over held-out text 0.46-0.49 without, 0.69-0.71 with).

Values: dense weights with std about 1/sqrt(fan_in) (bf16, or e4m3 codes over 4 octaves with e8m0
block scales), norms 1; MXFP4 / FP4 codes uniform random bytes with e8m0 scales sized so a
projection keeps unit variance. The tokenizer is the bundled demo model's, so prompts work; the
vocabulary is its ids, or `--vocab N` (at least the tokenizer's) rows of random embeddings and
head, the ids past the tokenizer's never in a prompt (the Engram hashes take them as the pad id). One shard per layer, written as it is generated (memory stays at one
expert row), with a progress line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

from tidejax.models.deepseek_v41.engram import compressed_token_map, layer_primes
from tidejax.models.layers.moe import RouterSpec, noaux_router, route
from tidejax.models.registry import FAMILY_MODULES, family_for
from tools.corpus import REPO
from tools.synthetic_layout import (BF16, E4M3, E8M0, F32, I8, U8, Declared, checkpoint_tensors,
                                    e4m3_codes)

ATTN_V3 = dict(num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128)
SHAPES = {
    "v41-flash": dict(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=2304,
                      n_routed_experts=384, num_experts_per_tok=6, n_shared_experts=1, n_group=1,
                      topk_group=1, routed_scaling_factor=2.5, **ATTN_V3),
    "v3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
               n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8,
               topk_group=4, routed_scaling_factor=2.5, **ATTN_V3),
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=1,
                 topk_group=1, routed_scaling_factor=1.0, num_attention_heads=2, q_lora_rank=32,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}

GLM_SHAPES = {
    "glm45-air": dict(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                      num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                      n_routed_experts=128, num_experts_per_tok=8, routed_scaling_factor=1.0,
                      use_qk_norm=False, dense_layers=1),
    "glm45": dict(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
                  num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                  n_routed_experts=160, num_experts_per_tok=8, routed_scaling_factor=2.5,
                  use_qk_norm=True, dense_layers=3),
    "glm-tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5,
                     use_qk_norm=True, dense_layers=1),
}

GLM5_SHAPES = {
    "glm5": dict(hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
                 num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                 qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
                 index_topk=2048, n_routed_experts=256, num_experts_per_tok=8, dense_layers=3),
    "glm5-tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4, index_head_dim=16,
                      index_topk=16, n_routed_experts=16, num_experts_per_tok=4, dense_layers=1),
}

QWEN3_SHAPES = {
    "qwen3-235b": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                       num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                       num_experts=128, num_experts_per_tok=8, dense_layers=0),
    "qwen3-30b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=128, num_experts_per_tok=8, dense_layers=0),
    "qwen3-tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_experts=16, num_experts_per_tok=4, dense_layers=0),
}

GPT_OSS_SHAPES = {
    "gpt-oss-120b": dict(num_local_experts=128),
    "gpt-oss-20b": dict(num_local_experts=32),
}

# Mixtral's and MiniMax-M2's config.json fields as published (`block_sparse_moe`: the experts
# stored per expert; no dense layers)
_MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_key_value_heads=8,
                num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5,
                sliding_window=None, router_aux_loss_coef=0.02)
BLOCK_SPARSE_SHAPES = {
    "mixtral-8x7b": _MIXTRAL | dict(hidden_size=4096, intermediate_size=14336,
                                    num_attention_heads=32),
    "mixtral-8x22b": _MIXTRAL | dict(hidden_size=6144, intermediate_size=16384,
                                     num_attention_heads=48),
    "minimax-m2": dict(architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2",
                       hidden_size=3072, intermediate_size=1536, num_attention_heads=48,
                       num_key_value_heads=8, head_dim=128, rotary_dim=64,
                       num_local_experts=256, num_experts_per_tok=8, rope_theta=5e6,
                       rms_norm_eps=1e-6, scoring_func="sigmoid", use_qk_norm=True,
                       qk_norm_type="per_layer", use_routing_bias=True, use_mtp=False),
}

# DeepSeek-V4.1-Flash's layer schedule (40 layers) and its text_config fields
DS41_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
DS41_KV_SOURCES = (2, 8, 14, 20)
DS41_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
DS41_CANDIDATE = 20
DS41_ENGRAM = (1, 14)
# --layers N keeps these first: 1 Engram (window only), 2 ratio-2 KV source, 14 ratio-2 KV source
# + Engram, 20 ratio-1 KV source + candidate source, 24 Reindex, 21 ratio-1 Reuse, 3 ratio-2 Reuse
DS41_KEEP = (1, 2, 14, 20, 24, 21, 3)
_DS41_COMMON = dict(num_key_value_heads=1, hc_sinkhorn_iters=20, hc_eps=1e-6, n_shared_experts=1,
                    norm_topk_prob=True, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
                    gate_temp=1.0, hidden_act="silu", rms_norm_eps=1e-20, rope_theta=10000.0,
                    compress_rope_theta=160000.0, num_nextn_predict_layers=0,
                    tie_word_embeddings=False, routed_scaling_factor=1.5, swiglu_limit=10.0)
DS41_SHAPES = {
    "ds41-flash": dict(hidden_size=5120, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
                       q_lora_rank=1280, o_groups=8, o_lora_rank=1024, sliding_window=128,
                       index_n_heads=32, index_head_dim=128, index_topk=512,
                       candidate_block_size=8, candidate_topk_blocks=2048, hc_mult=4,
                       n_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=2304,
                       engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,
                       max_position_embeddings=1 << 20, yarn_original=65536, engram_gib=4.0),
    "ds41-tiny": dict(hidden_size=64, num_attention_heads=2, head_dim=64, qk_rope_head_dim=16,
                      q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
                      index_n_heads=2, index_head_dim=32, index_topk=4, candidate_block_size=4,
                      candidate_topk_blocks=2, hc_mult=4, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, engram_max_ngram_size=3,
                      engram_n_heads=2, engram_head_dim=32, max_position_embeddings=4096,
                      yarn_original=256, engram_gib=1e-4),
}
FP8_BLOCK = 32  # the published weight_block_size: one e8m0 scale per 32 x 32 block
ST_DTYPES = {U8: "U8", I8: "I8", BF16: "BF16", F32: "F32", E4M3: "F8_E4M3", E8M0: "F8_E8M0"}


def _check_dense_layers(dense_layers: int, layers: int) -> None:
    if not 0 <= dense_layers < layers:
        raise SystemExit(f"error: --dense-layers {dense_layers} must leave at least one MoE layer "
                         f"of --layers {layers}")


def hf_config(shape: str, layers: int, dense_layers: int, vocab_size: int, max_positions: int,
              special: dict, n_experts: int = 0) -> dict:
    s = SHAPES[shape] | ({"n_routed_experts": n_experts} if n_experts else {})
    _check_dense_layers(dense_layers, layers)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, "num_hidden_layers": layers, **s,
        "num_key_value_heads": s["num_attention_heads"], "first_k_dense_replace": dense_layers,
        "moe_layer_freq": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "hidden_act": "silu", "rope_theta": 10000.0,
        "rope_scaling": None, "rope_interleave": True, "attention_bias": False,
        "attention_dropout": 0.0, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "max_position_embeddings": max_positions, "use_cache": True, "torch_dtype": "bfloat16",
        **special, "tidejax_synthetic": {"shape": shape, "random_weights": True},
    }


# -- tensors: (name, dtype, shape, filler); a filler is a picklable (kind, parameter) -----------

def fill(filler: tuple, rng, shape: tuple) -> np.ndarray:
    """Random values for `shape` from the integer bits of `rng` (fast: no float math on the codes),
    as an array of the tensor's bytes (codes and scales as uint8).

    bf16 / f32: random sign and mantissa, exponent spread over 4 octaves, centred so the std is
    about 1/sqrt(fan_in). codes: uniform e2m1 byte pairs. e4m3: codes over 4 octaves below 2.
    scales: e8m0 bytes around 2**round(-log2(sqrt(fan_in * E[v^2]))) (the parameter is
    fan_in * E[v^2] of the codes they scale), so a quantized projection keeps unit variance.
    """
    kind, param = filler
    n = math.prod(shape)
    if kind == "values_f32":  # given values, all of them
        if len(param) != n:
            raise ValueError(f"filler of {len(param)} values for a tensor of shape {shape}")
        return np.asarray(param, np.float32).reshape(shape)
    if kind == "const_bf16":
        return np.full(shape, param, BF16)
    if kind == "const_f32":
        return np.full(shape, param, np.float32)
    bits = rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]
    if kind == "codes":
        return bits.reshape(shape)
    if kind == "e4m3":
        return e4m3_codes(bits).reshape(shape)
    if kind == "scales":
        center = 127 + round(-0.5 * math.log2(param))
        return (center - 1 + bits % 3).astype(np.uint8).reshape(shape)
    if kind in ("bf16", "f32"):
        e0 = _top_exponent(param)
        words = rng.bit_generator.random_raw((n + 3) // 4).view(np.uint16)[:n]
        exponent = (e0 - ((words >> 7) & 3)).astype(np.uint16) << 7
        out = ((words & 0x807F) | exponent).view(BF16).reshape(shape)
        return out if kind == "bf16" else out.astype(np.float32)
    raise ValueError(f"unknown filler {filler}")


def _top_exponent(fan_in: int) -> int:
    """The biased exponent e0 of a "bf16" / "f32" filler: values spread over the 4 octaves below
    2**(e0 - 127), so their mean square (uniform_mean_square) is about 1 / fan_in."""
    return 127 + round(-0.5 * math.log2(0.774 * fan_in))


def uniform_mean_square(fan_in: int) -> float:
    """E[v^2] of a "bf16" / "f32" filler's values: 0.774 * 4**(e0 - 127)."""
    return 0.774 * 4.0 ** (_top_exponent(fan_in) - 127)


def _glm_shape(shape: dict, layers: int, dense_layers: int | None,
               n_experts: int) -> tuple[dict, int]:
    """A GLM shape's fields (--n-experts applied) and its dense layers (--dense-layers, else the
    shape's own), checked against `layers`."""
    s = dict(shape) | ({"n_routed_experts": n_experts} if n_experts else {})
    shape_dense = s.pop("dense_layers")
    dense_layers = shape_dense if dense_layers is None else dense_layers
    _check_dense_layers(dense_layers, layers)
    return s, dense_layers


def glm_config(shape: str, layers: int, dense_layers: int | None, vocab_size: int,
               max_positions: int, special: dict, n_experts: int = 0) -> dict:
    """A config.json as zai-org publishes GLM-4.5's (rope_theta and partial_rotary_factor at the
    top level), cut to `layers` layers."""
    s, dense_layers = _glm_shape(GLM_SHAPES[shape], layers, dense_layers, n_experts)
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": vocab_size, "num_hidden_layers": layers, **s,
        "first_k_dense_replace": dense_layers, "n_shared_experts": 1, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
        "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu",
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "initializer_range": 0.02,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "max_position_embeddings": max_positions, "use_cache": True, "torch_dtype": "bfloat16",
        **special, "tidejax_synthetic": {"shape": shape, "random_weights": True},
    }


def qwen3_config(shape: str, layers: int, dense_layers: int | None, vocab_size: int,
                 max_positions: int, special: dict, n_experts: int = 0) -> dict:
    """A config.json as Qwen publishes Qwen3-MoE's (rope_theta at the top level), cut to `layers`
    layers, the first `dense_layers` of them dense (mlp_only_layers)."""
    s = dict(QWEN3_SHAPES[shape]) | ({"num_experts": n_experts} if n_experts else {})
    shape_dense = s.pop("dense_layers")
    dense_layers = shape_dense if dense_layers is None else dense_layers
    _check_dense_layers(dense_layers, layers)
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab_size, "num_hidden_layers": layers, **s,
        "mlp_only_layers": list(range(dense_layers)), "decoder_sparse_step": 1,
        "norm_topk_prob": True, "hidden_act": "silu", "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "attention_bias": False, "use_sliding_window": False,
        "initializer_range": 0.02, "tie_word_embeddings": False,
        "max_position_embeddings": max_positions, "use_cache": True, "torch_dtype": "bfloat16",
        **special, "tidejax_synthetic": {"shape": shape, "random_weights": True},
    }


def gpt_oss_config(shape: str, layers: int, dense_layers: int | None, vocab_size: int,
                   max_positions: int, special: dict, n_experts: int = 0) -> dict:
    """A config.json as OpenAI publishes gpt-oss's (the widths both sizes share), cut to `layers`
    layers (sliding and full alternating, the first sliding)."""
    if dense_layers:
        raise SystemExit(f"error: --dense-layers {dense_layers}: gpt-oss has no dense layers")
    s = dict(GPT_OSS_SHAPES[shape]) | ({"num_local_experts": n_experts} if n_experts else {})
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": vocab_size, "num_hidden_layers": layers, **s,
        "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "num_experts_per_tok": 4,
        "sliding_window": 128, "attention_bias": True, "hidden_act": "silu",
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers)],
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "rope_theta": 150000.0, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0,
        "initializer_range": 0.02, "tie_word_embeddings": False,
        "max_position_embeddings": max_positions, "use_cache": True, "torch_dtype": "bfloat16",
        **special, "tidejax_synthetic": {"shape": shape, "random_weights": True},
    }


def block_sparse_config(shape: str, layers: int, dense_layers: int | None, vocab_size: int,
                        max_positions: int, special: dict, n_experts: int = 0) -> dict:
    """A config.json as Mistral publishes Mixtral's and MiniMax MiniMax-M2's, cut to `layers`
    layers (every one a MoE)."""
    if dense_layers:
        raise SystemExit(f"error: --dense-layers {dense_layers}: {shape} has no dense layers")
    s = BLOCK_SPARSE_SHAPES[shape] | ({"num_local_experts": n_experts} if n_experts else {})
    return {
        **s, "vocab_size": vocab_size, "num_hidden_layers": layers, "hidden_act": "silu",
        "attention_dropout": 0.0, "initializer_range": 0.02, "tie_word_embeddings": False,
        "max_position_embeddings": max_positions, "use_cache": True, "torch_dtype": "bfloat16",
        **special, "tidejax_synthetic": {"shape": shape, "random_weights": True},
    }


def glm5_config(shape: str, layers: int, dense_layers: int | None, vocab_size: int,
                max_positions: int, special: dict, n_experts: int = 0) -> dict:
    """A config.json as transformers' GlmMoeDsaConfig writes GLM-5's (an indexer in every
    layer), cut to `layers` layers."""
    s, dense_layers = _glm_shape(GLM5_SHAPES[shape], layers, dense_layers, n_experts)
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": vocab_size, "num_hidden_layers": layers, **s,
        "num_key_value_heads": s["num_attention_heads"], "first_k_dense_replace": dense_layers,
        "indexer_types": ["full"] * layers, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "attention_bias": False, "rms_norm_eps": 1e-5, "initializer_range": 0.02,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "max_position_embeddings": max_positions, "use_cache": True, "torch_dtype": "bfloat16",
        **special, "tidejax_synthetic": {"shape": shape, "random_weights": True},
    }


def shape_config(shape: str, layers: int, dense_layers: int | None, vocab_size: int,
                 max_positions: int, special: dict, n_experts: int = 0) -> dict:
    """The config.json of a shape of the families that follow transformers' configs (every
    shape but DeepSeek-V4.1's), cut to `layers` layers."""
    make = (glm_config if shape in GLM_SHAPES else glm5_config if shape in GLM5_SHAPES
            else qwen3_config if shape in QWEN3_SHAPES
            else gpt_oss_config if shape in GPT_OSS_SHAPES
            else block_sparse_config if shape in BLOCK_SPARSE_SHAPES else hf_config)
    return make(shape, layers, dense_layers, vocab_size, max_positions, special, n_experts)


# -- DeepSeek-V4.1, in the published layout ---------------------------------------------------

def ds41_layers(layers: int) -> list[int]:
    """The ids, among the real model's 40, of the layers an N-layer model keeps, in order."""
    if not 1 <= layers <= len(DS41_RATIOS):
        raise SystemExit(f"error: --layers {layers}: the DeepSeek-V4.1 shapes have 1 to "
                         f"{len(DS41_RATIOS)} layers")
    order = DS41_KEEP + tuple(i for i in range(len(DS41_RATIOS)) if i not in DS41_KEEP)
    return sorted(order[:layers])


def ds41_config(shape: str, layers: int, vocab_size: int, special: dict, token_map: np.ndarray,
                n_experts: int = 0, engram_gib: float | None = None) -> dict:
    """The composite config.json: the real schedule cut to `layers` layers, Engram tables of about
    `engram_gib` GiB (their rows are the sums of the hash layout's primes)."""
    s = dict(DS41_SHAPES[shape]) | ({"n_routed_experts": n_experts} if n_experts else {})
    yarn_original, gib = s.pop("yarn_original"), s.pop("engram_gib")
    gib = gib if engram_gib is None else engram_gib
    if special["pad_token_id"] is None:
        raise SystemExit("error: the tokenizer has no pad token, which Engram hashes blocked "
                         "n-gram slots with (tokenizer_config.json: pad_token)")
    kept = ds41_layers(layers)
    new_id = {old: new for new, old in enumerate(kept)}

    def renumber(ids):
        return [new_id[i] for i in ids if i in new_id]
    engram = renumber(DS41_ENGRAM)
    n, heads, width = s["engram_max_ngram_size"], s["engram_n_heads"], s["engram_head_dim"]
    prime_start = max(2, round(gib * 2**30 / ((width + width // 32) * (n - 1) * heads)))
    primes = layer_primes(len(engram), n, heads, prime_start)
    text = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41_text",
        "vocab_size": vocab_size, "num_hidden_layers": layers, **_DS41_COMMON, **s,
        "compress_ratios": [DS41_RATIOS[i] for i in kept],
        "kv_source_layer_ids": renumber(DS41_KV_SOURCES),
        "index_source_layer_ids": renumber(DS41_INDEX_SOURCES),
        "candidate_source_layer_id": new_id.get(DS41_CANDIDATE, -1),
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": yarn_original},
        "engram_layer_ids": engram, "engram_vocab_size": prime_start,
        "engram_num_embeddings": [int(p.sum()) for p in primes],
        "engram_compressed_vocab_size": int(token_map.max()) + 1,
        "engram_pad_id": special["pad_token_id"], **special,
    }
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": text, "vision_config": None, "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                    "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
            "tidejax_synthetic": {"shape": shape, "random_weights": True, "layers_of_40": kept}}


# -- a skewed router (--router-skew) ---------------------------------------------------------------

HOT_FRACTION, HOT_SHARE = 0.3, 0.7  # --router-skew: that part of a layer's experts takes that share
SKEW_SAMPLES = 8192  # rows of logits the bias is solved on
MEASURE_TOKENS = 4096  # random hidden states the written routers' picks are measured on


@dataclasses.dataclass(frozen=True)
class RouterSkew:
    """Correction biases for every MoE layer: `hot` experts of the layer (drawn per layer from
    `seed`) get `bias`, the others 0; the router picks by score + bias, weighs by score alone."""

    hot: int
    bias: float
    seed: int

    def layer_bias(self, layer: int, n_experts: int) -> tuple:
        """The layer's bias [n_experts] as a filler."""
        out = np.zeros(n_experts, np.float32)
        out[np.random.default_rng((self.seed, layer)).choice(n_experts, self.hot,
                                                              replace=False)] = self.bias
        return ("values_f32", tuple(out.tolist()))


@dataclasses.dataclass(frozen=True)
class Routers:
    """A checkpoint's routers as tidejax reads them: the family's RouterSpec, each MoE layer's
    router weight and correction bias names (the checkpoint table's), the hidden size."""

    spec: RouterSpec
    names: list[tuple[int, str, str | None]]
    hidden: int


def routers_of(cfg: dict) -> Routers:
    """The routers of config.json `cfg`: the RouterSpec the family declares its MoE layers with
    (its model.router_spec; GLM-5's is the shared noaux router)."""
    declared = Declared.of(cfg)
    if cfg["model_type"] == "glm_moe_dsa":
        spec = noaux_router(declared.cfg)
    else:
        model = importlib.import_module(FAMILY_MODULES[cfg["model_type"]].rsplit(".", 1)[0] + ".model")
        spec = model.router_spec(declared.cfg)
    return Routers(spec, declared.routers(), declared.cfg.hidden_size)


_route = jax.jit(route, static_argnames="spec")


def hot_bias(spec: RouterSpec, logit_std: float, hot: int, share: float = HOT_SHARE) -> float:
    """The bias for which `hot` of a layer's experts take `share` of its picks, solved once by
    bisection on SKEW_SAMPLES rows of independent N(0, logit_std**2) logits (what a synthetic
    router gives on unit-RMS hidden states) through the router's own selection (tidejax's route
    over an identity weight: scores, temperature, groups, top-k)."""
    if not spec.use_bias:
        raise SystemExit("error: --router-skew: this router has no correction bias (noaux_tc)")
    e = spec.n_experts
    logits = np.random.default_rng(0).standard_normal((SKEW_SAMPLES, e)).astype(np.float32)
    logits *= logit_std
    eye = np.eye(e, dtype=np.float32)

    def taken(bias: float) -> float:
        ids = _route(logits, eye, np.where(np.arange(e) < hot, bias, 0.0).astype(np.float32),
                     spec=spec)[0]
        return float(np.mean(np.asarray(ids) < hot))

    low, high = 0.0, 1.0
    while taken(high) < share:
        low, high = high, 2 * high
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if taken(mid) < share else (low, mid)
    return (low + high) / 2


def router_skew(cfg: dict, seed: int) -> RouterSkew:
    """--router-skew for the config `cfg` (a V3-family or V4.1 config.json): the hot experts'
    bias from the logits the synthetic router weights give (std sqrt(hidden * E[w^2]) on
    unit-RMS hidden states)."""
    routers = routers_of(cfg)
    hot = round(HOT_FRACTION * routers.spec.n_experts)
    logit_std = math.sqrt(routers.hidden * uniform_mean_square(routers.hidden))
    return RouterSkew(hot, hot_bias(routers.spec, logit_std, hot), seed)


def measure_picks(model: Path, tokens: int = MEASURE_TOKENS, seed: int = 0
                  ) -> tuple[int, int, list[float]]:
    """(H, E, each MoE layer's share of picks taken by its H most picked experts), H the
    HOT_FRACTION of its E experts, for `tokens` random unit-RMS hidden states through each
    router as written (its weight and bias, through tidejax's route)."""
    from tidejax.checkpoint.safetensors_io import SafetensorsFile

    cfg = json.loads((model / "config.json").read_text())
    routers = routers_of(cfg)
    weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]

    def read(name: str) -> np.ndarray:
        return np.asarray(SafetensorsFile(model / weight_map[name]).view(name), np.float32)

    e = routers.spec.n_experts
    hot = round(HOT_FRACTION * e)
    x = np.random.default_rng(seed).standard_normal((tokens, routers.hidden)).astype(np.float32)
    x /= np.sqrt(np.mean(x * x, axis=-1, keepdims=True))  # as the RMSNorm before the router
    shares = []
    for _, weight, bias in routers.names:
        ids = _route(x, read(weight), read(bias) if bias else np.zeros(e, np.float32),
                     spec=routers.spec)[0]
        counts = np.sort(np.bincount(np.asarray(ids).reshape(-1), minlength=e))[::-1]
        shares.append(float(counts[:hot].sum() / counts.sum()))
    return hot, e, shares


# -- writing ---------------------------------------------------------------------------------------

class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.start, self.last = total, 0, time.perf_counter(), 0.0

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last > 1.0 or self.done == self.total:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9) / 1e9
            end = "\n" if self.done == self.total or not sys.stderr.isatty() else "\r"
            print(f"writing {self.done / 1e9:7.2f} / {self.total / 1e9:.2f} GB ({rate:.2f} GB/s)",
                  end=end, file=sys.stderr, flush=True)


JOB_BYTES = 64 << 20  # a worker fills and writes about this much at a time


def shard_jobs(path: Path, tensors: list[tuple], seed: tuple) -> list[tuple]:
    """Writes the shard's header (sized file, data to come) and returns its fill jobs:
    (path, byte offset, filler, dtype, shape of the rows, seed). Each job has its own seed, so the
    bytes do not depend on how the jobs are spread over workers."""
    header, offset = {}, 0
    for name, dtype, shape, _ in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)
    jobs, base = [], 8 + len(text)
    for name, dtype, shape, filler in tensors:
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        step = max(1, JOB_BYTES // row_bytes)
        start = base + header[name]["data_offsets"][0]
        for first in range(0, shape[0], step):
            rows = (min(step, shape[0] - first),) + tuple(shape[1:])
            jobs.append((str(path), start + first * row_bytes, filler, dtype, rows,
                         (*seed, len(jobs))))
    return jobs


def run_job(job: tuple) -> int:
    path, offset, filler, dtype, rows, seed = job
    data = np.ascontiguousarray(fill(filler, np.random.default_rng(seed), rows))
    if data.nbytes != math.prod(rows) * dtype.itemsize:
        raise ValueError(f"filler {filler} gave {data.dtype}, the tensor is {dtype}")
    buf, done = data.reshape(-1).view(np.uint8), 0
    fd = os.open(path, os.O_WRONLY)
    try:
        while done < len(buf):
            done += os.pwrite(fd, buf[done:], offset + done)
    finally:
        os.close(fd)
    return data.nbytes


def read_tokenizer(tokenizer_dir: Path):
    """(tokenizers.Tokenizer, the config's special token ids) of `tokenizer_dir`."""
    import tokenizers

    tok_file = tokenizer_dir / "tokenizer.json"
    if not tok_file.exists():
        raise SystemExit(f"error: {tok_file}: tokenizer not found (--tokenizer DIR)")
    backend = tokenizers.Tokenizer.from_file(str(tok_file))
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    special = {"bos_token_id": backend.token_to_id(tok_config["bos_token"]),
               "eos_token_id": [backend.token_to_id(t) for t in (tok_config["eos_token"], "<|end|>")
                                if backend.token_to_id(t) is not None],
               "pad_token_id": backend.token_to_id(tok_config.get("pad_token") or "")}
    return backend, special


def write_headers(out: Path, shards: list[tuple[str, list]], seed: int = 0) -> list[tuple]:
    """Writes each shard's header (the file sized, its data to come) and the index; returns the
    jobs that fill the data."""
    out.mkdir(parents=True, exist_ok=True)
    jobs = [job for k, (file, tensors) in enumerate(shards)
            for job in shard_jobs(out / file, tensors, (seed, k))]
    weight_map = {name: file for file, tensors in shards for name, *_ in tensors}
    total = sum(math.prod(job[4]) * job[3].itemsize for job in jobs)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return jobs


def write_checkpoint(out: Path, cfg: dict, shards: list[tuple[str, list]], tokenizer_dir: Path,
                     seed: int = 0, workers: int = 1) -> int:
    """Writes the shards [(file, tensors)], their index, the tokenizer files and, last,
    config.json; returns the bytes of tensor data."""
    jobs = write_headers(out, shards, seed)
    progress = Progress(sum(math.prod(job[4]) * job[3].itemsize for job in jobs))
    if workers > 1:
        # spawned: --router-skew has started JAX's threads here, and a fork of a multithreaded
        # process can deadlock
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for n in pool.imap_unordered(run_job, jobs):
                progress.add(n)
    else:
        for job in jobs:
            progress.add(run_job(job))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return progress.total


# flags of one family's shapes, with their defaults (GLM's --dense-layers: the shape's own)
V3_FLAGS = {"dense_layers": 1, "experts": "mxfp4", "max_positions": 16384}
GLM_FLAGS = {"dense_layers": None, "experts": "mxfp4", "max_positions": 16384}
BLOCK_SPARSE_FLAGS = {"dense_layers": None, "experts": "bf16", "max_positions": 16384}
DS41_FLAGS = {"engram_gib": None}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked, each family's flags defaulted (--tiny: --shape tiny --layers 3)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--shape",
                        choices=sorted(SHAPES | GLM_SHAPES | GLM5_SHAPES | QWEN3_SHAPES
                                       | GPT_OSS_SHAPES | BLOCK_SPARSE_SHAPES | DS41_SHAPES),
                        default="v41-flash")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny --layers 3 (tests)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--n-experts", type=int, default=0,
                        help="routed experts per layer (default: the shape's)")
    parser.add_argument("--dense-layers", type=int,
                        help="leading dense-MLP layers (V3 family: 1; GLM, GLM-5: the shape's)")
    parser.add_argument("--experts", choices=("mxfp4", "bf16"),
                        help="V3, GLM and GLM-5 families (mxfp4)")
    parser.add_argument("--max-positions", type=int, help="V3, GLM and GLM-5 families (16384)")
    parser.add_argument("--engram-gib", type=float,
                        help="GiB of each Engram table (V4.1 family; ds41-flash: 4, real: 94.4)")
    parser.add_argument("--vocab", type=int,
                        help="rows of the embeddings and head (default: the tokenizer's ids)")
    parser.add_argument("--tokenizer", type=Path, default=REPO / "models" / "demo",
                        help="directory with tokenizer.json and tokenizer_config.json")
    parser.add_argument("--router-skew", action="store_true",
                        help=f"bias each MoE layer's router so that {100 * HOT_FRACTION:.0f}%% of its "
                             f"experts take about {100 * HOT_SHARE:.0f}%% of the picks")
    parser.add_argument("--mtp-layers", type=int, default=0,
                        help="MTP (NextN) layers after the last decoder layer, per-expert BF16 "
                             "experts as published (families that draft: V3, GLM-4.5, GLM-5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes filling and writing the shards")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shape, args.layers = "tiny", 3
    shape = args.shape
    flags = (DS41_FLAGS if shape in DS41_SHAPES
             else GLM_FLAGS if shape in GLM_SHAPES | GLM5_SHAPES | QWEN3_SHAPES | GPT_OSS_SHAPES
             else BLOCK_SPARSE_FLAGS if shape in BLOCK_SPARSE_SHAPES else V3_FLAGS)
    for name in (DS41_FLAGS | V3_FLAGS).keys() - flags.keys():
        if getattr(args, name) is not None:
            raise SystemExit(f"error: --{name.replace('_', '-')} does not apply to --shape {shape}")
    for name, default in flags.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def plan(args: argparse.Namespace) -> tuple[dict, list[tuple[str, list]], RouterSkew | None]:
    """(config.json, the shards [(file, tensors)], the router skew or None) the arguments ask
    for; nothing is written."""
    shape, layers = args.shape, args.layers
    backend, special = read_tokenizer(args.tokenizer)
    vocab = backend.get_vocab_size() if args.vocab is None else args.vocab
    if vocab < backend.get_vocab_size():
        raise SystemExit(f"error: --vocab {vocab} is below the tokenizer's "
                         f"{backend.get_vocab_size()} ids")
    if shape in DS41_SHAPES:
        cfg = ds41_config(shape, layers, vocab, special, compressed_token_map(backend),
                          args.n_experts, args.engram_gib)
    else:
        cfg = shape_config(shape, layers, args.dense_layers, vocab, args.max_positions, special,
                           args.n_experts)
    if args.mtp_layers:
        if family_for(cfg, "synthetic config.json").build_mtp is None:
            raise SystemExit(f"error: --mtp-layers: --shape {shape}'s family drafts nothing")
        cfg["num_nextn_predict_layers"] = args.mtp_layers
    skew = router_skew(cfg, args.seed) if args.router_skew else None
    if skew:
        cfg["tidejax_synthetic"]["router_skew"] = {
            **dataclasses.asdict(skew), "hot_fraction": HOT_FRACTION, "target_share": HOT_SHARE}
    return cfg, checkpoint_tensors(cfg, args.experts, skew.layer_bias if skew else None), skew


def main(argv=None) -> int:
    args = parse_args(argv)
    shape, layers = args.shape, args.layers
    start = time.perf_counter()
    cfg, shards, skew = plan(args)
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    if shape in DS41_SHAPES:
        t = cfg["text_config"]
        what = (f"{layers} layers (of the 40: {cfg['tidejax_synthetic']['layers_of_40']}) x "
                f"{t['n_routed_experts']} FP4 experts, Engram tables of "
                f"{t['engram_num_embeddings']} rows")
    else:
        family_cfg = Declared.of(cfg).cfg
        what = (f"{layers} layers ({len(family_cfg.moe_layers)} MoE x "
                f"{family_cfg.n_routed_experts} experts, {args.experts})")
    total = write_checkpoint(args.out, cfg, shards, args.tokenizer, args.seed, args.workers)
    print(f"{args.out}: {shape}, {what}, vocab {vocab}, "
          f"{total / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s")
    hot, e, shares = measure_picks(args.out, seed=args.seed)
    print(f"router picks: the {hot} most picked of each MoE layer's {e} experts take "
          f"{np.mean(shares):.3f} of the picks (per layer {min(shares):.3f} to "
          f"{max(shares):.3f}; {MEASURE_TOKENS} random unit-RMS hidden states)"
          + (f"; --router-skew: {hot} experts a layer biased +{skew.bias:.4f} for a share of "
             f"{HOT_SHARE}" if skew else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
