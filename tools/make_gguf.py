"""Write a llama.cpp GGUF of a checkpoint written by tools/make_synthetic.py, so llama.cpp runs the
very weights tidejax runs (bench/vs_llamacpp.py): a DeepSeek-V3-family checkpoint (model_type
deepseek_v3 / deepseek_v2) as llama.cpp's architecture `deepseek2`, a GLM-4.5 one (glm4_moe) as
`glm4moe`.

    python -m tools.make_gguf SYNTHETIC_DIR OUT.gguf

Needs gguf-py (PyPI `gguf`, or llama.cpp's own gguf-py folder on PYTHONPATH). What goes in, as
llama.cpp's converter (convert_hf_to_gguf.py: DeepseekV2Model, Glm4MoeModel) writes them:
  hparams     both: block count, context, embedding, feed-forward, heads, kv heads, rms eps,
              leading dense blocks, vocab size, experts: count, used, shared, feed-forward,
              weights scale and norm, gating func
              deepseek2: kv heads 1 (MLA is run as multi-query attention over the latent), q / kv
              lora ranks, key / value length of the latent (kv_lora + rope, kv_lora) and per head
              (`_mla`: nope + rope, v), rope dims and theta (YaRN keys where the config has them),
              gating sigmoid or softmax (scoring_func), group counts
              glm4moe: key / value length head_dim, rope dims the rotated channels of a head
              (partial rotary), theta, gating sigmoid, nextn_predict_layers 0 (the MTP layer is
              not written; block count is the decoder layers)
  attention   deepseek2: attn_q_a / q_a_norm / q_b, attn_kv_a_mqa / kv_a_norm, attn_output, and
              kv_b_proj split per head: attn_k_b its key rows transposed [heads, kv_lora, nope],
              attn_v_b its value rows [heads, v, kv_lora]
              glm4moe: attn_q / attn_k / attn_v with their biases, attn_output, attn_q_norm /
              attn_k_norm (where the config has use_qk_norm), post_attention_norm (the norm before
              the MLP, deepseek2's ffn_norm). q and k go over unpermuted: llama.cpp runs glm4moe's
              rope NEOX-style (rotate-half on the first rope-dims channels of a head), as tidejax
              does (layers/gqa.py)
  *_exps      the routed experts merged per layer as GGML MXFP4: ffn_gate_exps / ffn_up_exps from
              gate_up_proj's two halves, ffn_down_exps from down_proj (blocks repacked, below)
  exp_probs_b the router's correction bias (noaux_tc: picks by sigmoid score + bias, weighs by the
              score)
  dense       bf16 as stored; 1-D tensors (norms, biases) and routers (ffn_gate_inp) widened to
              F32, as the converter stores them (llama.cpp's norm and router paths want F32)
  vocabulary  the checkpoint's tokenizer.json as a `gpt2` BPE vocab (tokens, merges, types:
              CONTROL for special added tokens, USER_DEFINED for other added ones, NORMAL, UNUSED
              for ids the tokenizer lacks), pre-tokenizer `gpt-2`: the demo tokenizer is a
              ByteLevel one whose split regex is GPT-2's, which llama.cpp runs for `gpt-2`

MXFP4 in GGML is a 17-byte block: the e8m0 scale, then 16 bytes where byte j holds value j (low
nibble) and value j + 16 (high nibble). Ours (tidejax/checkpoint/mxfp4.py, gpt-oss layout) keeps
the scales apart and byte j holds values 2j (low) and 2j + 1 (high); `ggml_mxfp4` repacks.
Tensors are written one at a time, so memory holds one layer's expert tensor at most. Prints the
tensor bytes of both files: they differ by the widened F32 tensors only.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import MODEL_TENSOR as T

from tidejax.errors import CheckpointError
from tidejax.checkpoint import CheckpointReader
from tidejax.checkpoint.mxfp4 import BLOCK
from tidejax.errors import ConfigError
from tidejax.fields import read_json
from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.glm4_moe.config import Glm4MoeConfig

PRE_TOKENIZER = "gpt-2"
BF16 = np.dtype(ml_dtypes.bfloat16)


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Our MXFP4 (blocks [..., G, 16] uint8, byte j = values 2j | 2j+1 << 4; scales [..., G])
    -> GGML's blocks [..., G * 17] uint8: the scale, then byte j = values j | j+16 << 4."""
    first, second = blocks[..., :8], blocks[..., 8:]  # values 0..15 and 16..31
    even = (first & 0x0F) | (second << 4)  # GGML byte 2m: values 2m and 2m + 16
    odd = (first >> 4) | (second & 0xF0)  # GGML byte 2m + 1: values 2m + 1 and 2m + 17
    codes = np.stack([even, odd], axis=-1).reshape(blocks.shape)
    out = np.concatenate([scales[..., None], codes], axis=-1)  # [..., G, 17]
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * (1 + BLOCK // 2))


# -- the tensor map --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Out:
    """One GGUF tensor: name, numpy-order shape (GGUF lists it reversed), GGML type, bytes."""

    name: str
    shape: tuple[int, ...]
    qtype: Q

    @property
    def dtype(self) -> np.dtype:
        """The array it is written from: its values (F32, BF16) or its bytes (MXFP4)."""
        return {Q.F32: np.dtype(np.float32), Q.BF16: BF16}.get(self.qtype, np.dtype(np.uint8))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """`shape`, with the last axis in bytes for a quantized type."""
        if self.dtype != np.uint8:
            return self.shape
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * size)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.stored_shape)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Piece:
    """A checkpoint tensor (by its logical name) and the GGUF tensors made from it, in order."""

    source: str
    outs: tuple[Out, ...]
    make: Callable[[CheckpointReader, str], Iterator[np.ndarray]]


