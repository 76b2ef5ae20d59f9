"""DeepSeek-V4 against transformers' implementation on tiny random checkpoints made here: every
attention kind (sliding, CSA with its overlapping compressors and indexer, HCA), hash routing,
clamped SwiGLU, mHC with the hyper head, YaRN on the compress RoPE (or not)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tidejax.fields import ConfigError  # noqa: E402
from tidejax.models.deepseek_v4.config import V4Config  # noqa: E402
from tidejax.models.deepseek_v4.model import DeepseekV4, V4Cache, full_forward  # noqa: E402
from tidejax.models.deepseek_v4.weights import load_state  # noqa: E402

CONFIGS = {
    "yarn_hc3": dict(hidden_size=64, head_dim=32, hc_mult=3, hc_sinkhorn_iters=5, sliding_window=6,
                     index_topk=3, swiglu_limit=1.0, compress_rates={"compressed_sparse_attention": 4,
                                                                      "heavily_compressed_attention": 8},
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                      "original_max_position_embeddings": 64}),
    "plain_hc2": dict(hidden_size=48, head_dim=64, hc_mult=2, hc_sinkhorn_iters=20, sliding_window=9,
                      index_topk=4, swiglu_limit=7.0, compress_rates={"compressed_sparse_attention": 2,
                                                                       "heavily_compressed_attention": 16}),
}


def tiny_model(name, seed):
    torch.manual_seed(seed)
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
             "compressed_sparse_attention", "heavily_compressed_attention"]
    cfg = transformers.DeepseekV4Config(
        vocab_size=97, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, o_groups=2, o_lora_rank=16,
        index_n_heads=16, index_head_dim=32,  # many heads: ReLU all-zero ties at top-k are rare
        partial_rotary_factor=0.25, layer_types=kinds,
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], max_position_embeddings=256,
        **CONFIGS[name])
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():  # every parameter random and O(1) in effect (the defaults zero many)
        for pname, p in model.named_parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.ndim > 1 else 0.3)
            if "norm" in pname:
                p.add_(1.0)
        for bname, b in model.named_buffers():
            if bname.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape))
            elif bname.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    raw = json.loads(cfg.to_json_string())
    return model, raw


@pytest.mark.parametrize("name, seed", [("yarn_hc3", 0), ("plain_hc2", 1)])
def test_logits_match_transformers(name, seed):
    model, raw = tiny_model(name, seed)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = model(ids).logits.numpy()
    cfg = V4Config.from_hf(raw, f"{name}/config.json")
    assert set(cfg.layer_types) == {"sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention"} and cfg.hash_layers == (0, 1)
    params, banks = load_state(cfg, {k: v.numpy() for k, v in model.state_dict().items()})
    got = jax.jit(lambda p, b: full_forward(cfg, p, b, jnp.asarray(ids.numpy()), "reference"))(
        params, banks)
    assert np.abs(np.asarray(got) - want).max() <= 1e-4
    assert np.array_equal(np.asarray(got).argmax(-1), want.argmax(-1))


def test_prefill_then_decode_equals_full_forward():
    """Prefill 11 (CSA and HCA windows left part full), then one token at a time: the same
    logits as one forward (which matches transformers above)."""
    model, raw = tiny_model("yarn_hc3", 4)
    cfg = V4Config.from_hf(raw, "x")
    params, banks = load_state(cfg, {k: v.numpy() for k, v in model.state_dict().items()})
    ids = np.random.default_rng(4).integers(0, 97, (1, 40)).astype(np.int32)
    want = np.asarray(jax.jit(lambda p, b: full_forward(cfg, p, b, jnp.asarray(ids), "reference"))(
        params, banks))[0]
    step = jax.jit(lambda p, c, tok, pos, b: DeepseekV4(cfg, "reference").apply(
        p, tok, pos, pos >= 0, c, b))
    cache, got = V4Cache.create(cfg, 1, 40), []
    for lo, hi in [(0, 11)] + [(p, p + 1) for p in range(11, 40)]:
        logits, cache = step(params, cache, jnp.asarray(ids[:, lo:hi]),
                             jnp.arange(lo, hi, dtype=jnp.int32)[None], banks)
        got.append(np.asarray(logits[0]))
    assert np.abs(np.concatenate(got) - want).max() <= 1e-4


def test_load_folder(tmp_path):
    """A folder of transformers' module names (config.json + safetensors) loads through `load`."""
    from safetensors.torch import save_file

    from tidejax.models.deepseek_v4.weights import load

    model, raw = tiny_model("plain_hc2", 3)
    state = model.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg, params, banks = load(tmp_path)
    np.testing.assert_array_equal(np.asarray(params["params"]["embed"]),
                                  state["model.embed_tokens.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(banks[4]["down"]),
                                  state["model.layers.4.mlp.experts.down_proj"].numpy())


def test_unmapped_tensor_is_named():
    model, raw = tiny_model("plain_hc2", 2)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    state["model.layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ConfigError, match="layers.0.self_attn.extra.weight has no place"):
        load_state(V4Config.from_hf(raw, "x"), state)
