"""One contract for a family, parametrised over the registered families it covers (CONTRACT):
declared params = checkpoint table, fp32 logits within 1e-4 of transformers' on tiny random
checkpoints, greedy tokens, the paged cached decode = the full forward, half-resident `exact` =
all-resident, the GQA families' cached decode on the paged GQA kernel (gpt-oss's on the MoE
kernel too); for the families whose MTP layer drafts (MTP), greedy output with speculative
decoding on as with it off and the refusals without the layer; and for the families with a chat
template kept in tests/data/chat_templates, a tool call and its result through the app to the
openai and anthropic clients. Where an item does not run here for a family, or a registered
model type is not in the contract, NOT_HERE says why and where it is checked instead. A new
family costs a writer and configs in tests/support/tiny_models.py and an entry here (and its chat
vocabulary in tests/support/chat_models.py). The checkpoints, engines and chat servers are
tests/models/conftest.py's (`tiny_family`, `chat_server`), shared with the families' own
modules."""

from __future__ import annotations

import importlib
import json
import shutil

import anthropic
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import torch

import tidejax
from tidejax.config import EngineConfig
from tidejax.errors import ConfigError
from tidejax.kv.paged import PagedCache
from tidejax.models.registry import FAMILY_MODULES, family_of
from tidejax.residency.serve import ServeOptions
from tidejax.runtime.build import LoadedModel
from tidejax.runtime.scheduler import DoneEvent, GenerationRequest
from tests.support.chat_models import CHAT_FAMILIES, CITY, THOUGHT, WEATHER
from tests.support.declaration import check_forward_on_declared, param_paths
from tests.support.engine_probes import run, tokens_of
from tests.support.tiny_models import (FAMILIES, cached_decode_logits,
                                       check_cached_decode_on_the_gqa_kernel, deepseek_v3_config,
                                       glm4_moe_config, glm_moe_dsa_config, gpt_oss_config,
                                       lower_index_ties, minimax_m2_config, mixtral_config,
                                       qwen3_moe_config, relative_diff, repeating_mtp,
                                       served_greedy, transformers_greedy,
                                       write_gpt_oss_mxfp4_copies)

# family -> its transformers config builder (the writer's and the configs' are in FAMILIES)
CONTRACT = {"deepseek_v3": deepseek_v3_config, "glm4_moe": glm4_moe_config,
            "glm_moe_dsa": glm_moe_dsa_config, "qwen3_moe": qwen3_moe_config,
            "mixtral": mixtral_config, "minimax_m2": minimax_m2_config,
            "gpt_oss": gpt_oss_config}
CASES = [(family, config) for family in CONTRACT for config in sorted(FAMILIES[family][1])]
# the config a family's half-resident check runs on (one is enough): one with the most MoE layers
HALF_RESIDENT = {"deepseek_v3": "qlora_groups", "glm4_moe": "no_dense", "glm_moe_dsa": "topk_above",
                 "qwen3_moe": "renormalized", "mixtral": "top3_mqa", "minimax_m2": "half_rotary",
                 "gpt_oss": "window8"}
# the families whose cached decode runs on the paged GQA kernel here (Triton's interpreter is
# slow: GLM-4.5's q/k norm, biases and partial rotary, and gpt-oss's sinks and window, cover what
# the other GQA families' attention adds to the kernel's inputs)
GQA_KERNEL = [(family, config) for family in ("glm4_moe", "gpt_oss")
              for config in sorted(FAMILIES[family][1])]
# what is not checked here, and where it is instead: registered model types outside CONTRACT, and
# the contract families with no tool call through the clients here (no template in
# tests/data/chat_templates)
NOT_HERE = {
    "deepseek_v2": "the deepseek_v3 family: tests/models/test_deepseek_v3.py checks its softmax "
                   "routing (test_deepseek_v2_routes_as_transformers)",
    "kimi_k2": "the deepseek_v3 family: tests/models/test_kimi_k2.py checks its tiktoken "
               "tokenizer, logits and tool-call sections through the openai client",
    "deepseek_v41": "no transformers model: tests/models/test_deepseek_v41*.py check it against "
                    "the reference's own outputs (tests/data/golden_v41)",
    "deepseek_v4": "tests/models/test_deepseek_v4.py: against transformers' "
                   "DeepseekV4ForCausalLM, with its compressor and window rings per lane",
    "tools:deepseek_v3": "no published chat template kept here: its tool-call format is parsed "
                         "in tests/server/test_server_units.py, Kimi K2's served end to end in "
                         "tests/models/test_kimi_k2.py",
    "tools:glm_moe_dsa": "GLM-4.5's tool format, served here on glm4_moe's checkpoint with "
                         "GLM-4.5's template; tests/models/test_glm_moe_dsa.py checks the family "
                         "picks it",
    "mtp:deepseek_v3": "tests/runtime/test_speculative_engine.py: greedy output with its MTP "
                       "layer drafting, alone and in four preempting lanes, sampled output by "
                       "chi-square, the stats through the server; tests/runtime/"
                       "test_speculative.py: the refusals at start",
}
# the families whose MTP layer drafts ([speculative] method "mtp", Family.build_mtp) checked
# here, each on a config whose layer 1 is a MoE layer (the MTP layer's copied from it and layer
# 0's attention: tiny_models.write_mtp_copy)
MTP = {"glm4_moe": "qknorm_groups", "glm_moe_dsa": "topk_below"}
PROMPT = np.random.RandomState(11).randint(3, 256, 32)


