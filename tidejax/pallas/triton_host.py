"""Arrays in and out of Triton's interpreter, which runs our Triton kernels on the host off the
GPU (tests) on torch tensors: numpy has no bf16, so bf16 crosses as its bits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def to_torch(a: np.ndarray):
    """A host array as a writable torch tensor (bf16 through its bits)."""
    import torch

    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(np.array(a).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def to_numpy(t) -> np.ndarray:
    """A torch tensor as a numpy array (bf16 as jnp.bfloat16, through its bits)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()
