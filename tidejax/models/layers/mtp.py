"""The multi-token-prediction (MTP, "NextN") layer's draft forward, as DeepSeek-V3, GLM-4.5 and
GLM-5 publish it and transformers computes it (modeling_layers.MtpLayer / MtpModel, a
checkpoint's layer num_layers + k): for the main model's hidden state at position p and the
token at p + 1,

    x = eh_proj([enorm(embed(token)); hnorm(hidden)])        # [b, t, 2d] -> [b, t, d]
    x = one MoE decoder block (the family's attention over the paged pool, its own experts)
    x = shared_head.norm(x);  logits = lm_head(x)            # the main model's embed and head

so logits at p draft the token at p + 2. `hidden` is the main model's hidden state as its head
reads it, after the final norm (Decoder's "head_hidden": transformers' MTPCandidateGenerator
feeds `hidden_states[-1]`, which transformers ties to the normed last_hidden_state).

Where things live (the model part; runtime/speculative.Speculator runs verify rounds over it,
the engine's steps through it: runtime/steps.py):
- The KV cache: the MTP layer k has layer slot num_layers + k of the main pool (its checkpoint
  index), written through the same block table at the main model's positions p: the pool is the
  family's cache created for num_layers + num_mtp_layers layers (`with_mtp_slots`), and the main
  Decoder passes the slots past its own untouched. So its pages are the lane's pages, and
  whatever moves a lane's pages (preemption, the prompt cache) moves the MTP keys with them.
  Queries and keys are rotated at p + 1 (the token's position, as transformers' position_ids)
  and attend the positions <= p of the row; attention scores depend only on the difference.
- The params: the main model's embed and lm_head, and the MTP layer as kept on the host by the
  loader (decoder.mtp_specs), put on the device by `mtp_params` (FP8 weights dequantized),
  split over "tensor" by the declared axes as a decoder layer is (Family.mtp_specs).
- The routed experts: the layer routes by the expert state's last MoE layer. In the engine that
  is residency's: the drafting layer is one more MoE layer of the residency geometry, after the
  main model's (row L_moe; its rows `mtp_expert_row` put in the host pool at load,
  runtime/build.py), so the bank, the planner, the miss policies and the demand history serve
  and count it as any layer. The model part alone (tests, tools/train_mtp.py) runs it on a
  one-layer state of its own (`mtp_expert_state`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tidejax import parallel
from tidejax.checkpoint.fp8 import BLOCK, dequantize_fp8_block
from tidejax.kv import paged
from tidejax.kv.paged import PagedCache
from tidejax.models.base import declare, serving
from tidejax.models.layers.decoder import decoder_block
from tidejax.models.layers.linear import Linear, embedding_specs, lm_logits
from tidejax.models.layers.moe import RouterSpec
from tidejax.models.layers.norm import RMSNorm
from tidejax.models.layers.rope import rope_cos_sin, rope_frequencies
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState, all_resident_state


def with_mtp_slots(cfg):
    """`cfg` with num_layers counting the MTP layers too: the family's cache `create(..)` of it
    is a pool with the MTP layers' slots after the decoder's (only for creating the pool)."""
    return dataclasses.replace(cfg, num_layers=cfg.num_layers + cfg.num_mtp_layers)


class MTPLayer(nn.Module):
    """MTP layer `layer` (its checkpoint index): the glue and a decoder block in one scope, the
    params as decoder.mtp_specs declares them (input_norm, attn, post_attn_norm, moe, enorm,
    hnorm, eh_proj, shared_head_norm). DecoderLayer's fields, for decoder_block."""

    cfg: Any
    layer: int
    router: RouterSpec
    attention: Callable[[str, int], nn.Module]
    serve: ServeOptions
    dtype: jnp.dtype
    carries: bool = False

    @nn.compact
    def __call__(self, embedded, hidden, positions, token_mask, cos, sin, pages: tuple, slots,
                 block_table, experts, replay=None):
        cfg, dt = self.cfg, self.dtype
        x = jnp.concatenate([RMSNorm(cfg.rms_norm_eps, dt, name="enorm")(embedded),
                             RMSNorm(cfg.rms_norm_eps, dt, name="hnorm")(hidden)], axis=-1)
        x = Linear(cfg.hidden_size, dt, name="eh_proj")(x)  # [b, t, 2d] -> [b, t, d]
        last = experts.rowmap.shape[0] - 1  # the MTP layer's row: the state's last (docstring)
        if replay is not None:  # [b, t, k] as every layer's, so that its row `last` is them
            replay = jnp.broadcast_to(replay[:, :, None],
                                      (*replay.shape[:2], last + 1, replay.shape[-1]))
        x, pages, experts, _ = decoder_block(self, last, x, positions, token_mask, cos, sin,
                                             pages, slots, block_table, experts, replay)
        return RMSNorm(cfg.rms_norm_eps, dt, name="shared_head_norm")(x), pages, experts


