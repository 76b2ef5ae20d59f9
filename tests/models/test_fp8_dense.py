"""DeepSeek-V4.1's dense projections kept FP8 on the device (model.dense_format = "fp8"): the
block-scaled matmul against float64 numpy, the scales moved onto the dividing block, and the
tiny_a checkpoint in the published formats loaded FP8 as stored: the same logits as its float
load (the goldens' tolerance) in fewer device bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tidejax.checkpoint.fp8 import dequantize_fp8_block, scales_on_dividing_block
from tidejax.config import EngineConfig
from tidejax.errors import ConfigError
from tidejax.ops import fp8_block_matmul
from tidejax.pallas.fp8_matmul import fp8_block_matmul_reference
from tidejax.models.deepseek_v41.weights import load
from tests.support.declaration import edited_copy
from tests.support.v41_published import GOLDEN, fp8_blocks
from tests.support.v41_runner import full_logits

E4M3 = ml_dtypes.float8_e4m3fn
TOLERANCE = 1e-4  # the goldens' (test_deepseek_v41.test_logits)


@pytest.mark.parametrize("shape, block", [((64, 96), (32, 32)), ((48, 40), (16, 8))])
def test_fp8_block_matmul_against_float64(shape, block, rng):
    w = rng.normal(size=shape).astype(np.float32)
    q, scales = fp8_blocks(w, block)
    x = rng.normal(size=(3, 5, shape[1])).astype(np.float32)
    full = np.repeat(np.repeat(scales.astype(np.float64), block[0], 0), block[1], 1)
    want = x.astype(np.float64) @ (q.astype(np.float64) * full).T
    got = fp8_block_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scales.astype(np.float32)),
                           block)
    assert got.dtype == jnp.float32 and got.shape == (3, 5, shape[0])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"needs blocks dividing it"):
        fp8_block_matmul(jnp.asarray(x), jnp.asarray(q), jnp.ones((1, 1)), block)


@pytest.mark.parametrize("lead", [(1,), (2, 2), (1, 1, 3)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_few_rows_form_is_the_reference(lead, dtype, rng):
    """Decode's rows (at most block rows / 8: here 4 of 32) take the form with the scales on the
    activations (its named scope in the lowered step); it gives the reference's product."""
    w = rng.normal(size=(96, 64)).astype(np.float32)
    q, scales = fp8_blocks(w, (32, 16))
    x = jnp.asarray(rng.normal(size=lead + (64,)), dtype)
    args = (x, jnp.asarray(q), jnp.asarray(scales.astype(np.float32)), (32, 16))
    got = fp8_block_matmul(*args)
    want = fp8_block_matmul_reference(*args)
    assert got.dtype == dtype and got.shape == lead + (96,)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    text = jax.jit(fp8_block_matmul, static_argnums=3).lower(*args).as_text(debug_info=True)
    assert "fp8_block_matmul_few_rows" in text and "fp8_block_matmul_reference" not in text


def test_scales_on_the_dividing_block_dequantize_the_same(rng):
    """320 rows in 128-row blocks (a partial edge block) are 5 blocks of 64 with repeated
    scales: the same weight."""
    q, scales = fp8_blocks(rng.normal(size=(320, 192)).astype(np.float32), (128, 128))
    fine = scales_on_dividing_block(scales.astype(np.float32), (320, 192), (128, 128))
    assert fine.shape == (5, 3)
    assert np.array_equal(dequantize_fp8_block(q, fine, (64, 64)),
                          dequantize_fp8_block(q, scales.astype(np.float32), (128, 128)))


def _bytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


def test_fp8_on_the_device_gives_the_float_logits_in_fewer_bytes(published):
    as_stored = load(published / "fp8", dense_format="fp8")
    dequantized = load(published / "fp8")
    attn = as_stored.params["params"]["layers_1"]["attn"]
    assert attn["wq_b"]["weight"].dtype == E4M3 and attn["indexer"]["wq_b"]["scale"].shape == (2, 1)
    assert as_stored.params["params"]["layers_1"]["engram"]["wkv"]["scale"].shape == (5, 3)
    assert attn["wo_a"]["weight"].dtype == E4M3 and "scale" in attn["wo_a"]  # the grouped one too
    fp8_bytes, float_bytes = _bytes(as_stored.params), _bytes(dequantized.params)
    print(f"dense params on the device: {float_bytes} B float32, {fp8_bytes} B with FP8")
    assert fp8_bytes < 0.8 * float_bytes
    ids = np.load(GOLDEN / "input_ids.npy")[0]
    got = full_logits(as_stored, ids, kernel="reference")
    assert np.abs(got - full_logits(dequantized, ids, kernel="reference")).max() <= TOLERANCE


