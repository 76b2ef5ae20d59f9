"""The one sharding table (DESIGN.md rule 3): nothing but tidejax/parallel.py names a device or
places an array; one CPU device is a 1x1 mesh; a mesh holds only inside on_mesh, on its
thread; `put` places leaves by their logical axes; an engine loads and generates with every
param, page, bank and pool leaf placed through it."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tidejax
from tidejax import parallel
from tidejax.runtime.scheduler import GenerationRequest, TokenEvent
from tidejax.contract import expert_axes
from tidejax.models.base import AXES
from tidejax.models.deepseek_v3.weights import param_specs
from tidejax.residency.pool import host_pool
from tidejax.residency.state import all_resident_state, build_state

PACKAGE = Path(__file__).resolve().parents[1] / "tidejax"
PLACEMENTS = {"devices", "local_devices", "device_put", "memory", "SingleDeviceSharding"}


def _root(node) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def placements(path: Path) -> list[str]:
    """Uses of jax in `path` that name a device or place an array (jax.devices(),
    jax.device_put, jax.memory.Space, SingleDeviceSharding), as "file:line: name"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in PLACEMENTS and _root(node) == "jax":
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax"):
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: import {a.name}"
                      for a in node.names if a.name in PLACEMENTS]
    return found


def test_no_device_outside_parallel():
    wrong = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "parallel.py"
             for hit in placements(path)]
    assert not wrong, "raw device placement outside tidejax/parallel.py:\n" + "\n".join(wrong)
    assert placements(PACKAGE / "parallel.py")  # the check sees what it looks for


def test_every_logical_axis_has_one_rule():
    assert set(parallel.RULES) == set(AXES)
    assert set(parallel.RULES.values()) <= {None, *parallel.MESH_AXES}


def test_one_cpu_device_is_a_1x1_mesh():
    mesh = parallel.current_mesh()
    assert dict(mesh.shape) == {"data": 1, "tensor": 1}
    assert list(mesh.devices.flat) == jax.devices()[:1]
    too_many = len(jax.devices()) + 1
    with pytest.raises(ValueError, match=f"needs {too_many} devices"):
        parallel.make_mesh(tensor=too_many)


def test_local_shards_are_sliced_per_page_and_stacked_again():
    """This process's shards of a leaf split over processes (LocalShards, as to_host reads KV
    pages split by heads): a page of them is a copy (host_rows), pages stack again padded with
    zeros (stack_rows), as numpy leaves do; a leaf split along its first axis has no page of its
    own. In one process agree_min is the values themselves, and host_shapes a leaf whole."""
    device = jax.devices()[0]
    where = NamedSharding(parallel.make_mesh(), P(None, None, "tensor"))
    rows = np.arange(3 * 4 * 2, dtype=np.float32).reshape(3, 4, 2)  # [pages, page, heads here]
    leaf = parallel.LocalShards((3, 4, 4), where, ((device, rows),))  # the other 2 heads: a peer's
    page = parallel.host_rows(leaf, 1, 2)
    assert page.shape == (1, 4, 4) and page.shards[0][0] == device
    assert np.array_equal(page.shards[0][1], rows[1:2])
    assert not np.shares_memory(page.shards[0][1], rows)
    stacked = parallel.stack_rows([parallel.host_rows(leaf, 2, 3), page], 4)
    assert stacked.shape == (4, 4, 4) and stacked.sharding is where
    want = np.concatenate([rows[2:3], rows[1:2], np.zeros((2, 4, 2), np.float32)])
    assert np.array_equal(stacked.shards[0][1], want)
    assert np.array_equal(parallel.stack_rows([parallel.host_rows(rows, 2, 3),
                                               parallel.host_rows(rows, 1, 2)], 4), want)
    with pytest.raises(ValueError, match="split along its first axis"):
        parallel.host_rows(parallel.LocalShards((6, 4, 2), where, ((device, rows),)), 0, 1)
    values = np.array([[1, 0], [1, 1]], np.int32)
    assert parallel.agree_min(values, parallel.make_mesh()) is values
    spec = jax.ShapeDtypeStruct((1, 4, 4), np.float32, sharding=where)
    assert parallel.host_shapes({"k": spec}) == {"k": jax.ShapeDtypeStruct((1, 4, 4), np.float32)}


