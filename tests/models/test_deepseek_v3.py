"""The DeepSeek-V3 family against transformers' DeepseekV3ForCausalLM on tiny random checkpoints."""

from __future__ import annotations

import json
import shutil

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import tidejax
from tidejax.errors import CheckpointError
from tidejax.checkpoint import CheckpointReader
from tidejax.errors import ConfigError
from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.kv.paged import PagedCache
from tidejax.models.base import ParamSpec, init
from tidejax.models.deepseek_v3.model import build
from tidejax.models.deepseek_v3.weights import (checkpoint_table, expert_specs, load_weights,
                                               mtp_specs, param_specs)
from tidejax.models.layers.mla import MLACache
from tidejax.models.loading import ExpertPool
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import all_resident_state
from tests.support.declaration import check_forward_on_declared, param_paths
from tests.support.tiny_models import (DEEPSEEK_V3_CONFIGS, deepseek_v3_config, load_mtp_copy,
                                       relative_diff, served_greedy, state_dict,
                                       transformers_greedy, write_fp8_copies, write_fused_copy)

PROMPT = np.random.RandomState(7).randint(3, 256, 32)


@pytest.fixture(scope="module", params=sorted(DEEPSEEK_V3_CONFIGS))
def tiny(request, tiny_family):
    """(config name, path, transformers' model, the engine): tests/models/conftest.py's, shared
    with the family contract (test_family_contract.py: declared params, logits, greedy tokens,
    cached decode, half-resident `exact`)."""
    return request.param, *tiny_family("deepseek_v3", request.param)


def _config(name: str) -> DeepseekV3Config:
    return DeepseekV3Config.from_hf(deepseek_v3_config(**DEEPSEEK_V3_CONFIGS[name]).to_dict())


def _forward_args(cfg) -> tuple:
    """A forward's arguments before the experts: 4 tokens into one page of 4; block table [[0]]."""
    tokens = jnp.zeros((1, 4), jnp.int32)
    return (tokens, tokens, tokens > -1, PagedCache(MLACache.create(cfg, 1, 4, jnp.float32)),
            tokens[:, :1])


def test_params_unlike_the_declaration_fail_loudly():
    """The modules take their params' shapes from the spec builders (base.declare): a param of
    another shape or a missing one fails the forward, naming it; a declared param no module reads
    fails check_forward_on_declared."""
    cfg = _config("qlora_groups")
    model = build(cfg, ServeOptions(kernel="reference", all_resident=True), jnp.float32)
    declared, experts = param_specs(cfg, jnp.float32), expert_specs(cfg, jnp.float32)
    resident = all_resident_state(init(experts, jax.random.key(1)), len(cfg.moe_layers))

    def forward(params):
        return jax.eval_shape(lambda: model.apply({"params": params}, *_forward_args(cfg),
                                                  resident))

    params = init(declared, jax.random.key(0))
    forward(params)
    wrong = jax.tree.map(lambda a: a, params)  # new dicts, the same arrays
    wrong["layers_0"]["attn"]["kv_b_proj"] = params["layers_0"]["attn"]["kv_b_proj"][1:]
    with pytest.raises(flax.errors.ScopeParamShapeError, match="kv_b_proj"):
        forward(wrong)
    with pytest.raises(flax.errors.ScopeParamNotFoundError, match="lm_head"):
        forward({k: v for k, v in params.items() if k != "lm_head"})
    unread = declared | {"unread": ParamSpec((2,), jnp.float32, (None,))}
    with pytest.raises(AssertionError, match="never reads.*unread"):
        check_forward_on_declared(model, unread, experts, len(cfg.moe_layers), _forward_args(cfg))


def test_sampling_is_seeded_and_batch_independent(tiny):
    _, _, _, engine = tiny
    kwargs = dict(max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=3)
    alone = engine.generate("The tide", **kwargs)
    together = engine.generate(["def add", "The tide", "Le chat"], **kwargs)
    assert together[1] == alone
    assert engine.generate("The tide", **kwargs) == alone


