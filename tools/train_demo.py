"""Train the bundled demo model: a small DeepSeek-V3-family MoE, with tidejax's own forward.

    python -m tools.train_demo prepare [--corpus .corpus] [--tokenizer models/demo] [--out .corpus_gpu/tokens.npz]
    python -m tools.train_demo train --data .corpus_gpu/tokens.npz --out models/demo [--tiny] [--minutes 4]
    python -m tools.train_demo mtp --model models/demo --out models/demo [--minutes 20]

`prepare` tokenizes every domain's training documents (some written as chats in the tokenizer's
chat template, so the model learns the turn layout) and the held-out files into one .npz of
token streams. `train` runs AdamW with a warmup + cosine schedule on domain-balanced batches
(every batch holds the same number of windows from each domain), updates the routers'
e_score_correction_bias by the sign of each expert's load error (DeepSeek-V3's aux-loss-free
balancing), prints the loss curve, evaluates the held-out loss per domain and exports a
Hugging Face checkpoint directory (config.json, model.safetensors, generation_config.json and
the tokenizer files). `mtp` adds one MTP layer trained with the main model frozen
(tools/train_mtp.py).

The forward is tidejax.models.deepseek_v3.model.build's with every expert resident and the jnp
reference kernel (differentiable), so the model that is trained is the model that is served.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np

from tools.corpus import HELDOUT_DIR

REPO = Path(__file__).resolve().parent.parent

BOS_ID, EOS_ID, END_ID = 0, 1, 6  # tools/tokenizer.py SPECIAL order

# Hugging Face config fields of the two sizes (everything DeepseekV3Config reads).
SIZES = {
    "demo": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, n_routed_experts=48, num_experts_per_tok=6, q_lora_rank=96,
                 kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                 max_position_embeddings=1024),
    "tiny": dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=16,
                 kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                 max_position_embeddings=128),
}

# Requests for the chat-shaped samples made of a single short text (fortunes), per language.
ASK = {
    "en": ["Tell me something.", "Say something witty.", "Give me a quote.", "Hello!"],
    "de": ["Erzähl mir etwas.", "Sag etwas Witziges.", "Gib mir ein Zitat.", "Hallo!"],
}
SYSTEM_PROMPT = "You are a helpful assistant."


def log(msg: str) -> None:
    print(msg, flush=True)


def hf_config(size: str, vocab_size: int) -> dict:
    """The exported config.json."""
    s = SIZES[size]
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, **s, "num_key_value_heads": s["num_attention_heads"],
        "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
        "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True,
        "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": 1e-6,
        "initializer_range": 0.02, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_ID], "pad_token_id": 2,
        "use_cache": True, "torch_dtype": "bfloat16",
    }


# ---------------------------------------------------------------------------------------------
# prepare: documents -> token streams


def chat_sample(domain: str, text: str, rng: random.Random, template) -> str | None:
    """A chat made of one document: a request and the text, or its first and second parts."""
    paras = [p for p in text.split("\n\n") if p.strip()]
    if len(paras) >= 2:
        cut = max(1, min(len(paras) // 2, 2))
        user, reply = "\n\n".join(paras[:cut]), "\n\n".join(paras[cut:cut + 3])
    elif domain in ASK and len(text) < 600:
        user, reply = rng.choice(ASK[domain]), text
    else:
        return None
    messages = [{"role": "user", "content": user.strip()}, {"role": "assistant", "content": reply.strip()}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return template.render(messages=messages, bos_token="<|bos|>", add_generation_prompt=False)


def prepare(args) -> None:
    import jinja2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    tcfg = json.loads((args.tokenizer / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(tcfg["chat_template"])
    manifest = json.loads((args.corpus / "manifest.json").read_text())
    rng = random.Random(0)
    arrays = {}
    for domain in manifest:
        docs = [json.loads(line)["text"] for line in open(args.corpus / f"{domain}.jsonl", encoding="utf-8")]
        plain, chats = [], []
        for doc in docs:
            chat = chat_sample(domain, doc, rng, template) if rng.random() < args.chat_share else None
            (chats if chat else plain).append(chat or doc)
        ids = [e.ids + [EOS_ID] for e in tok.encode_batch(plain)]
        ids += [e.ids + [EOS_ID] for e in tok.encode_batch(chats, add_special_tokens=False)]
        rng.shuffle(ids)
        arrays[f"train/{domain}"] = np.fromiter((i for doc in ids for i in doc), np.uint16)
        held = (HELDOUT_DIR / f"{domain}.txt").read_text(encoding="utf-8")
        arrays[f"heldout/{domain}"] = np.asarray(tok.encode(held).ids, np.uint16)
        log(f"{domain:7s} train {len(arrays[f'train/{domain}']):9d} tokens ({len(chats)} chats)  "
            f"held-out {len(arrays[f'heldout/{domain}'])} tokens")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **arrays)
    log(f"wrote {args.out}")


# ---------------------------------------------------------------------------------------------
# train


def load_streams(path: Path) -> tuple[list[str], dict, dict]:
    data = np.load(path)
    domains = sorted({k.split("/", 1)[1] for k in data.files})
    return domains, {d: data[f"train/{d}"] for d in domains}, {d: data[f"heldout/{d}"] for d in domains}


def balanced_batch(streams: dict, domains: list[str], rows_per_domain: int, seq: int,
                   rng: np.random.Generator) -> np.ndarray:
    """[len(domains) * rows_per_domain, seq + 1] windows at random offsets, domain-major."""
    rows = []
    for d in domains:
        s = streams[d]
        for start in rng.integers(0, len(s) - seq - 1, rows_per_domain):
            rows.append(s[start:start + seq + 1])
    return np.stack(rows).astype(np.int32)


class Trainer:
    """The model, its loss and one jitted training step."""

    def __init__(self, raw_cfg: dict, seq: int, seed: int):
        import jax
        import jax.numpy as jnp

        from tidejax.kv.paged import PagedCache
        from tidejax.models.base import init
        from tidejax.models.deepseek_v3.config import DeepseekV3Config
        from tidejax.models.deepseek_v3.model import build
        from tidejax.models.deepseek_v3.weights import expert_specs, param_specs
        from tidejax.models.layers.mla import MLACache
        from tidejax.residency.serve import ServeOptions
        from tidejax.residency.state import all_resident_state

        self.jax, self.jnp = jax, jnp
        self.cfg = cfg = DeepseekV3Config.from_hf(raw_cfg, "train_demo config")
        self.seq = seq
        self.model = build(cfg, ServeOptions(kernel="reference", all_resident=True, count=True),
                           jnp.float32)
        self.n_moe = len(cfg.moe_layers)
        # a KV pool of one page of `seq` tokens a row, and its block table [b, 1]
        self._cache = lambda b: (PagedCache(MLACache.create(cfg, b, seq, jnp.float32)),
                                 jnp.arange(b, dtype=jnp.int32)[:, None])
        self._state = lambda experts: all_resident_state(experts, self.n_moe)
        key_model, key_experts = jax.random.split(jax.random.PRNGKey(seed))
        self.params = {"model": init(param_specs(cfg, jnp.float32), key_model),
                       "experts": init(expert_specs(cfg, jnp.float32), key_experts)}

    def forward(self, params, tokens):
        """tokens [b, t] -> logits [b, t, vocab], demand counts [L_moe, E] of this batch."""
        jnp = self.jnp
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _, state = self.model.apply({"params": params["model"]}, tokens, positions,
                                            jnp.ones((b, t), bool), *self._cache(b),
                                            self._state(params["experts"]))
        return logits, state.counts

    def row_losses(self, params, batch):
        """batch [b, t + 1] -> mean next-token loss per row [b], counts."""
        logits, counts = self.forward(params, batch[:, :-1])
        logp = self.jax.nn.log_softmax(logits, axis=-1)
        nll = -self.jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
        return nll.mean(axis=1), counts

    def make_step(self, optimizer, bias_rate: float):
        jax = self.jax

        def loss(params, batch):
            rows, counts = self.row_losses(params, batch)
            return rows.mean(), (rows, counts)

        def step(params, opt_state, batch, lr):
            (_, (rows, counts)), grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
            opt_state.hyperparams["learning_rate"] = lr
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = jax.tree.map(lambda p, u: p + u, params, updates)
            model = balance_routers(params["model"], [f"layers_{i}" for i in self.cfg.moe_layers],
                                    counts, bias_rate)
            return {**params, "model": model}, opt_state, rows, counts

        return jax.jit(step, donate_argnums=(0, 1))

    def evaluate(self, params, heldout: dict, batch_rows: int) -> dict:
        """Held-out loss per domain over non-overlapping windows of seq + 1 tokens."""
        fn = self.jax.jit(self.row_losses)
        out = {}
        for d, s in heldout.items():
            n = (len(s) - 1) // self.seq
            windows = np.stack([s[i * self.seq:(i + 1) * self.seq + 1] for i in range(n)]).astype(np.int32)
            losses = []
            for i in range(0, n, batch_rows):
                chunk = windows[i:i + batch_rows]
                pad = batch_rows - len(chunk)
                rows, _ = fn(params, np.concatenate([chunk, np.repeat(chunk[:1], pad, 0)]))
                losses += list(np.asarray(rows)[:len(chunk)])
            out[d] = float(np.mean(losses))
        return out


def balance_routers(params: dict, moe_layers: list[str], counts, rate: float) -> dict:
    """DeepSeek-V3's aux-loss-free balancing: params (a tree holding the MoE layers named
    `moe_layers`) with each router's e_score_correction_bias raised by `rate` for the experts
    loaded below their layer's mean in counts [len(moe_layers), E], lowered for the others."""
    import jax.numpy as jnp

    load_error = counts.mean(axis=1, keepdims=True) - counts
    out = dict(params)
    for m, name in enumerate(moe_layers):
        moe = dict(out[name]["moe"])
        moe["gate_bias"] = moe["gate_bias"] + rate * jnp.sign(load_error[m])
        out[name] = {**out[name], "moe": moe}
    return out


