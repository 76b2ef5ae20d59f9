"""The MTP (NextN) layer's draft forward (tidejax/models/layers/mtp.py) against transformers'
MtpModel, on tiny checkpoints of each family that drafts (DeepSeek-V3 with MLA, GLM-4.5 with GQA:
q/k norm, biases, partial rotary; GLM-5 with DSA, its MTP layer's own indexer picking) with one
MTP layer in the published names (write_mtp_copy), loaded by transformers' own
MtpModel.from_pretrained."""

from __future__ import annotations

import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from tidejax.kv.paged import PagedCache
from tidejax.models.layers.mtp import mtp_expert_state, mtp_params, with_mtp_slots
from tidejax.models.loading import ExpertPool
from tidejax.models.registry import family_of
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import all_resident_state
from tests.support.tiny_models import lower_index_ties, relative_diff, write_mtp_copy

N = 24  # the main model reads SEQ[:N]; the MTP layer the tokens SEQ[1:N + 1]
SEQ = np.random.RandomState(7).randint(3, 256, N + 1)
PREFILL = 10  # the cached run: a chunk of 10, then one position at a time
SERVE = ServeOptions(kernel="reference", all_resident=True)
# family -> (the tiny config, transformers' class); GLM-5's with an index_topk below N, so its
# indexers pick (ties to the lower index, as ours: lower_index_ties)
CASES = {"deepseek_v3": ("qlora_groups", "DeepseekV3ForCausalLM"),
         "glm4_moe": ("qknorm_groups", "Glm4MoeForCausalLM"),
         "glm_moe_dsa": ("topk_below", "GlmMoeDsaForCausalLM")}


def transformers_mtp(main):
    """transformers' MtpModel of `main`. GLM-5's MtpModel needs three things transformers 5.25
    does not give it: its config's MTP layer count and types (GlmMoeDsaConfig has no
    num_mtp_layers; the MTP layer is a MoE layer with its own indexer, indexer_types' first
    entry "full"; its mask a causal one, as "full_attention" asks: MtpModel maps no mask to
    "indexed_attention"), and its block's output as MtpLayer takes a decoder layer's (the DSA
    layer returns (hidden, top-k pick)). Its MtpCache has no indexer keys: the cached
    reference is not run for it (`cacheable`)."""
    from transformers.modeling_layers import MtpModel
    if main.config.model_type != "glm_moe_dsa":
        return MtpModel.from_pretrained(main).eval()
    main.config.num_mtp_layers = 1
    main.config.mtp_layer_types = ["full_attention"]
    main.config.mtp_mlp_layer_types = ["sparse"]
    mtp = MtpModel.from_pretrained(main).eval()
    block = mtp.layers[0].mtp_block
    block_forward = block.forward
    block.forward = lambda *args, **kwargs: block_forward(*args, **kwargs)[0]
    return mtp


def cacheable(main) -> bool:
    return main.config.model_type != "glm_moe_dsa"


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tiny_checkpoint, tmp_path_factory):
    """(transformers' main model and MtpModel, the family, tidejax's config, main params and
    experts, MTP params and experts) of the family's tiny checkpoint with one MTP layer."""
    import transformers
    config, model_class = CASES[request.param]
    family = family_of(request.param)
    out = tmp_path_factory.mktemp("mtp") / "ckpt"
    write_mtp_copy(tiny_checkpoint(request.param, config), out, attention_from=0, moe_from=1)
    raw = json.loads((out / "config.json").read_text())
    cfg = family.config_from_hf(raw)
    # Scales that let every part of the MTP layer show in its logits: write_mtp_copy's random
    # norms (0.1 randn) would make the block's attention and experts ~1e-3 of the residual, and
    # its eh_proj (randn) the residual ~sqrt(2d): norms near one, eh_proj to unit scale. And the
    # final norm's weight off its ones, so the hidden state before it and after it differ (as
    # the MTP layer's hnorm sees them).
    rng = np.random.RandomState(1)
    tensors = load_file(out / "model.safetensors")
    mtp = f"model.layers.{cfg.num_layers}."
    for name, w in tensors.items():
        if name.startswith(mtp) and name.endswith("layernorm.weight"):
            tensors[name] = (1 + 0.2 * rng.randn(*w.shape)).astype(np.float32)
    tensors[mtp + "eh_proj.weight"] /= np.sqrt(2 * cfg.hidden_size)
    tensors["model.norm.weight"] = rng.uniform(0.2, 2.0, cfg.hidden_size).astype(np.float32)
    save_file(tensors, out / "model.safetensors")
    # transformers finds the MTP tensors by the main class's ignore pattern, which names the
    # published models' layers: here the layer after the tiny model's last
    model_class = getattr(transformers, model_class)
    pattern = [rf"model\.layers\.{cfg.num_layers}\..*"]
    with mock.patch.object(model_class, "_keys_to_ignore_on_load_unexpected", pattern):
        # eager attention: the masks MtpModel makes for sdpa are None, which DSA cannot take
        main = model_class.from_pretrained(out, dtype=torch.float32,
                                           attn_implementation="eager").eval()
        mtp = transformers_mtp(main)
    pool = ExpertPool(len(cfg.moe_layers) * cfg.n_routed_experts, "checkpoint", np.float32)
    params, kept = family.load_weights(cfg, out, raw, SERVE, jnp.float32, pool.put_row)
    return (main, mtp, family, cfg, params,
            all_resident_state(pool.result(), len(cfg.moe_layers)),
            mtp_params(params, kept, cfg, jnp.float32), mtp_expert_state(kept, cfg, jnp.float32))


