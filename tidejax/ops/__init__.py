"""The ops models call: one plain function per op, each running the op's GPU kernel
(tidejax.pallas) or its jnp reference by one rule (ops/dispatch.py). A caller passes arrays,
never an implementation: an op given no `impl` takes the policy in force (`kernels`,
set for a family's forward from its ServeOptions), and `impl=` is for tests and benchmarks
(tests/test_layout.py: no model passes one).

    fp8_block_matmul     FP8 block-scaled dense weights (no kernel yet: two jnp forms, by rows)
    moe_grouped          the routed experts over the bank (tidejax.residency.serve calls it); a
                         prompt chunk's on Pallas's dots or a Triton GEMM (`prefill`)
    paged_mla_decode     MLA decode attention over the paged latent cache
    paged_mla_prefill    a prompt chunk's MLA attention over the paged latent cache
    mla_attention        either of the two by the chunk's length, split over "tensor" by heads
    paged_index_scores   a lightning indexer's scores over its paged keys
    paged_gqa_decode     grouped-query decode attention over the paged KV pool (GLM-4.5): Triton
    paged_gqa_prefill    a prompt chunk's GQA over the paged KV pool: the same Triton kernel
    gqa_attention        either of the two by the chunk's length, split over "tensor" by heads
    sinkhorn             mHC's Sinkhorn normalization (DeepSeek-V4 / V4.1): one Triton kernel
    mhc_front            an mHC site's mixes (pre, post, comb) and collapsed input: two Triton
                         kernels
    reads_by_length      whether a paged op, on given shapes, reads each row's pages only up to its
                         length (its kernel) or every page its table holds (its reference)

What the kernels and their callers agree on beyond shapes (activation, bias, gate/up layout) is
tidejax.contract.
"""

from __future__ import annotations

import functools
import math

import jax

from tidejax import parallel
from tidejax.ops import dispatch
from tidejax.ops.dispatch import (IMPLS, MHC_FRONTS, MOE_PREFILL_KERNELS, choose_impl, kernels,
                                  log_choice, mhc_front_form, run)
from tidejax.pallas import attention, index_scores, mhc as mhc_forms, paged_gqa
from tidejax.pallas import sinkhorn as sinkhorn_forms
from tidejax.pallas.bank import bank_dims
from tidejax.pallas.demand import Demand
from tidejax.pallas.fp8_matmul import fp8_block_matmul_few_rows, fp8_block_matmul_reference
from tidejax.pallas.moe import moe_grouped_reference
from tidejax.pallas.moe_plan import reach

__all__ = ["Demand", "IMPLS", "MHC_FRONTS", "MOE_PREFILL_KERNELS", "fp8_block_matmul",
           "gqa_attention", "kernels", "mhc_front", "mhc_front_form", "mla_attention",
           "moe_grouped", "paged_gqa_decode", "paged_gqa_prefill", "paged_index_scores",
           "paged_mla_decode", "paged_mla_prefill", "reads_by_length", "sinkhorn"]