def adamw(peak_lr: float, weight_decay: float):
    """Clipped AdamW whose learning rate the step sets (opt_state.hyperparams)."""
    import jax
    import optax

    def decay_mask(params):  # no decay on norms and the router's correction bias
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    def make(learning_rate):
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                       mask=decay_mask))

    return optax.inject_hyperparams(make)(learning_rate=peak_lr)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(args) -> None:
    import jax

    domains, streams, heldout = load_streams(args.data)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")).get_vocab_size()
    raw_cfg = hf_config("tiny" if args.tiny else "demo", vocab)
    trainer = Trainer(raw_cfg, args.seq, args.seed)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    import tidejax

    log(f"tidejax from {Path(tidejax.__file__).parent}")
    log(f"jax {jax.__version__} on {jax.devices()[0].platform}; {n_params / 1e6:.2f} M parameters; "
        f"domains {domains}; batch {args.rows_per_domain} x {len(domains)} x {args.seq}")
    optimizer = adamw(args.lr, args.weight_decay)
    opt_state = optimizer.init(trainer.params)
    train_step = trainer.make_step(optimizer, args.bias_rate)
    rng = np.random.default_rng(args.seed)
    params = trainer.params
    total = args.steps
    start = time.perf_counter()
    timed_from = None
    history = []
    step = 0
    while step < total:
        lr = cosine_lr(step, total, args.lr, args.warmup)
        batch = balanced_batch(streams, domains, args.rows_per_domain, args.seq, rng)
        params, opt_state, rows, counts = train_step(params, opt_state, batch, np.float32(lr))
        step += 1
        if step == 3:  # compiled and warm: size the run to the time budget
            jax.block_until_ready(rows)
            timed_from = (time.perf_counter(), step)
        if args.minutes and timed_from and step == 13:
            jax.block_until_ready(rows)
            per_step = (time.perf_counter() - timed_from[0]) / (step - timed_from[1])
            budget = args.minutes * 60 - (time.perf_counter() - start)
            total = max(step + 1, min(args.steps, step + int(budget / per_step)))
            log(f"{per_step * 1e3:.1f} ms/step -> {total} steps in {args.minutes} min")
        if step % args.log_every == 0 or step == total:
            r = np.asarray(rows).reshape(len(domains), -1).mean(axis=1)
            c = np.asarray(counts)
            spread = float((c.max(axis=1) / c.mean(axis=1)).mean())
            history.append({"step": step, "loss": float(r.mean()), **dict(zip(domains, map(float, r)))})
            log(f"step {step:5d}/{total}  lr {lr:.2e}  loss {r.mean():.3f}  "
                + "  ".join(f"{d} {x:.2f}" for d, x in zip(domains, r))
                + f"  max/mean load {spread:.2f}  {time.perf_counter() - start:.0f}s")
    export(params, trainer.cfg, raw_cfg, args.out, args.tokenizer, args.shard_mb)
    held = trainer.evaluate(params, heldout, args.rows_per_domain * len(domains))
    log("held-out loss: " + "  ".join(f"{d} {x:.3f}" for d, x in held.items()))
    (args.out / "training_log.json").write_text(json.dumps(
        {"history": history, "heldout_loss_fp32": held, "args": {k: str(v) for k, v in vars(args).items()}},
        indent=1) + "\n")