Rule = tuple[tuple[Out, ...], Callable[[CheckpointReader, str], Iterator[np.ndarray]]]


@dataclasses.dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture: the model types written as it, how their config is read and
    checked, the checkpoint tensors (names within a layer, or whole) that go over as they are
    (a `.weight` or `.bias` as the GGUF tensor's weight or bias), the rule for tensors of its
    own (None: no place), the tensors its loader requires of a layer (attention and norms, by
    the config; an MoE layer's), and its own hparams."""

    arch: gguf.MODEL_ARCH
    model_types: tuple[str, ...]
    read: Callable[[dict, str], Any]
    direct: dict[str, T]
    special: Callable[[Any, str, Callable[..., str], int | None, tuple[int, ...]], Rule | None]
    attention: Callable[[Any], list[tuple[T, str]]]
    moe: list[tuple[T, str]]
    hparams: Callable[[gguf.GGUFWriter, Any], None]

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]

    def tensor(self, tensor: T, block: int | None = None, suffix: str = "weight") -> str:
        """The GGUF name of `tensor` (of layer `block`)."""
        if tensor not in gguf.MODEL_TENSORS[self.arch]:
            raise ValueError(f"{tensor} is not a tensor of llama.cpp's {self.name}")
        return gguf.TENSOR_NAMES[tensor].format(bid=block) + "." + suffix


# checkpoint tensors that go over as they are in every architecture
COMMON = {
    "model.embed_tokens.weight": T.TOKEN_EMBD, "model.norm.weight": T.OUTPUT_NORM,
    "lm_head.weight": T.OUTPUT, "input_layernorm.weight": T.ATTN_NORM,
    "mlp.gate_proj.weight": T.FFN_GATE, "mlp.up_proj.weight": T.FFN_UP,
    "mlp.down_proj.weight": T.FFN_DOWN, "mlp.shared_experts.gate_proj.weight": T.FFN_GATE_SHEXP,
    "mlp.shared_experts.up_proj.weight": T.FFN_UP_SHEXP,
    "mlp.shared_experts.down_proj.weight": T.FFN_DOWN_SHEXP,
}
DENSE_MLP = [(T.FFN_GATE, "weight"), (T.FFN_UP, "weight"), (T.FFN_DOWN, "weight")]
MOE_MLP = [(T.FFN_GATE_INP, "weight"), (T.FFN_GATE_EXP, "weight"), (T.FFN_UP_EXP, "weight"),
           (T.FFN_DOWN_EXP, "weight"), (T.FFN_GATE_SHEXP, "weight"), (T.FFN_UP_SHEXP, "weight"),
           (T.FFN_DOWN_SHEXP, "weight")]


def _as_stored(reader, name):
    yield reader.read(name)


def _widened(reader, name):
    yield reader.read(name).astype(np.float32)


def _kv_b_split(nope: int, v: int, heads: int):
    def make(reader, name):
        kv_b = reader.read(name)  # [heads * (nope + v), kv_lora]
        per_head = kv_b.reshape(heads, nope + v, kv_b.shape[-1])
        yield np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))  # [heads, kv_lora, nope]
        yield np.ascontiguousarray(per_head[:, nope:])  # [heads, v, kv_lora]
    return make


