"""What the MoE kernels and their references agree on, in one place that imports no kernel: the
activation of the gate and up projections (the Pallas kernel, the jnp reference, the host
kernel's numpy fallback and, through residency/serve.py, the dense and shared-expert MLPs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def swiglu(g, u, swiglu_limit: float):
    """silu(g) * u of the gate and up projections, with g <= L and |u| <= L when swiglu_limit
    L > 0 (the reference's and the kernels' one definition; numpy in, numpy out: the host
    kernel's fallback, tidejax.residency.cpu)."""
    xp = np if isinstance(g, np.ndarray) else jnp
    if swiglu_limit > 0:
        g = xp.minimum(g, swiglu_limit)
        u = xp.clip(u, -swiglu_limit, swiglu_limit)
    if xp is np:
        with np.errstate(over="ignore"):  # exp(-g) = inf for g << 0: sigmoid 0, as wanted
            return g * (1 / (1 + np.exp(-g))) * u
    return g * jax.nn.sigmoid(g) * u
