"""DeepSeek-V4.1 (and its published checkpoints) as an engine family: routed experts into the
residency pool, Engram tables in host memory, hashed and read inside a decode step (engram.py, so
the decode is pipelined) and on the host for a prompt chunk (engram.prompt_rows); compressed
entries and indexer keys in the shared KV pool, window rings, group buffers and the Engram
look-back per lane."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.deepseek_v41.config import V41Config
from tidejax.models.deepseek_v41.engram import prompt_rows
from tidejax.models.deepseek_v41.model import DeepseekV41, V41Lanes, V41Pages
from tidejax.models.deepseek_v41.weights import expert_dims, load_weights
from tidejax.models.registry import register

register(Family(
    name="deepseek_v41",
    model_types=("deepseek_v41",),
    config_from_hf=V41Config.from_hf,
    build=DeepseekV41,
    load_weights=load_weights,
    expert_dims=expert_dims,
    top_k=lambda cfg: cfg.num_experts_per_tok,
    create_cache=V41Pages.create,
    create_lane_cache=lambda cfg, lanes, max_context, dtype: V41Lanes.create(cfg, lanes, dtype),
    page_multiple=lambda cfg: cfg.page_multiple,
    cache_bytes_per_token=V41Pages.bytes_per_token,
    cache_axes=V41Pages.axes,
    index_keys=lambda pages: tuple(k for k in pages.index_keys if k is not None),
    step_tables=lambda cfg, checkpoint: checkpoint.engram,
    prompt_rows=lambda cfg, checkpoint, *chunk: (
        prompt_rows(checkpoint.engram_layout, checkpoint.engram_tables, *chunk)
        if checkpoint.engram_layout is not None else None),
    swiglu_limit=lambda cfg: cfg.swiglu_limit,
    dense_fp8=True,
))
