"""DeepSeek-V4.1 configuration: the composite config.json (`text_config` nested) read into one
frozen dataclass, with the layer schedule (compress ratios, KV sources, index sources, candidate
source) resolved and validated. Every error names the file and the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from tidejax.errors import ConfigError
from tidejax.fields import Fields, read_json
from tidejax.models.layers.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int  # the single K=V latent width
    rope_dim: int  # qk_rope_head_dim: the trailing rotated channels
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig  # attention_factor forced to 1 (no YaRN mscale)
    # CSA2 schedule
    compress_ratios: tuple[int, ...]  # per layer: 0 window only, 1 per-token, r > 1 pooled
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int  # -1: no two-level top-k
    candidate_block_size: int
    candidate_topk_blocks: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    # mHC
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    gate_temp: float
    swiglu_limit: float
    # Engram
    engram_layers: tuple[int, ...]
    engram_max_ngram: int
    engram_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_compressed_vocab: int
    engram_num_embeddings: tuple[int, ...]
    engram_pad_id: int
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "deepseek_v41"
    source: str = ""

    # --- the schedule, as the forward uses it

    def owns_index_keys(self, layer: int) -> bool:
        return layer in self.kv_sources and layer in self.index_sources

    def layer_kind(self, layer: int) -> tuple:
        """What a layer's body depends on besides its params, MoE row and cache rows: two layers
        of one kind run the same computation."""
        return (self.compress_ratios[layer], layer in self.kv_sources,
                layer in self.index_sources, layer == self.candidate_source,
                0 <= self.candidate_source < layer, layer in self.engram_layers)

    def layer_runs(self) -> tuple[tuple[int, int, int], ...]:
        """(first, period, repeats) of each run of layers the forward scans: `repeats` >= 2
        blocks of `period` layers, each block the same kinds in the same order, none a KV source
        (it writes its own pool) or an Engram layer (it reads its own table); at each layer the
        period that covers the most layers (the shortest of those)."""
        n_layers = self.num_layers
        free = [i not in self.kv_sources and i not in self.engram_layers for i in range(n_layers)]

        def repeats(first: int, period: int) -> int:
            def same(block: int) -> bool:
                return all(free[first + block * period + k] and self.layer_kind(
                    first + block * period + k) == self.layer_kind(first + k)
                    for k in range(period))
            n = 0
            while first + (n + 1) * period <= n_layers and same(n):
                n += 1
            return n

        runs, first = [], 0
        while first < n_layers:
            best = max(((repeats(first, p), p) for p in range(1, (n_layers - first) // 2 + 1)),
                       key=lambda run: (run[0] * run[1] if run[0] > 1 else 0, -run[1]),
                       default=(0, 1))
            if best[0] > 1:
                runs.append((first, best[1], best[0]))
                first += best[0] * best[1]
            else:
                first += 1
        return tuple(runs)

    @property
    def engram_cols(self) -> int:
        return (self.engram_max_ngram - 1) * self.engram_heads

    @property
    def page_multiple(self) -> int:
        """A KV page must hold whole groups of every KV source: page_size is a multiple of this
        (the least common multiple of their compress ratios)."""
        return math.lcm(1, *(self.compress_ratios[s] for s in self.kv_sources))

    @staticmethod
    def from_file(path: str | os.PathLike) -> "V41Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return V41Config.from_hf(read_json(path), str(path))

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "V41Config":
        top_type = raw.get("model_type")
        if top_type not in ("deepseek_v41", "deepseek_v41_text"):
            raise ConfigError(f"{source}: field 'model_type' = {top_type!r}, expected 'deepseek_v41'")
        text = raw.get("text_config", raw) if top_type == "deepseek_v41" else raw
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: field 'text_config' should be an object")
        return _parse_text(text, f"{source}: text_config" if text is not raw else source)


def _parse_text(t: dict, src: str) -> V41Config:
    f = Fields(t, src)

    n_layers = f.req("num_hidden_layers")
    head_dim, rope_dim = f.req("head_dim"), f.req("qk_rope_head_dim")
    hidden, heads = f.req("hidden_size"), f.req("num_attention_heads")
    n_mtp = f.opt("num_nextn_predict_layers", 0)
    ratios = list(f.req("compress_ratios", tuple))
    ratios = (ratios + [0] * (n_layers + n_mtp))[:n_layers + n_mtp][:n_layers]
    kv_sources = t.get("kv_source_layer_ids")
    if kv_sources is None:  # the first layer of each run of equal nonzero ratios
        kv_sources = [i for i, r in enumerate(ratios) if r and (i == 0 or ratios[i - 1] != r)]
    kv_sources = tuple(sorted(f.cast("kv_source_layer_ids", list(kv_sources), tuple)))
    index_sources = t.get("index_source_layer_ids")
    index_sources = tuple(sorted(f.cast("index_source_layer_ids", list(index_sources), tuple))
                          if index_sources is not None else kv_sources)
    candidate = t.get("candidate_source_layer_id")
    candidate = (kv_sources[-1] if kv_sources else -1) if candidate is None else f.cast(
        "candidate_source_layer_id", candidate, int)
    max_pos = f.opt("max_position_embeddings", 4096)

    o_groups = f.req("o_groups")
    if heads % o_groups:
        raise ConfigError(f"{src}: field 'o_groups' = {o_groups} does not divide "
                          f"num_attention_heads = {heads}")
    if f.opt("hidden_act", "silu", str) != "silu":
        raise ConfigError(f"{src}: field 'hidden_act' = {t['hidden_act']!r} is not supported (silu)")
    if f.opt("scoring_func", "sqrtsoftplus", str) != "sqrtsoftplus":
        raise ConfigError(f"{src}: field 'scoring_func' = {t['scoring_func']!r} is not supported "
                          "(sqrtsoftplus)")
    if f.req("sliding_window") < 2:
        raise ConfigError(f"{src}: field 'sliding_window' should be at least 2")

    for i in kv_sources + index_sources:
        if not 0 <= i < n_layers or not ratios[i]:
            raise ConfigError(f"{src}: layer {i} in kv_source_layer_ids / index_source_layer_ids "
                              "needs 0 <= layer < num_hidden_layers and compress_ratios[layer] > 0")
    for i, r in enumerate(ratios):
        if r < 0:
            raise ConfigError(f"{src}: field 'compress_ratios'[{i}] = {r} is negative")
        if r and not any(s <= i for s in kv_sources):
            raise ConfigError(f"{src}: layer {i} has compress_ratios {r} but no KV source at or "
                              "before it (kv_source_layer_ids)")
    for s in kv_sources:
        # A KV group whose source runs no indexer would reuse the previous group's selection,
        # which indexes another group's entries: the reference crashes there; refuse it.
        if any(ratios[i] for i in range(s, n_layers)) and s not in index_sources:
            raise ConfigError(f"{src}: KV source layer {s} is not in index_source_layer_ids, so "
                              "its group has no selection over its compressed entries")
    if candidate >= 0 and candidate not in index_sources:
        raise ConfigError(f"{src}: field 'candidate_source_layer_id' = {candidate} is not an "
                          "index source")

    engram_layers = tuple(f.opt("engram_layer_ids", (), tuple))
    num_embeddings = tuple(f.opt("engram_num_embeddings", (), tuple))
    if len(num_embeddings) != len(engram_layers):
        raise ConfigError(f"{src}: field 'engram_num_embeddings' needs one entry per "
                          f"engram_layer_ids entry ({len(engram_layers)})")

    rope_params = t.get("rope_parameters") or {}
    main_raw = dict(rope_params.get("main") or {"rope_theta": f.req("rope_theta", float)})
    compress_raw = dict(rope_params.get("compress") or {})
    if not compress_raw:  # published layout: compress_rope_theta + rope_scaling
        compress_raw = dict(t.get("rope_scaling") or {})
        compress_raw["rope_theta"] = f.req("compress_rope_theta", float)
    main_rope = _rope(main_raw, head_dim, rope_dim, max_pos, f"{src}: rope_parameters.main")
    compress_rope = dataclasses.replace(
        _rope(compress_raw, head_dim, rope_dim, max_pos, f"{src}: rope_parameters.compress"),
        attention_factor=1.0)

    eos = t.get("eos_token_id")
    return V41Config(
        vocab_size=f.req("vocab_size"), hidden_size=hidden, num_layers=n_layers, num_heads=heads,
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=f.req("q_lora_rank"), o_groups=o_groups,
        o_lora_rank=f.req("o_lora_rank"), sliding_window=f.req("sliding_window"),
        rms_norm_eps=f.opt("rms_norm_eps", 1e-6, float), main_rope=main_rope,
        compress_rope=compress_rope, compress_ratios=tuple(ratios), kv_sources=kv_sources,
        index_sources=index_sources, candidate_source=candidate,
        candidate_block_size=f.opt("candidate_block_size", 8),
        candidate_topk_blocks=f.opt("candidate_topk_blocks", 2048),
        index_heads=f.req("index_n_heads"), index_head_dim=f.req("index_head_dim"),
        index_topk=f.req("index_topk"), hc_mult=f.req("hc_mult"),
        hc_sinkhorn_iters=f.opt("hc_sinkhorn_iters", 20), hc_eps=f.opt("hc_eps", 1e-6, float),
        n_routed_experts=f.req("n_routed_experts"), num_experts_per_tok=f.req("num_experts_per_tok"),
        moe_intermediate_size=f.req("moe_intermediate_size"),
        norm_topk_prob=f.opt("norm_topk_prob", True, bool),
        routed_scaling_factor=f.opt("routed_scaling_factor", 1.0, float),
        gate_temp=f.opt("gate_temp", 1.0, float), swiglu_limit=f.opt("swiglu_limit", 0.0, float),
        engram_layers=engram_layers, engram_max_ngram=f.opt("engram_max_ngram_size", 3),
        engram_heads=f.opt("engram_n_heads", 1), engram_head_dim=f.opt("engram_head_dim", 32),
        engram_vocab_size=f.opt("engram_vocab_size", 0),
        engram_compressed_vocab=f.opt("engram_compressed_vocab_size", 0),
        engram_num_embeddings=num_embeddings, engram_pad_id=f.opt("engram_pad_id", 0),
        tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        source=src)


def _rope(params: dict, head_dim: int, rope_dim: int, max_pos: int, src: str) -> RopeConfig:
    factor = params.get("partial_rotary_factor")
    if factor is not None and int(head_dim * factor) != rope_dim:
        raise ConfigError(f"{src}: partial_rotary_factor {factor} x head_dim {head_dim} != "
                          f"qk_rope_head_dim {rope_dim}")
    return RopeConfig.from_hf({"rope_parameters": params}, rope_dim, max_pos, src)