class MTP(nn.Module):
    """The draft forward of MTP layer `depth` (0 .. num_mtp_layers - 1). The config is read as
    the Decoder reads it (decoder.py), num_mtp_layers included; the family gives the attention
    factory the Decoder takes (called with the MTP layer's checkpoint index), and `carries` as
    the Decoder's: the MTP layer's attention is then given no carry (GLM-5's DSA layer picks
    with its own indexer)."""

    cfg: Any
    router: RouterSpec
    attention: Callable[[str, int], nn.Module]
    serve: ServeOptions
    dtype: jnp.dtype = jnp.float32
    depth: int = 0
    carries: bool = False

    @nn.compact
    @serving
    def __call__(self, hidden, tokens, positions, token_mask, cache: PagedCache, block_table,
                 experts: ExpertState, logits_at=None, replay=None):
        """hidden [b, t, d]: the main model's hidden states at `positions` (its head's input,
        Decoder's "head_hidden"); tokens [b, t] int32: the tokens at positions + 1; positions
        [b, t] int32, token_mask [b, t] bool: the main model's; cache: the pool with the MTP
        slots (with_mtp_slots); block_table [b, P]: each row's pages (the main model's);
        experts: an expert state whose last MoE layer is this layer's (the engine's residency
        state, or mtp_expert_state's); logits_at [b] as the Decoder's; replay [b, t, k]: picks to
        route by (None: its router chooses) ->
        draft logits [b, t or 1, vocab] float32 (at p: the token at p + 2), the MTP hidden
        state [b, t, d] (after shared_head.norm: what transformers chains into depth + 1),
        cache, experts."""
        cfg, dt = self.cfg, self.dtype
        index = cfg.num_layers + self.depth  # its checkpoint index, param scope and pool slot
        embedding = declare(self, embedding_specs(cfg.vocab_size, cfg.hidden_size, dt,
                                                  cfg.tie_word_embeddings))
        embedded = jnp.take(embedding["embed"], tokens, axis=0)
        inv_freq, attention_factor = rope_frequencies(cfg.rope)
        cos, sin = rope_cos_sin(positions + 1, inv_freq, attention_factor)  # the tokens'
        fields = [f.name for f in dataclasses.fields(cache.pages)]
        layer = tuple(getattr(cache.pages, name)[index] for name in fields)
        n_pages, page_size = layer[0].shape[:2]
        slots = paged.token_slots(block_table, positions, token_mask, n_pages, page_size)
        x, layer, experts = MTPLayer(cfg, index, self.router, self.attention, self.serve, dt,
                                     self.carries, name=f"layers_{index}")(
            embedded, hidden.astype(embedded.dtype), positions, token_mask, cos, sin, layer,
            slots, block_table, experts, replay)
        head = embedding["embed" if cfg.tie_word_embeddings else "lm_head"]
        pages = cache.pages.replace(**{
            name: tuple(layer[j] if i == index else leaf
                        for i, leaf in enumerate(getattr(cache.pages, name)))
            for j, name in enumerate(fields)})
        return lm_logits(x, head, logits_at), x, PagedCache(pages), experts


def mtp_params(params: dict, kept: dict, cfg, dtype, block=BLOCK, depth: int = 0,
               specs: dict | None = None) -> dict:
    """The MTP module's params: the main model's embedding and head (`params`, the Decoder's),
    and MTP layer `depth` as the loader keeps it on the host (`kept`: {"layers_{i}": ...}, the
    family's load_weights aux) put on the current mesh as stored, but for FP8 weights,
    dequantized on the checkpoint's scale `block` to `dtype` (as_float); its routed experts left
    out (the residency pool's: mtp_expert_row). `specs`: the family's mtp_specs, whose logical
    axes place each leaf (split over "tensor" as a decoder layer's, tidejax.parallel.put);
    None: every leaf whole on every device."""
    name = f"layers_{cfg.num_layers + depth}"
    layer = without_experts(kept[name])
    layer = jax.tree.map(lambda leaf: as_float(leaf, block, dtype), layer, is_leaf=_is_fp8)
    if specs is None:
        axes = jax.tree.map(lambda leaf: (None,) * leaf.ndim, layer)
    else:
        axes = jax.tree.map(lambda spec: spec.axes, without_experts(specs[name]))
    head = {k: params[k] for k in ("embed", "lm_head") if k in params}
    return head | {name: parallel.put(layer, axes)}


