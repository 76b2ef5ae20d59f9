"""Shared checks of a family's declared params (DESIGN.md rule 2) and of the header-first
checkpoint checks (rule 6)."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from tidejax.checkpoint.safetensors_io import SafetensorsFile
from tidejax.models.base import init, nbytes
from tidejax.residency.state import all_resident_state


def check_forward_on_declared(model, declared, expert_specs, n_moe: int, args: tuple,
                              extra: tuple = ()) -> None:
    """The forward reads every declared param and runs on params from init(declared) to finite
    logits. (The modules declare their params from the same spec builders, base.declare: flax
    fails on a param a module reads that is missing or of another shape; a declared param no
    module reads would be loaded for nothing.) The model is called as (*args, experts, *extra)."""
    params = init(declared, jax.random.key(2))
    assert nbytes(declared) == sum(a.nbytes for a in jax.tree.leaves(params))
    experts = all_resident_state(init(expert_specs, jax.random.key(1)), n_moe)
    traced = jax.jit(model.apply).trace({"params": params}, *args, experts, *extra)
    jaxpr = traced.jaxpr.jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    paths = param_paths(params)  # the first invars are the params' leaves, in this order
    unread = [path for path, v in zip(paths, jaxpr.invars) if id(v) not in read]
    assert not unread, f"declared params the forward never reads: {unread}"
    logits = traced.lower().compile()({"params": params}, *args, experts, *extra)[0]
    assert bool(jnp.isfinite(logits).all())


def param_paths(tree) -> list[tuple]:
    return [tuple(k.key for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def forbid_data_reads(monkeypatch) -> None:
    """Any read of tensor data (not headers) fails the test."""
    def no_data(self, name):
        raise AssertionError(f"tensor data read before the checks: {name}")
    monkeypatch.setattr(SafetensorsFile, "view", no_data)


def edited_copy(src: Path, out: Path, edit) -> Path:
    """A copy of checkpoint folder `src` (one model.safetensors) at `out`, its tensors changed by
    edit(name -> array dict) in place (read through SafetensorsFile: safetensors.numpy cannot
    read e8m0)."""
    shutil.copytree(src, out)
    f = SafetensorsFile(out / "model.safetensors")
    tensors = {name: np.array(f.view(name)) for name in f.tensors}
    del f
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


def check_dense_dtypes(specs, keeps_float32) -> None:
    """Dense params declared for a bfloat16 model: bfloat16, but the leaves whose path (a tuple
    of names) `keeps_float32` says stay float32 (what the reference keeps in float32) and integer
    tables; and some of each."""
    dtypes = {tuple(k.key for k in path): jnp.dtype(spec.dtype) for path, spec
              in jax.tree_util.tree_flatten_with_path(specs)[0]}
    for path, dtype in dtypes.items():
        if jnp.issubdtype(dtype, jnp.integer):
            continue
        want = jnp.float32 if keeps_float32(path) else jnp.bfloat16
        assert dtype == want, (path, dtype)
    assert {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)} <= set(dtypes.values())