def reference(main, mtp):
    """transformers: the main model's hidden states as MTPCandidateGenerator takes them, the MTP
    layer's logits over the whole sequence, the same prefilled PREFILL entries then fed one at a
    time through its MtpCache (None where not `cacheable`), and MtpModel.forward's greedy draft
    at the last position."""
    from transformers.cache_utils import MtpCache

    def new_cache():
        return MtpCache(config=main.config.get_mtp_config()) if cacheable(main) else None

    def layer(hidden, start, stop, cache):
        ids = torch.tensor(SEQ[None, start + 1:stop + 1])
        x = mtp.forward_layer(0, hidden[:, start:stop], torch.arange(start + 1, stop + 1)[None],
                              cache, input_ids=ids)
        return mtp._project_to_logits(x)[0].numpy()

    with torch.no_grad(), lower_index_ties():
        hidden = main(torch.tensor(SEQ[None, :N]), output_hidden_states=-1).hidden_states[-1]
        full = layer(hidden, 0, N, new_cache())
        cached = None
        if cacheable(main):
            cache = new_cache()
            cached = np.concatenate([layer(hidden, 0, PREFILL, cache)]
                                    + [layer(hidden, p, p + 1, cache) for p in range(PREFILL, N)])
        draft, _, _ = mtp(input_ids=torch.tensor(SEQ[None, 1:]), last_hidden_states=hidden,
                          attention_mask=None, position_ids=torch.arange(1, N + 1)[None],
                          mtp_cache=new_cache())
    return hidden[0].numpy(), full, cached, int(draft[0, 0])


def ours(family, cfg, params, experts, mtp_params_, mtp_experts, chunks):
    """tidejax: the main Decoder then the MTP layer over each (start, stop) of `chunks` in turn,
    both through one pool with the MTP slot (16 pages of 4, shuffled) -> (the main model's head
    hidden, draft logits), each [N, ...]."""
    main = jax.jit(lambda *a: family.build(cfg, SERVE, jnp.float32).apply(
        {"params": params}, *a, mutable=["intermediates"]))
    draft = jax.jit(lambda *a: family.build_mtp(cfg, SERVE, jnp.float32).apply(
        {"params": mtp_params_}, *a))
    cache = PagedCache(family.create_cache(with_mtp_slots(cfg), 16, 4, jnp.float32))
    table = jnp.asarray(np.random.RandomState(0).permutation(16)[None].astype(np.int32))
    hiddens, logits = [], []
    for start, stop in chunks:
        tokens, positions = jnp.asarray(SEQ[None, start:stop]), jnp.arange(start, stop)[None]
        (_, cache, experts), seen = main(tokens, positions, tokens > -1, cache, table, experts)
        hidden = seen["intermediates"]["head_hidden"][0]
        out, _, cache, mtp_experts = draft(hidden, jnp.asarray(SEQ[None, start + 1:stop + 1]),
                                           positions, tokens > -1, cache, table, mtp_experts)
        hiddens.append(np.asarray(hidden[0]))
        logits.append(np.asarray(out[0]))
    return np.concatenate(hiddens), np.concatenate(logits)


def test_draft_logits_match_transformers_mtp(checkpoint):
    """The main model's head hidden state is what transformers feeds its MTP layer; the draft
    logits equal MtpModel's (fp32, 1e-4) over the whole sequence and through the paged pool (a
    prefill chunk, then one token at a time; GLM-5's cached run against the whole sequence's:
    transformers' MtpCache keeps no indexer keys), and so do the greedy drafts."""
    main, mtp, *args = checkpoint
    hidden, full, cached, draft = reference(main, mtp)
    our_hidden, our_full = ours(*args, [(0, N)])
    assert relative_diff(our_hidden, hidden) < 1e-4
    diff = relative_diff(our_full, full)
    print(f"max relative draft logit difference {diff:.2e}")
    assert diff < 1e-4
    _, our_cached = ours(*args, [(0, PREFILL)] + [(p, p + 1) for p in range(PREFILL, N)])
    if cached is not None:
        assert relative_diff(our_cached, cached) < 1e-4
        assert relative_diff(cached, full) < 1e-4
    assert relative_diff(our_cached, full) < 1e-4
    np.testing.assert_array_equal(our_full.argmax(-1), full.argmax(-1))
    np.testing.assert_array_equal(our_cached.argmax(-1), full.argmax(-1))
    assert int(our_cached[-1].argmax()) == draft
