"""The one sharding table (DESIGN.md rule 3): logical axes -> mesh axes, and every placement.

Every param, KV page, bank and pool leaf names the logical axis of each dimension
(tidejax.models.base.AXES); `RULES` maps those names to the mesh's ("data", "tensor") axes, and
the functions here are the only place anything is put on a device. One device is a 1x1 mesh.
The process has no mesh: a loaded model holds its own (`tensor_mesh(tensor)`, from [distributed]
tensor_parallel) and runs its loading and its device calls `on_mesh(mesh)`, which every
placement and `over_tensor` given no mesh reads (this thread only, inside the block; else 1x1):
a thread the block starts starts without it, so what places from threads is given the mesh.

    mesh = tensor_mesh(4)                               # 1x4 (0: every device of every process)
    with on_mesh(mesh): ...                             # placements given no mesh use it here
    spec(("heads", "embed"))                            # P("tensor", None): the table
    sharding(("heads", "embed"))                        # NamedSharding(mesh, P()) on a 1x1 mesh
    put(params, axes_tree)                              # device_put leaf by leaf
    replicated(counters)                                # leaves without a declaration
    put(pool, pool_axes, memory="host")                 # pinned_host where the backend has it
    host_buffer(pool["down"])                           # numpy over a host leaf's own bytes
    shard_buffers(pool["down"])                         # the same, of each local shard
    local_indices(shape, axes)                          # where each local shard lies
    from_host(to_host(saved))                           # a tree to host memory and back, where
                                                        # each process holds its own shards
    host_rows(leaf, i, i + 1), stack_rows(leaves, n)    # a page of it; pages stacked again
    agree_min(counts, mesh)                             # the least over the processes
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import functools
import logging

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from tidejax.errors import ConfigError

log = logging.getLogger("tidejax")

MESH_AXES = ("data", "tensor")

# logical axis -> mesh axis (None: never split). "tensor" splits attention heads and every
# intermediate (dense, shared and routed experts: the bank's gate_up rows, see
# tidejax.contract for the layout that split needs); the rest stays whole for now.
RULES: dict[str, str | None] = {
    "vocab": None, "embed": None, "heads": "tensor", "q_lora": None, "kv_lora": None,
    "rope": None, "ffw": "tensor", "experts": None, "slots": None, "pages": None, "page": None,
}

# the mesh of the innermost on_mesh block of this thread (a context variable: a new thread starts
# with none); None: 1x1
_scoped: contextvars.ContextVar[jax.sharding.Mesh | None] = contextvars.ContextVar(
    "tidejax_mesh", default=None)


def make_mesh(data: int = 1, tensor: int = 1) -> jax.sharding.Mesh:
    """A (data, tensor) mesh over the first data * tensor devices present."""
    devices = jax.devices()
    if data * tensor > len(devices):
        raise ValueError(f"a {data}x{tensor} mesh needs {data * tensor} devices; "
                         f"{len(devices)} present")
    return jax.make_mesh((data, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 2,
                         devices=devices[:data * tensor])


@functools.cache
def _one_device() -> jax.sharding.Mesh:
    return make_mesh()


def tensor_mesh(tensor: int) -> jax.sharding.Mesh:
    """A 1 x `tensor` mesh (0: every device, of every process). A mesh of several processes must
    hold every device: each process runs the same steps on its shards."""
    devices = len(jax.devices())
    tensor = tensor or devices
    if tensor > devices:
        raise ValueError(f"distributed.tensor_parallel = {tensor}: only {devices} devices present")
    if jax.process_count() > 1 and tensor != devices:
        raise ValueError(f"distributed.tensor_parallel = {tensor}: a mesh over "
                         f"{jax.process_count()} processes must hold all {devices} devices")
    return _one_device() if tensor == 1 else make_mesh(tensor=tensor)


@contextlib.contextmanager
def on_mesh(mesh: jax.sharding.Mesh):
    """Inside the block (on this thread), placements and over_tensor given no mesh use `mesh`;
    the mesh before it after."""
    token = _scoped.set(mesh)
    try:
        yield mesh
    finally:
        _scoped.reset(token)


def current_mesh() -> jax.sharding.Mesh:
    """The mesh of the innermost on_mesh block on this thread, else 1x1 on the first device."""
    return _scoped.get() or _one_device()


def tensor_size(mesh=None) -> int:
    """How many ways "tensor" splits (1: no tensor parallelism)."""
    return (mesh or current_mesh()).shape["tensor"]


def process_count(mesh=None) -> int:
    """How many processes hold the mesh's devices (1: every device is this process's)."""
    return len({device.process_index for device in (mesh or current_mesh()).devices.flat})


def spec(axes) -> PartitionSpec:
    """PartitionSpec of a leaf whose dimensions have logical `axes` (None: not split)."""
    return PartitionSpec(*(None if a is None else RULES[a] for a in axes))


def _on(mesh, axes) -> PartitionSpec:
    """spec(axes) naming only the mesh axes that split (size > 1), trailing Nones dropped: on a
    1x1 mesh every leaf is P(), as a jitted step returns it, so a step compiles once, not twice."""
    names = [a if a is not None and mesh.shape[a] > 1 else None for a in spec(axes)]
    while names and names[-1] is None:
        names.pop()
    return PartitionSpec(*names)


def host_memory_kind(mesh=None) -> str | None:
    """'pinned_host' where the mesh's devices have it (GPU, recent CPU backends), else None."""
    kinds = {m.kind for m in (mesh or current_mesh()).devices.flat[0].addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def sharding(axes, mesh=None) -> NamedSharding:
    """The device sharding of a leaf with logical `axes`."""
    mesh = mesh or current_mesh()
    return NamedSharding(mesh, _on(mesh, axes))


def host_sharding(axes, mesh=None) -> NamedSharding:
    """The sharding of a leaf with logical `axes` in host memory the devices read inside a jit
    (pinned_host where available; the devices' default memory otherwise, with a warning)."""
    mesh = mesh or current_mesh()
    kind = host_memory_kind(mesh)
    if kind is None:
        log.warning("devices %s have no pinned_host memory: host pools stay in their default "
                    "memory", mesh.devices.flat[0])
    return NamedSharding(mesh, _on(mesh, axes), memory_kind=kind)


def put(tree, axes_tree, mesh=None, memory: str = "device"):
    """device_put of each leaf of `tree` by the logical axes of the matching leaf of `axes_tree`
    (a tuple per leaf: `tree` is a prefix of `axes_tree`); memory "host" puts it where
    host_sharding says, in buffers of its own (see _own)."""
    mesh = mesh or current_mesh()
    place = host_sharding if memory == "host" else sharding
    jax.tree_util.tree_map_with_path(lambda path, leaf, axes: _check_split(path, leaf, axes, mesh),
                                     tree, axes_tree)
    placed = jax.tree.map(lambda leaf, axes: _placed(leaf, place(axes, mesh)), tree, axes_tree)
    return jax.tree.map(_own, placed, tree) if memory == "host" else placed


def _placed(leaf, where: NamedSharding) -> jax.Array:
    """`leaf` at `where`. Across processes a numpy leaf is placed shard by shard from this
    process's own copy (every process reads the same checkpoint): device_put would first compare
    the whole array across the processes, over the network."""
    if isinstance(leaf, np.ndarray) and not where.is_fully_addressable:
        return jax.make_array_from_callback(leaf.shape, where, lambda index: np.asarray(leaf[index]))
    return jax.device_put(leaf, where)


def _check_split(path, leaf, axes, mesh) -> None:
    """A ConfigError naming the leaf where a dimension the mesh splits does not divide by it (a
    tiny MXFP4 expert has fewer 32-wide blocks than devices), instead of jax's placement error."""
    for dim, (size, name) in enumerate(zip(np.shape(leaf), _on(mesh, axes))):
        if name is not None and size % mesh.shape[name]:
            raise ConfigError(
                f"'distributed.tensor_parallel' = {mesh.shape[name]} splits "
                f"{jax.tree_util.keystr(path) or 'a leaf'} along its {axes[dim]} axis "
                f"(dimension {dim}), of {size}: not a multiple of {mesh.shape[name]}")


def _own(placed: jax.Array, source):
    """`placed` in a buffer of its own where it aliases its numpy `source` (the CPU backend does
    that for aligned arrays): a step cannot donate memory it does not own, so the first donating
    step would copy the leaf elsewhere, and a host pool must stay put (tidejax.residency.cpu
    reads it in place)."""
    if (isinstance(source, np.ndarray) and source.size and len(placed.addressable_shards) == 1
            and next(iter(placed.devices())).platform == "cpu"
            and placed.unsafe_buffer_pointer() == source.ctypes.data):
        return jax.device_put(placed, placed.sharding, may_alias=False)
    return placed


def host_buffer(leaf: jax.Array) -> np.ndarray:
    """A writable numpy view of the bytes of `leaf`, a single-device array in host memory (put
    with memory "host"), in place: no copy, and no reference held on the buffer (valid while
    `leaf` lives). The loader fills a host pool through it and the `cpu` miss policy reads one.
    Checked by a probe: bytes written through the view must be what jax reads of the leaf's first
    and last row. ValueError where the backend gives no such view."""
    if len(leaf.addressable_shards) != 1 or len(leaf.sharding.device_set) != 1:
        raise ValueError(f"a host buffer is read in place on one device; this leaf is sharded "
                         f"over {len(leaf.sharding.device_set)}")
    on_cpu = next(iter(leaf.devices())).platform == "cpu"  # there every memory is the host's
    if not leaf.size or not (on_cpu or leaf.sharding.memory_kind in ("pinned_host",
                                                                      "unpinned_host")):
        raise ValueError(f"no host buffer: the leaf is in {leaf.sharding.memory_kind} memory")
    leaf.block_until_ready()  # the put is asynchronous: its bytes may still be on their way
    try:
        buffer = (ctypes.c_char * leaf.nbytes).from_address(leaf.unsafe_buffer_pointer())
    except Exception as e:  # noqa: BLE001 (a backend without raw host pointers)
        raise ValueError(f"no host buffer: {e}") from None
    view = np.frombuffer(buffer, leaf.dtype).reshape(leaf.shape)
    ends = [0, leaf.shape[0] - 1] if leaf.ndim else []
    saved = [view[i].copy() for i in ends]
    try:
        for i in ends:  # a probe of distinct bytes in each end row, each in 1..0x7B: no NaN
            # or subnormal in any float dtype, which a backend may canonicalize as it reads
            view[i].reshape(-1).view(np.uint8)[:] = (
                (np.arange(view[i].nbytes) * 7 + i) % 0x7B + 1).astype(np.uint8)
        if not all(np.array_equal(np.asarray(_read_row(leaf, i)).view(np.uint8),
                                  view[i].view(np.uint8)) for i in ends):
            raise ValueError("no host buffer: its bytes are not laid out as jax reads them")
    finally:
        for i, row in zip(ends, saved):
            view[i] = row
    return view


def shard_buffers(leaf: jax.Array) -> list[tuple[tuple, np.ndarray]]:
    """host_buffer of each of this process's shards of `leaf`, in the order of their devices'
    ids: (its index in `leaf`, a slice per dimension; the view), so that a leaf split over
    devices or processes is filled in place too."""
    return [(shard.index, host_buffer(shard.data))
            for shard in sorted(leaf.addressable_shards, key=lambda shard: shard.device.id)]


def local_indices(shape: tuple, axes, mesh=None) -> list[tuple]:
    """The index in a leaf of `shape` and logical `axes` (a slice per dimension) of each of this
    process's shards, in the order of their devices' ids (shard_buffers' order)."""
    where = sharding(axes, mesh).addressable_devices_indices_map(tuple(shape))
    return [where[device] for device in sorted(where, key=lambda device: device.id)]


@jax.jit
def _read_row(leaf: jax.Array, i) -> jax.Array:
    return to_device(jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False))