def test_fp8_needs_a_checkpoint_storing_fp8(published, tmp_path):
    with pytest.raises(ConfigError, match=r"model.dense_format = 'fp8': .* stores no dense"):
        load(published / "float", dense_format="fp8")

    def store_float(tensors):
        name = "layers.0.attn.wq_a"
        tensors[f"{name}.weight"] = tensors[f"{name}.weight"].astype(np.float32)
        del tensors[f"{name}.scale"]

    mixed = edited_copy(published / "fp8", tmp_path / "mixed", store_float)
    assert load(mixed, dense_format="fp8").params["params"]["layers_0"]["attn"]["wq_a"][
        "weight"].dtype == jnp.float32  # stored float: declared float
    with pytest.raises(ConfigError, match=r"model.dense_format = 'fp16'"):
        load(published / "fp8", dense_format="fp16")
    with pytest.raises(ConfigError, match=r"'model.dense_format' = 'fp16' is not one of"):
        EngineConfig.from_dict({"model": {"dense_format": "fp16"}})


def test_fp8_declaration_is_what_loads(published):
    """The FP8 declaration (the checkpoint decides which Linears are FP8: loading.fp8_specs;
    declaration.check_forward_on_declared covers the float one) is the loaded tree, and its
    bytes (the load's memory estimate) are the loaded params' and below the float ones'."""
    from tidejax.checkpoint import CheckpointReader
    from tidejax.checkpoint.fp8 import config_block
    from tidejax.fields import read_json
    from tidejax.models.base import nbytes
    from tidejax.models.deepseek_v41.config import V41Config
    from tidejax.models.deepseek_v41.weights import checkpoint_table, param_specs
    from tidejax.models.loading import fp8_specs, stored_fp8

    raw = read_json(published / "fp8" / "config.json")
    cfg = V41Config.from_hf(raw, "config.json")
    table = checkpoint_table(cfg)
    reader = CheckpointReader(published / "fp8", fp8_block=config_block(raw),
                              fp8_blocks=table.fp8_blocks, progress=False)
    floats = param_specs(cfg, jnp.float32)
    declared = fp8_specs(floats, stored_fp8(reader, table), reader)
    loaded = load(published / "fp8", dense_format="fp8").params["params"]
    assert jax.tree.map(lambda s: (s.shape, np.dtype(s.dtype)), declared) == jax.tree.map(
        lambda a: (a.shape, a.dtype), loaded)
    assert nbytes(declared) == _bytes(loaded) < 0.8 * nbytes(floats)


def test_fp8_is_refused_for_a_family_without_it(tmp_path):
    import tidejax
    from tests.support.tiny_models import write_deepseek_v3

    write_deepseek_v3(tmp_path)
    with pytest.raises(ConfigError, match=r"model.dense_format = 'fp8': the deepseek_v3 family"):
        tidejax.load(tmp_path, model={"dense_format": "fp8"})


def test_fp8_declared_weight_stored_float_names_the_tensor(published, monkeypatch):
    """The table's own check (a caller declaring FP8 itself): a float tensor for an FP8-declared
    weight is found on the headers."""
    from tests.support.declaration import forbid_data_reads
    from tidejax.errors import CheckpointError
    from tidejax.checkpoint import CheckpointReader
    from tidejax.checkpoint import load as load_table
    from tidejax.fields import read_json
    from tidejax.models.base import abstract
    from tidejax.models.deepseek_v41.config import V41Config
    from tidejax.models.deepseek_v41.weights import checkpoint_table, host_specs, param_specs
    from tidejax.models.loading import fp8_specs, stored_fp8

    cfg = V41Config.from_hf(read_json(published / "fp8" / "config.json"), "config.json")
    table = checkpoint_table(cfg)
    fp8_reader = CheckpointReader(published / "fp8", fp8_blocks=table.fp8_blocks, progress=False)
    declared = fp8_specs(param_specs(cfg, jnp.float32), stored_fp8(fp8_reader, table), fp8_reader)
    forbid_data_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.attn.wq_a.weight' is "
                                              r"stored plain, but params \('layers_0', 'attn', "
                                              r"'wq_a', 'weight'\) are declared FP8"):
        load_table(CheckpointReader(published / "float", fp8_blocks=table.fp8_blocks,
                                    progress=False), table,
                   abstract(declared), host=abstract(host_specs(cfg)))