def reference_logits(model, prompt):
    """transformers' logits, top-k ties to the lower index as jax.lax.top_k breaks them
    (lower_index_ties: GLM-5's indexers tie)."""
    with torch.no_grad(), lower_index_ties():
        return model(torch.tensor(prompt)[None]).logits[0].numpy()


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def tiny(request, tiny_family):
    family, config = request.param
    path, model, engine = tiny_family(family, config)
    return family, config, path, model, engine


def test_every_registered_family_is_checked_somewhere():
    """Each registered model type is in the contract or NOT_HERE says where it is checked; each
    contract family's tool call runs here (CHAT_FAMILIES) or NOT_HERE says where."""
    for model_type in FAMILY_MODULES:
        assert model_type in CONTRACT or model_type in NOT_HERE, model_type
    for family in CONTRACT:
        assert (family in CHAT_FAMILIES) != (f"tools:{family}" in NOT_HERE), family
    assert set(HALF_RESIDENT) == set(CONTRACT)
    for family in CONTRACT:
        drafts = family_of(family).build_mtp is not None
        assert drafts == (family in MTP or f"mtp:{family}" in NOT_HERE), family
        assert drafts == (family_of(family).mtp_specs is not None), family


@pytest.mark.parametrize("family", CONTRACT)
def test_declared_params_are_what_the_model_consumes(family):
    """In every config of the family: the forward reads each declared param, and the checkpoint
    table fills each from exactly one name."""
    weights = importlib.import_module(f"tidejax.models.{family}.weights")
    fam = family_of(family)
    for overrides in FAMILIES[family][1].values():
        raw = CONTRACT[family](**overrides).to_dict()
        cfg = fam.config_from_hf(raw)
        tokens = jnp.zeros((1, 4), jnp.int32)
        declared = weights.param_specs(cfg, jnp.float32)
        check_forward_on_declared(
            fam.build(cfg, ServeOptions(kernel="reference", all_resident=True), jnp.float32),
            declared, weights.expert_specs(cfg, jnp.float32), len(cfg.moe_layers),
            (tokens, tokens, tokens > -1, PagedCache(fam.create_cache(cfg, 1, 4, jnp.float32)),
             tokens[:, :1]))
        table = weights.checkpoint_table(cfg)
        for path in param_paths(declared):
            assert len(table.param_names(path)) == 1, path


def test_logits_match_transformers(tiny):
    family, config, _, model, engine = tiny
    diff = relative_diff(engine.logits(PROMPT), reference_logits(model, PROMPT))
    print(f"{family} {config}: max relative logit difference {diff:.2e}")
    assert diff < 1e-4


def test_greedy_tokens_match_transformers(tiny):
    *_, model, engine = tiny
    with lower_index_ties():
        want = transformers_greedy(model, PROMPT, 16)
    assert served_greedy(engine, PROMPT, 16) == want


def test_cached_decode_equals_full_forward(tiny):
    *_, engine = tiny
    assert relative_diff(cached_decode_logits(engine, PROMPT, 16), engine.logits(PROMPT)) < 1e-5


@pytest.mark.parametrize("family, config", GQA_KERNEL, ids=["-".join(c) for c in GQA_KERNEL])
def test_cached_decode_on_the_gqa_kernel_matches_transformers(family, config, tiny_family,
                                                              monkeypatch):
    """The attention on the paged GQA kernel (Triton's interpreter here), a 16-token prompt
    chunk then one token a step: the cached decode's logits against transformers' full forward
    (GLM-4.5's q/k norm, biases and partial rotary; gpt-oss's sinks and the sliding window of 8
    in its first layer)."""
    _, model, engine = tiny_family(family, config)
    check_cached_decode_on_the_gqa_kernel(engine, model, PROMPT, monkeypatch)


@pytest.mark.parametrize("family, config", HALF_RESIDENT.items(),
                         ids=["-".join(c) for c in HALF_RESIDENT.items()])
