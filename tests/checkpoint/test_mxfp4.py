"""MXFP4 format: the e2m1 table from the spec's bit layout, round trips, transformers' decoding."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tests.support.checkpoint_fixtures import save_checkpoint
from tidejax.checkpoint import CheckpointReader, mxfp4




def spec_value(code: int) -> float:
    """e2m1 from its bits: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def test_dequantize_every_code_and_nibble_order():
    codes = np.arange(16, dtype=np.uint8)
    # byte j of the block holds code j in the low nibble and code 15 - j in the high one
    blocks = (codes | ((15 - codes) << 4)).astype(np.uint8)[None, :]  # [1, 16]
    for scale in (127 - 3, 127, 127 + 5):
        got = mxfp4.dequantize(blocks, np.array([scale], np.uint8))
        want = [spec_value(c) * 2.0 ** (scale - 127) for j in range(16) for c in (j, 15 - j)]
        np.testing.assert_array_equal(got, np.array(want, np.float32))


def test_round_trip_is_exact_on_representable_values(rng):
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 5, 4), dtype=np.uint8)
    values = mxfp4.dequantize(blocks, scales)
    again = mxfp4.dequantize(*mxfp4.quantize(values))
    np.testing.assert_array_equal(again, values)


def test_quantize_picks_the_nearest_value_of_the_block_grid(rng):
    w = (rng.standard_normal((7, 96)) * np.exp(rng.standard_normal((7, 1)) * 3)).astype(np.float32)
    blocks, scales = mxfp4.quantize(w)
    got = mxfp4.dequantize(blocks, scales).reshape(7, 3, 32)
    grid = np.array([spec_value(c) for c in range(16)])[None, None, :] * 2.0 ** (scales[..., None] - 127.0)
    wb = w.reshape(7, 3, 32).astype(np.float64)
    dist = np.abs(wb[..., None] - grid[:, :, None, :])  # [7, 3, 32, 16]
    best = np.take_along_axis(grid[:, :, None, :].repeat(32, 2), dist.argmin(-1)[..., None], -1)[..., 0]
    np.testing.assert_array_equal(got, best)
    # the OCP scale: the block's largest magnitude lands in [4, 8) before rounding
    amax = np.abs(wb).max(-1)
    ratio = amax / 2.0 ** (scales - 127.0)
    assert np.all((ratio >= 4) & (ratio < 8)), ratio


def test_numpy_and_jax_agree_also_under_jit(rng):
    w = rng.standard_normal((4, 64)).astype(np.float32)
    b_np, s_np = mxfp4.quantize(w)
    b_j, s_j = jax.jit(mxfp4.quantize)(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(b_j), b_np)
    np.testing.assert_array_equal(np.asarray(s_j), s_np)
    deq = jax.jit(lambda b, s: mxfp4.dequantize(b, s, jnp.bfloat16))(b_j, s_j)
    assert deq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(deq, np.float32), mxfp4.dequantize(b_np, s_np))


def test_gpt_oss_pair_decodes_like_transformers(rng, tmp_path):
    experts, rows, groups = 3, 6, 4  # gpt-oss stores [experts, out rows, in/32, 16]
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (experts, rows, groups), dtype=np.uint8)
    tensors = {"model.layers.0.mlp.experts.down_proj_blocks": blocks,
               "model.layers.0.mlp.experts.down_proj_scales": scales,
               "model.layers.0.mlp.router.weight": np.ones(2, np.float32)}
    reader = CheckpointReader(save_checkpoint(tmp_path, tensors), progress=False)
    assert sorted(reader.tensors) == ["model.layers.0.mlp.experts.down_proj",
                                      "model.layers.0.mlp.router.weight"]
    ours = reader.read("model.layers.0.mlp.experts.down_proj")  # [experts, out, in]
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32)  # [experts, in, out]
    np.testing.assert_array_equal(ours, theirs.numpy().transpose(0, 2, 1))


def test_bad_inputs_name_the_problem():
    """(Unpaired blocks or scales in a checkpoint: tests/checkpoint/test_checkpoint.py, mxfp4_* cases.)"""
    with pytest.raises(ValueError, match=r"blocks \(2, 1, 16\) and scales \(2, 2\) do not match"):
        mxfp4.dequantize(np.zeros((2, 1, 16), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        mxfp4.quantize(np.zeros((2, 40), np.float32))