def replicated(tree, mesh=None):
    """device_put of every leaf whole on every device (counters, rowmaps, tokens: leaves without
    a declaration), committed as a step's outputs are."""
    where = NamedSharding(mesh or current_mesh(), PartitionSpec())
    return jax.tree.map(lambda leaf: _placed(leaf, where), tree)


@dataclasses.dataclass(frozen=True, eq=False)
class LocalShards:
    """What this process holds of an array split over several processes' devices (KV pages split
    by heads): its global shape and sharding, and each of this process's shards on the host, in
    the order of their devices' ids."""

    shape: tuple
    sharding: jax.sharding.Sharding
    shards: tuple  # ((device, np.ndarray), ...)

    @property
    def nbytes(self) -> int:
        return sum(data.nbytes for _, data in self.shards)


def to_host(tree):
    """Each leaf of `tree` in host memory: numpy where this process can read it whole (one
    process, or the same on every device), else this process's LocalShards (only its peers hold
    the rest). `from_host` puts it back."""
    def one(leaf: jax.Array):
        if leaf.is_fully_addressable or leaf.is_fully_replicated:
            return leaf
        shards = sorted(leaf.addressable_shards, key=lambda shard: shard.device.id)
        return LocalShards(leaf.shape, leaf.sharding, tuple(
            (shard.device, np.asarray(shard.data)) for shard in shards))
    return jax.device_get(jax.tree.map(one, tree))  # the whole leaves' copies started together