def test_half_resident_exact_equals_all_resident(family, config, tiny_family):
    """Half the experts in the bank, misses copied in from the host pool: the same logits."""
    path, _, engine = tiny_family(family, config)
    n_moe, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    half = tidejax.load(path, residency={"budget_experts": n_moe * n_experts // 2,
                                         "miss_policy": "exact"})
    assert half.residency.stats()["resident"] == n_moe * n_experts // 2
    np.testing.assert_array_equal(half.logits(PROMPT), engine.logits(PROMPT))
    assert half.residency.stats()["misses"] > 0


def test_gpt_oss_published_mxfp4_experts_and_the_host_policies(tmp_path):
    """The published layout (MXFP4 blocks and scales, gate/up rows interleaved) loads, kept
    MXFP4, to the same logits as its values dequantized in transformers' float layout; the `cpu`
    and `auto` miss policies (the host kernel takes no biases nor (u + 1) * glu) are refused at
    load, naming the key."""
    writer, configs = FAMILIES["gpt_oss"]
    model = writer(tmp_path / "model", **configs["window8"])
    packed, dense = write_gpt_oss_mxfp4_copies(model, tmp_path / "model", tmp_path)
    engine = tidejax.load(packed)
    assert "gate_up_blocks" in engine.state.experts.bank
    assert relative_diff(engine.logits(PROMPT), tidejax.load(dense).logits(PROMPT)) < 1e-5
    for policy in ("cpu", "auto"):
        with pytest.raises(ConfigError, match="miss_policy"):
            tidejax.load(packed, residency={"budget_experts": 8, "miss_policy": policy})


def test_gpt_oss_cached_decode_on_the_kernels_matches_transformers(tiny_family, monkeypatch):
    """engine.kernel = "pallas" (interpret mode and Triton's interpreter here): gpt-oss's experts
    (biases, the clamped g * sigmoid(1.702 g) * (u + 1)) on the grouped MoE kernel, its attention
    on the paged GQA kernel. One token a step (the kernel's GEMV path: float32 products) within
    the contract's 1e-4 of transformers' full forward; a 16-token prompt chunk first (its dots
    path: the float32 activations rounded to bf16, ~2e-3 an expert's output) within 1e-2."""
    from tidejax import ops

    path, model, _ = tiny_family("gpt_oss", "window8")
    engine = tidejax.load(path, engine={"kernel": "pallas", "warmup": False})
    chosen = []

    def choose_impl(op, impl=None, fits=None):
        chosen.append((op, ops.dispatch.choose_impl(op, impl, fits)))
        return chosen[-1][1]

    monkeypatch.setattr(ops, "choose_impl", choose_impl)  # moe_grouped's choice
    with torch.no_grad():
        ref = model(torch.tensor(PROMPT)[None]).logits[0].numpy()
    assert relative_diff(cached_decode_logits(engine, PROMPT, 1), ref) < 1e-4
    assert relative_diff(cached_decode_logits(engine, PROMPT, 16), ref) < 1e-2
    # each layer's experts, every time they were traced (one token, 16)
    assert len(chosen) >= 2 * engine.cfg.num_layers and set(chosen) == {("moe_grouped", "pallas")}


@pytest.fixture(scope="module", params=sorted(CHAT_FAMILIES))
def served(request, chat_server):
    """(family, its chat checkpoint's path, the base URL, the served model name): the app over
    the family's tiny chat checkpoint (tests/models/conftest.py's `chat_server`, shared with the
    families' own modules)."""
    path, url, engine = chat_server(request.param)
    return request.param, path, url, engine.served_name


def reference_prompt_tokens(path, messages, **kwargs) -> int:
    """The prompt length of transformers' own rendering of the checkpoint's template."""
    from transformers import PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    return len(tokenizer.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True,
                                             return_dict=True, **kwargs)["input_ids"])


