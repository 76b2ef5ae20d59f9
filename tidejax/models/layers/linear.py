"""The dense projection as Hugging Face stores it, and the matmul precision the models use."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tidejax.models.base import ParamSpec

HIGHEST = jax.lax.Precision.HIGHEST


def dense_init(stddev: float = 0.02):
    return nn.initializers.normal(stddev)


def linear_specs(out: int, inn: int, axes: tuple[str, str], dtype, bias: bool = False) -> dict:
    """Linear's declared params: {"weight": [out, in]} (`axes` naming (out, in)), and with
    `bias` {"bias": [out]} (zeros)."""
    specs = {"weight": ParamSpec((out, inn), dtype, axes)}
    if bias:
        specs["bias"] = ParamSpec((out,), dtype, axes[:1], init="zeros")
    return specs


class Linear(nn.Module):
    """y = x @ W^T (+ b) with W stored [out, in] as in Hugging Face checkpoints."""

    features: int
    dtype: jnp.dtype = jnp.float32
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", dense_init(), (self.features, x.shape[-1]), self.dtype)
        y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), precision=HIGHEST)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype).astype(y.dtype)
        return y
