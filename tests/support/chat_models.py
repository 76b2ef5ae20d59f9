"""Tiny chat checkpoints of the families whose published chat templates the tests keep
(tests/data/chat_templates/: gpt-oss's harmony, Qwen3's, MiniMax-M2's, GLM-4.5's (its
chat_template.jinja, GLM-4.6's too); Mixtral's is the template Mistral's own mistral_common
1.12.0 writes for its v3 SentencePiece tokenizer, Mixtral-8x22B's,
`generate_chat_template(spm=True, tokenizer_version=v3)`, as no copy of the published
tokenizer_config.json is at hand): a byte-level BPE with the family's control tokens and template,
and transformers' model of the family whose weights write one fixed reply
(server_fixtures.write_chain): reasoning (where the family reasons), then a call of get_weather
for Paris in the family's format. Each chain starts at the last token of the family's generation
prompt.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import torch

from tests.support.server_fixtures import write_chain
from tests.support.tiny_models import (FAMILIES, TEXT, glm4_moe_config, gpt_oss_config,
                                       minimax_m2_config, mixtral_config, qwen3_moe_config,
                                       randomize_moe)

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
THOUGHT, CITY = "Checking the weather.", "Paris"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
# the calls' text, each one added token
HARMONY_CALL = ("assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                "<|message|>")
HARMONY_ARGS = json.dumps({"city": CITY})
HERMES_CALL = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
MINIMAX_INVOKE = ('\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                  '</invoke>\n')
MISTRAL_CALL = ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@dataclasses.dataclass(frozen=True)
class ChatFamily:
    """A family's chat vocabulary: `special` its control tokens, `plain` added tokens that are
    text (the reply's pieces, so that each is one token), `chain` the token texts the weights
    map each to the next (its first: the generation prompt's last token), `eos` the end-of-turn
    tokens, `bos`; `model`: transformers' class, `config` its tiny config builder
    (tests/support/tiny_models.py); `reasons`: whether the reply opens with THOUGHT."""

    name: str
    model: str
    config: Callable
    special: tuple[str, ...]
    plain: tuple[str, ...]
    chain: tuple[str, ...]
    eos: tuple[str, ...]
    bos: str | None = None
    reasons: bool = True

    @property
    def template(self) -> str:
        return (TEMPLATES / f"{self.name}.jinja").read_text()


CHAT_FAMILIES = {
    # <|start|>assistant | <|channel|>analysis<|message|>THOUGHT<|end|><|start|>assistant
    # <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    "gpt_oss": ChatFamily(
        "gpt_oss", "GptOssForCausalLM", gpt_oss_config,
        special=("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
                 "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"),
        plain=("assistant", "analysis", THOUGHT, HARMONY_CALL, HARMONY_ARGS),
        chain=("assistant", "<|channel|>", "analysis", "<|message|>", THOUGHT, "<|end|>",
               "<|start|>", HARMONY_CALL, HARMONY_ARGS, "<|call|>"),
        eos=("<|return|>", "<|call|>", "<|endoftext|>"), bos="<|startoftext|>"),
    # <|im_start|>assistant\n | <think>THOUGHT</think><tool_call>\n{...}\n</tool_call><|im_end|>
    "qwen3_moe": ChatFamily(
        "qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe_config,
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        plain=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", THOUGHT, HERMES_CALL),
        chain=("\n", "<think>", THOUGHT, "</think>", "<tool_call>", HERMES_CALL, "</tool_call>",
               "<|im_end|>"),
        eos=("<|im_end|>", "<|endoftext|>")),
    # ]~b]ai\n<think>\n | THOUGHT</think><minimax:tool_call><invoke ...>...</invoke>
    # </minimax:tool_call>[e~[
    "minimax_m2": ChatFamily(
        "minimax_m2", "MiniMaxM2ForCausalLM", minimax_m2_config,
        special=("]~!b[", "]~b]", "[e~["),
        plain=("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>", THOUGHT,
               MINIMAX_INVOKE),
        chain=("\n", THOUGHT, "</think>", "<minimax:tool_call>", MINIMAX_INVOKE,
               "</minimax:tool_call>", "[e~["),
        eos=("[e~[",), bos="]~!b["),
    # [INST] ...[/INST] | [TOOL_CALLS] [{"name": ..., "arguments": {...}}]</s>
    "mixtral": ChatFamily(
        "mixtral", "MixtralForCausalLM", mixtral_config,
        special=("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        plain=(MISTRAL_CALL,), chain=("[/INST]", "[TOOL_CALLS]", MISTRAL_CALL, "</s>"),
        eos=("</s>",), bos="<s>", reasons=False),
    # <|assistant|> | <think>THOUGHT</think><tool_call>get_weather<arg_key>city</arg_key>
    # <arg_value>Paris</arg_value></tool_call><|observation|> (with thinking off the prompt ends
    # in <think></think>: the chain from </think> on); eos: config.json's eos_token_id
    "glm4_moe": ChatFamily(
        "glm4_moe", "Glm4MoeForCausalLM", glm4_moe_config,
        special=("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                 "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
                 "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                 "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"),
        plain=(THOUGHT, "get_weather", "city", CITY),
        chain=("<|assistant|>", "<think>", THOUGHT, "</think>", "<tool_call>", "get_weather",
               "<arg_key>", "city", "</arg_key>", "<arg_value>", CITY, "</arg_value>",
               "</tool_call>", "<|observation|>"),
        eos=("<|endoftext|>", "<|user|>", "<|observation|>")),
}


def write_chat_tokenizer(family: str, path: Path) -> dict[str, int]:
    """The family's tokenizer files in `path`: a byte-level BPE trained on some prose and the
    family's template text (so a prompt is a few hundred tokens), its control tokens special,
    its reply's pieces plain added tokens, its published template. Returns the id of each
    token text of the chain."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    spec = CHAT_FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(spec.special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT + (spec.template + json.dumps(WEATHER)) * 4], trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in spec.plain])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": spec.bos, "eos_token": spec.eos[0], "chat_template": spec.template,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}))
    ids = {}
    for text in spec.chain:
        [ids[text]] = tok.encode(text, add_special_tokens=False).ids
    return ids | {t: tok.token_to_id(t) for t in spec.eos} | {"vocab": tok.get_vocab_size()}


def write_chat_model(family: str, path: Path, seed: int = 0):
    """A tiny checkpoint of `family` (its first config in tiny_models.FAMILIES) with its chat
    tokenizer, whose weights write the family's chain; returns the path."""
    import transformers
    spec = CHAT_FAMILIES[family]
    ids = write_chat_tokenizer(family, path)
    configs = FAMILIES[family][1]
    config = spec.config(**configs[sorted(configs)[0]], vocab_size=ids["vocab"],
                         max_position_embeddings=1024, bos_token_id=None,
                         eos_token_id=[ids[t] for t in spec.eos])
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model)(config).eval()
    randomize_moe(model)
    write_chain(model, [ids[t] for t in spec.chain])
    model.save_pretrained(path)
    return path
