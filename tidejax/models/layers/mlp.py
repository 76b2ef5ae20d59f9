"""The SwiGLU MLP: dense layers and shared experts, clamped where a family asks (DeepSeek-V4 /
V4.1's swiglu_limit, the same clamp the routed experts' kernel applies)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tidejax.contract import swiglu  # the routed experts' kernels' own definition
from tidejax.models.layers.linear import Linear, linear_specs


def swiglu_specs(hidden: int, intermediate: int, dtype) -> dict:
    """SwiGLU's declared params: gate_proj, up_proj [f, d] and down_proj [d, f]."""
    up = linear_specs(intermediate, hidden, ("ffw", "embed"), dtype)
    return {"gate_proj": up, "up_proj": up,
            "down_proj": linear_specs(hidden, intermediate, ("embed", "ffw"), dtype)}


class SwiGLU(nn.Module):
    """down(swiglu(gate(x), up(x))): the dense MLP and the shared experts."""

    intermediate: int
    dtype: jnp.dtype = jnp.float32
    swiglu_limit: float = 0.0  # > 0: gate <= limit, |up| <= limit
    act_dtype: Any = None  # the dtype swiglu is computed in (None: the input's)

    @nn.compact
    def __call__(self, x):
        gate = Linear(self.intermediate, self.dtype, name="gate_proj")(x)
        up = Linear(self.intermediate, self.dtype, name="up_proj")(x)
        if self.act_dtype is not None:
            gate, up = gate.astype(self.act_dtype), up.astype(self.act_dtype)
        act = swiglu(gate, up, self.swiglu_limit).astype(x.dtype)
        return Linear(x.shape[-1], self.dtype, name="down_proj")(act)
