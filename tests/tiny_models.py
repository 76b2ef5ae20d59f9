"""Tiny random checkpoints written by transformers itself, and a small tokenizer, for tests.

Every checkpoint here is made on the fly: transformers' own model class with a tiny config and
random weights, saved with save_pretrained, plus a byte-level BPE tokenizer trained on a few
sentences and a simple chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    # GLM-4.5's attention (q/k norm, q/k/v biases, half the head rotated), one dense layer
    # first, group-limited routing (4 groups, top 2), GQA with 2 query heads a KV head
    "qknorm_groups": dict(use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                          first_k_dense_replace=1, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, num_key_value_heads=2),
    # GLM-4.5-Air's (no q/k norm), no dense layer, plain top-k without renormalization, every
    # channel rotated, one KV head
    "no_dense": dict(use_qk_norm=False, attention_bias=True, partial_rotary_factor=1.0,
                     first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False,
                     routed_scaling_factor=1.0, num_key_value_heads=1),
}


def glm4_moe_config(**overrides):
    from transformers import Glm4MoeConfig
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
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


def randomize_moe(model) -> None:
    """Random router biases (so the selection-only bias is exercised), expert weights of std
    0.1 and, where attention has them, biases and q/k norm weights off their init."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
                layer.mlp.experts.gate_up_proj.normal_(0, 0.1)
                layer.mlp.experts.down_proj.normal_(0, 0.1)
            for name, param in layer.self_attn.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.normal_(1.0 if "norm" in name else 0.0, 0.1)