def _experts(halves: int):
    def make(reader, name):
        blocks, scales = reader.read_mxfp4(name)  # [E, rows, G, 16], [E, rows, G]
        rows = blocks.shape[1] // halves
        for h in range(halves):  # gate_up_proj: gate rows first, then up (make_synthetic.py)
            part = slice(h * rows, (h + 1) * rows)
            yield ggml_mxfp4(blocks[:, part], scales[:, part])
    return make


def plan(reader: CheckpointReader, arch: Arch, cfg) -> list[Piece]:
    """Every checkpoint tensor with its GGUF tensors; a tensor the map does not know, or an
    expected one that is absent, raises CheckpointError naming it."""
    shapes = {name: t.shape for name, t in reader.tensors.items()}

    def simple(tensor: T, block: int | None, qtype: Q, shape, suffix="weight") -> Rule:
        return ((Out(arch.tensor(tensor, block, suffix), tuple(shape), qtype),),
                _widened if qtype == Q.F32 else _as_stored)

    def rule(source: str, block: int | None) -> Rule:
        shape = shapes[source]
        key = source.split(f"model.layers.{block}.", 1)[-1] if block is not None else source
        if key in arch.direct:  # 1-D tensors (norms, biases) widened to F32, as the converter does
            if len(shape) > 1 and reader.dtype(source) != BF16:
                raise CheckpointError(f"{reader.file_of(source)}: '{source}' is "
                                      f"{reader.dtype(source)}: dense weights go over as bf16")
            return simple(arch.direct[key], block, Q.F32 if len(shape) == 1 else Q.BF16, shape,
                          suffix=key.rsplit(".", 1)[-1])
        if key == "mlp.gate.weight":  # the router: F32, as llama.cpp's converter keeps it
            return simple(T.FFN_GATE_INP, block, Q.F32, shape)
        if key == "mlp.gate.e_score_correction_bias":
            return simple(T.FFN_EXP_PROBS_B, block, Q.F32, shape, suffix="bias")
        if key in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            if reader.tensors[source].format != "mxfp4":
                raise CheckpointError(f"{reader.file_of(source)}: '{source}' is not MXFP4 "
                                      "(make_gguf writes MXFP4 experts: make_synthetic.py "
                                      "--experts mxfp4)")
            e, rows, n = shape
            if key == "mlp.experts.down_proj":
                return ((Out(arch.tensor(T.FFN_DOWN_EXP, block), (e, rows, n), Q.MXFP4),),
                        _experts(1))
            return ((Out(arch.tensor(T.FFN_GATE_EXP, block), (e, rows // 2, n), Q.MXFP4),
                     Out(arch.tensor(T.FFN_UP_EXP, block), (e, rows // 2, n), Q.MXFP4)),
                    _experts(2))
        made = arch.special(cfg, key, arch.tensor, block, shape)
        if made is not None:
            return made
        raise CheckpointError(f"{reader.file_of(source)}: tensor '{source}' has no place in a "
                              f"{arch.name} GGUF")

    def layer_of(source: str) -> int | None:
        return int(source.split(".")[2]) if source.startswith("model.layers.") else None

    def order(source: str) -> tuple[int, str]:  # the embedding, the layers, the head
        block = layer_of(source)
        return (-1 if source == "model.embed_tokens.weight" else
                cfg.num_layers if block is None else block, source)

    pieces = []
    for source in sorted(reader.tensors, key=order):
        block = layer_of(source)
        if block is not None and block >= cfg.num_layers:
            raise CheckpointError(f"{reader.file_of(source)}: tensor '{source}' is past the "
                                  f"config's {cfg.num_layers} layers (MTP layers are not written)")
        outs, make = rule(source, block)
        pieces.append(Piece(source, outs, make))
    _check_complete(reader, arch, cfg, {o.name for p in pieces for o in p.outs})
    return pieces


def required(arch: Arch, cfg) -> list[str]:
    """The GGUF tensors llama.cpp's loader for `arch` requires of this config (src/models/
    deepseek2.cpp, glm4-moe.cpp), and those the config says tidejax runs (GLM's q / k norm)."""
    want = [arch.tensor(T.TOKEN_EMBD), arch.tensor(T.OUTPUT_NORM), arch.tensor(T.OUTPUT)]
    for i in range(cfg.num_layers):
        mlp = DENSE_MLP if i not in cfg.moe_layers else arch.moe
        want += [arch.tensor(t, i, suffix) for t, suffix in [*arch.attention(cfg), *mlp]]
    return want


def _check_complete(reader: CheckpointReader, arch: Arch, cfg, names: set[str]) -> None:
    missing = [n for n in required(arch, cfg) if n not in names]
    if missing:
        raise CheckpointError(f"{reader.source}: no tensor for GGUF {', '.join(missing[:5])}"
                              + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))


# -- DeepSeek-V3 family: deepseek2 -----------------------------------------------------------------

def _read_deepseek(raw: dict, path: str) -> DeepseekV3Config:
    cfg = DeepseekV3Config.from_hf(raw, path)
    if cfg.q_lora_rank is None:
        raise ConfigError(f"{path}: field 'q_lora_rank' is null: make_gguf writes q_lora models")
    if cfg.moe_layer_freq != 1:
        raise ConfigError(f"{path}: field 'moe_layer_freq' = {cfg.moe_layer_freq}: llama.cpp's "
                          "deepseek2 has every layer after the leading dense ones MoE (1)")
    return cfg


def _deepseek_kv_b(cfg: DeepseekV3Config, key: str, name, block, shape) -> Rule | None:
    if key != "self_attn.kv_b_proj.weight":
        return None
    h, nope, v, c = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    return ((Out(name(T.ATTN_K_B, block), (h, c, nope), Q.BF16),
             Out(name(T.ATTN_V_B, block), (h, v, c), Q.BF16)), _kv_b_split(nope, v, h))


def _deepseek_hparams(w: gguf.GGUFWriter, cfg: DeepseekV3Config) -> None:
    w.add_head_count_kv(1)  # MLA runs as multi-query attention over the latent
    w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_rope_freq_base(cfg.rope.theta)
    if cfg.rope.kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position)
        w.add_rope_scaling_yarn_beta_fast(cfg.rope.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(cfg.rope.beta_slow)
        if cfg.rope.mscale_all_dim:  # llama.cpp divides the key by 0.1 when it reads it
            w.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope.mscale_all_dim)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.scoring_func == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)


DEEPSEEK2 = Arch(
    arch=gguf.MODEL_ARCH.DEEPSEEK2, model_types=("deepseek_v3", "deepseek_v2"),
    read=_read_deepseek,
    direct=COMMON | {
        "post_attention_layernorm.weight": T.FFN_NORM, "self_attn.q_a_proj.weight": T.ATTN_Q_A,
        "self_attn.q_a_layernorm.weight": T.ATTN_Q_A_NORM, "self_attn.q_b_proj.weight": T.ATTN_Q_B,
        "self_attn.kv_a_proj_with_mqa.weight": T.ATTN_KV_A_MQA,
        "self_attn.kv_a_layernorm.weight": T.ATTN_KV_A_NORM, "self_attn.o_proj.weight": T.ATTN_OUT,
    },
    special=_deepseek_kv_b,
    attention=lambda cfg: [(t, "weight") for t in (
        T.ATTN_NORM, T.ATTN_Q_A_NORM, T.ATTN_KV_A_NORM, T.ATTN_Q_A, T.ATTN_Q_B, T.ATTN_KV_A_MQA,
        T.ATTN_K_B, T.ATTN_V_B, T.ATTN_OUT, T.FFN_NORM)],
    moe=MOE_MLP,  # exp_probs_b optional: softmax routers have none
    hparams=_deepseek_hparams,
)


# -- GLM-4.5: glm4moe ------------------------------------------------------------------------------

def _read_glm(raw: dict, path: str) -> Glm4MoeConfig:
    cfg = Glm4MoeConfig.from_hf(raw, path)
    if not cfg.attention_bias:
        raise ConfigError(f"{path}: field 'attention_bias' is false: llama.cpp's glm4moe loads "
                          "q / k / v biases")
    if cfg.rope.kind != "default":
        raise ConfigError(f"{path}: rope_type {cfg.rope.kind!r}: make_gguf writes GLM-4.5's "
                          "default rope only")
    if cfg.n_group != 1:
        raise ConfigError(f"{path}: field 'n_group' = {cfg.n_group}: llama.cpp's glm4moe routes "
                          "without groups (1)")
    return cfg


def _glm_hparams(w: gguf.GGUFWriter, cfg: Glm4MoeConfig) -> None:
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rotary_dim)  # partial rotary: the first rotary_dim channels
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_nextn_predict_layers(0)  # the MTP layer is not written


GLM4MOE = Arch(
    arch=gguf.MODEL_ARCH.GLM4_MOE, model_types=("glm4_moe",),
    read=_read_glm,
    direct=COMMON | {
        "post_attention_layernorm.weight": T.ATTN_POST_NORM,
        "self_attn.o_proj.weight": T.ATTN_OUT,
        "self_attn.q_norm.weight": T.ATTN_Q_NORM, "self_attn.k_norm.weight": T.ATTN_K_NORM,
    } | {f"self_attn.{p}_proj.{kind}": t for p, t in (("q", T.ATTN_Q), ("k", T.ATTN_K),
                                                      ("v", T.ATTN_V))
         for kind in ("weight", "bias")},
    special=lambda cfg, key, name, block, shape: None,
    attention=lambda cfg: [
        (T.ATTN_NORM, "weight"), *((t, s) for t in (T.ATTN_Q, T.ATTN_K, T.ATTN_V)
                                   for s in ("weight", "bias")),
        (T.ATTN_OUT, "weight"), (T.ATTN_POST_NORM, "weight"),
        *([(T.ATTN_Q_NORM, "weight"), (T.ATTN_K_NORM, "weight")] if cfg.use_qk_norm else [])],
    moe=[*MOE_MLP, (T.FFN_EXP_PROBS_B, "bias")],  # the loader requires the correction bias
    hparams=_glm_hparams,
)

ARCHES = {t: a for a in (DEEPSEEK2, GLM4MOE) for t in a.model_types}


# -- hparams and vocabulary ------------------------------------------------------------------------

def read_config(model: Path) -> tuple[Arch, Any]:
    """The architecture the checkpoint's model_type is written as, and its config, checked."""
    path = model / "config.json"
    raw = read_json(path)
    arch = ARCHES.get(raw.get("model_type"))
    if arch is None:
        raise ConfigError(f"{path}: field 'model_type' = {raw.get('model_type')!r}: make_gguf "
                          f"writes {', '.join(ARCHES)} checkpoints")
    return arch, arch.read(raw, str(path))


def add_hparams(w: gguf.GGUFWriter, arch: Arch, cfg, name: str) -> None:
    """The keys both architectures take from the same config fields, then `arch`'s own."""
    w.add_name(name)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    arch.hparams(w, cfg)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


@dataclasses.dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos: int
    eos: int
    pad: int | None
    add_bos: bool
    chat_template: str | None


def read_vocab(model: Path, vocab_size: int) -> Vocab:
    """The checkpoint's BPE tokenizer (tokenizer.json, tokenizer_config.json) as GGUF lists."""
    import tokenizers

    path, config_path = model / "tokenizer.json", model / "tokenizer_config.json"
    raw, config = read_json(path), read_json(config_path)
    if raw.get("model", {}).get("type") != "BPE":
        raise ConfigError(f"{path}: field 'model.type' = {raw.get('model', {}).get('type')!r}: "
                          "a gpt2 vocab needs a BPE tokenizer")
    backend = tokenizers.Tokenizer.from_file(str(path))
    ids = backend.get_vocab(with_added_tokens=True)
    if max(ids.values()) >= vocab_size:
        raise ConfigError(f"{path}: token id {max(ids.values())} is past the config's "
                          f"vocab_size {vocab_size}")
    added = backend.get_added_tokens_decoder()
    by_id = {i: t for t, i in ids.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        types.append(gguf.TokenType.NORMAL if i not in added else gguf.TokenType.CONTROL
                     if added[i].special else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]

    def special(field: str) -> int | None:
        text = config.get(field)
        if text is None:
            return None
        if backend.token_to_id(text) is None:
            raise ConfigError(f"{config_path}: field '{field}' = {text!r} is not a token")
        return backend.token_to_id(text)

    bos, eos = special("bos_token"), special("eos_token")
    if bos is None or eos is None:
        raise ConfigError(f"{config_path}: needs 'bos_token' and 'eos_token'")
    return Vocab(tokens, types, merges, bos, eos, special("pad_token"),
                 add_bos=backend.encode("a").ids[:1] == [bos],
                 chat_template=config.get("chat_template"))


def add_vocab(w: gguf.GGUFWriter, vocab: Vocab) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    if vocab.pad is not None:
        w.add_pad_token_id(vocab.pad)
    w.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


# -- writing ---------------------------------------------------------------------------------------

def checkpoint_bytes(reader: CheckpointReader) -> int:
    """Bytes of every stored tensor (MXFP4 blocks and scales both)."""
    return sum(int(np.prod(reader.shape(n))) * reader.dtype(n).itemsize for n in reader.names())


def write(model: Path, out: Path, progress: bool = True) -> tuple[int, int]:
    """Writes the GGUF of checkpoint `model` to `out`; returns (checkpoint, GGUF) tensor bytes."""
    arch, cfg = read_config(model)
    vocab = read_vocab(model, cfg.vocab_size)
    reader = CheckpointReader(model, progress=progress, label="writing GGUF")
    pieces = plan(reader, arch, cfg)
    w = gguf.GGUFWriter(out, arch.name)
    add_hparams(w, arch, cfg, model.name)
    add_vocab(w, vocab)
    for o in (o for p in pieces for o in p.outs):  # all tensor infos go before any data
        w.add_tensor_info(o.name, o.stored_shape, o.dtype, o.nbytes, raw_dtype=o.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for piece in pieces:
        for want, array in zip(piece.outs, piece.make(reader, piece.source), strict=True):
            if array.shape != want.stored_shape or array.dtype != want.dtype:
                raise AssertionError(f"{want.name}: made {array.dtype} {array.shape}, planned "
                                     f"{want.dtype} {want.stored_shape}")
            w.write_tensor_data(array)
    w.close()
    return checkpoint_bytes(reader), sum(o.nbytes for p in pieces for o in p.outs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="checkpoint directory (tools/make_synthetic.py)")
    parser.add_argument("out", type=Path, help="GGUF file to write")
    args = parser.parse_args(argv)
    try:
        ours, theirs = write(args.model, args.out)
    except (CheckpointError, ConfigError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{args.out}: tensor bytes {theirs:,} (checkpoint {ours:,}, "
          f"{(theirs - ours) / ours:+.4%}: norms, biases and routers widened to F32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
