"""Checkpoint reading: round trips through the reference safetensors writer, the regex table over
declared params, both routed-expert layouts, FP8 (both scale conventions) against a float64
computation, MXFP4 pairs, and every bad-checkpoint error, found on the headers before any data is
read."""

import io
import json
import re
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.torch import save_file

from tests.support.checkpoint_fixtures import (save_checkpoint, to_fp8, to_numpy, to_per_expert,
                                               to_torch)
from tidejax.checkpoint import (TRANSPOSE, CheckpointReader, Experts, Rule, Table,
                                dequantize_fp8_block, load, mxfp4, quantize_fp8_block)
from tidejax.checkpoint.fp8 import e4m3_to_float32
from tidejax.checkpoint import progress as progress_module
from tidejax.checkpoint.progress import Progress
from tidejax.errors import CheckpointError

E, D, I = 4, 8, 6  # experts, hidden, intermediate
MOE = ["model.layers.1.mlp", "model.layers.2.mlp"]


def various_tensors(rng) -> dict[str, np.ndarray]:
    return {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "a.bf16": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
        "a.f16": rng.standard_normal((7,)).astype(np.float16),
        "a.f64": rng.standard_normal((2, 2, 2)),
        "b.i64": rng.integers(-9, 9, (5,)),
        "b.i8": rng.integers(-9, 9, (3, 3)).astype(np.int8),
        "b.u8": rng.integers(0, 255, (6, 2)).astype(np.uint8),
        "b.bool": rng.random(4) > 0.5,
        "b.e8m0": (2.0 ** rng.integers(-5, 5, (3, 2))).astype(ml_dtypes.float8_e8m0fnu),
        "c.scalar": np.array(1.5, np.float32),
        "c.empty": np.zeros((0, 3), np.float32),
    }


