"""The family contract and declared params.

`Family` is what the engine needs from a model family (each family's family.py builds one and
registers it in tidejax.models.registry). A family's `weights.py` gives its params as a pytree
of ParamSpec; the abstract tree (for jax.eval_shape and the checkpoint table's shape checks),
test init and memory estimates all derive from that one declaration. The flax modules declare
their params through `declare`, from the same spec builders (layers.norm.norm_specs, ...), so a
module and the declared tree get shape, dtype and init from one function.

    specs = {"embed": ParamSpec((V, D), jnp.bfloat16, ("vocab", "embed"), stddev=1.0),
             "norm": {"weight": ParamSpec((D,), jnp.bfloat16, ("embed",), init="ones")}}
    abstract(specs)           # {"embed": ShapeDtypeStruct((V, D), bfloat16), ...}
    init(specs, key)          # random normal (stddev), ones or zeros, as each spec says
    nbytes(specs)             # V * D * 2 + D * 2
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tidejax import ops

# Logical axis names, one per concept: every param, KV page, bank and pool axis is one of these
# (or None: never split); the sharding table (tidejax.parallel.RULES) maps them to mesh axes.
# rope: the rotary key width; slots: bank rows; pages, page: a KV pool's pages and their rows.
AXES = ("vocab", "embed", "heads", "q_lora", "kv_lora", "rope", "ffw", "experts", "slots",
        "pages", "page")
INITS = ("normal", "ones", "zeros")  # how `init` fills a param (normal: N(0, stddev**2))


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One param: its shape, dtype, the logical axis of each dimension, and its test init."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    init: str = "normal"
    stddev: float = 0.02

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "axes", tuple(self.axes))
        if len(self.axes) != len(self.shape):
            raise ValueError(f"ParamSpec{self.shape}: {len(self.axes)} axes {self.axes} "
                             f"for {len(self.shape)} dimensions")
        unknown = [a for a in self.axes if a is not None and a not in AXES]
        if unknown:
            raise ValueError(f"ParamSpec{self.shape}: unknown logical axes {unknown} "
                             f"(known: {', '.join(AXES)})")
        if self.init not in INITS:
            raise ValueError(f"ParamSpec{self.shape}: init {self.init!r} is not one of {INITS}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def abstract(specs):
    """The specs as a tree of jax.ShapeDtypeStruct (nothing allocated)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs)


def init(specs, key: jax.Array):
    """Arrays for the specs (tests, training from scratch): each leaf from its own key."""
    leaves, treedef = jax.tree.flatten(specs)
    keys = jax.random.split(key, max(len(leaves), 1))
    return treedef.unflatten([_init_leaf(s, k) for s, k in zip(leaves, keys)])


def _init_leaf(spec: ParamSpec, key: jax.Array) -> jax.Array:
    if spec.init == "ones":
        return jnp.ones(spec.shape, spec.dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, spec.dtype)
    return (spec.stddev * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)


def declare(module, specs: dict) -> dict:
    """A flax module's own params, declared on it as `specs` says ({name: ParamSpec}; nested
    dicts are its submodules' params, which they declare) -> {name: array}. Given params whose
    shape differs from the spec's fail in apply (flax's ScopeParamShapeError), missing ones too;
    a given param's dtype is kept (the loaded tree may hold FP8 weights: models.loading)."""
    return {name: module.param(name, functools.partial(_init_leaf, spec))
            for name, spec in specs.items() if isinstance(spec, ParamSpec)}


def nbytes(specs) -> int:
    """Bytes the params take in their declared dtypes."""
    return sum(s.nbytes for s in jax.tree.leaves(specs))


