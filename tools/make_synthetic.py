"""Write a random-weight checkpoint of a real model's shape, routed experts in MXFP4.

    python tools/make_synthetic.py OUT_DIR --shape v41-flash --layers 8 [--experts mxfp4|bf16]
    python tools/make_synthetic.py OUT_DIR --tiny

Shapes (DeepSeek-V3 family arithmetic: MLA attention, DeepSeekMoE with a shared expert):
  v41-flash  hidden 5120, 384 routed experts of moe_intermediate 2304, 6 a token, 1 shared expert,
             MLA dims as DeepSeek-V3's (128 heads, q_lora 1536, kv_lora 512, rope 64)
  v3         DeepSeek-V3: hidden 7168, 256 experts of 2048, 8 a token, groups 8 / top 4
  tiny       hidden 64, 16 experts of 32, 4 a token (tests)
The first `--dense-layers` layers have a dense MLP (DeepSeek's first_k_dense_replace), the rest
are MoE. The tokenizer (and so the vocabulary) is the bundled demo model's, so prompts work.

Routed experts of MoE layer i are stored fused per layer, in the bank's row convention (gate rows
0..I-1, then up rows I..2I-1), gpt-oss style for MXFP4:
  model.layers.{i}.mlp.experts.gate_up_proj_blocks [E, 2I, D/32, 16] U8, ..._scales [E, 2I, D/32] U8
  model.layers.{i}.mlp.experts.down_proj_blocks    [E, D, I/32, 16] U8, ..._scales [E, D, I/32] U8
or with `--experts bf16` as transformers 5's fused `gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I].

Values: dense weights uniform with std 1/sqrt(fan_in) (bf16), norms 1; MXFP4 codes uniform random
bytes with e8m0 scales sized so a projection keeps unit variance. One shard per layer, written
as it is generated (memory stays at one expert row), with a progress line.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parent.parent
E2M1_MEAN_SQUARE = 8.5625  # mean of v**2 over the 16 e2m1 codes

ATTN_V3 = dict(num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128)
SHAPES = {
    "v41-flash": dict(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=2304,
                      n_routed_experts=384, num_experts_per_tok=6, n_shared_experts=1, n_group=1,
                      topk_group=1, routed_scaling_factor=2.5, **ATTN_V3),
    "v3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
               n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8,
               topk_group=4, routed_scaling_factor=2.5, **ATTN_V3),
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=1,
                 topk_group=1, routed_scaling_factor=1.0, num_attention_heads=2, q_lora_rank=32,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}
BF16 = np.dtype(ml_dtypes.bfloat16)
ST_DTYPES = {np.dtype(np.uint8): "U8", BF16: "BF16", np.dtype(np.float32): "F32"}


def hf_config(shape: str, layers: int, dense_layers: int, vocab_size: int, max_positions: int,
              special: dict, n_experts: int = 0) -> dict:
    s = SHAPES[shape] | ({"n_routed_experts": n_experts} if n_experts else {})
    if not 0 <= dense_layers < layers:
        raise SystemExit(f"error: --dense-layers {dense_layers} must leave at least one MoE layer "
                         f"of --layers {layers}")
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, "num_hidden_layers": layers, **s,
        "num_key_value_heads": s["num_attention_heads"], "first_k_dense_replace": dense_layers,
        "moe_layer_freq": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "hidden_act": "silu", "rope_theta": 10000.0,
        "rope_scaling": None, "rope_interleave": True, "attention_bias": False,
        "attention_dropout": 0.0, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "max_position_embeddings": max_positions, "use_cache": True, "torch_dtype": "bfloat16",
        **special, "tidejax_synthetic": {"shape": shape, "random_weights": True},
    }


# -- tensors: (name, dtype, shape, filler); a filler is a picklable (kind, parameter) -----------

def fill(filler: tuple, rng, shape: tuple) -> np.ndarray:
    """Random values for `shape` from the integer bits of `rng` (fast: no float math on MXFP4).

    bf16: random sign and mantissa, exponent spread over 4 octaves, centred so the std is about
    1/sqrt(fan_in). codes: uniform e2m1 byte pairs. scales: e8m0 bytes around
    2**round(-log2(sqrt(fan_in * E[v^2]))), so an MXFP4 projection keeps unit variance.
    """
    kind, param = filler
    n = math.prod(shape)
    if kind == "const_bf16":
        return np.full(shape, param, BF16)
    if kind == "const_f32":
        return np.full(shape, param, np.float32)
    bits = rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]
    if kind == "codes":
        return bits.reshape(shape)
    if kind == "scales":
        center = 127 + round(-0.5 * math.log2(param * E2M1_MEAN_SQUARE))
        return (center - 1 + bits % 3).astype(np.uint8).reshape(shape)
    if kind == "bf16":  # E[v^2] = 0.774 * 4**(e0 - 127) over the 4 octaves below e0
        e0 = 127 + round(-0.5 * math.log2(0.774 * param))
        words = rng.bit_generator.random_raw((n + 3) // 4).view(np.uint16)[:n]
        exponent = (e0 - ((words >> 7) & 3)).astype(np.uint16) << 7
        return ((words & 0x807F) | exponent).view(BF16).reshape(shape)
    raise ValueError(f"unknown filler {filler}")


def _uniform(fan_in: int) -> tuple:
    return ("bf16", fan_in)


def _const(value: float, dtype) -> tuple:
    return ("const_bf16" if dtype == BF16 else "const_f32", value)


_codes = ("codes", 0)


def _scales(fan_in: int) -> tuple:
    return ("scales", fan_in)


def layer_tensors(cfg: dict, i: int, experts: str) -> list[tuple]:
    d, h = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, c = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    p = f"model.layers.{i}"
    out = [
        (f"{p}.input_layernorm.weight", BF16, (d,), _const(1.0, BF16)),
        (f"{p}.post_attention_layernorm.weight", BF16, (d,), _const(1.0, BF16)),
        (f"{p}.self_attn.q_a_proj.weight", BF16, (q_lora, d), _uniform(d)),
        (f"{p}.self_attn.q_a_layernorm.weight", BF16, (q_lora,), _const(1.0, BF16)),
        (f"{p}.self_attn.q_b_proj.weight", BF16, (h * (nope + rope), q_lora), _uniform(q_lora)),
        (f"{p}.self_attn.kv_a_proj_with_mqa.weight", BF16, (c + rope, d), _uniform(d)),
        (f"{p}.self_attn.kv_a_layernorm.weight", BF16, (c,), _const(1.0, BF16)),
        (f"{p}.self_attn.kv_b_proj.weight", BF16, (h * (nope + v), c), _uniform(c)),
        (f"{p}.self_attn.o_proj.weight", BF16, (d, h * v), _uniform(h * v)),
    ]
    if i < cfg["first_k_dense_replace"]:
        inter = cfg["intermediate_size"]
        return out + [(f"{p}.mlp.gate_proj.weight", BF16, (inter, d), _uniform(d)),
                      (f"{p}.mlp.up_proj.weight", BF16, (inter, d), _uniform(d)),
                      (f"{p}.mlp.down_proj.weight", BF16, (d, inter), _uniform(inter))]
    e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    shared = inter * cfg["n_shared_experts"]
    out += [(f"{p}.mlp.gate.weight", BF16, (e, d), _uniform(d)),
            (f"{p}.mlp.gate.e_score_correction_bias", np.dtype(np.float32), (e,),
             _const(0.0, np.float32)),
            (f"{p}.mlp.shared_experts.gate_proj.weight", BF16, (shared, d), _uniform(d)),
            (f"{p}.mlp.shared_experts.up_proj.weight", BF16, (shared, d), _uniform(d)),
            (f"{p}.mlp.shared_experts.down_proj.weight", BF16, (d, shared), _uniform(shared))]
    x = f"{p}.mlp.experts"
    u8 = np.dtype(np.uint8)
    if experts == "mxfp4":
        return out + [(f"{x}.gate_up_proj_blocks", u8, (e, 2 * inter, d // 32, 16), _codes),
                      (f"{x}.gate_up_proj_scales", u8, (e, 2 * inter, d // 32), _scales(d)),
                      (f"{x}.down_proj_blocks", u8, (e, d, inter // 32, 16), _codes),
                      (f"{x}.down_proj_scales", u8, (e, d, inter // 32), _scales(inter))]
    return out + [(f"{x}.gate_up_proj", BF16, (e, 2 * inter, d), _uniform(d)),
                  (f"{x}.down_proj", BF16, (e, d, inter), _uniform(inter))]


def top_tensors(cfg: dict) -> list[tuple]:
    v, d = cfg["vocab_size"], cfg["hidden_size"]
    return [("model.embed_tokens.weight", BF16, (v, d), _uniform(1)),
            ("model.norm.weight", BF16, (d,), _const(1.0, BF16)),
            ("lm_head.weight", BF16, (v, d), _uniform(d))]


# -- writing ---------------------------------------------------------------------------------------

class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.start, self.last = total, 0, time.perf_counter(), 0.0

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last > 1.0 or self.done == self.total:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9) / 1e9
            end = "\n" if self.done == self.total or not sys.stderr.isatty() else "\r"
            print(f"writing {self.done / 1e9:7.2f} / {self.total / 1e9:.2f} GB ({rate:.2f} GB/s)",
                  end=end, file=sys.stderr, flush=True)


JOB_BYTES = 64 << 20  # a worker fills and writes about this much at a time


def shard_jobs(path: Path, tensors: list[tuple], seed: tuple) -> list[tuple]:
    """Writes the shard's header (sized file, data to come) and returns its fill jobs:
    (path, byte offset, filler, dtype, shape of the rows, seed). Each job has its own seed, so the
    bytes do not depend on how the jobs are spread over workers."""
    header, offset = {}, 0
    for name, dtype, shape, _ in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)
    jobs, base = [], 8 + len(text)
    for name, dtype, shape, filler in tensors:
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        step = max(1, JOB_BYTES // row_bytes)
        start = base + header[name]["data_offsets"][0]
        for first in range(0, shape[0], step):
            rows = (min(step, shape[0] - first),) + tuple(shape[1:])
            jobs.append((str(path), start + first * row_bytes, filler, dtype, rows,
                         (*seed, len(jobs))))
    return jobs


def run_job(job: tuple) -> int:
    path, offset, filler, dtype, rows, seed = job
    data = np.ascontiguousarray(fill(filler, np.random.default_rng(seed), rows), dtype)
    buf, done = data.reshape(-1).view(np.uint8), 0
    fd = os.open(path, os.O_WRONLY)
    try:
        while done < len(buf):
            done += os.pwrite(fd, buf[done:], offset + done)
    finally:
        os.close(fd)
    return data.nbytes


def write_checkpoint(out: Path, shape: str, layers: int, dense_layers: int, experts: str,
                     tokenizer_dir: Path, max_positions: int, seed: int = 0,
                     workers: int = 1, n_experts: int = 0) -> dict:
    """Writes config.json, the tokenizer files and the shards; returns the config."""
    import tokenizers

    tok_file = tokenizer_dir / "tokenizer.json"
    if not tok_file.exists():
        raise SystemExit(f"error: {tok_file}: tokenizer not found (--tokenizer DIR)")
    backend = tokenizers.Tokenizer.from_file(str(tok_file))
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    special = {"bos_token_id": backend.token_to_id(tok_config["bos_token"]),
               "eos_token_id": [backend.token_to_id(t) for t in (tok_config["eos_token"], "<|end|>")
                                if backend.token_to_id(t) is not None],
               "pad_token_id": backend.token_to_id(tok_config.get("pad_token") or "")}
    cfg = hf_config(shape, layers, dense_layers, backend.get_vocab_size(), max_positions, special,
                    n_experts)
    out.mkdir(parents=True, exist_ok=True)
    shards = [("model-top.safetensors", top_tensors(cfg))] + [
        (f"model-layer{i:03d}.safetensors", layer_tensors(cfg, i, experts)) for i in range(layers)]
    jobs = [job for k, (file, tensors) in enumerate(shards)
            for job in shard_jobs(out / file, tensors, (seed, k))]
    progress = Progress(sum(math.prod(job[4]) * job[3].itemsize for job in jobs))
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for n in pool.imap_unordered(run_job, jobs):
                progress.add(n)
    else:
        for job in jobs:
            progress.add(run_job(job))
    weight_map = {name: file for file, tensors in shards for name, *_ in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": progress.total}, "weight_map": weight_map}, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return cfg


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="v41-flash")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny --layers 3 (tests)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (dense + MoE)")
    parser.add_argument("--dense-layers", type=int, default=1, help="leading dense-MLP layers")
    parser.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4")
    parser.add_argument("--n-experts", type=int, default=0,
                        help="routed experts per layer (default: the shape's)")
    parser.add_argument("--max-positions", type=int, default=16384)
    parser.add_argument("--tokenizer", type=Path, default=REPO / "models" / "demo",
                        help="directory with tokenizer.json and tokenizer_config.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes filling and writing the shards")
    args = parser.parse_args(argv)
    shape, layers = ("tiny", 3) if args.tiny else (args.shape, args.layers)
    start = time.perf_counter()
    cfg = write_checkpoint(args.out, shape, layers, args.dense_layers, args.experts,
                           args.tokenizer, args.max_positions, args.seed, args.workers,
                           args.n_experts)
    n_moe = layers - cfg["first_k_dense_replace"]
    print(f"{args.out}: {shape}, {layers} layers ({n_moe} MoE x {cfg['n_routed_experts']} experts, "
          f"{args.experts}), vocab {cfg['vocab_size']}, in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