def from_host(tree):
    """`to_host`'s tree as device arrays again: LocalShards on their devices as they were; numpy
    leaves as they are (a jitted call takes them)."""
    def one(leaf):
        if not isinstance(leaf, LocalShards):
            return leaf
        return jax.make_array_from_single_device_arrays(
            leaf.shape, leaf.sharding, [jax.device_put(data, device) for device, data in leaf.shards])
    return jax.tree.map(one, tree, is_leaf=lambda leaf: isinstance(leaf, LocalShards))


def to_pinned(trees: list, shardings) -> list:
    """Each tree of `trees` (a page of the KV pool: device arrays, or numpy read from disk) copied
    into pinned host memory by `shardings`, one tree of them for all (runtime/runner.py
    pinned_pages); the copies are started, not waited for."""
    return jax.device_put(trees, [shardings] * len(trees))


def host_rows(leaf, start: int, stop: int):
    """Rows start:stop of a `to_host` leaf's first axis, copied (numpy, or this process's
    LocalShards of them: the prompt cache keeps a page of a read sequence), where every shard
    holds that axis whole (KV pages are split by heads, never by page)."""
    if not isinstance(leaf, LocalShards):
        return leaf[start:stop].copy()
    if any(data.shape[0] != leaf.shape[0] for _, data in leaf.shards):
        raise ValueError(f"rows of a leaf of shape {leaf.shape} split along its first axis")
    return LocalShards((stop - start,) + tuple(leaf.shape[1:]), leaf.sharding, tuple(
        (device, data[start:stop].copy()) for device, data in leaf.shards))


