"""Arrays in and out of Triton's interpreter, which runs our Triton kernels on the host off the
GPU (tests) on torch tensors: numpy has no bf16, so bf16 crosses as its bits. `launch` runs a
kernel there or through jax-triton on the GPU."""

from __future__ import annotations

import functools

import jax
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


def _interpreted(*arrays, kernel, grid, scalars, out_shape, meta):
    """`launch`'s host callback: the arrays as torch tensors, the outputs zeroed."""
    import torch

    outs = [torch.zeros(s.shape, dtype=torch.bfloat16 if s.dtype == jnp.bfloat16
                        else getattr(torch, np.dtype(s.dtype).name)) for s in out_shape]
    run_interpreted(kernel, grid, *map(to_torch, arrays), *scalars, *outs, **meta)
    return tuple(map(to_numpy, outs))


def launch(kernel, grid: tuple, arrays: tuple, scalars: tuple, out_shape: tuple, meta: dict, *,
           num_warps: int, interpret: bool):
    """`kernel`(*arrays, *scalars, *outputs, **meta) over `grid` -> the outputs (jax.Arrays of
    `out_shape`, a tuple of ShapeDtypeStructs): through jax-triton on the GPU, through Triton's
    interpreter on the host (jax.pure_callback) with `interpret`, where num_warps has no use."""
    if interpret:
        return jax.pure_callback(
            functools.partial(_interpreted, kernel=kernel, grid=grid, scalars=scalars,
                              out_shape=out_shape, meta=meta), out_shape, *arrays)
    import jax_triton

    return tuple(jax_triton.triton_call(*arrays, *scalars, kernel=kernel, out_shape=out_shape,
                                        grid=grid, num_warps=num_warps, **meta))
