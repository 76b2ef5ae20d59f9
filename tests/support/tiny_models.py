"""Tiny random checkpoints written by transformers itself, and a small tokenizer, for tests.

Every checkpoint here is made on the fly: transformers' own model class with a tiny config and
random weights, saved with save_pretrained, plus a byte-level BPE tokenizer trained on a few
sentences and a simple chat template.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import torch

TEXT = """The tide comes in and the tide goes out. Experts live in host memory and the busy ones
move to the GPU. def add(a, b):\n    return a + b\nDer Hund schläft im Garten. Le chat dort.
A mixture of experts routes every token to a few experts. for i in range(10): print(i)
""" * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

SPECIAL = ["<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"]


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE of at most `vocab_size` tokens, with chat special tokens and a template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}))


DEEPSEEK_V3_CONFIGS = {
    # q_lora_rank, group-limited routing (n_group 4, topk_group 2), one dense layer first
    "qlora_groups": dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1),
    # no q_lora_rank (V2-Lite style), two dense layers, plain top-k
    "no_qlora": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=2),
    # YaRN with mscale / mscale_all_dim, two shared experts
    "yarn": dict(q_lora_rank=16, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=2,
                 rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 64, "beta_fast": 32,
                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def deepseek_v3_config(**overrides):
    from transformers import DeepseekV3Config
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
                max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                num_nextn_predict_layers=0)
    base.update(overrides)
    return DeepseekV3Config(**base)


def write_deepseek_v2(path: Path, topk_method: str, seed: int = 0):
    """Writes a tiny DeepseekV2ForCausalLM checkpoint (V2-Lite style: no q_lora_rank; softmax
    routing by `topk_method`, no scoring_func in its config.json) with a tokenizer; returns the
    torch model (eval mode)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=3, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
        max_position_embeddings=256, first_k_dense_replace=1, topk_method=topk_method,
        n_group=4, topk_group=2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = DeepseekV2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                for param in layer.mlp.experts.parameters():
                    param.normal_(0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size)
    return model


def write_deepseek_v3(path: Path, seed: int = 0, **overrides):
    """Writes a tiny DeepseekV3ForCausalLM checkpoint (random, float32) with a tokenizer; returns
    the torch model (eval mode) for reference outputs."""
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    config = deepseek_v3_config(**overrides)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # random router bias so the selection-only bias is exercised
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
                layer.mlp.experts.gate_up_proj.normal_(0, 0.1)
                layer.mlp.experts.down_proj.normal_(0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size)
    return model


GLM4_MOE_CONFIGS = {
    # (two layers each) GLM-4.5's attention (q/k norm, q/k/v biases, half the head rotated),
    # a dense layer then a MoE layer, group-limited routing (4 groups, top 2), GQA with 2 query
    # heads a KV head
    "qknorm_groups": dict(use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                          first_k_dense_replace=1, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, num_key_value_heads=2),
    # GLM-4.5-Air's (no q/k norm), two MoE layers and no dense one, plain top-k without
    # renormalization, every channel rotated, one KV head
    "no_dense": dict(use_qk_norm=False, attention_bias=True, partial_rotary_factor=1.0,
                     first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False,
                     routed_scaling_factor=1.0, num_key_value_heads=1),
}


def glm4_moe_config(**overrides):
    from transformers import Glm4MoeConfig
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
                max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                num_nextn_predict_layers=0)
    base.update(overrides)
    return Glm4MoeConfig(**base)


def write_glm4_moe(path: Path, seed: int = 0, **overrides):
    """Writes a tiny Glm4MoeForCausalLM checkpoint (random, float32) with a tokenizer; returns
    the torch model (eval mode) for reference outputs."""
    from transformers import Glm4MoeForCausalLM
    torch.manual_seed(seed)
    config = glm4_moe_config(**overrides)
    model = Glm4MoeForCausalLM(config).eval()
    randomize_moe(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size)
    return model


GLM_MOE_DSA_CONFIGS = {
    # DSA top-k (8) below the 32-token prompt, the second layer reusing the first's pick
    # ("shared"), a dense layer then a MoE layer, group-limited routing (4 groups, top 2)
    "topk_below": dict(index_topk=8, index_topk_pattern="FS", first_k_dense_replace=1,
                       n_group=4, topk_group=2, num_hidden_layers=2),
    # DSA top-k (64) above the context, an indexer in every layer, no dense layer, plain top-k
    # without renormalization
    "topk_above": dict(index_topk=64, index_topk_pattern="FF", first_k_dense_replace=0,
                       n_group=1, topk_group=1, norm_topk_prob=False, num_hidden_layers=2),
}


