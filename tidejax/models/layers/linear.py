"""The dense projection as Hugging Face stores it (float, or FP8 values with block scales kept
as stored), and the matmul precision the models use."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tidejax.models.base import ParamSpec, declare
from tidejax.ops import fp8_block_matmul

HIGHEST = jax.lax.Precision.HIGHEST


def lm_logits(x, head, at=None):
    """The output head: x [b, t, d] -> float32 logits [b, t, vocab]; with `at` [b] int32, only
    at position at[row] of each row: [b, 1, vocab] (a prompt chunk samples one position, and the
    head over all of a 2,048-token chunk costs ~2.7 TFLOP in float32)."""
    if at is not None:
        x = jnp.take_along_axis(x, at[:, None, None], 1)
    return jnp.einsum("btd,vd->btv", x.astype(jnp.float32), head.astype(jnp.float32),
                      precision=HIGHEST)


def embedding_specs(vocab: int, hidden: int, dtype, tied: bool) -> dict:
    """The token embedding's declared params: {"embed": [vocab, hidden]} (N(0, 1)), and unless
    `tied` (the head is the embedding) the output head {"lm_head": [vocab, hidden]}."""
    specs = {"embed": ParamSpec((vocab, hidden), dtype, ("vocab", "embed"), stddev=1.0)}
    if not tied:
        specs["lm_head"] = ParamSpec((vocab, hidden), dtype, ("vocab", "embed"))
    return specs


def linear_specs(out: int, inn: int, axes: tuple[str, str], dtype, bias: bool = False) -> dict:
    """Linear's declared params: {"weight": [out, in]} (`axes` naming (out, in)), and with
    `bias` {"bias": [out]} (zeros)."""
    specs = {"weight": ParamSpec((out, inn), dtype, axes)}
    if bias:
        specs["bias"] = ParamSpec((out,), dtype, axes[:1], init="zeros")
    return specs


class Linear(nn.Module):
    """y = x @ W^T (+ b) with W stored [out, in] as in Hugging Face checkpoints. Params declared
    FP8 (a "scale" beside the "weight": models.loading.fp8_specs) compute through
    fp8_block_matmul, the block read from the shapes."""

    features: int
    dtype: jnp.dtype = jnp.float32
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):
        p = declare(self, linear_specs(self.features, x.shape[-1], (None, None), self.dtype,
                                       self.use_bias))
        w = p["weight"]
        if self.has_variable("params", "scale"):
            scales = self.get_variable("params", "scale")
            block = (w.shape[0] // scales.shape[0], w.shape[1] // scales.shape[1])
            y = fp8_block_matmul(x, w, scales, block)
        else:
            y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), precision=HIGHEST)
        if self.use_bias:
            y = y + p["bias"].astype(y.dtype)
        return y
