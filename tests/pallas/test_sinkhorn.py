"""mHC's Sinkhorn kernel (pallas.sinkhorn, Triton; its interpreter on the CPU) against the jnp
reference, and the reference against the property the math promises (rows and columns that sum
to ~1), computed in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tidejax import ops
from tidejax.pallas import sinkhorn as forms


@pytest.mark.parametrize("hc,iters", [(4, 20), (3, 10), (2, 1), (4, 7)])
def test_the_kernel_computes_the_reference(rng, hc, iters):
    """Shapes whose matrices are not a multiple of the kernel's block, hc padded (3) and not,
    large logits (the softmax's max subtracted)."""
    logits = jnp.asarray(rng.normal(0, 4, (5, 7, hc, hc)), jnp.float32)
    want = forms.sinkhorn_reference(logits, hc_eps=1e-6, iters=iters)
    got = jax.jit(lambda x: ops.sinkhorn(x, hc_eps=1e-6, iters=iters, impl="pallas"))(logits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)


def test_the_reference_is_doubly_stochastic(rng):
    """Columns sum to 1 after each iteration (its last pass), rows approach 1 as iterations go (after 20
    ten times closer than after 2); the first pass is a softmax over k (numpy's)."""
    logits = rng.normal(0, 2, (64, 4, 4)).astype(np.float32)
    combs = [np.asarray(forms.sinkhorn_reference(jnp.asarray(logits), hc_eps=1e-6, iters=n))
             for n in (2, 20)]
    for comb in combs:
        np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)
    rows_off = [np.abs(comb.sum(-1) - 1).max() for comb in combs]
    assert rows_off[1] < rows_off[0] / 10
    softmax = np.exp(logits - logits.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    first = np.asarray(forms.sinkhorn_reference(jnp.asarray(logits), hc_eps=0.0, iters=1))
    np.testing.assert_allclose(first, softmax / softmax.sum(-2, keepdims=True), rtol=1e-5)


def test_auto_takes_the_kernel_only_where_it_fits():
    """"auto" takes the kernel on a GPU, the reference elsewhere; the kernel takes square
    float32 blocks up to MAX_HC."""
    x = jnp.zeros((2, 4, 4), jnp.float32)
    want = "pallas" if jax.default_backend() == "gpu" else "reference"
    assert ops.dispatch.choose_impl("sinkhorn", "auto", lambda: forms.triton_supports(x)) == want
    assert not forms.triton_supports(jnp.zeros((2, 9, 9), jnp.float32))
    assert not forms.triton_supports(x.astype(jnp.bfloat16))
    assert not forms.triton_supports(jnp.zeros((2, 4, 3), jnp.float32))