def glm_moe_dsa_config(**overrides):
    from transformers import GlmMoeDsaConfig
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=8, num_experts_per_tok=3, kv_lora_rank=16, q_lora_rank=24,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_head_dim=16,
                index_n_heads=8, max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    base.update(overrides)
    return GlmMoeDsaConfig(**base)


def write_glm_moe_dsa(path: Path, seed: int = 0, **overrides):
    """Writes a tiny GlmMoeDsaForCausalLM checkpoint (random, float32) with a tokenizer; returns
    the torch model (eval mode) for reference outputs."""
    from transformers import GlmMoeDsaForCausalLM
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(glm_moe_dsa_config(**overrides)).eval()
    randomize_moe(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return model


QWEN3_MOE_CONFIGS = {
    # (two layers each) Qwen3-30B-A3B's routing (top-k renormalized), two MoE layers, 2 query
    # heads a KV head
    "renormalized": dict(norm_topk_prob=True, num_key_value_heads=2),
    # a dense layer (mlp_only_layers) then a MoE layer, top-k probabilities as they are, one KV
    # head
    "dense_first": dict(norm_topk_prob=False, mlp_only_layers=[0], num_key_value_heads=1),
}


def qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                num_experts=8, num_experts_per_tok=3, max_position_embeddings=256,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    base.update(overrides)
    return Qwen3MoeConfig(**base)


def write_qwen3_moe(path: Path, seed: int = 0, **overrides):
    """Writes a tiny Qwen3MoeForCausalLM checkpoint (random, float32) with a tokenizer; returns
    the torch model (eval mode) for reference outputs."""
    from transformers import Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(qwen3_moe_config(**overrides)).eval()
    randomize_moe(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return model


MIXTRAL_CONFIGS = {
    # (two layers each) Mixtral's top-2 of 8 with 2 query heads a KV head
    "top2": dict(num_experts_per_tok=2, num_key_value_heads=2),
    # top-3 with one KV head
    "top3_mqa": dict(num_experts_per_tok=3, num_key_value_heads=1),
}


def mixtral_config(**overrides):
    from transformers import MixtralConfig
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_local_experts=8,
                num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    base.update(overrides)
    return MixtralConfig(**base)


def write_mixtral(path: Path, seed: int = 0, **overrides):
    """Writes a tiny MixtralForCausalLM checkpoint (random, float32; save_pretrained writes the
    published `block_sparse_moe` names) with a tokenizer; returns the torch model (eval mode)."""
    from transformers import MixtralForCausalLM
    torch.manual_seed(seed)
    model = MixtralForCausalLM(mixtral_config(**overrides)).eval()
    randomize_moe(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return model


MINIMAX_M2_CONFIGS = {
    # (two layers each) MiniMax-M2's partial rotary (half of each head), 2 query heads a KV head
    "half_rotary": dict(partial_rotary_factor=0.5, num_key_value_heads=2, num_experts_per_tok=3),
    # every channel rotated, one KV head, top-2
    "full_rotary": dict(partial_rotary_factor=1.0, num_key_value_heads=1, num_experts_per_tok=2),
}


def minimax_m2_config(partial_rotary_factor: float = 0.5, **overrides):
    from transformers import MiniMaxM2Config
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_local_experts=8,
                num_experts_per_tok=3, max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                 "partial_rotary_factor": partial_rotary_factor},
                bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    base.update(overrides)
    return MiniMaxM2Config(**base)


def write_minimax_m2(path: Path, seed: int = 0, **overrides):
    """Writes a tiny MiniMaxM2ForCausalLM checkpoint (random, float32; save_pretrained writes the
    published `block_sparse_moe` names) with a tokenizer; returns the torch model (eval mode)."""
    from transformers import MiniMaxM2ForCausalLM
    torch.manual_seed(seed)
    model = MiniMaxM2ForCausalLM(minimax_m2_config(**overrides)).eval()
    randomize_moe(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return model


GPT_OSS_CONFIGS = {
    # (two layers: sliding window 8, then full) top-2 of 8, 2 query heads a KV head, YaRN rope,
    # a clamp low enough that the experts' activations reach it
    "window8": dict(sliding_window=8, num_experts_per_tok=2, swiglu_limit=1.0),
}


def gpt_oss_config(**overrides):
    from transformers import GptOssConfig
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                rms_norm_eps=1e-5, rope_parameters={
                    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
                bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    base.update(overrides)
    return GptOssConfig(**base)


def write_gpt_oss(path: Path, seed: int = 0, **overrides):
    """Writes a tiny GptOssForCausalLM checkpoint (random, float32; save_pretrained writes the
    fused experts as transformers holds them) with a tokenizer; returns the torch model (eval
    mode). The router, the experts' weights and biases and the sinks are drawn off their init
    (zeros or std 0.02), so each one matters."""
    from transformers import GptOssForCausalLM
    torch.manual_seed(seed)
    model = GptOssForCausalLM(gpt_oss_config(**overrides)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.weight.normal_(0, 0.5)
            layer.mlp.router.bias.normal_(0, 0.5)
            for name in ("gate_up_proj", "down_proj"):
                getattr(layer.mlp.experts, name).normal_(0, 0.2)
                getattr(layer.mlp.experts, name + "_bias").normal_(0, 0.2)
            layer.self_attn.sinks.normal_(0, 1.0)
            for name, param in layer.self_attn.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return model


# family -> (writer, its named configs): what conftest.py's `tiny_checkpoint` writes
FAMILIES = {
    "deepseek_v3": (write_deepseek_v3, DEEPSEEK_V3_CONFIGS),
    "glm4_moe": (write_glm4_moe, GLM4_MOE_CONFIGS),
    "glm_moe_dsa": (write_glm_moe_dsa, GLM_MOE_DSA_CONFIGS),
    "qwen3_moe": (write_qwen3_moe, QWEN3_MOE_CONFIGS),
    "mixtral": (write_mixtral, MIXTRAL_CONFIGS),
    "minimax_m2": (write_minimax_m2, MINIMAX_M2_CONFIGS),
    "gpt_oss": (write_gpt_oss, GPT_OSS_CONFIGS),
}


def randomize_moe(model) -> None:
    """Random router biases (so the selection-only bias is exercised) or, for a router without
    one, a wider router weight; expert weights of std
    0.1 and, where attention has them, biases and q/k norm weights off their init."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                # the correction bias on the router (DeepSeek-V3, GLM) or on the block (MiniMax-M2)
                owner = next((m for m in (layer.mlp.gate, layer.mlp)
                              if hasattr(m, "e_score_correction_bias")), None)
                if owner is not None:
                    owner.e_score_correction_bias.normal_(0, 0.1)
                else:  # a softmax router: logits spread wide enough that picks rarely near-tie
                    layer.mlp.gate.weight.normal_(0, 0.5)
                layer.mlp.experts.gate_up_proj.normal_(0, 0.1)
                layer.mlp.experts.down_proj.normal_(0, 0.1)
            for name, param in layer.self_attn.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.normal_(1.0 if "norm" in name else 0.0, 0.1)


def assert_same_weights(a, b) -> None:
    """Two engines hold identical dense params and routed experts (so compute identical logits)."""
    import jax
    for x, y in ((a.loaded.params, b.loaded.params), (a.state.experts.bank, b.state.experts.bank)):
        assert jax.tree.structure(x) == jax.tree.structure(y)
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@contextlib.contextmanager
def lower_index_ties():
    """Within the block torch's Tensor.topk returns the lower index first among equal values,
    as jax.lax.top_k does (so our engines' top-k picks). torch leaves the choice among ties
    unspecified (its docs; its CPU kernel's nth_element takes any of them), and the lightning
    indexers tie often: a score is exactly 0 wherever ReLU zeroes every index head, so with few
    heads the k-th place is often a tie. Each call checks that its values are torch's own: the
    pin decides which of equal scores are picked, never which scores. Yields a list that gets,
    per call, the rows whose k-th and (k+1)-th values are equal and finite (where it decides)."""
    own, tied = torch.Tensor.topk, []

    def topk(values, k, dim=-1, largest=True, sorted=True):
        ordered, ids = torch.sort(values, dim=dim, descending=largest, stable=True)
        if k < values.shape[dim]:
            kth, next_ = ordered.narrow(dim, k - 1, 1), ordered.narrow(dim, k, 1)
            tied.append(int(((kth == next_) & kth.isfinite()).sum()))
        ordered, ids = ordered.narrow(dim, 0, k), ids.narrow(dim, 0, k)
        if not torch.equal(ordered, own(values, k, dim=dim, largest=largest).values):
            raise AssertionError("lower_index_ties: the stable top-k's values are not torch's")
        return torch.return_types.topk((ordered, ids))

    with mock.patch.object(torch.Tensor, "topk", topk):
        yield tied


def relative_diff(ours, ref) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def transformers_greedy(model, prompt, n: int) -> list[int]:
    """transformers' own greedy continuation of `prompt`, n tokens."""
    with torch.no_grad():
        return model.generate(torch.tensor(prompt)[None], max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def served_greedy(engine, prompt, n: int) -> list[int]:
    """The engine's greedy continuation of `prompt` through its scheduler, n tokens."""
    from tidejax.runtime.scheduler import GenerationRequest, TokenEvent
    tokens = []
    engine.scheduler.submit(GenerationRequest(list(prompt), n, ignore_eos=True),
                            lambda e: tokens.append(e.token_id) if isinstance(e, TokenEvent) else None)
    engine.scheduler.run_until_idle()
    return tokens


def second_turn(engine, first: list[int], new: list[int], n: int) -> tuple[list[int], list[int],
                                                                        int, int]:
    """A conversation through the scheduler, greedy: turn 1 (`first`, n tokens), then turn 2
    (turn 1, its answer and `new`, n tokens): (turn 2's prompt, its tokens, its prompt tokens
    found in the prompt cache, those its steps prefilled)."""
    from tidejax.runtime.scheduler import DoneEvent, GenerationRequest, TokenEvent
    prompt = list(first) + served_greedy(engine, first, n) + list(new)
    events = []
    before = engine.scheduler.totals["prefilled_tokens"]
    engine.scheduler.submit(GenerationRequest(prompt, n, ignore_eos=True), events.append)
    engine.scheduler.run_until_idle()
    assert isinstance(events[-1], DoneEvent), events[-1]
    return (prompt, [e.token_id for e in events if isinstance(e, TokenEvent)],
            events[-1].stats["cached_tokens"], engine.scheduler.totals["prefilled_tokens"] - before)


def cached_decode_logits(engine, prompt, prefill: int):
    """Logits [len(prompt), vocab] of `prompt` prefilled `prefill` tokens at once, then fed one
    token at a time through the family's paged cache (16 pages of 4, in shuffled order)."""
    import jax
    import jax.numpy as jnp

    from tidejax.kv.paged import PagedCache
    cache = PagedCache(engine.family.create_cache(engine.cfg, 16, 4, engine.loaded.dtype))
    table = jnp.asarray(np.random.RandomState(0).permutation(16)[None].astype(np.int32))
    state = engine.state.experts
    apply = jax.jit(engine.loaded.module.apply)
    params = {"params": engine.loaded.params}
    tokens = jnp.asarray(prompt[None, :prefill])
    logits, cache, state = apply(params, tokens, jnp.arange(prefill)[None], tokens > -1, cache,
                                 table, state)
    stepped = [np.asarray(logits[0])]
    for pos in range(prefill, len(prompt)):
        token = jnp.asarray(prompt[None, pos:pos + 1])
        logits, cache, state = apply(params, token, jnp.full((1, 1), pos), token > -1, cache,
                                     table, state)
        stepped.append(np.asarray(logits[0]))
    return np.concatenate(stepped)



def check_cached_decode_on_the_gqa_kernel(engine, model, prompt, monkeypatch) -> None:
    """The attention on the paged GQA kernel (ops.paged_gqa_prefill and paged_gqa_decode forced
    to "pallas": Triton's interpreter here; the other ops as served), a 16-token prompt chunk then
    one token a step: the cached decode's logits against transformers' full forward, and every
    layer's attention through the forced ops (each shape traced once, given no impl)."""
    from tests.support.engine_probes import force_gqa_kernel

    calls = force_gqa_kernel(monkeypatch)
    with torch.no_grad():
        ref = model(torch.tensor(prompt)[None]).logits[0].numpy()
    assert relative_diff(cached_decode_logits(engine, prompt, 16), ref) < 1e-4
    n = engine.cfg.num_layers
    assert calls == [("paged_gqa_prefill", None)] * n + [("paged_gqa_decode", None)] * n

def state_dict(model) -> dict:
    """The torch model's tensors as numpy arrays, as transformers 5 holds them in memory."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def write_gpt_oss_mxfp4_copies(model, path: Path, out: Path) -> tuple[Path, Path]:
    """Two copies of gpt-oss checkpoint `path`: its experts' gate_up_proj and down_proj as the
    published checkpoints store them (MXFP4 `_blocks` / `_scales`, [E, 2I, D/32, 16] with the
    gate and up rows interleaved, [E, D, I/32, 16]), and the same values dequantized in
    transformers' float layout ([E, D, 2I], [E, I, D]): (mxfp4, float)."""
    import shutil

    from safetensors.numpy import save_file

    from tidejax.checkpoint import mxfp4
    state = state_dict(model)
    packed, dense = dict(state), dict(state)
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(np.swapaxes(state[name], 1, 2))  # [E, out, in]
        packed.pop(name)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dense[name] = np.swapaxes(mxfp4.dequantize(blocks, scales, np.float32), 1, 2).copy()
    copies = (out / "mxfp4", out / "float")
    for copy, tensors in zip(copies, (packed, dense)):
        shutil.copytree(path, copy)
        (copy / "model.safetensors").unlink()
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                  str(copy / "model.safetensors"))
    return copies


def write_fused_copy(model, path: Path, out: Path) -> Path:
    """A copy of checkpoint `path` whose tensors are the model's in-memory ones (transformers 5's
    fused experts, gate_up_proj [E, 2I, D] and down_proj [E, D, I])."""
    import shutil

    from safetensors.numpy import save_file
    state = state_dict(model)
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    shutil.copytree(path, out)
    (out / "model.safetensors").unlink()
    save_file(state, str(out / "model.safetensors"))
    return out


def write_fp8_copies(path: Path, out: Path) -> tuple[Path, Path]:
    """Two copies of checkpoint `path` under `out`: "fp8", every 2-D projection weight as e4m3 +
    weight_scale_inv (128 x 128 blocks, as DeepSeek and GLM publish them), and "dequant", the
    same values dequantized to float32 (so the two must load to identical logits)."""
    import shutil

    from safetensors.numpy import save_file

    from tidejax.checkpoint import CheckpointReader, dequantize_fp8_block, quantize_fp8_block
    fp8, dequant = out / "fp8", out / "dequant"
    for d in (fp8, dequant):
        shutil.copytree(path, d)
    per_expert = CheckpointReader(path, progress=False)
    fp8_tensors, dq_tensors = {}, {}
    for key in per_expert.names():
        w = per_expert.read(key)
        if key.endswith("proj.weight") and w.ndim == 2:
            q, scale_inv = quantize_fp8_block(w)
            fp8_tensors[key], fp8_tensors[key + "_scale_inv"] = q, scale_inv
            dq_tensors[key] = dequantize_fp8_block(q, scale_inv)
        else:
            fp8_tensors[key] = dq_tensors[key] = w
    save_file(fp8_tensors, str(fp8 / "model.safetensors"))
    save_file(dq_tensors, str(dequant / "model.safetensors"))
    return fp8, dequant


def write_mtp_copy(path: Path, out: Path, attention_from: int, moe_from: int,
                   seed: int = 0) -> dict[str, np.ndarray]:
    """Copies the checkpoint at `path` to `out` with one MTP (NextN) layer after the last decoder
    layer, in the published names (transformers' classes have no MTP layer to save): random
    tensors shaped as layer `attention_from`'s attention and layer `moe_from`'s MoE (per-expert
    routed experts), plus enorm, hnorm, eh_proj [d, 2d] and shared_head.norm, and the copies
    of the main model's embedding and head the published layer carries (embed_tokens,
    shared_head.head); the config gets num_nextn_predict_layers = 1. Returns the MTP layer's
    tensors by name."""
    from safetensors.numpy import save_file

    from tests.support.checkpoint_fixtures import to_per_expert
    from tidejax.checkpoint import CheckpointReader
    shutil.copytree(path, out)
    raw = json.loads((out / "config.json").read_text())
    n, d = raw["num_hidden_layers"], raw["hidden_size"]
    reader = CheckpointReader(path, progress=False)
    tensors = {k: reader.read(k) for k in reader.names()}
    rng = np.random.RandomState(seed)
    attention, moe = f"model.layers.{attention_from}.self_attn.", f"model.layers.{moe_from}."
    mtp = {f"model.layers.{n}." + k.split(".", 3)[3]: (0.1 * rng.randn(*v.shape)).astype(np.float32)
           for k, v in to_per_expert(tensors).items() if k.startswith(attention)
           or k.startswith(moe) and ".self_attn." not in k}
    for part in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "eh_proj.weight"):
        mtp[f"model.layers.{n}.{part}"] = rng.randn(
            *((d, 2 * d) if "proj" in part else (d,))).astype(np.float32)
    embed = tensors["model.embed_tokens.weight"]
    mtp[f"model.layers.{n}.embed_tokens.weight"] = embed
    mtp[f"model.layers.{n}.shared_head.head.weight"] = tensors.get("lm_head.weight", embed)
    for name in [f for f in out.glob("*.safetensors*")]:
        name.unlink()
    save_file(tensors | mtp, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}))
    return mtp


def load_mtp_copy(family: str, path: Path, engine, out: Path, kept_as: dict) -> tuple:
    """Writes `path`'s copy with an MTP layer (write_mtp_copy: layer 0's attention, layer 1's
    MoE) to `out`, loads it with `family`'s load_weights, and checks that the MTP layer is kept
    apart as host arrays equal to the stored tensors (`kept_as`: {name after
    "model.layers.N.": the path of its leaf in the kept layer}) and that the decoder's params
    are `engine`'s (so are its logits). -> (its config, config.json as read, the stored MTP
    tensors, the kept aux by layer name, N)."""
    import importlib

    import jax
    import jax.numpy as jnp

    from tidejax.models.loading import ExpertPool
    from tidejax.models.registry import family_of
    from tidejax.residency.serve import ServeOptions
    load_weights = importlib.import_module(f"tidejax.models.{family}.weights").load_weights
    mtp = write_mtp_copy(path, out, attention_from=0, moe_from=1)
    raw = json.loads((out / "config.json").read_text())
    cfg = family_of(family).config_from_hf(raw)
    n = raw["num_hidden_layers"]
    pool = ExpertPool(len(cfg.moe_layers) * cfg.n_routed_experts, "checkpoint", np.float32)
    params, kept = load_weights(cfg, out, raw, ServeOptions(), jnp.float32, pool.put_row)
    for name, leaf_path in kept_as.items():
        got = kept[f"layers_{n}"]
        for key in leaf_path:
            got = got[key]
        assert isinstance(got, np.ndarray) and not isinstance(got, jax.Array), name
        np.testing.assert_array_equal(got, mtp[f"model.layers.{n}.{name}"])
    assert jax.tree.structure(params) == jax.tree.structure(engine.loaded.params)
    for u, v in zip(jax.tree.leaves(params), jax.tree.leaves(engine.loaded.params)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    return cfg, raw, mtp, kept, n


def repeating_mtp(path, out, scale: float):
    """A copy of `path` whose main model often repeats its last token (lm_head tied to the
    embedding, the final norm ones, the layers' outputs scaled by `scale`, so the residual stream
    keeps the input token's embedding) and whose MTP layer drafts "the main model's next token
    again": eh_proj passes the normed hidden state alone, the block's attention and experts add
    nothing, the norms are ones; its logits are then the main head's at a positive scale of the
    same hidden state, so it drafts the token at p + 1 for p + 2, right wherever the target
    repeats."""
    from safetensors.numpy import load_file, save_file
    write_mtp_copy(path, out, attention_from=0, moe_from=1)
    tensors = load_file(out / "model.safetensors")
    n = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    mtp = f"model.layers.{n}."
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"]  # the published copy
    tensors["model.norm.weight"] = np.ones_like(tensors["model.norm.weight"])
    for name, w in tensors.items():
        if not name.startswith(mtp):
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = w * scale
            continue
        if name.endswith("norm.weight"):
            tensors[name] = np.ones_like(w)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros_like(w)
    d = tensors[mtp + "eh_proj.weight"].shape[0]
    tensors[mtp + "eh_proj.weight"] = np.concatenate([np.zeros((d, d)), np.eye(d)], 1).astype(
        np.float32)
    save_file(tensors, out / "model.safetensors")
    return out