def test_fused_and_fp8_layouts_load_to_the_same_logits(tiny, tmp_path):
    """transformers 5's in-memory fused experts, and DeepSeek's FP8 blocks, load like the original."""
    name, path, model, engine = tiny
    if name != "qlora_groups":
        pytest.skip("one config is enough for the layouts")
    fused = write_fused_copy(model, path, tmp_path / "fused")
    np.testing.assert_array_equal(tidejax.load(fused).logits(PROMPT), engine.logits(PROMPT))
    fp8, dequant = write_fp8_copies(path, tmp_path)
    np.testing.assert_array_equal(tidejax.load(fp8).logits(PROMPT),
                                  tidejax.load(dequant).logits(PROMPT))


def test_bad_checkpoints_name_file_and_tensor(tiny, tmp_path):
    name, path, _, _ = tiny
    if name != "no_qlora":
        pytest.skip("one config is enough for the failure cases")

    def copy(label):
        target = tmp_path / label
        shutil.copytree(path, target)
        return target

    missing = copy("missing")
    tensors = {k: CheckpointReader(path, progress=False).read(k)
               for k in CheckpointReader(path, progress=False).names()}
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        tidejax.load(missing)

    wrong = copy("wrong_shape")
    tensors = {k: CheckpointReader(path, progress=False).read(k)
               for k in CheckpointReader(path, progress=False).names()}
    tensors["model.norm.weight"] = np.ones(7, np.float32)
    save_file(tensors, str(wrong / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.norm\.weight.*\[7\]"):
        tidejax.load(wrong)

    truncated = copy("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|beyond)"):
        tidejax.load(truncated)

    unknown = copy("unknown_type")
    config = json.loads((unknown / "config.json").read_text())
    config["model_type"] = "mystery_moe"
    (unknown / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config\.json.*model_type.*mystery_moe"):
        tidejax.load(unknown)

    no_field = copy("missing_field")
    del config["kv_lora_rank"]
    config["model_type"] = "deepseek_v3"
    (no_field / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config\.json.*kv_lora_rank"):
        tidejax.load(no_field)


def test_mtp_layer_is_loaded_and_kept(tiny, tmp_path):
    """The published MTP (NextN) layer after the last decoder layer (an MLA layer with its own
    routed experts, plus enorm, hnorm, eh_proj and shared_head.norm) is read into host arrays as
    stored, apart from the decoder's params, every declared tensor named once by the table; one
    missing fails the load naming it."""
    name, path, model, engine = tiny
    if name != "qlora_groups":
        pytest.skip("one config is enough for the MTP layer")
    out = tmp_path / "mtp"
    cfg, raw, _, _, n = load_mtp_copy("deepseek_v3", path, engine, out, {
        "eh_proj.weight": ("eh_proj", "weight"), "hnorm.weight": ("hnorm", "weight"),
        "shared_head.norm.weight": ("shared_head_norm", "weight"),
        "self_attn.kv_b_proj.weight": ("attn", "kv_b_proj"),
        "mlp.experts.5.down_proj.weight": ("moe", "experts", "5", "down_proj")})
    assert cfg.num_mtp_layers == 1
    table = checkpoint_table(cfg)
    for p in param_paths(mtp_specs(cfg, jnp.float32)):
        assert len(table.param_names(p)) == 1, p

    reader = CheckpointReader(out, progress=False)
    tensors = {k: reader.read(k) for k in reader.names()}
    del tensors[f"model.layers.{n}.enorm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    pool = ExpertPool(len(cfg.moe_layers) * cfg.n_routed_experts, "checkpoint", np.float32)
    with pytest.raises(CheckpointError, match=rf"model\.layers\.{n}\.enorm\.weight"):
        load_weights(cfg, out, raw, ServeOptions(), jnp.float32, pool.put_row)


def test_native_mxfp4_experts_load_as_an_mxfp4_bank(tiny, tmp_path):
    """Experts stored as fused MXFP4 blocks and scales stay MXFP4 in the bank and compute what
    the same values stored dense compute."""
    from tidejax.checkpoint import mxfp4
    name, path, model, _ = tiny
    if name != "qlora_groups":
        pytest.skip("one config is enough for the format")
    state = state_dict(model)
    packed, dense = dict(state), dict(state)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(state[key])
        del packed[key]
        packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
        dense[key] = mxfp4.dequantize(blocks, scales).astype(np.float32)
    for label, tensors in (("packed", packed), ("dense", dense)):
        shutil.copytree(path, tmp_path / label)
        (tmp_path / label / "model.safetensors").unlink()
        save_file(tensors, str(tmp_path / label / "model.safetensors"))
    native = tidejax.load(tmp_path / "packed")
    assert set(native.state.experts.bank) == {"gate_up_blocks", "gate_up_scales",
                                                "down_blocks", "down_scales"}
    np.testing.assert_allclose(native.logits(PROMPT), tidejax.load(tmp_path / "dense").logits(PROMPT),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routes_as_transformers(topk_method, tmp_path):
    """A transformers-written DeepSeek-V2 checkpoint names no scoring_func: it routes by softmax,
    greedy or group-limited (groups by their best score), weights not renormalized; logits and
    greedy tokens match DeepseekV2ForCausalLM."""
    from tests.support.tiny_models import write_deepseek_v2
    model = write_deepseek_v2(tmp_path, topk_method)
    assert "scoring_func" not in json.loads((tmp_path / "config.json").read_text())
    engine = tidejax.load(tmp_path)
    assert (engine.cfg.scoring_func, engine.cfg.norm_topk_prob) == ("softmax", False)
    with torch.no_grad():
        ref = model(torch.tensor(PROMPT)[None]).logits[0].numpy()
    assert relative_diff(engine.logits(PROMPT), ref) < 1e-4
    assert served_greedy(engine, PROMPT, 12) == transformers_greedy(model, PROMPT, 12)


def test_deepseek_v2_rejects_a_scoring_it_does_not_have(tmp_path):
    raw = json.loads(deepseek_v3_config().to_json_string())
    raw.update(model_type="deepseek_v2", scoring_func="sigmoid")
    with pytest.raises(ConfigError, match="scoring_func.*softmax"):
        DeepseekV3Config.from_hf(raw, "config.json")


@pytest.mark.parametrize("t", [4, 1])
def test_the_forward_runs_its_ops_under_the_served_kernel(t):
    """No layer names a kernel implementation: the forward runs every op under its ServeOptions'
    kernel (models.base.serving), "reference" on the jnp paths, "pallas" on the kernels
    (interpret mode off the GPU) of the MLA attention (prefill for a chunk, decode for one
    token) and of the routed experts; "auto" takes the kernels on a GPU only."""
    import re

    cfg = DeepseekV3Config.from_hf(deepseek_v3_config(
        qk_rope_head_dim=16, q_lora_rank=None, n_group=1, topk_group=1,
        first_k_dense_replace=1).to_dict())  # rope width 16: shapes the MLA kernels take
    params = init(param_specs(cfg, jnp.float32), jax.random.key(0))
    experts = all_resident_state(init(expert_specs(cfg, jnp.float32), jax.random.key(1)),
                                 len(cfg.moe_layers))
    args = [a[:, :t] for a in _forward_args(cfg)[:3]] + list(_forward_args(cfg)[3:])

    def kernels(kernel: str) -> set[str]:
        model = build(cfg, ServeOptions(kernel=kernel, all_resident=True), jnp.float32)
        jaxpr = str(jax.make_jaxpr(lambda p, e: model.apply({"params": p}, *args, e))(params,
                                                                                        experts))
        return set(re.findall(r"name=(paged_mla_\w+|moe_\w+)", jaxpr)) if (
            "pallas_call" in jaxpr) else set()

    attention = "paged_mla_prefill" if t > 1 else "paged_mla_decode"
    assert kernels("reference") == set()
    on_kernels = kernels("pallas")
    assert attention in on_kernels and any(name.startswith("moe_") for name in on_kernels)
    assert kernels("auto") == (on_kernels if jax.default_backend() == "gpu" else set())
