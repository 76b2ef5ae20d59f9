"""tools/memory_needs.py against the formats' own arithmetic: MXFP4 is 16 bytes of codes and one
scale byte per 32 weights, BF16 two bytes a weight, the GQA pool a key and a value a layer and KV
head; the budget lines are the largest that fit."""

from __future__ import annotations

import pytest

from tools.memory_needs import DEVICES, GIB, Needs, main

MXFP4_BYTES = 17 / 32  # a weight's bytes in MXFP4


def test_qwen3_30b_from_its_published_shape():
    """Qwen3-30B-A3B: 48 layers of 128 experts of 2048 x 768, 4 KV heads of 128, vocab 151,936."""
    needs = Needs("qwen3-30b", "mxfp4")
    weights = 3 * 2048 * 768  # gate, up and down
    assert (needs.total, needs.n_experts) == (48 * 128, 128)
    assert needs.expert_bytes == weights * MXFP4_BYTES
    assert needs.stored_bytes == weights * 2
    assert needs.kv_per_token == 48 * 2 * 4 * 128 * 2
    assert needs.embed_head_bytes == 2 * 151936 * 2048 * 2
    assert needs.transient_bytes == 128 * needs.expert_bytes
    assert Needs("qwen3-30b", "bf16").expert_bytes == weights * 2


def test_gpt_oss_experts_as_published_keep_their_biases():
    """gpt-oss-20b held as stored: MXFP4 gate/up [5760, 2880] and down [2880, 2880], the biases
    float32."""
    needs = Needs("gpt-oss-20b", "checkpoint")
    assert needs.expert_bytes == needs.stored_bytes == (
        (5760 + 2880) * 2880 * MXFP4_BYTES + (5760 + 2880) * 4)


def test_budgets_are_the_largest_that_fit():
    needs = Needs("qwen3-30b", "mxfp4")
    assert needs.slots(1) == GIB // needs.expert_bytes
    assert needs.device_bytes(0, 0) == needs.dense_bytes + needs.pool_bytes  # no transient slots
    assert needs.device_bytes(1, 10) == (needs.dense_bytes + needs.slots(1) * needs.expert_bytes
                                         + needs.transient_bytes + 10 * needs.kv_per_token)
    room = (20 - 8) * GIB  # a 20 GiB card less 8 of working memory: not every expert fits
    best = needs.largest_budget(20, 65536, 8)
    assert needs.device_bytes(best, 65536) <= room < needs.device_bytes(best + 1, 65536)
    assert needs.largest_budget(DEVICES["H200 (141 GB)"], 65536, 8) == 0  # every expert


def test_the_mtp_layer_speculating_puts_its_dense_part_on_the_device_and_its_experts_in_the_pool(
        capsys):
    """GLM-4.5-Air's MTP layer (bf16): its 128 routed experts of 4096 x 1408 are the layer's bytes
    less its dense part; speculating they join the host pool as one more MoE layer in the format
    held (MXFP4 here), and only the dense part goes to the device."""
    needs = Needs("glm45-air", "mxfp4")
    assert needs.mtp_bytes - needs.mtp_dense_bytes == 128 * 3 * 4096 * 1408 * 2
    assert 0 < needs.mtp_dense_bytes < GIB
    assert needs.mtp_pool_bytes == 128 * needs.expert_bytes
    assert Needs("qwen3-30b", "mxfp4").mtp_pool_bytes == 0  # no MTP layer kept
    main(["--shape", "glm45-air"])
    assert "0.30 GiB of it on the device" in capsys.readouterr().out


def test_a_shape_without_published_figures_is_named(capsys):
    with pytest.raises(SystemExit, match="--shape glm-tiny"):
        Needs("glm-tiny", "mxfp4")
    main(["--shape", "qwen3-30b", "--budget-gib", "4"])
    out = capsys.readouterr().out
    assert "6,144 routed experts" in out and "budget_gib = 4: 4 -> 1,713 experts" in out