def test_tool_call_and_result_through_the_openai_client(served):
    """The model's reply in the family's format comes back as reasoning_content (where the
    family reasons) and an OpenAI tool call, whole and streamed; the call's history (its
    reasoning under the field the template reads) and the tool's result render into the next
    prompt as transformers renders them."""
    family, path, url, name = served
    thought = THOUGHT if CHAT_FAMILIES[family].reasons else None
    oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = dict(model=name, tools=[WEATHER], temperature=0, max_tokens=24)
    first = oai.chat.completions.create(messages=messages, **kwargs)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                         {"city": CITY})
    assert choice.message.model_extra.get("reasoning_content") == thought
    assert first.usage.prompt_tokens == reference_prompt_tokens(path, messages)

    chunks = list(oai.chat.completions.create(messages=messages, stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == (
        thought or "")
    assert [(t.function.name, json.loads(t.function.arguments)) for d in deltas
            for t in d.tool_calls or []] == [("get_weather", {"city": CITY})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    history = messages + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = oai.chat.completions.create(messages=history, **kwargs)
    reasoning_key = "thinking" if family == "gpt_oss" else "reasoning_content"
    reference = messages + [
        {"role": "assistant", "content": "", reasoning_key: thought, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": CITY}}}]},
        history[-1]]
    assert second.usage.prompt_tokens == reference_prompt_tokens(path, reference)


def test_tool_use_through_the_anthropic_client(served):
    family, _, url, name = served
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    reply = claude.messages.create(model=name, max_tokens=24, tools=[tool], extra_body={
        "temperature": 0}, messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert reply.stop_reason == "tool_use"
    if CHAT_FAMILIES[family].reasons:
        assert [(b.type, getattr(b, "thinking", None)) for b in reply.content][0] == (
            "thinking", THOUGHT)
    assert [(b.name, b.input) for b in reply.content if b.type == "tool_use"] == [
        ("get_weather", {"city": CITY})]


# four lanes in a pool of 64 tokens (8 pages) for sequences of up to 30: preemption; warm-up off
# (the steps compile as the requests meet them)
SPECULATING = {"lanes": 4, "max_context": 32, "page_size": 8, "prefill_chunk": 16,
               "kv_pool_tokens": 64, "warmup": False}
DRAFT_PROMPTS = [np.random.RandomState(s).randint(3, 256, n).tolist()
                 for s, n in ((1, 14), (2, 9), (3, 11), (4, 6))]


def greedy_with_stats(engine, prompts, new: int = 16):
    """Each prompt's `new` greedy tokens (eos ignored), all submitted at once, and each
    request's stats."""
    events = run(engine, [GenerationRequest(p, new, ignore_eos=True) for p in prompts])
    for got in events:
        assert isinstance(got[-1], DoneEvent) and got[-1].finish_reason == "length"
    return [tokens_of(got) for got in events], [got[-1].stats for got in events]


@pytest.mark.parametrize("family, config", MTP.items(), ids=["-".join(c) for c in MTP.items()])
def test_mtp_drafting_keeps_the_greedy_output(family, config, tiny_checkpoint, tmp_path):
    """The family's MTP layer (tiny_models.repeating_mtp's: it drafts the main model's next token
    again) drafting 2 tokens a lane a step: greedy output token for token the engine's without
    speculation, one request alone and then four in a pool that preempts; drafts both accepted
    and rejected, counted in each request's stats; fewer steps than tokens alone."""
    path = repeating_mtp(tiny_checkpoint(family, config, seed=5), tmp_path / "mtp", 0.3)
    plain = tidejax.load(path, engine=SPECULATING)
    speculating = tidejax.load(path, engine=SPECULATING,
                               speculative={"method": "mtp", "tokens": 2})
    totals = speculating.scheduler.totals
    for prompts in (DRAFT_PROMPTS[:1], DRAFT_PROMPTS):
        steps, preempted = totals["steps"], totals["preemptions"]
        got, stats = greedy_with_stats(speculating, prompts)
        print(f"{family} {len(prompts)} lanes: accepted "
              f"{[s['accepted_tokens'] for s in stats]} of {[s['drafted_tokens'] for s in stats]}")
        assert got == greedy_with_stats(plain, prompts)[0]
        assert 0 < sum(s["accepted_tokens"] for s in stats) < sum(s["drafted_tokens"]
                                                                   for s in stats)
        for s in stats:
            assert s["acceptance"] == s["accepted_tokens"] / s["drafted_tokens"]
        if len(prompts) == 1:
            assert totals["steps"] - steps < len(got[0])
        else:
            assert totals["preemptions"] > preempted
    assert speculating.scheduler.pages.in_use == 0


@pytest.mark.parametrize("family", MTP)
def test_mtp_refused_at_start_without_the_layer(family, tiny_checkpoint, tmp_path):
    """method = "mtp" on a checkpoint whose config.json counts no MTP layer, or counts one that
    its tensors lack (GLM-4.5's count is 1 where the field is absent), fails at start naming
    config.json's field; that checkpoint still loads without speculation."""
    def profile(path, method="mtp"):
        return EngineConfig.from_dict({"model": {"path": str(path)},
                                       "speculative": {"method": method}}, source="spec.toml")

    base = tiny_checkpoint(family, MTP[family], seed=5)
    with pytest.raises(ConfigError, match=r"spec.toml: 'speculative.method' = 'mtp' but "
                                          r".*config.json has no MTP layer .*"
                                          r"'num_nextn_predict_layers'"):
        LoadedModel(profile(base))
    counted = tmp_path / "counted"
    shutil.copytree(base, counted)
    raw = json.loads((counted / "config.json").read_text())
    (counted / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}))
    assert LoadedModel(profile(counted, "none")).speculating == 0
    with pytest.raises(ConfigError, match=r"spec.toml: 'speculative.method' = 'mtp' but .* holds "
                                          r"no MTP layer \(config.json's field "
                                          r"'num_nextn_predict_layers' = 1, and no tensor "
                                          r"model.layers.2.\*\)"):
        LoadedModel(profile(counted))