@dataclasses.dataclass(frozen=True)
class Family:
    """What the engine needs from a model family; every callable takes the family's config.

    build(cfg, serve_options, dtype) -> a flax module whose __call__ is
        (tokens, positions, token_mask, cache, block_table, experts[, tables], replay=None,
        logits_at=None) -> (logits [b, t, vocab] float32, cache, experts), the cache a
        kv.paged.PagedCache and block_table [b, P] each row's pages in its pool; replay
        [b, t, L_moe, k]: recorded picks the MoE layers route by instead of their routers' choice
        (passed only when given); logits_at [b]: logits only at that position of each row
        ([b, 1, vocab], layers.linear.lm_logits)
    load_weights(cfg, model_dir, raw_config, serve_options, dtype, put_row) -> (params, aux):
        dense params on the device; routed experts through put_row(layer * E + expert, row);
        aux is whatever host-side state the family keeps (None for most)
    expert_dims(cfg) -> (moe layers, experts per layer, hidden, expert intermediate)
    create_cache(cfg, n_pages, page_size, dtype) -> the KV pool (PagedCache.pages): leaves
        [n_pages, rows, ...] shared by all sequences through one block table each
    create_lane_cache(cfg, lanes, max_context, dtype) -> the rows each decode lane keeps for a
        sequence of up to max_context (PagedCache.lanes, leaves [lanes, ...]: DeepSeek-V4.1's
        window rings and Engram look-back, DeepSeek-V4's window and compressor rings), or None
    page_multiple(cfg) -> what engine.page_size must be a multiple of (DeepSeek-V4.1: its
        compress ratios, so that a page holds whole groups)
    mla_decode: decoding attends through ops.paged_mla_decode over an MLA latent cache
        (cfg.kv_lora_rank, cfg.qk_rope_head_dim); the op's own choice for those shapes sets the
        decode tables' width (`table_widths`)
    index_keys(pages) -> the pool leaves (of PagedCache.pages) whose every entry in a block
        table an indexer scores (ops.paged_index_scores, a top-k over the table's width): their
        prefill tables follow what the chunk needs, and their decode tables too where the
        scores kernel does not take them (`table_widths`); () for a family without indexers
    cache_axes(pages) -> the logical axes of each pool leaf (a tuple per leaf, the pool's
        structure), or None: the pool is placed replicated (tidejax.parallel); the lane rows are
        always replicated
    step_tables(cfg, aux) -> arrays placed at load that every forward takes after `experts` (the
        same ones each step: DeepSeek-V4.1's Engram hash maps and its tables in host memory), or
        None: the forward takes none
    prompt_rows(cfg, aux, context, tokens, start, size) -> host arrays a prompt chunk's forward
        takes as `prompt_rows` (read on the host, where a chunk's tokens are known:
        DeepSeek-V4.1's Engram rows), for its `size` positions from `start` (tokens, then
        padding), context the sequence's tokens before start; None: the family reads none
    replays: whether build's forward takes `replay` (False: the family cannot replay recorded
        routing, and Engine.set_routing_replay refuses)
    dense_fp8: whether load_weights takes dense_format="fp8" (the profile's model.dense_format:
        dense projections kept FP8 as stored, models.loading.fp8_specs)
    build_mtp(cfg, serve_options, dtype, depth) -> MTP layer `depth`'s draft forward
        (layers/mtp.py), or None: the family drafts nothing ([speculative] method "mtp" refused)
    mtp_specs(cfg, dtype) -> the MTP layers' ParamSpecs as its load_weights keeps them in aux
        (layers/decoder.mtp_specs), whose logical axes place the drafting layer's params on the
        mesh as a decoder layer's are (layers/mtp.mtp_params); None where build_mtp is None
    tool_formats: model_type -> the text.toolcalls.ToolFormat its checkpoints write tool calls
        in (gpt-oss: text.harmony.HARMONY, its whole reply's format), where their chat template
        does not show it (a model type not named: none)
    """

    name: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict, str], Any]
    build: Callable
    load_weights: Callable
    expert_dims: Callable
    top_k: Callable  # (cfg) -> routed experts picked per token
    create_cache: Callable
    cache_bytes_per_token: Callable  # (cfg, dtype) -> pool bytes a token of context adds
    create_lane_cache: Callable = lambda cfg, lanes, max_context, dtype: None
    page_multiple: Callable = lambda cfg: 1
    mla_decode: bool = False
    index_keys: Callable = lambda pages: ()
    replays: bool = True
    cache_axes: Callable | None = None
    step_tables: Callable = lambda cfg, aux: None
    prompt_rows: Callable | None = None
    swiglu_limit: Callable = lambda cfg: 0.0
    swiglu_form: Callable = lambda cfg: (1.0, 0.0)  # (alpha, up_shift): tidejax.contract.swiglu
    dense_fp8: bool = False
    build_mtp: Callable | None = None
    mtp_specs: Callable | None = None
    tool_formats: dict = dataclasses.field(default_factory=dict)

    def table_widths(self, cfg, page_size: int, dtype, serve) -> tuple[bool, bool]:
        """(prefill, decode): whether that part's block tables are max_context wide (one shape)
        rather than a power of two of the pages its rows need (a few), for a forward served with
        `serve` (its ServeOptions: the ops' implementation). Full width where every read of the
        pool goes row by row up to the row's own length, so a wider table costs nothing: MLA's
        prefill (the Pallas kernel and its reference loop over key blocks up to the chunk's last
        position), GQA's flash loop, the paged MLA decode kernel, the indexer's decode scores
        kernel (a block past a row's count is written -inf unread; the top-k over [lanes,
        max_pages * rows] scores stays, small beside a step's weight reads): ops.reads_by_length.
        Powers of two where a path gathers or scores the whole table: the jnp references of the
        MLA decode and of the indexer scores (off the GPU, or engine.kernel "reference"), and the
        indexers' prefill (scores [chunk, entries] and their top-k for every entry the table
        addresses: at max_context a short prompt's chunks would score a whole context's
        entries)."""
        def struct(shape, dtype=dtype):
            return jax.ShapeDtypeStruct(shape, dtype)
        with ops.kernels(serve.kernel):
            decode = []  # the decode's paged reads: whether each goes by length
            if self.mla_decode:
                c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
                decode.append(ops.reads_by_length("paged_mla_decode", struct((1, 1, c)),
                                                  struct((1, 1, r)), struct((1, page_size, c))))
            pool = jax.eval_shape(lambda: self.create_cache(cfg, 1, page_size, dtype))
            index_keys = self.index_keys(pool)  # the leaves an indexer scores, whole
            for keys in index_keys:
                q = struct((1, 1, 1, keys.shape[-1]), jnp.float32)
                decode.append(ops.reads_by_length("paged_index_scores", q, None, keys))
        return not index_keys, all(decode)


def serving(forward):
    """Decorates a family's forward (its top module's __call__, under nn.compact): the ops its
    layers call run on the implementation the module's ServeOptions name (`self.serve.kernel`,
    the profile's engine.kernel; ops.kernels), mHC's front half on the form they name
    (`self.serve.mhc_front`; ops.mhc_front_form), so no layer holds or passes one."""
    @functools.wraps(forward)
    def served(self, *args, **kwargs):
        with ops.kernels(self.serve.kernel), ops.mhc_front_form(self.serve.mhc_front):
            return forward(self, *args, **kwargs)
    return served