# ---------------------------------------------------------------------------------------------
# export


def export(params, cfg, raw_cfg: dict, out: Path, tokenizer_dir: Path, shard_mb: float,
           mtp: dict | None = None) -> None:
    """A Hugging Face checkpoint directory: bf16 weights, float32 router; per-expert tensor names
    as published DeepSeek-V3 checkpoints have them; shards of at most `shard_mb` MB (with
    model.safetensors.index.json) when the weights are larger than that. `mtp`: the MTP layers
    as decoder.mtp_specs declares them (tools/train_mtp.py), written after the main model's
    tensors in DeepSeek-V3's names."""
    import jax
    import jax.numpy as jnp
    from safetensors.flax import save_file

    from tidejax.models.deepseek_v3.weights import checkpoint_table, mtp_specs, param_specs

    table = checkpoint_table(cfg)  # its inverse names each param and expert part
    tensors = {}

    def add(path, spec, leaf):  # in the declared dtype: bf16, routers float32
        (name,) = table.param_names(tuple(k.key for k in path))
        tensors[name] = jnp.asarray(leaf, spec.dtype)

    jax.tree_util.tree_map_with_path(add, param_specs(cfg, jnp.bfloat16), params["model"])
    e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
    gate_up, down = np.asarray(params["experts"]["gate_up"]), np.asarray(params["experts"]["down"])
    for m, layer in enumerate(table.expert_layers):
        for x in range(e):
            row = m * e + x
            for part, w in (("gate", gate_up[row, :i]), ("up", gate_up[row, i:]),
                            ("down", down[row])):
                (name,) = table.expert_names(layer, part, x)
                tensors[name] = jnp.asarray(w, jnp.bfloat16)
    if mtp is not None:
        jax.tree_util.tree_map_with_path(add, mtp_specs(cfg, jnp.bfloat16), mtp)
    out.mkdir(parents=True, exist_ok=True)
    shards, size = [{}], 0
    for name, t in tensors.items():
        if size + t.nbytes > shard_mb * 1e6 and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    if len(shards) == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(raw_cfg, indent=1) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_ID], "pad_token_id": 2,
                  "do_sample": False, "max_new_tokens": 128}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).resolve() != (out / name).resolve():
            shutil.copy(tokenizer_dir / name, out / name)
    total = sum(f.stat().st_size for f in out.iterdir())
    log(f"exported {len(tensors)} tensors in {len(shards)} file(s) to {out} ({total / 1e6:.1f} MB)")


