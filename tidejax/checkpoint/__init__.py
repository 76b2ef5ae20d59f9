"""Checkpoint loading: safetensors (single file or sharded), DeepSeek FP8, expert layouts.

Usage from a model family (a declarative table; this package reads, maps and checks)::

    from tidejax.checkpoint import CheckpointReader, Rule, load_params, load_routed_experts

    reader = CheckpointReader(model_dir)          # headers checked now; data read lazily
    table = {                       # params path -> Rule(source, stored HF shape, transform)
        ("embed",): Rule("model.embed_tokens.weight", (V, D)),
        ("layers", 0, "attn", "q_a_proj"): Rule("model.layers.0.self_attn.q_a_proj.weight",
                                                (q_lora, D), np.transpose),
        ...                         # a plain tuple (source, shape[, transform]) works too
    }
    params = load_params(reader, table, dtype=jnp.bfloat16, put=lambda path, a: jnp.asarray(a))

    pool = {"gate_up": np.empty((L_moe * E, 2 * I, D), dt), "down": np.empty((L_moe * E, D, I), dt)}
    def put_row(row, r):                          # row = moe_layer * E + expert
        pool["gate_up"][row] = r["gate_up"]; pool["down"][row] = r["down"]
    load_routed_experts(reader, [f"model.layers.{i}.mlp" for i in moe_layers], E, D, I, put_row)

    # fails naming any tensor left unconsumed that no ignore regex matches (re.search)
    reader.check_all_consumed(ignore=[r"^model\\.layers\\.61\\.", r"rotary_emb\\.inv_freq$"])

    # or all three in one call, every check (unmapped tensors too) done before any data is read:
    params = load_checkpoint(reader, table, ignore=[...], experts=(prefixes, E, D, I),
                             put_row=put_row, put=...)

Rule shapes are the stored (HF, [out, in]) shapes. `X.weight` with a sibling `X.weight_scale_inv`
(DeepSeek FP8, 128x128 blocks) reads as float32 and consumes both. Every error is a
`CheckpointError` (a ValueError) naming the file and the tensor: truncated file, unknown dtype,
missing tensor, shape mismatch, duplicate or unmapped tensor, missing shard.
`reader.read(name)` / `reader.read_rows(name)` give single tensors; a one-line progress bar
(tensors and bytes) goes to stderr unless `progress=False`.
"""

from tidejax.checkpoint.fp8 import dequantize_fp8_block, quantize_fp8_block
from tidejax.checkpoint.names import Rule, load_checkpoint, load_params, load_routed_experts
from tidejax.checkpoint.reader import CheckpointReader
from tidejax.checkpoint.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "CheckpointReader", "Rule", "load_checkpoint", "load_params",
           "load_routed_experts", "dequantize_fp8_block", "quantize_fp8_block"]
