"""The SwiGLU MLP: dense layers and shared experts."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tidejax.models.layers.linear import Linear, linear_specs


def swiglu_specs(hidden: int, intermediate: int, dtype) -> dict:
    """SwiGLU's declared params: gate_proj, up_proj [f, d] and down_proj [d, f]."""
    up = linear_specs(intermediate, hidden, ("ffw", "embed"), dtype)
    return {"gate_proj": up, "up_proj": up,
            "down_proj": linear_specs(hidden, intermediate, ("embed", "ffw"), dtype)}


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared experts."""

    intermediate: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        gate = Linear(self.intermediate, self.dtype, name="gate_proj")(x)
        up = Linear(self.intermediate, self.dtype, name="up_proj")(x)
        return Linear(x.shape[-1], self.dtype, name="down_proj")(jax.nn.silu(gate) * up)