def model_tensors(rng, dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """A tiny DeepSeek-like state dict with transformers-5 fused experts."""
    t = {"model.embed_tokens.weight": rng.standard_normal((10, D)),
         "model.layers.0.mlp.up_proj.weight": rng.standard_normal((I, D)),
         "model.layers.0.input_layernorm.weight": rng.standard_normal((D,))}
    for p in MOE:
        t[f"{p}.gate.weight"] = rng.standard_normal((E, D))
        t[f"{p}.experts.gate_up_proj"] = rng.standard_normal((E, 2 * I, D))
        t[f"{p}.experts.down_proj"] = rng.standard_normal((E, D, I))
    return {n: v.astype(dtype) for n, v in t.items()}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n_shards", [1, 3])
def test_round_trip_single_and_sharded(tmp_path, n_shards):
    tensors = various_tensors(np.random.default_rng(0))
    reader = CheckpointReader(save_checkpoint(tmp_path, tensors, n_shards), progress=False)
    assert reader.names() == sorted(tensors)
    assert len({reader.file_of(n) for n in tensors}) == n_shards
    for name, t in tensors.items():
        assert reader.shape(name) == t.shape and reader.dtype(name) == t.dtype
        assert same_bits(reader.read(name), t), name
    assert reader.progress.items == len(tensors)


def test_read_row(tmp_path):
    """Rows in any order; the tensor is done when its last row is read, whichever that is."""
    t = np.random.default_rng(1).standard_normal((5, 3, 2)).astype(np.float32)
    reader = CheckpointReader(save_checkpoint(tmp_path, {"x": t}), progress=False)
    rows = {i: reader.read_row("x", i) for i in (4, 0, 3, 1)}
    assert not reader.progress.closed
    rows[2] = reader.read_row("x", 2)
    assert all(np.array_equal(r, t[i]) for i, r in rows.items())
    assert reader.progress.closed


EXPERT_RULES = (
    Experts(r"{layer:model\.layers\.[0-9]+\.mlp}.experts.{expert}.{part:gate|up|down}_proj.weight"),
    Experts(r"{layer:model\.layers\.[0-9]+\.mlp}.experts.{part:gate_up|down}_proj"))


def table(ignore=(), more=()) -> Table:
    return Table((Rule("model.embed_tokens.weight", "embed"),
                  Rule("model.layers.0.mlp.up_proj.weight", "layers_0.mlp.up", TRANSPOSE),
                  Rule("model.layers.0.input_layernorm.weight", "layers_0.norm"),
                  Rule("model.layers.{i}.mlp.gate.weight", "layers_{i}.router"), *EXPERT_RULES,
                  *more), ignore=ignore, expert_layers=MOE)


def spec(*shape, dtype=np.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def param_specs(dtype=np.float32) -> dict:
    """What `table` fills: the declared params of model_tensors (abstract)."""
    return {"embed": spec(10, D, dtype=dtype),
            "layers_0": {"mlp": {"up": spec(D, I, dtype=dtype)}, "norm": spec(D, dtype=dtype)},
            **{f"layers_{m + 1}": {"router": spec(E, D, dtype=dtype)} for m in range(len(MOE))}}


def expert_specs(layers=len(MOE)) -> dict:
    return {"gate_up": spec(layers * E, 2 * I, D), "down": spec(layers * E, D, I)}


def empty_pool(dtype=np.float32) -> dict:
    return {"gate_up": np.full((len(MOE) * E, 2 * I, D), np.nan, dtype),
            "down": np.full((len(MOE) * E, D, I), np.nan, dtype)}


def load_all(model_dir, dtype=np.float32):
    """Load model_tensors' layout through the public API: (params, expert pool)."""
    reader = CheckpointReader(model_dir, progress=False)
    pool = empty_pool(dtype)

    def put_row(row, r):
        pool["gate_up"][row], pool["down"][row] = r["gate_up"], r["down"]

    params = load(reader, table(), param_specs(dtype), expert_specs(), put_row=put_row)
    return params, pool


def test_load_checkpoint_checks_everything_before_reading(tmp_path):
    tensors = to_per_expert(model_tensors(np.random.default_rng(8)))
    params, pool = load_all(save_checkpoint(tmp_path / "ok", tensors))
    reader = CheckpointReader(tmp_path / "ok", progress=False)
    pool2 = empty_pool()

    def put_row(row, r):
        pool2["gate_up"][row], pool2["down"][row] = r["gate_up"], r["down"]

    params2 = load(reader, table(), param_specs(), expert_specs(), put_row=put_row,
                   put=lambda path, a: a * 2)
    np.testing.assert_array_equal(params2["layers_0"]["norm"], 2 * params["layers_0"]["norm"])
    for k in pool:
        np.testing.assert_array_equal(pool2[k], pool[k])
    assert reader.progress.closed and reader.progress.nbytes == sum(
        t.nbytes for t in tensors.values())

    tensors["model.layers.7.extra"] = np.ones(3, np.float32)
    reader = CheckpointReader(save_checkpoint(tmp_path / "extra", tensors), progress=False)
    with pytest.raises(CheckpointError, match="'model.layers.7.extra' in .*model.safetensors"):
        load(reader, table(), param_specs(), expert_specs(), put_row=put_row)
    assert reader.progress.nbytes == 0  # failed on the headers alone
    reader = CheckpointReader(tmp_path / "extra", progress=False)
    load(reader, table(ignore=["{any:.*}.extra"]), param_specs(), expert_specs(), put_row=put_row)


def test_load_params_and_expert_layouts_agree(tmp_path):
    tensors = model_tensors(np.random.default_rng(2))
    params, pool = load_all(save_checkpoint(tmp_path / "fused", tensors))
    assert params["layers_0"]["mlp"]["up"].shape == (D, I)
    np.testing.assert_array_equal(params["layers_0"]["mlp"]["up"],
                                  tensors["model.layers.0.mlp.up_proj.weight"].astype(np.float32).T)
    assert params["embed"].dtype == np.float32
    for m, p in enumerate(MOE):
        np.testing.assert_array_equal(pool["gate_up"][m * E:(m + 1) * E],
                                      tensors[f"{p}.experts.gate_up_proj"].astype(np.float32))
        np.testing.assert_array_equal(pool["down"][m * E:(m + 1) * E],
                                      tensors[f"{p}.experts.down_proj"].astype(np.float32))
    per_expert = to_per_expert(tensors)
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in per_expert
    params2, pool2 = load_all(save_checkpoint(tmp_path / "per_expert", per_expert, n_shards=4))
    for k in pool:
        np.testing.assert_array_equal(pool2[k], pool[k])
    np.testing.assert_array_equal(params2["embed"], params["embed"])


def test_transformers_writes_per_expert_like_its_fused_params(tmp_path):
    """save_pretrained converts transformers-5's fused experts to the published per-expert
    layout; both must load to the same rows (gate rows first in gate_up)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(vocab_size=32, hidden_size=D, intermediate_size=12,
                           moe_intermediate_size=I, num_hidden_layers=2, first_k_dense_replace=1,
                           n_routed_experts=E, num_experts_per_tok=2, n_group=1, topk_group=1,
                           num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                           kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                           n_shared_experts=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    model.save_pretrained(tmp_path / "saved")
    state = {k: to_numpy(v) for k, v in model.state_dict().items()}
    save_checkpoint(tmp_path / "fused", state, n_shards=2)
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in CheckpointReader(
        tmp_path / "saved", progress=False)
    pools = []
    for d in ("saved", "fused"):
        reader = CheckpointReader(tmp_path / d, progress=False)
        pool = {"gate_up": np.zeros((E, 2 * I, D), np.float32),
                "down": np.zeros((E, D, I), np.float32)}

        def put_row(row, r, pool=pool):
            pool["gate_up"][row], pool["down"][row] = r["gate_up"], r["down"]

        only_experts = Table(EXPERT_RULES, ignore=[r"{other:(?!.*\.experts\.).*}"],
                             expert_layers=["model.layers.1.mlp"])
        load(reader, only_experts, {}, expert_specs(layers=1), put_row=put_row)
        pools.append(pool)
    for k in ("gate_up", "down"):
        np.testing.assert_array_equal(pools[0][k], pools[1][k])
        np.testing.assert_array_equal(pools[1][k], state[f"model.layers.1.mlp.experts.{k}_proj"])


def test_fp8_dequantize_matches_float64():
    rng = np.random.default_rng(3)
    out_f, in_f = 200, 300  # partial edge blocks in both dimensions
    q = (rng.standard_normal((out_f, in_f)) * 50).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-4, 1e-1, (2, 3)).astype(np.float32)
    ref = np.empty((out_f, in_f))
    for r in range(out_f):
        for c in range(in_f):
            ref[r, c] = float(q[r, c]) * float(scale[r // 128, c // 128])
    got = dequantize_fp8_block(q, scale)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=2 ** -23, atol=0)


def test_e4m3_decode_every_code():
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(16, 16)
    ref = codes.astype(np.float32)  # ml_dtypes' conversion
    got = e4m3_to_float32(codes)
    np.testing.assert_array_equal(got, ref)  # NaN where ref is NaN
    assert np.array_equal(np.signbit(got), np.signbit(ref))  # -0.0 stays -0.0


def test_fp8_quantize_block_scales():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((130, 260)).astype(np.float32) * rng.uniform(0.01, 10, (130, 1))
    w[:, 256:] = 0.0  # an all-zero edge block
    q, scale = quantize_fp8_block(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (2, 3)
    for bi in range(2):
        for bj in range(3):
            block = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].astype(np.float64)
            amax = np.abs(block).max()
            expect = amax / 448 if amax > 0 else 1.0
            assert scale[bi, bj] == pytest.approx(expect, rel=2 ** -23)
            qb = q[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].astype(np.float64)
            assert np.abs(qb).max() == (448.0 if amax > 0 else 0.0)
            err = np.abs(qb * scale[bi, bj] - block)
            # e4m3: 3 mantissa bits (half-ulp 2^-4 relative); subnormal step 2^-9
            assert np.all(err <= 2 ** -4 * np.abs(block) + 2 ** -10 * scale[bi, bj] * 1.0001)


def test_fp8_checkpoint_loads_dequantized(tmp_path):
    tensors = to_per_expert(model_tensors(np.random.default_rng(5), np.float32))
    fp8 = to_fp8(tensors)
    name = "model.layers.2.mlp.experts.2.down_proj.weight"  # row E + 2
    assert fp8[name].dtype == ml_dtypes.float8_e4m3fn and name + "_scale_inv" in fp8
    assert fp8["model.embed_tokens.weight"].dtype == np.float32
    reader = CheckpointReader(save_checkpoint(tmp_path, fp8, n_shards=2), progress=False)
    assert reader.tensors[name].format == "fp8"
    np.testing.assert_array_equal(reader.read(name),
                                  dequantize_fp8_block(fp8[name], fp8[name + "_scale_inv"]))
    params, pool = load_all(tmp_path)  # every scale tensor consumed with its weight
    np.testing.assert_array_equal(pool["down"][E + 2],
                                  dequantize_fp8_block(fp8[name], fp8[name + "_scale_inv"]))
    np.testing.assert_allclose(pool["down"][E + 2], tensors[name], rtol=0.07, atol=1e-3)


def test_progress_bar(tmp_path, capsys):
    tensors = model_tensors(np.random.default_rng(6))
    reader = CheckpointReader(save_checkpoint(tmp_path, tensors), label="loading test")
    experts_only = Table(EXPERT_RULES, expert_layers=MOE, ignore=[
        r"model.{x:embed_tokens|layers\.\d+\.(mlp\.gate|mlp\.up_proj|input_layernorm)}.weight"])
    load(reader, experts_only, {}, expert_specs(), put_row=lambda row, r: None)
    err = capsys.readouterr().err
    total = sum(t.nbytes for t in tensors.values()) * 1e-9
    n = len(tensors)  # not a tty: just the final line
    assert re.fullmatch(rf"loading test \[{'#' * 20}\] {n}/{n} tensors, {total:.2f}/{total:.2f} "
                        r"GB, 0 s, [0-9.]+ GB/s\n", err), err


def test_progress_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    clock = iter([100.0, 100.5, 102.0])  # the start, then each line's time
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    out = Terminal()
    progress = Progress("load", 4, 4 * 10**8, stream=out)
    progress.every_s = 0.0
    progress.advance(1, 10**8)
    progress.advance(3, 3 * 10**8)  # the last item ends the line
    progress.close()
    assert out.getvalue() == (
        "\rload [#####---------------] 1/4 tensors, 0.10/0.40 GB, 0 s, 0.20 GB/s"
        "\rload [####################] 4/4 tensors, 0.40/0.40 GB, 2 s, 0.20 GB/s\n")


# -- bad checkpoints: each error names the file and the tensor ------------------------------

def write_raw(path, header: dict, data: bytes = b"", header_len=None):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", header_len or len(text)) + text + data)
    return path


def fused(tmp_path, **kw):
    return save_checkpoint(tmp_path, model_tensors(np.random.default_rng(7)), **kw)


def truncated(tmp_path):
    d = save_checkpoint(tmp_path, {"a": np.ones(4, np.float32), "b": np.ones(8, np.float32)})
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4])
    CheckpointReader(d)


def truncated_header(tmp_path):
    write_raw(tmp_path / "model.safetensors", {"a": {}}, header_len=10 ** 6)
    CheckpointReader(tmp_path)


def unknown_dtype(tmp_path):
    write_raw(tmp_path / "model.safetensors",
              {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    CheckpointReader(tmp_path)


def duplicate_in_header(tmp_path):
    entry = '{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    text = f'{{"a": {entry}, "a": {entry}}}'.encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"\0")
    CheckpointReader(tmp_path)


def duplicate_across_shards(tmp_path):
    t = model_tensors(np.random.default_rng(7))
    d = save_checkpoint(tmp_path, t, n_shards=2)
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    second = [n for n, shard in weight_map.items() if shard.startswith("model-00002")]
    save_file({n: to_torch(t[n]) for n in second + ["model.embed_tokens.weight"]},
              d / "model-00002-of-00002.safetensors")
    CheckpointReader(d)


def missing_shard(tmp_path):
    d = fused(tmp_path, n_shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    CheckpointReader(d)


def load_with(model_dir, more=(), **specs):
    """Load by `table` with more rules and more (or other) declared params."""
    load(CheckpointReader(model_dir), table(more=more), {**param_specs(), **specs},
         expert_specs(), put_row=lambda row, r: None)


def with_tensors(tmp_path, **extra):
    """model_tensors plus `extra` (dots spelled __ in the names)."""
    t = model_tensors(np.random.default_rng(7))
    t.update({name.replace("__", "."): v for name, v in extra.items()})
    return save_checkpoint(tmp_path, t)


def missing_tensor(tmp_path):
    load_with(fused(tmp_path), [Rule("model.norm.weight", "x")], x=spec(D))


def shape_mismatch(tmp_path):
    load_with(fused(tmp_path), embed=spec(11, D))


def mapped_twice(tmp_path):
    load_with(fused(tmp_path), [Rule("model.{what:embed_tokens|wte}.weight", "b")], b=spec(10, D))


def filled_twice(tmp_path):
    load_with(with_tensors(tmp_path, model__wte__weight=np.ones((10, D), np.float32)),
              [Rule("model.wte.weight", "embed")])


def no_place(tmp_path):
    load_with(with_tensors(tmp_path, model__layers__0__post_attention_layernorm__weight=np.ones(D)),
              [Rule("model.layers.{i}.post_attention_layernorm.weight", "layers_{i}.post_norm")])


def experts_of_a_dense_layer(tmp_path):
    load_with(with_tensors(tmp_path, model__layers__0__mlp__experts__down_proj=np.ones((E, D, I))))


def expert_past_the_count(tmp_path):
    load_with(with_tensors(tmp_path, **{f"model__layers__1__mlp__experts__{E}__down_proj__weight":
                                        np.ones((D, I))}))


def unmapped(tmp_path):
    t = {**model_tensors(np.random.default_rng(7)), "model.layers.9.extra": np.ones(2, np.float32)}
    load_all(save_checkpoint(tmp_path, t, n_shards=2))


def expert_shape(tmp_path):
    t = model_tensors(np.random.default_rng(7))
    t["model.layers.2.mlp.experts.down_proj"] = t["model.layers.2.mlp.experts.down_proj"][:, :, :5]
    load_all(save_checkpoint(tmp_path, t))


def expert_missing(tmp_path):
    t = to_per_expert(model_tensors(np.random.default_rng(7)))
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    load_all(save_checkpoint(tmp_path, t))


def both_layouts(tmp_path):
    t = model_tensors(np.random.default_rng(7))
    t.update({k: v for k, v in to_per_expert(t).items() if "layers.2.mlp.experts.0" in k})
    load_all(save_checkpoint(tmp_path, t))


def fp8_without_scale(tmp_path):
    fp8 = to_fp8(to_per_expert(model_tensors(np.random.default_rng(7), np.float32)))
    del fp8["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"]
    CheckpointReader(save_checkpoint(tmp_path, fp8))


def fp8_bad_scale(tmp_path):
    fp8 = to_fp8(to_per_expert(model_tensors(np.random.default_rng(7), np.float32)))
    fp8["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"] = np.ones((2, 1), np.float32)
    CheckpointReader(save_checkpoint(tmp_path, fp8))


def mxfp4_blocks_without_scales(tmp_path):
    CheckpointReader(save_checkpoint(tmp_path, {"x.down_proj_blocks": np.zeros((2, 1, 16), np.uint8)}))


def mxfp4_scales_without_blocks(tmp_path):
    CheckpointReader(save_checkpoint(tmp_path, {"x.down_proj_scales": np.zeros((2, 1), np.uint8)}))


def mxfp4_pair_shapes(tmp_path):
    CheckpointReader(save_checkpoint(tmp_path, {"x.down_proj_blocks": np.zeros((2, 1, 16), np.uint8),
                                                "x.down_proj_scales": np.zeros((2, 2), np.uint8)}))


def mxfp4_mixed_with_dense(tmp_path):
    e, d, i = 2, 64, 32
    rng = np.random.default_rng(7)
    blocks, scales = mxfp4.quantize(rng.standard_normal((e, 2 * i, d)).astype(np.float32))
    p = "model.layers.1.mlp.experts"
    d_ = save_checkpoint(tmp_path, {f"{p}.gate_up_proj_blocks": blocks, f"{p}.gate_up_proj_scales": scales,
                                    f"{p}.down_proj": np.ones((e, d, i), np.float32)})
    load(CheckpointReader(d_), Table(EXPERT_RULES, expert_layers=[MOE[0]]), {},
         {"gate_up": spec(e, 2 * i, d), "down": spec(e, d, i)}, put_row=lambda row, r: None)


BAD = {  # case -> (what the message must name: the file, the tensor or field)
    truncated: ("model.safetensors", "'b'", "truncated"),
    truncated_header: ("model.safetensors", "truncated", "header length 1000000"),
    unknown_dtype: ("model.safetensors", "'a'", "unknown dtype 'F4'"),
    duplicate_in_header: ("model.safetensors", "duplicate tensor name 'a'"),
    duplicate_across_shards: ("model-00002-of-00002.safetensors", "duplicate tensor",
                              "puts in model-00001-of-00002.safetensors",
                              "'model.embed_tokens.weight'"),
    missing_shard: ("model.safetensors.index.json", "model-00002-of-00002.safetensors",
                    "not found"),
    missing_tensor: ("model.safetensors", "missing tensor 'model.norm.weight'", "('x',)"),
    shape_mismatch: ("model.safetensors", "'model.embed_tokens.weight'", "[10, 8]", "[11, 8]"),
    mapped_twice: ("model.safetensors", "'model.embed_tokens.weight'", "mapped twice",
                   "'model.{what:embed_tokens|wte}.weight'"),
    filled_twice: ("model.safetensors", "'model.wte.weight'", "'model.embed_tokens.weight'",
                   "both fill params ('embed',)"),
    no_place: ("model.safetensors", "'model.layers.0.post_attention_layernorm.weight'", "no place",
               "('layers_0', 'post_norm')"),
    experts_of_a_dense_layer: ("model.safetensors", "'model.layers.0.mlp.experts.down_proj'",
                               "'model.layers.0.mlp', which is not a MoE layer"),
    expert_past_the_count: ("model.safetensors", f"'model.layers.1.mlp.experts.{E}.down_proj.weight'",
                            f"routed expert {E} of layer 'model.layers.1.mlp', which has {E}"),
    unmapped: ("model.safetensors.index.json", "'model.layers.9.extra' in",
               "-of-00002.safetensors", "unexpected tensor"),
    expert_shape: ("model.safetensors", "'model.layers.2.mlp.experts.down_proj'", "[4, 8, 5]"),
    expert_missing: ("model.safetensors", "missing tensor",
                     "'model.layers.1.mlp.experts.3.up_proj.weight'"),
    both_layouts: ("model.safetensors", "'model.layers.2.mlp'", "both"),
    fp8_without_scale: ("model.safetensors", "'model.layers.1.mlp.experts.0.gate_proj.weight'",
                        "no 'model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv'"),
    mxfp4_blocks_without_scales: ("model.safetensors", "'x.down_proj_blocks'",
                                  "no 'x.down_proj_scales'"),
    mxfp4_scales_without_blocks: ("model.safetensors", "'x.down_proj_scales'",
                                  "no 'x.down_proj_blocks'"),
    mxfp4_pair_shapes: ("model.safetensors", "'x.down_proj_blocks'", "'x.down_proj_scales'",
                        "[2, 2]", "do not pair"),
    mxfp4_mixed_with_dense: ("model.safetensors", "'model.layers.1.mlp'", "mixes MXFP4 and dense"),
    fp8_bad_scale: ("model.safetensors",
                    "'model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv'", "(1, 1)"),
}


@pytest.mark.parametrize("case", list(BAD), ids=[c.__name__ for c in BAD])
def test_bad_checkpoint_is_named(tmp_path, case):
    with pytest.raises(CheckpointError) as info:
        case(tmp_path)
    message = str(info.value)
    for part in BAD[case]:
        assert part in message, message


def test_every_problem_is_reported_at_once(tmp_path):
    t = to_per_expert(model_tensors(np.random.default_rng(9)))
    del t["model.layers.0.input_layernorm.weight"]
    t["model.layers.5.extra"] = np.ones(2, np.float32)
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:9]
    with pytest.raises(CheckpointError) as info:
        load_all(save_checkpoint(tmp_path, t))
    lines = str(info.value).splitlines()
    assert lines[0].endswith("model.safetensors: 3 problems:"), lines
    assert "'model.embed_tokens.weight' has shape [9, 8]" in lines[1]
    assert "missing tensor 'model.layers.0.input_layernorm.weight'" in lines[2]
    assert "'model.layers.5.extra' in" in lines[3]


def test_bad_headers_fail_before_any_data_is_read(tmp_path):
    """The data section is cut off after the headers were read: every header check fails
    first, before any tensor is read; then the good table's first read meets the cut and names
    the file and the tensor (pread, not a memory map that would die of SIGBUS)."""
    model_dir = fused(tmp_path)
    reader = CheckpointReader(model_dir, progress=False)
    f = model_dir / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(8 + int.from_bytes(fh.read(8), "little"))  # header only
    rows = []
    bad = {  # the check -> (table, declared params, routed experts)
        "shape": (table(), {**param_specs(), "embed": spec(11, D)}, expert_specs()),
        "unfilled": (table(more=[Rule("model.norm.weight", "x")]), {**param_specs(), "x": spec(D)},
                     expert_specs()),
        "unmapped": (Table(table().rules[1:], expert_layers=MOE),
                     {k: v for k, v in param_specs().items() if k != "embed"}, expert_specs()),
        "multi-match": (table(more=[Rule("model.{n:embed_tokens}.weight", "embed")]),
                        param_specs(), expert_specs()),
        "expert shape": (table(), param_specs(), expert_specs(layers=1)),
    }
    for check, (t, params, experts) in bad.items():
        with pytest.raises(CheckpointError, match="model.safetensors"):
            load(reader, t, params, experts, put_row=lambda row, r: rows.append(row))
    assert reader.progress.nbytes == 0 and rows == []
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: tensor "
                                              r"'model\.[^']+' ends at byte \d+, the file now"):
        load(reader, table(), param_specs(), expert_specs(), put_row=lambda row, r: None)


def test_fp8_scale_conventions_and_blocks(tmp_path):
    """DeepSeek-V3's float32 `X.weight_scale_inv` and DeepSeek-V4.1's e8m0 `X.scale` (as
    float8_e8m0fnu or raw uint8 exponents), with the block of config.json."""
    rng = np.random.default_rng(10)
    q = (rng.standard_normal((40, 70)) * 20).astype(ml_dtypes.float8_e4m3fn)
    exponents = rng.integers(120, 130, (2, 3)).astype(np.uint8)  # 32 x 32 blocks
    value = np.ldexp(1.0, exponents.astype(np.int32) - 127)
    want = e4m3_to_float32(q) * np.repeat(np.repeat(value, 32, 0), 32, 1)[:40, :70]
    model_dir = save_checkpoint(tmp_path, {
        "a.weight": q, "a.weight_scale_inv": value.astype(np.float32),
        "b.weight": q, "b.scale": value.astype(ml_dtypes.float8_e8m0fnu),
        "c.weight": q, "c.scale": exponents})
    reader = CheckpointReader(model_dir, fp8_block=(32, 32), progress=False)
    assert sorted(reader.tensors) == ["a.weight", "b.weight", "c.weight"]
    for name in reader.tensors:
        assert reader.tensors[name].format == "fp8"
        np.testing.assert_array_equal(reader.read(name), want.astype(np.float32))
    with pytest.raises(CheckpointError, match=r"'a.weight_scale_inv'.*does not fit.*\(1, 1\)"):
        CheckpointReader(model_dir, progress=False)  # 128 x 128 blocks: one scale each


def test_mxfp4_pairs_read_and_load_as_rows(tmp_path):
    """gpt-oss's fused `X_blocks` + `X_scales` and DeepSeek-V4.1's per-expert packed
    `X.weight` + `X.scale` both load as MXFP4 bank rows, unchanged."""
    e, d, i = 2, 64, 32
    rng = np.random.default_rng(11)
    gate_up = mxfp4.quantize(rng.standard_normal((e, 2 * i, d)).astype(np.float32))
    down = mxfp4.quantize(rng.standard_normal((e, d, i)).astype(np.float32))
    fused = {"model.layers.1.mlp.experts.gate_up_proj_blocks": gate_up[0],
             "model.layers.1.mlp.experts.gate_up_proj_scales": gate_up[1],
             "model.layers.1.mlp.experts.down_proj_blocks": down[0],
             "model.layers.1.mlp.experts.down_proj_scales": down[1]}
    packed = {}  # w1 gate [I, D], w3 up [I, D], w2 down [D, I]; codes [out, in / 2]
    for x in range(e):
        parts = {"w1": (gate_up[0][x, :i], gate_up[1][x, :i]),
                 "w3": (gate_up[0][x, i:], gate_up[1][x, i:]), "w2": (down[0][x], down[1][x])}
        for w, (blocks, scales) in parts.items():
            packed[f"layers.1.ffn.experts.{x}.{w}.weight"] = blocks.reshape(len(blocks), -1).view(np.int8)
            packed[f"layers.1.ffn.experts.{x}.{w}.scale"] = scales.view(ml_dtypes.float8_e8m0fnu)
    v41_rules = [Experts(r"{layer:layers\.[0-9]+\.ffn}.experts.{expert}." + w + ".weight", part)
                 for w, part in (("w1", "gate"), ("w3", "up"), ("w2", "down"))]
    experts = {"gate_up": spec(e, 2 * i, d), "down": spec(e, d, i)}
    for label, tensors, t in (("fused", fused, Table(EXPERT_RULES, expert_layers=[MOE[0]])),
                              ("packed", packed, Table(v41_rules, expert_layers=["layers.1.ffn"]))):
        reader = CheckpointReader(save_checkpoint(tmp_path / label, tensors), progress=False)
        assert {x.format for x in reader.tensors.values()} == {"mxfp4"}
        rows = {}
        load(reader, t, {}, experts, put_row=rows.__setitem__)
        for x in range(e):
            np.testing.assert_array_equal(rows[x]["gate_up_blocks"], gate_up[0][x])
            np.testing.assert_array_equal(rows[x]["gate_up_scales"], gate_up[1][x])
            np.testing.assert_array_equal(rows[x]["down_blocks"], down[0][x])
            np.testing.assert_array_equal(rows[x]["down_scales"], down[1][x])
        assert reader.progress.closed
    reader = CheckpointReader(tmp_path / "packed", progress=False)
    assert reader.tensors["layers.1.ffn.experts.0.w2.weight"].shape == (d, i)
    np.testing.assert_array_equal(reader.read("layers.1.ffn.experts.0.w2.weight"),
                                  mxfp4.dequantize(down[0][0], down[1][0]))
