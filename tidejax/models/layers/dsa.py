"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2's, GLM-5's) on the paged pool: MLA whose queries
attend only the entries a lightning indexer picks for each of them, the top `index_topk` of its
scores over the row's cached index keys.

The indexer (layers in `cfg.index_layers`, which may name MTP layers past num_layers: the pool
has their slots where they draft; the others, GLM-5's "shared" layers, reuse the previous
indexer layer's pick, handed down the stack as the decoder's carry) writes its key of
every token into the pool beside MLA's latent and scores a chunk's queries against the row's
keys (ops.paged_index_scores: the Pallas kernel for decode steps). Its rotary channels are the
leading qk_rope_head_dim of each head, interleaved pairs (GLM-5; transformers'
GlmMoeDsaIndexer).

Tied scores (exactly 0 where ReLU zeroes every index head: common with few heads) go to the
earlier entry (compress.top_k_select).

Whether a step selects is static: a row's bucket of P pages holds P * page_size entries, and
where that is at most index_topk the top-k is every visible entry, so MLA attends the row as it
is (ops.mla_attention, the paged kernels) and no scores are computed; past it the selected
entries alone are read from the pool by id (kv.paged.sparse_mla_attention). Either way a step
costs what the rows hold.

Config fields beyond MLA's (layers/mla.py): index_topk, index_head_dim, index_n_heads,
index_layers, num_layers.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax.numpy as jnp

from tidejax import ops
from tidejax.checkpoint import Rule
from tidejax.kv import paged
from tidejax.models.layers.compress import top_k_select
from tidejax.models.layers.linear import Linear, linear_specs
from tidejax.models.layers.mla import MLA_RULES, MLACache, mla_output, mla_queries, mla_specs
from tidejax.models.layers.norm import LayerNorm, layer_norm_specs
from tidejax.models.layers.rope import apply_rope

F32 = jnp.float32
INDEX_KEY_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers' GlmMoeDsaIndexer)


@flax.struct.dataclass
class DSAPages:
    """The paged pool, per layer: MLA's latent and rotated key (MLACache), and index_k
    [n_pages, page_size, index_head_dim], the indexer's keys (None in a layer without an
    indexer)."""

    latent: tuple
    rope_k: tuple
    index_k: tuple

    @staticmethod
    def create(cfg, n_pages: int, page_size: int, dtype) -> "DSAPages":
        mla = MLACache.create(cfg, n_pages, page_size, dtype)
        return DSAPages(mla.latent, mla.rope_k, tuple(
            jnp.zeros((n_pages, page_size, cfg.index_head_dim), dtype)
            if i in cfg.index_layers else None for i in range(cfg.num_layers)))

    def axes(self) -> "DSAPages":
        """The logical axes of each pool leaf (tidejax.parallel): the index keys are one head."""
        mla = MLACache(self.latent, self.rope_k).axes()
        return DSAPages(mla.latent, mla.rope_k, tuple(
            None if keys is None else ("pages", "page", None) for keys in self.index_k))

    @staticmethod
    def bytes_per_token(cfg, dtype) -> int:
        indexed = sum(i < cfg.num_layers for i in cfg.index_layers)  # of the pool's layers
        return (MLACache.bytes_per_token(cfg, dtype)
                + indexed * cfg.index_head_dim * jnp.dtype(dtype).itemsize)


def dsa_specs(cfg, dtype, indexer: bool) -> dict:
    """DSAttention's declared params: MLA's, and with `indexer` the indexer's (its weights_proj
    float32, as transformers keeps it)."""
    specs = mla_specs(cfg, dtype)
    if indexer:
        d, n, k = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
        specs["indexer"] = {
            "wq_b": linear_specs(n * k, cfg.q_lora_rank, (None, "q_lora"), dtype),
            "wk": linear_specs(k, d, (None, "embed"), dtype),
            "k_norm": layer_norm_specs(k, None, dtype),
            "weights_proj": linear_specs(n, d, (None, "embed"), F32)}
    return specs


# the Hugging Face names of DSAttention's tensors: MLA's and the indexer's
DSA_RULES = MLA_RULES + (
    Rule("model.layers.{i}.self_attn.indexer.{proj:wq_b|wk|weights_proj}.weight",
         "layers_{i}.attn.indexer.{proj}.weight"),
    Rule("model.layers.{i}.self_attn.indexer.k_norm.{kind:weight|bias}",
         "layers_{i}.attn.indexer.k_norm.{kind}"),
)


class Indexer(nn.Module):
    cfg: object
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, q_res, positions, cos, sin, key_pages, slots, block_table,
                 select: bool):
        """x [b, t, d], q_res [b, t, q_lora] (MLA's normed query latent); key_pages [n_pages,
        page_size, k]: the layer's index keys -> (key_pages with the chunk's keys written,
        the pick: (ids, valid) [b, t, index_topk] with `select`, else None)."""
        cfg, dt = self.cfg, self.dtype
        b, t, _ = x.shape
        n, k, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim

        def rotate(v):  # the leading r channels, interleaved pairs; the rest pass as they are
            return jnp.concatenate([apply_rope(v[..., :r], cos, sin, interleaved=True),
                                    v[..., r:]], -1)

        keys = rotate(LayerNorm(INDEX_KEY_NORM_EPS, dt, name="k_norm")(
            Linear(k, dt, name="wk")(x)))  # [b, t, k]
        key_pages = paged.write(key_pages, keys, slots)
        q = Linear(n * k, dt, name="wq_b")(q_res).reshape(b, t, n, k)
        w = Linear(n, F32, name="weights_proj")(x.astype(F32)) * n ** -0.5  # [b, t, n]
        if not select:
            return key_pages, None
        scores = ops.paged_index_scores(rotate(q).astype(F32), w, key_pages, block_table,
                                        positions + 1, scale=k ** -0.5)
        return key_pages, top_k_select(scores, cfg.index_topk)


class DSAttention(nn.Module):
    cfg: object  # a config with the fields of the module docstring
    layer: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, cos, sin, latent_pages, rope_pages, index_pages, slots,
                 block_table, pick):
        """As MLAttention's call, with this layer's index keys [n_pages, page_size, k] (None
        without an indexer) and `pick`, the (ids, valid) [b, t, index_topk] of the indexer layer
        before (the decoder's carry; None before any) -> (out [b, t, d], latent_pages,
        rope_pages, index_pages, the pick the next layer sees)."""
        cfg = self.cfg
        q_res, q_latent, q_rope, w_uv, latent_pages, rope_pages = mla_queries(
            self, x, cos, sin, latent_pages, rope_pages, slots)
        select = block_table.shape[1] * latent_pages.shape[1] > cfg.index_topk
        if self.layer in cfg.index_layers:
            index_pages, pick = Indexer(cfg, self.dtype, name="indexer")(
                x, q_res, positions, cos, sin, index_pages, slots, block_table, select)
        if select:
            ids, valid = pick
            out = paged.sparse_mla_attention(q_latent, q_rope, latent_pages, rope_pages,
                                             block_table, ids, valid, scale=cfg.softmax_scale)
        else:
            out = ops.mla_attention(q_latent, q_rope, latent_pages, rope_pages, block_table,
                                    positions, scale=cfg.softmax_scale)
        return mla_output(self, out, w_uv), latent_pages, rope_pages, index_pages, pick