def test_a_mesh_holds_inside_its_block_on_its_thread_only():
    """on_mesh is no process state: placements given no mesh use it inside the block, on the
    thread that entered it; before, after and on another thread they use 1x1."""
    mine = jax.make_mesh((1, 1), parallel.MESH_AXES, devices=jax.devices()[:1])
    seen = []
    with parallel.on_mesh(mine):
        assert parallel.current_mesh() is mine
        assert parallel.replicated(np.zeros(2)).sharding.mesh is mine
        other = threading.Thread(target=lambda: seen.append(parallel.current_mesh()))
        other.start()
        other.join()
    assert seen == [parallel.current_mesh()] and seen[0] is not mine
    assert parallel.put(np.zeros(2), (None,)).sharding.mesh is not mine


def test_put_places_leaves_by_their_logical_axes():
    """The table maps heads to "tensor"; on a 1x1 mesh nothing splits, so every placement is
    P() (as jitted steps return their outputs: no second compilation)."""
    mesh = parallel.current_mesh()
    assert parallel.spec(("heads", "embed")) == P("tensor", None)
    assert parallel.spec(("experts", "ffw", "embed")) == P(None, "tensor", None)
    tree = {"w": np.ones((4, 8), np.float32), "b": np.ones(8, np.float32)}
    placed = parallel.put(tree, {"w": ("heads", "embed"), "b": ("embed",)})
    assert placed["w"].sharding == NamedSharding(mesh, P())
    assert placed["b"].sharding == parallel.sharding(("embed",))
    np.testing.assert_array_equal(placed["w"], tree["w"])
    counters = parallel.replicated({"n": np.zeros(3, np.int32)})
    assert counters["n"].sharding == NamedSharding(mesh, P())
    host = parallel.put(tree, {"w": ("heads", "embed"), "b": ("embed",)}, memory="host")
    assert host["w"].sharding.memory_kind == parallel.host_memory_kind()


def test_bank_axes_name_every_leaf():
    dense = {"gate_up": np.zeros((2, 6, 4)), "down": np.zeros((2, 4, 3))}
    assert expert_axes(dense) == {"gate_up": ("slots", "ffw", "embed"),
                                  "down": ("slots", "embed", "ffw")}
    mx = {k: None for k in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")}
    assert expert_axes(mx, "experts")["down_blocks"] == ("experts", "embed", "ffw", None)


def test_a_state_places_bank_pool_and_map():
    rows = {"gate_up": np.ones((8, 6, 4), np.float32), "down": np.ones((8, 4, 3), np.float32)}
    mesh = parallel.current_mesh()
    state = build_state(host_pool(rows), 2, np.array([0, 5, -1], np.int32), transient=1)
    assert state.bank["gate_up"].sharding == parallel.sharding(("slots", "ffw", "embed"))
    assert state.pool["gate_up"].sharding == parallel.host_sharding(("experts", "ffw", "embed"))
    assert state.rowmap.sharding == state.counts.sharding == NamedSharding(mesh, P())
    full = all_resident_state(rows, 2)
    assert full.bank["down"].sharding == parallel.sharding(("slots", "embed", "ffw"))


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v3", "qlora_groups", seed=5)


def test_an_engine_loads_and_generates_through_the_table(model_dir):
    """Half the experts resident (so a host pool exists): params by their declared axes, KV
    pages, bank, map and pool on the mesh (the pool in host memory); greedy tokens are the
    full forwards'."""
    engine = tidejax.load(model_dir, engine={"lanes": 2, "max_context": 64, "page_size": 8},
                          residency={"budget_experts": 8, "miss_policy": "exact"})
    mesh = engine.loaded.mesh
    specs = param_specs(engine.cfg, engine.loaded.dtype)
    for param, spec in zip(jax.tree.leaves(engine.loaded.params), jax.tree.leaves(specs)):
        assert param.sharding == parallel.sharding(spec.axes)
    assert engine.state.cache.pages.latent[0].sharding == parallel.sharding(("pages", "page", "kv_lora"))
    state = engine.state.experts  # as the warm-up steps returned it: on the mesh, in place
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.mesh == mesh
    assert state.pool["gate_up"].sharding.memory_kind == parallel.host_memory_kind()

    prompt = np.random.RandomState(1).randint(3, 256, 12).tolist()
    events = []
    engine.scheduler.submit(GenerationRequest(prompt, 8, ignore_eos=True), events.append)
    engine.scheduler.run_until_idle()
    ids = []
    while len(ids) < 8:
        ids.append(int(np.argmax(engine.logits(prompt + ids)[-1])))
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == ids
