"""Train the demo model's byte-level BPE tokenizer on the corpus (tools/corpus.py) and write
tokenizer.json + tokenizer_config.json (with a chat template) into the model directory.

    python -m tools.tokenizer [--corpus .corpus] [--out models/demo] [--vocab 4096]

Every domain contributes the same number of characters, so no domain's words crowd out another's.
Encoding a plain string adds <|bos|> in front (as the training documents start); a chat is
rendered by the template, which writes <|bos|> itself, and is encoded without special tokens
(transformers' apply_chat_template does exactly that).
"""

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parent.parent
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END]  # ids 0..6 in this order

# <|bos|>, then each turn as <|role|>text<|end|> and a newline; the prompt for a reply ends in
# <|assistant|>. The model learns this layout from the chat-shaped samples in its training data.
# Tools (not trained on, but a client's tool loop renders): offered tools go in a system turn
# first; an assistant's calls follow its text as <tool_call>{"name": ..., "arguments": {...}}
# </tool_call> (the Hermes format, which the server then parses); a tool result is a user turn
# holding <tool_response>RESULT</tool_response>. A chat without tools renders as before.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>You may call these tools. To call one, answer with <tool_call>{\"name\": "
    "NAME, \"arguments\": {...}}</tool_call>.\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '<|end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|><tool_response>' + message['content'] + '</tool_response><|end|>\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{{ '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ (arguments | tojson) if arguments is mapping else arguments }}"
    "{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def read_domains(corpus: Path) -> dict[str, list[str]]:
    manifest = corpus / "manifest.json"
    if not manifest.exists():
        sys.exit(f"{manifest} not found: run tools/corpus.py first")
    domains = json.loads(manifest.read_text())
    return {d: [json.loads(line)["text"] for line in open(corpus / f"{d}.jsonl", encoding="utf-8")]
            for d in domains}


def balanced_sample(docs_by_domain: dict[str, list[str]], chars_per_domain: int):
    for docs in docs_by_domain.values():
        n = 0
        for doc in docs:
            if n >= chars_per_domain:
                break
            n += len(doc)
            yield doc


def train(docs_by_domain: dict[str, list[str]], vocab: int, chars_per_domain: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(balanced_sample(docs_by_domain, chars_per_domain), trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos)]),
    ])
    return tok


def tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT, END],
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=REPO / ".corpus")
    ap.add_argument("--out", type=Path, default=REPO / "models" / "demo")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--chars-per-domain", type=int, default=2_000_000)
    ap.add_argument("--max-length", type=int, default=1024, help="model_max_length in the config")
    args = ap.parse_args()
    tok = train(read_domains(args.corpus), args.vocab, args.chars_per_domain)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args.max_length), indent=1) + "\n")
    print(f"vocab {tok.get_vocab_size()} -> {args.out}/tokenizer.json, tokenizer_config.json")


if __name__ == "__main__":
    main()