def stack_rows(leaves, length: int):
    """`to_host` leaves of one process (all numpy, or all LocalShards on the same devices)
    concatenated along their first axis and padded with zeros to `length` rows."""
    def padded(parts) -> np.ndarray:
        rows = np.concatenate(parts)
        return np.concatenate([rows, np.zeros((length - len(rows),) + rows.shape[1:],
                                              rows.dtype)])
    first = leaves[0]
    if not isinstance(first, LocalShards):
        return padded(leaves)
    return LocalShards((length,) + tuple(first.shape[1:]), first.sharding, tuple(
        (device, padded([leaf.shards[i][1] for leaf in leaves]))
        for i, (device, _) in enumerate(first.shards)))


def host_shapes(tree):
    """What `to_host` gives for a tree of jax.ShapeDtypeStruct with shardings (a leaf without one
    is whole): a ShapeDtypeStruct where this process holds the leaf whole, else LocalShards of
    ShapeDtypeStruct shards (the prompt cache's disk tier checks its files against it)."""
    def one(spec):
        where = spec.sharding
        whole = jax.ShapeDtypeStruct(spec.shape, spec.dtype)
        if where is None or where.is_fully_addressable or where.is_fully_replicated:
            return whole
        shard = jax.ShapeDtypeStruct(where.shard_shape(spec.shape), spec.dtype)
        return LocalShards(tuple(spec.shape), where, tuple(
            (device, shard) for device in sorted(where.addressable_devices, key=lambda d: d.id)))
    return jax.tree.map(one, tree)


def agree_min(values: np.ndarray, mesh) -> np.ndarray:
    """The elementwise minimum of `values` (int32, one shape on every process) over the
    processes of `mesh`: a collective, so every process calls it with its own values at the same
    point of its work; in one process, `values` itself."""
    values = np.asarray(values, np.int32)
    if process_count(mesh) == 1:
        return values
    where = NamedSharding(mesh, PartitionSpec(MESH_AXES))
    every = jax.make_array_from_single_device_arrays(
        (mesh.devices.size,) + values.shape, where,
        [jax.device_put(values[None], device) for device in mesh.local_devices])
    return np.asarray(_minimum(every, mesh).addressable_data(0))


@functools.partial(jax.jit, static_argnums=1)
def _minimum(every: jax.Array, mesh) -> jax.Array:
    return jax.lax.with_sharding_constraint(every.min(axis=0), NamedSharding(mesh, PartitionSpec()))


def over_tensor(fn, in_axes: tuple, out_axes: tuple, mesh=None):
    """`fn` on each device's shards where the mesh splits "tensor" (shard_map; a Pallas kernel
    cannot be partitioned by XLA), else `fn` itself: one code path. in_axes: per argument, the
    logical axes of its leaves (a pytree prefix of tuples) or None (whole on every device).
    `fn` returns a tuple; out_axes: per output, "sum" (a partial sum over "tensor": psum'd),
    None (the same on every device) or its logical axes (each device's shard of it)."""
    mesh = mesh or current_mesh()
    if tensor_size(mesh) == 1:
        return fn

    def local(*args):
        return tuple(jax.lax.psum(out, "tensor") if axes == "sum" else out
                     for out, axes in zip(fn(*args), out_axes, strict=True))

    def specs(axes):
        if axes is None or axes == "sum":
            return PartitionSpec()
        return jax.tree.map(lambda a: _on(mesh, a), axes, is_leaf=lambda a: isinstance(a, tuple))
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs(a) for a in in_axes),
                         out_specs=tuple(specs(a) for a in out_axes), check_vma=False)


def to_device(x):
    """Inside a jit: `x` (read from a host pool) moved to device memory, keeping its sharding."""
    return jax.device_put(x, jax.memory.Space.Device)