def fp8_block_matmul(x, w, scales, block: tuple[int, int]):
    """x [..., in], w [out, in] float8_e4m3fn, scales [out / block[0], in / block[1]] float32
    (block dividing [out, in]) -> [..., out] in x's dtype (pallas.fp8_matmul: no kernel yet;
    its few-rows form where x has at most block[0] / 8 rows, the reference otherwise, on every
    backend whatever the policy)."""
    (out, inn), (bo, bi) = w.shape, block
    if out % bo or inn % bi or scales.shape != (out // bo, inn // bi):
        raise ValueError(f"fp8_block_matmul: weight {w.shape} with scales {scales.shape} "
                         f"needs blocks dividing it; got block {block}")
    if math.prod(x.shape[:-1]) <= bo // 8:
        with jax.named_scope("fp8_block_matmul_few_rows"):
            return fp8_block_matmul_few_rows(x, w, scales, block)
    with jax.named_scope("fp8_block_matmul_reference"):
        return fp8_block_matmul_reference(x, w, scales, block)


def sinkhorn(logits, *, hc_eps: float, iters: int, impl: str | None = None):
    """logits [..., hc(j), hc(k)] float32 -> the doubly stochastic mix: a softmax over k, then
    alternate column and row normalizations, iters in all (pallas.sinkhorn).

    impl: "auto" (the Triton kernel through jax-triton on a GPU, where jax-triton is installed and
    hc <= pallas.sinkhorn.MAX_HC; the reference elsewhere) | "pallas" (the kernel; Triton's
    interpreter off the GPU) | "reference"; None: the policy in force. The kernel against the
    reference: ~1e-7 (float32 both; the kernel multiplies by each sum's reciprocal where the
    reference divides)."""
    return run("sinkhorn", impl, lambda: sinkhorn_forms.triton_supports(logits),
               sinkhorn_forms.sinkhorn_reference, sinkhorn_forms.sinkhorn_triton, logits,
               hc_eps=float(hc_eps), iters=int(iters))


def mhc_front(streams, fn, base, scale, collapse_pre=None, *, eps: float, hc_eps: float,
              iters: int, impl: str | None = None):
    """One mHC site's front half (pallas.mhc): streams [..., hc, d] and the site's fn
    [(2 + hc) * hc, hc * d], base, scale -> (pre [..., hc], post [..., hc], comb
    [..., hc, hc] float32, x [..., d] in the streams' dtype), x = sum_j w_j X_j with w
    `collapse_pre` where given (V4.1: the previous site's pre), else this site's pre.

    impl: "auto" (the two Triton kernels through jax-triton on a GPU, where
    pallas.mhc.triton_supports takes the shapes; the reference elsewhere) | "pallas" (the
    kernels; Triton's interpreter off the GPU) | "reference" (its Sinkhorn `sinkhorn` on the
    same impl); None: the reference while the form in force is "chain" (dispatch.MHC_FRONT, a
    profile's engine.mhc_front), its Sinkhorn on the policy in force; under "fused", the policy
    in force. The kernels against the reference: float32 rounding (the RMS factor applied after
    the dot, sums in another order)."""
    reference = functools.partial(mhc_forms.mhc_front_reference,
                                  sinkhorn=functools.partial(sinkhorn, impl=impl))
    chain = impl is None and dispatch.mhc_front_in_force() == "chain"
    return run("mhc_front", "reference" if chain else impl,
               lambda: mhc_forms.triton_supports(streams, fn), reference,
               mhc_forms.mhc_front_triton, streams, fn, base, scale, collapse_pre,
               eps=float(eps), hc_eps=float(hc_eps), iters=int(iters))


def _moe_fits(bank) -> bool:
    from tidejax.pallas.moe_kernel import pallas_supports  # here: the Triton lowering loads on use

    return pallas_supports(bank)


def _prefill_on_triton(bank, slot_ids, prefill: str, n_experts: int | None,
                       interpret: bool) -> bool:
    """Whether a step's picks run on moe_prefill's Triton kernel: chosen (`prefill`), a prompt
    chunk's many picks an expert (over the slots they can name: the bank's, at most
    n_experts), and a bank the kernel takes here."""
    if prefill != "triton":
        return False
    from tidejax.pallas import moe_prefill

    return (moe_prefill.fills_tiles(slot_ids.size, reach(bank_dims(bank)[0], n_experts))
            and moe_prefill.triton_supports(bank, interpret=interpret))


def moe_grouped(x, bank, slot_ids, weights, *, swiglu_limit: float = 0.0,
                swiglu_alpha: float = 1.0, swiglu_up_shift: float = 0.0, impl: str | None = None,
                demand: Demand | None = None, prefill: str | None = None,
                n_experts: int | None = None):
    """Routed experts of one MoE layer over the bank: y[t] = sum_j w[t,j] * down_s(swiglu(g, u)),
    s = slot_ids[t,j] (-1 skips); shapes: pallas.moe.moe_grouped_reference.

    impl: "auto" (Pallas on a GPU when the kernel takes the bank's shapes, the reference
    elsewhere) | "pallas" (interpret mode off the GPU) | "reference"; None: the policy in force.
    The kernel's accuracy against the float32 reference (before the cast to x.dtype): decode
    steps whose picks rarely share an expert (GEMV, float32 products) ~1e-7; busier steps and
    prefill (bf16 dots, float32 accumulation) ~1e-5 for bf16 activations, ~2e-3 for float32
    ones (rounded to bf16).
    prefill: on the kernels, the one for a prompt chunk's many picks an expert, one of
    MOE_PREFILL_KERNELS (a profile's engine.moe_prefill); None: dispatch.MOE_PREFILL, the
    default. "triton" (pallas.moe_prefill: bf16 h between the projections, ~1e-2 of the
    output's scale) where the bank fits it, Pallas's dots elsewhere.
    n_experts: the distinct slots the picks can name, where fewer than the bank's (a layer's
    experts in a bank of several layers' slots): the picks an expert, which pick the Triton
    kernel (prefill) and Pallas's tile, are counted over these; None: the bank's slots.
    demand: the layer's wanted picks to count (the kernel adds them with atomic adds in its
    first pass); then returns (y, counts, weight_sums).
    swiglu_alpha, swiglu_up_shift and bias leaves in the bank (gpt-oss; tidejax.contract): both
    implementations (the kernel compiles them in only where given).
    """
    prefill = dispatch.MOE_PREFILL if prefill is None else prefill
    if prefill not in MOE_PREFILL_KERNELS:
        raise ValueError(f"moe_grouped: prefill={prefill!r}, expected one of {MOE_PREFILL_KERNELS}")
    impl = choose_impl("moe_grouped", impl, fits=lambda: _moe_fits(bank))
    form = dict(swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
                swiglu_up_shift=swiglu_up_shift)
    interpret = jax.default_backend() != "gpu"
    with jax.named_scope(f"moe_grouped_{impl}"):
        if impl == "reference":
            return moe_grouped_reference(x, bank, slot_ids, weights, **form, demand=demand)
        if _prefill_on_triton(bank, slot_ids, prefill, n_experts, interpret):
            from tidejax.pallas.moe_prefill import moe_grouped_triton

            log_choice("moe_grouped prefill", "triton", "prefill=, engine.moe_prefill")
            with jax.named_scope("moe_prefill_triton"):
                return moe_grouped_triton(x, bank, slot_ids, weights, **form, demand=demand,
                                          interpret=interpret, n_experts=n_experts)
        from tidejax.pallas.moe_kernel import moe_grouped_pallas

        return moe_grouped_pallas(x, bank, slot_ids, weights, **form, demand=demand,
                                  interpret=interpret, n_experts=n_experts)


def _mla_fits(q_latent, q_rope, latent_pages, *_) -> bool:
    return attention.pallas_supports(q_latent, q_rope, latent_pages)


def _index_fits(q, weights, key_pages, *_) -> bool:
    """The scores kernel under "auto": decode steps (t = 1) only; a prompt chunk's queries are one
    matmul in the reference."""
    return q.shape[1] == 1 and index_scores.pallas_supports(q, key_pages)


def paged_mla_decode(q_latent, q_rope, latent_pages, rope_pages, block_table, lengths, *, scale,
                     impl: str | None = None):
    """Decode attention of one layer over its paged latent cache (shapes: see
    pallas.attention.paged_mla_decode_reference) -> out [b, h, c] float32.

    impl: "auto" (the Pallas kernel on a GPU when it takes the shapes,
    pallas.attention.pallas_supports; the reference elsewhere) | "pallas" (interpret mode off the
    GPU) | "reference"; None: the policy in force. The kernel against the float32 reference:
    ~1e-7 for float32 pools; bf16 pools ~1e-3 (probabilities rounded to bf16 for the value dot).
    H200, V3 shapes: 3.5-5x faster than the jitted reference.
    """
    args = (q_latent, q_rope, latent_pages, rope_pages, block_table, lengths)
    return run("paged_mla_decode", impl, lambda: _mla_fits(*args),
                    attention.paged_mla_decode_reference, attention.paged_mla_decode_pallas, *args,
                    scale=float(scale))


def paged_mla_prefill(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, *, scale,
                      impl: str | None = None):
    """Causal attention of a prompt chunk's queries over their rows' paged latent cache (shapes:
    see pallas.attention.paged_mla_prefill_reference) -> out [b, t, h, c] in the queries' dtype.

    impl: as paged_mla_decode's. The kernel against the reference: ~1e-6 for float32 pools and
    queries; ~1e-3 for bf16 (probabilities rounded to bf16 for the value dot, against other
    running maxima)."""
    args = (q_latent, q_rope, latent_pages, rope_pages, block_table, positions)
    return run("paged_mla_prefill", impl, lambda: _mla_fits(*args),
                    attention.paged_mla_prefill_reference, attention.paged_mla_prefill_pallas,
                    *args, scale=float(scale))


def mla_attention(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, *,
                  scale: float, impl: str | None = None):
    """Multi-head latent attention over each row's pages: q_latent [b, t, h, c] (kv_b absorbed),
    q_rope [b, t, h, r]; positions [b, t] (a query sees positions <= its own) -> the attended
    latent [b, t, h, c] in the queries' dtype. Decode (t = 1) is paged_mla_decode, a prompt
    chunk paged_mla_prefill (either reads the pages a row holds, no more, but for the decode
    reference: the whole table). Where the mesh splits "tensor", each device attends its heads
    over the whole pages (parallel.over_tensor: the kernels see one device's shard)."""
    def attend(q_latent, q_rope, latent_pages, rope_pages, block_table, positions):
        if q_latent.shape[1] == 1:
            out = paged_mla_decode(q_latent[:, 0], q_rope[:, 0], latent_pages, rope_pages,
                                   block_table, positions[:, 0] + 1, scale=float(scale), impl=impl)
            return (out[:, None].astype(q_latent.dtype),)
        return (paged_mla_prefill(q_latent, q_rope, latent_pages, rope_pages, block_table,
                                  positions, scale=float(scale), impl=impl),)

    heads = (None, None, "heads", None)  # [b, t, h, c]
    return parallel.over_tensor(attend, (heads, heads, None, None, None, None), (heads,))(
        q_latent, q_rope, latent_pages, rope_pages, block_table, positions)[0]


def _gqa_fits(q, k_pages, v_pages, *_) -> bool:
    return paged_gqa.triton_supports(q, k_pages, v_pages)


def _gqa_run(op: str, impl, args, reference, kernel, scale, sinks, window: int):
    """One of the two paged GQA ops, sinks and window passed to either implementation."""
    return run(op, impl, lambda: _gqa_fits(*args), reference, kernel, *args, scale=float(scale),
               sinks=sinks, window=window)


def paged_gqa_decode(q, k_pages, v_pages, block_table, lengths, *, scale, sinks=None,
                     window: int = 0, impl: str | None = None):
    """Grouped-query decode attention over the paged KV pool, one query token a row: q [b, h, k],
    k_pages [n_pages, page_size, g, k], v_pages [n_pages, page_size, g, v] (query head j reads KV
    head j // (h / g)), block_table [b, P], lengths [b] (a row sees its positions 0..length-1)
    -> out [b, h, v] float32, zeros for a row of length 0 (pallas.paged_gqa).

    impl: "auto" (the Triton kernel through jax-triton on a GPU, where jax-triton is installed and
    pallas.paged_gqa.triton_supports takes the shapes; the reference elsewhere) | "pallas" (the
    kernel; Triton's interpreter off the GPU) | "reference"; None: the policy in force. Both read
    each row's pages up to its length (the reference: up to the longest row's). The kernel
    against the float32 reference, in Triton's interpreter: ~1e-7 for float32 pools; bf16 pools
    ~1e-2 of the values' scale (probabilities rounded to bf16 for the value dot). Not yet run or
    timed on a GPU. sinks [h] (a logit per head in the softmax's denominator) and window > 0, a
    static int (a query at q sees positions > q - window): gpt-oss, on either implementation
    (the kernel: the window compiled in, its loop from the window's first block; the sinks in
    the combine of its splits)."""
    args = (q, k_pages, v_pages, block_table, lengths)
    return _gqa_run("paged_gqa_decode", impl, args, paged_gqa.paged_gqa_decode_reference,
                    paged_gqa.paged_gqa_decode_triton, scale, sinks, window)


def paged_gqa_prefill(q, k_pages, v_pages, block_table, positions, *, scale, sinks=None,
                      window: int = 0, impl: str | None = None):
    """Causal GQA of a prompt chunk's queries over their rows' pages: q [b, t, h, k], the pools
    and table as paged_gqa_decode's, positions [b, t] (a query sees positions <= its own; none,
    so zeros, when negative) -> out [b, t, h, v] float32 (pallas.paged_gqa).

    impl: as paged_gqa_decode's. The kernel against the reference: as paged_gqa_decode's (the
    same kernel: a program's dot rows are queries x the heads of one KV head). Not yet run or
    timed on a GPU. sinks, window: as paged_gqa_decode's."""
    args = (q, k_pages, v_pages, block_table, positions)
    return _gqa_run("paged_gqa_prefill", impl, args, paged_gqa.paged_gqa_reference,
                    paged_gqa.paged_gqa_triton, scale, sinks, window)


def gqa_attention(q, k_pages, v_pages, block_table, positions, *, scale: float, sinks=None,
                  window: int = 0, impl: str | None = None):
    """Grouped-query attention over each row's pages: q [b, t, h, k], k_pages, v_pages [n_pages,
    page_size, g, k | v], block_table [b, P], positions [b, t] (a query sees positions <= its
    own) -> out [b, t, h, v] in the queries' dtype. Decode (t = 1) is paged_gqa_decode, a prompt
    chunk paged_gqa_prefill (either reads each row's pages up to its positions, no more). Where
    the mesh splits "tensor", each device attends its query and KV heads
    (parallel.over_tensor: the kernels see one device's shard). sinks [h], window: as
    paged_gqa_decode's."""
    def attend(q, k_pages, v_pages, block_table, positions, sinks):
        if q.shape[1] == 1:
            out = paged_gqa_decode(q[:, 0], k_pages, v_pages, block_table, positions[:, 0] + 1,
                                   scale=float(scale), sinks=sinks, window=window,
                                   impl=impl)[:, None]
        else:
            out = paged_gqa_prefill(q, k_pages, v_pages, block_table, positions,
                                    scale=float(scale), sinks=sinks, window=window, impl=impl)
        return (out.astype(q.dtype),)

    heads = (None, None, "heads", None)  # q [b, t, h, k] and the pools [n_pages, page_size, g, k]
    sink_axes = None if sinks is None else ("heads",)
    return parallel.over_tensor(attend, (heads, heads, heads, None, None, sink_axes), (heads,))(
        q, k_pages, v_pages, block_table, positions, sinks)[0]


def paged_index_scores(q, weights, key_pages, block_table, counts, *, scale,
                       impl: str | None = None):
    """The indexer's scores of each query over its row's paged keys: q [b, t, i, k], weights
    [b, t, i], key_pages [n_pages, rows, k], counts [b, t] (the entries 0.. each query sees) ->
    [b, t, P * rows] float32, -inf past each query's count (pallas.index_scores).

    impl: "auto" (the Pallas kernel on a GPU for decode steps, t = 1, when it takes the shapes,
    pallas.index_scores.pallas_supports; the reference elsewhere: a prompt chunk's queries are
    one matmul there) | "pallas" (any t; interpret mode off the GPU) | "reference"; None: the
    policy in force."""
    args = (q, weights, key_pages, block_table, counts)
    return run("paged_index_scores", impl, lambda: _index_fits(*args),
                    index_scores.paged_index_scores_reference,
                    index_scores.paged_index_scores_pallas, *args, scale=float(scale))


_FITS = {"paged_mla_decode": _mla_fits, "paged_index_scores": _index_fits}


def reads_by_length(op: str, *args) -> bool:
    """Whether `op` ("paged_mla_decode" | "paged_index_scores") called on arguments of these shapes
    (its leading ones, jax.ShapeDtypeStructs will do: (q_latent, q_rope, latent_pages) | (q,
    weights, key_pages)) under the policy in force reads each row's pages only up to the row's
    length, so a table wider than the rows need costs nothing: their kernels do (the scores
    kernel writes a block past a query's count -inf unread); their references gather every page
    the table holds, so a caller sizes the table by what the rows hold."""
    return choose_impl(op, None, lambda: _FITS[op](*args)) == "pallas"