def without_experts(layer: dict) -> dict:
    """An MTP layer's tree (kept or declared) less its routed experts."""
    return layer | {"moe": {k: v for k, v in layer["moe"].items() if k != "experts"}}


def mtp_expert_row(kept: dict, cfg, expert: int, dtype, block=BLOCK, depth: int = 0) -> dict:
    """Routed expert `expert` of MTP layer `depth` (as kept: moe.experts.{e}.{gate,up,down}_proj)
    as one row in the bank's format: gate_up [2f, d] with the gate rows first, down [d, f], in
    `dtype` (FP8 ones dequantized on `block`): what the engine puts in the host pool as the
    residency geometry's MTP layer (runtime/build.py)."""
    parts = kept[f"layers_{cfg.num_layers + depth}"]["moe"]["experts"][str(expert)]
    part = lambda proj: as_float(parts[proj], block, dtype)
    gate_up = np.concatenate([part("gate_proj"), part("up_proj")])
    return {"gate_up": gate_up.astype(dtype, copy=False),
            "down": part("down_proj").astype(dtype, copy=False)}


class MtpExpertRows:
    """MTP layer `depth`'s routed experts as a source of rows for the residency disk tier
    (residency.disk.CheckpointRows over it, as over the checkpoint table's RowSource): row e is
    mtp_expert_row of the loader's kept tensors, memory-mapped from the checkpoint's files, so
    read through the page cache (`read_direct` False), not with O_DIRECT."""

    def __init__(self, kept: dict, cfg, dtype, block=BLOCK, depth: int = 0):
        self.kept, self.cfg, self.dtype, self.block, self.depth = kept, cfg, dtype, block, depth
        self.experts = kept[f"layers_{cfg.num_layers + depth}"]["moe"]["experts"]
        self.n_rows = cfg.n_routed_experts

    def read(self, row: int) -> dict:
        return mtp_expert_row(self.kept, self.cfg, row, self.dtype, self.block, self.depth)

    def read_direct(self) -> bool:
        return False

    def files(self, row: int | None = None) -> list[Path]:
        """The checkpoint files row `row`'s tensors are mapped from (None: every row's)."""
        experts = self.experts.values() if row is None else [self.experts[str(row)]]
        return sorted({Path(leaf.filename) for parts in experts for leaf in jax.tree.leaves(parts)
                       if isinstance(leaf, np.memmap)})

    def stored_as_read(self) -> bool:
        """Whether a row reads as its files' bytes (no FP8 to dequantize)."""
        return not any(_is_fp8(leaf) for parts in self.experts.values() for leaf in parts.values())

    def empty_row(self) -> dict:
        """A row of zeros shaped and typed as `read` gives one, without reading any data."""
        first = self.experts["0"]
        (f, d), dtype = _stored_shape(first["gate_proj"]), np.dtype(self.dtype)
        return {"gate_up": np.zeros((2 * f, d), dtype),
                "down": np.zeros(_stored_shape(first["down_proj"]), dtype)}


def mtp_expert_state(kept: dict, cfg, dtype, block=BLOCK, depth: int = 0) -> ExpertState:
    """MTP layer `depth`'s routed experts as an all-resident expert state of one MoE layer: the
    model part run alone (the engine serves them through residency instead)."""
    rows = [mtp_expert_row(kept, cfg, e, dtype, block, depth) for e in range(cfg.n_routed_experts)]
    return all_resident_state({k: jnp.asarray(np.stack([r[k] for r in rows]), dtype)
                               for k in ("gate_up", "down")}, 1)


def _is_fp8(leaf) -> bool:
    return isinstance(leaf, tuple)


def _stored_shape(leaf) -> tuple:
    """A kept leaf's shape (an FP8 pair's: its values')."""
    return np.shape(leaf[0] if _is_fp8(leaf) else leaf)


def as_float(leaf, block, dtype) -> np.ndarray:
    """A leaf the loader kept as stored (reader.keep): an FP8 weight, the pair (float8_e4m3fn
    values [out, in], float32 scales on `block`), dequantized to `dtype`; any other as it is."""
    if _is_fp8(leaf):
        return dequantize_fp8_block(*leaf, block).astype(dtype)
    return np.asarray(leaf)
