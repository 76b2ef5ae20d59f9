"""Declared params: a family's `weights.py` gives its params as a pytree of ParamSpec; the
abstract tree (for jax.eval_shape and the checkpoint table's shape checks), test init and memory
estimates all derive from that one declaration.

    specs = {"embed": ParamSpec((V, D), jnp.bfloat16, ("vocab", "embed"), stddev=1.0),
             "norm": {"weight": ParamSpec((D,), jnp.bfloat16, ("embed",), init="ones")}}
    abstract(specs)           # {"embed": ShapeDtypeStruct((V, D), bfloat16), ...}
    init(specs, key)          # random normal (stddev), ones or zeros, as each spec says
    nbytes(specs)             # V * D * 2 + D * 2
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Logical axis names, one per concept: every param, KV page, bank and pool axis is one of these
# (or None: never split); the sharding table (tidejax.parallel.RULES) maps them to mesh axes.
# rope: the rotary key width; slots: bank rows; pages, page: a KV pool's pages and their rows.
AXES = ("vocab", "embed", "heads", "q_lora", "kv_lora", "rope", "ffw", "experts", "slots",
        "pages", "page")
INITS = ("normal", "ones", "zeros")  # how `init` fills a param (normal: N(0, stddev**2))


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One param: its shape, dtype, the logical axis of each dimension, and its test init."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    init: str = "normal"
    stddev: float = 0.02

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "axes", tuple(self.axes))
        if len(self.axes) != len(self.shape):
            raise ValueError(f"ParamSpec{self.shape}: {len(self.axes)} axes {self.axes} "
                             f"for {len(self.shape)} dimensions")
        unknown = [a for a in self.axes if a is not None and a not in AXES]
        if unknown:
            raise ValueError(f"ParamSpec{self.shape}: unknown logical axes {unknown} "
                             f"(known: {', '.join(AXES)})")
        if self.init not in INITS:
            raise ValueError(f"ParamSpec{self.shape}: init {self.init!r} is not one of {INITS}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def abstract(specs):
    """The specs as a tree of jax.ShapeDtypeStruct (nothing allocated)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs)


def init(specs, key: jax.Array):
    """Arrays for the specs (tests, training from scratch): each leaf from its own key."""
    leaves, treedef = jax.tree.flatten(specs)
    keys = jax.random.split(key, max(len(leaves), 1))
    return treedef.unflatten([_init_leaf(s, k) for s, k in zip(leaves, keys)])


def _init_leaf(spec: ParamSpec, key: jax.Array) -> jax.Array:
    if spec.init == "ones":
        return jnp.ones(spec.shape, spec.dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, spec.dtype)
    return (spec.stddev * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)


def nbytes(specs) -> int:
    """Bytes the params take in their declared dtypes."""
    return sum(s.nbytes for s in jax.tree.leaves(specs))
