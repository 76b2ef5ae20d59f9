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


def run_interpreted(kernel, grid: tuple, *args, **meta) -> None:
    """Runs the @triton.jit `kernel` over `grid` in Triton's interpreter on host tensors. The
    @triton.jit functions its module names are interpreted too while it runs: outside
    TRITON_INTERPRET=1 a jitted function refuses a call from Python, and a kernel calling
    another's helper (sinkhorn_kernel.sinkhorn_block) would fail."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    scope = kernel.fn.__globals__  # the interpreter adds its own names here: restore ours only
    jitted = {name: f for name, f in scope.items()
              if isinstance(f, JITFunction) and f is not kernel}
    scope.update({name: InterpretedFunction(f.fn) for name, f in jitted.items()})
    try:
        InterpretedFunction(kernel.fn)[grid](*args, **meta)
    finally:
        scope.update(jitted)