def training_options(p: argparse.ArgumentParser, steps: int, seq: int, rows: int, warmup: int,
                     log_every: int) -> None:
    """The options `train` and `mtp` share, with their defaults."""
    p.add_argument("--data", type=Path, default=REPO / ".corpus_gpu" / "tokens.npz")
    p.add_argument("--steps", type=int, default=steps, help="steps (an upper bound with --minutes)")
    p.add_argument("--minutes", type=float, default=0, help="size the run to this wall time")
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--rows-per-domain", type=int, default=rows)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=1e-3, help="router bias step per update")
    p.add_argument("--log-every", type=int, default=log_every)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=15.0, help="largest safetensors file")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize the corpus into token streams")
    p.add_argument("--corpus", type=Path, default=REPO / ".corpus")
    p.add_argument("--tokenizer", type=Path, default=REPO / "models" / "demo")
    p.add_argument("--out", type=Path, default=REPO / ".corpus_gpu" / "tokens.npz")
    p.add_argument("--chat-share", type=float, default=0.15, help="share of documents written as chats")
    t = sub.add_parser("train", help="train and export")
    t.add_argument("--tokenizer", type=Path, default=REPO / "models" / "demo")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--tiny", action="store_true", help="the toy size (CPU tests)")
    training_options(t, steps=2000, seq=512, rows=8, warmup=100, log_every=50)
    m = sub.add_parser("mtp", help="train an MTP layer for a trained model (tools/train_mtp.py)")
    m.add_argument("--model", type=Path, default=REPO / "models" / "demo", help="the trained model")
    m.add_argument("--out", type=Path, required=True, help="where the model with its MTP layer goes")
    training_options(m, steps=1000, seq=256, rows=2, warmup=20, log_every=10)
    args = ap.parse_args(argv)
    if args.cmd == "mtp":
        from tools.train_mtp import train_mtp
        train_mtp(args)
    else:
        prepare(args) if args.cmd == "prepare" else train(args)


if __name__ == "__main__":
    main()
