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
from tidejax.models.base import abstract, init, nbytes
from tidejax.residency.state import all_resident_state


def check_declaration(make_model, param_specs, expert_specs, n_moe: int, args: tuple,
                      extra: tuple = ()):
    """The declaration and the flax modules cannot drift: model.init's params tree is the
    declared one (names, shapes, dtypes) in bfloat16 and float32, and the model runs on params
    from init(specs). make_model(dtype), param_specs(dtype), expert_specs(dtype); the model is
    called as (*args, experts, *extra). Returns the float32 declaration."""
    pool = abstract(expert_specs(jnp.float32))
    for dtype in (jnp.bfloat16, jnp.float32):
        model, declared = make_model(dtype), param_specs(dtype)
        traced = jax.eval_shape(lambda p: model.init(
            jax.random.key(0), *args, all_resident_state(p, n_moe), *extra)["params"], pool)
        assert traced == abstract(declared)
    params = init(declared, jax.random.key(2))
    assert nbytes(declared) == sum(a.nbytes for a in jax.tree.leaves(params))
    experts = all_resident_state(init(expert_specs(jnp.float32), jax.random.key(1)), n_moe)
    logits = jax.jit(model.apply)({"params": params}, *args, experts, *extra)[0]
    assert bool(jnp.isfinite(logits).all())
    return declared


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
