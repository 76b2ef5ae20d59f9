"""The banded window attention (a chunk longer than the ring) against the dense [t, W-1+t] form
it replaces, through window_keys' own layout and mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tidejax.models.layers import latent_window as lw

W = 8  # sliding window: a ring of W - 1 = 7 slots
H, K = 3, 16


def _inputs(starts, t, seed=0):
    rng = np.random.default_rng(seed)
    b = len(starts)
    q = jnp.asarray(rng.standard_normal((b, t, H, K)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((b, t, K)), jnp.float32)
    ring = jnp.asarray(rng.standard_normal((b, W - 1, K)), jnp.float32)
    positions = jnp.asarray(np.array(starts)[:, None] + np.arange(t), jnp.int32)
    n_valid = jnp.full((b,), t, jnp.int32)
    keys, mask, _ = lw.window_keys(ring, kv, positions, n_valid, W)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return q, keys, mask, sink, rng


def _dense(*args):
    return lw._attend_dense(*args)


@pytest.mark.parametrize("t", [8, 14, 23])
@pytest.mark.parametrize("starts", [[0], [3, 40]])
def test_banded_equals_dense_window_only(starts, t):
    q, keys, mask, sink, _ = _inputs(starts, t)
    got = lw.attend_with_sink(q, keys, mask, sink)
    np.testing.assert_allclose(got, _dense(q, keys, mask, sink, None, None), atol=1e-5)


def test_banded_equals_dense_with_per_query_entries():
    q, keys, mask, sink, rng = _inputs([5, 30], 19, seed=1)
    extra = jnp.asarray(rng.standard_normal((2, 19, 4, K)), jnp.float32)
    extra_mask = jnp.asarray(rng.random((2, 19, 4)) < 0.6)
    got = lw.attend_with_sink(q, keys, mask, sink, extra, extra_mask)
    np.testing.assert_allclose(got, _dense(q, keys, mask, sink, extra, extra_mask), atol=1e-5)


def test_banded_equals_dense_with_shared_entries():
    q, keys, mask, sink, rng = _inputs([0, 64], 17, seed=2)
    extra = jnp.asarray(rng.standard_normal((2, 6, K)), jnp.float32)
    extra_mask = jnp.asarray(rng.random((2, 17, 6)) < 0.5)
    got = lw.attend_with_sink(q, keys, mask, sink, extra, extra_mask)
    np.testing.assert_allclose(got, _dense(q, keys, mask, sink, extra, extra_mask), atol=1e-5)


def test_banded_logits_are_a_band():
    """The banded path's logits are [t, 2(W-1)] per band, not [t, W-1+t]: it is the one taken."""
    q, keys, mask, sink, _ = _inputs([0], 21)
    text = jax.jit(lw.attend_with_sink).lower(q, keys, mask, sink).as_text()
    assert "3x3x7x14" in text and "1x3x21x28" not in text


def test_bfloat16_operands_run_bfloat16_dots_near_float32():
    """A bfloat16 model's attention: the dots take bfloat16 operands (accumulated in float32)
    and come within bfloat16's rounding of the float32 attention, banded or not."""
    for t in (5, 19):
        q, keys, mask, sink, rng = _inputs([3, 30], t, seed=3)
        extra = jnp.asarray(rng.standard_normal((2, t, 4, K)), jnp.float32)
        extra_mask = jnp.asarray(rng.random((2, t, 4)) < 0.6)
        want = lw.attend_with_sink(q, keys, mask, sink, extra, extra_mask)
        low = [a.astype(jnp.bfloat16) for a in (q, keys, extra)]
        args = (low[0], low[1], mask, sink, low[2], extra_mask)
        got = lw.attend_with_sink(*args)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)
        text = jax.jit(lw.attend_with_sink).lower(*args).as_text()
        dots = [line for line in text.splitlines() if "dot_general" in line]
        assert dots and all("bf16>" in line.split("->")[0] for line in dots), dots
