"""The package layout's rules over the import graph (DESIGN.md, rules of the house 1, 5 and 7): a
family package never imports another family, the shared layers import no family, nothing under
tidejax/models imports tidejax.pallas (models reach kernels only through tidejax.ops) and no
model names a kernel implementation, outside tidejax.ops nothing reaches a kernel or a
reference, the kernels' contract (tidejax/contract.py) imports nothing of tidejax, no module of
tidejax takes part in an import circle, and the server reaches the runtime only through
tidejax.runtime.api. Of tests/: its folders mirror the package, and no test module imports
another. Read from the source with ast: nothing is imported, so it costs no JAX
start-up."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tidejax"
TESTS = PACKAGE.parent / "tests"
MODELS = PACKAGE / "models"
SHARED = "layers"  # the one package under models/ that is not a family
# the server's process entry: it builds the engine (runtime.engine, runtime.client) and a
# tensor-parallel peer (distributed.peer) that the rest of the server is handed as an EngineClient
SERVER_ENTRY = "tidejax.server.__main__"
API = "tidejax.runtime.api"
KERNELS = "tidejax.pallas"
OPS = "tidejax.ops"
CONTRACT = "tidejax.contract"
# what of tidejax.pallas a module outside tidejax.ops may import: the bank helpers (its dims,
# dequantized rows), data the host kernel's fallback reads too (residency/cpu.py)
BANK_HELPERS = {"tidejax.pallas.bank"}


def module_name(path: Path) -> str:
    parts = path.relative_to(MODELS.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(path: Path):
    """(module, names) of each import in `path`, at any depth (a function's too): `import a.b`
    gives ("a.b", ()), `from a import b, c` gives ("a", ("b", "c")), relative names resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base, tuple(alias.name for alias in node.names)


def imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; `from a import b` counts a and a.b)."""
    found = set()
    for base, names in import_statements(path):
        found.add(base)
        found.update(f"{base}.{name}" for name in names)
    return found


def extensions() -> set[str]:
    """The compiled extensions setup.py declares (built or not: a fresh checkout has no .so)."""
    tree = ast.parse((PACKAGE.parent / "setup.py").read_text())
    return {node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "Extension"}


def package_graph() -> dict[str, set[str]]:
    """tidejax's modules (compiled extensions included) -> the tidejax modules each imports:
    `from a import b` is an edge to a.b where that is a module, else to a. A package's own
    __init__ running before its modules is not an edge."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths) | extensions()
    graph = {}
    for name, path in paths.items():
        targets = set()
        for base, names in import_statements(path):
            subs = {f"{base}.{n}" for n in names} & known
            if len(subs) < len(names) or not names:  # `import a`, or a name defined in a
                subs.add(base)
            targets |= subs & known
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def families() -> list[str]:
    return sorted(p.name for p in MODELS.iterdir()
                  if (p / "__init__.py").exists() and p.name != SHARED)


def modules() -> dict[Path, set[str]]:
    return {path: imports(path) for path in sorted(MODELS.rglob("*.py"))}


def package_of(name: str) -> str | None:
    """The package directly under tidejax.models that module `name` lies in, if any."""
    parts = name.split(".")
    return parts[2] if parts[:2] == ["tidejax", "models"] and len(parts) > 2 else None


def test_the_graph_is_not_empty():
    graph = modules()
    assert {"deepseek_v3", "deepseek_v4", "deepseek_v41"} <= set(families())
    assert sum(len(found) for found in graph.values()) > 50


def test_no_family_imports_another():
    names = set(families())
    wrong = []
    for path, found in modules().items():
        own = package_of(module_name(path))
        if own not in names:
            continue
        for name in found:
            other = package_of(name)
            if other in names and other != own:
                wrong.append(f"{path.relative_to(MODELS)} imports {name}")
    assert not wrong, "a family imports another family:\n" + "\n".join(sorted(wrong))


def test_shared_layers_import_no_family():
    names = set(families())
    wrong = [f"{path.relative_to(MODELS)} imports {name}" for path, found in modules().items()
             if package_of(module_name(path)) == SHARED for name in found
             if package_of(name) in names]
    assert not wrong, "\n".join(sorted(wrong))


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_models_never_import_pallas():
    wrong = [f"{path.relative_to(MODELS)} imports {name}" for path, found in modules().items()
             for name in found if name == "tidejax.pallas" or name.startswith("tidejax.pallas.")]
    assert not wrong, "models reach kernels only through tidejax.ops:\n" + "\n".join(sorted(wrong))


def test_no_model_names_a_kernel_implementation():
    """Models call ops with arrays alone: no call under tidejax/models passes `impl`, and no
    module there imports the dispatch rule (a family's forward runs under its ServeOptions'
    kernel, models.base.serving)."""
    wrong = []
    for path in sorted(MODELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and any(k.arg == "impl" for k in node.keywords):
                wrong.append(f"{path.relative_to(MODELS)}:{node.lineno} passes impl=")
        wrong += [f"{path.relative_to(MODELS)} imports {name}" for name in imports(path)
                  if under(name, "tidejax.ops.dispatch")]
    assert not wrong, "\n".join(wrong)


def test_only_the_ops_reach_the_kernels():
    """Outside tidejax.pallas, only tidejax.ops imports a kernel or a reference; the rest of
    tidejax imports at most the bank helpers."""
    wrong = [f"{path.relative_to(PACKAGE)} imports {name}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if not under(module_name(path), KERNELS) and not under(module_name(path), OPS)
             for name in imports(path) if under(name, KERNELS)
             and not any(under(name, helpers) for helpers in BANK_HELPERS)]
    assert not wrong, "only tidejax.ops calls the kernels:\n" + "\n".join(sorted(wrong))
    assert any(under(name, KERNELS) for name in imports(PACKAGE / "ops" / "__init__.py"))


def test_the_kernel_contract_imports_nothing_of_tidejax():
    """tidejax/contract.py (activation, bias, gate/up layout) imports no module of tidejax, so the
    kernels, their references, the host kernel and the models all import it, and none of them
    through another."""
    found = imports(PACKAGE / "contract.py")
    assert not [name for name in found if under(name, "tidejax")], sorted(found)
    graph = package_graph()
    users = ("tidejax.pallas.moe_kernel", "tidejax.pallas.moe", "tidejax.residency.cpu",
             "tidejax.models.layers.mlp")
    assert all(CONTRACT in graph[name] for name in users)


def test_registry_names_family_packages():
    """Each model_type's module is the family.py of a family package."""
    tree = ast.parse((MODELS / "registry.py").read_text())
    table = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "FAMILY_MODULES" for t in node.targets))
    targets = ast.literal_eval(table)
    assert targets
    for model_type, module in targets.items():
        package = package_of(module)
        assert package in families() and module == f"tidejax.models.{package}.family", model_type
        assert (MODELS / package / "family.py").exists(), module


def test_no_import_circle_in_the_package():
    graph = package_graph()
    assert len(graph) > 100 and "tidejax.runtime.runner" in graph["tidejax.runtime.scheduler"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not circles(graph), "import circles:\n" + "\n".join(map(str, circles(graph)))


def test_the_server_reaches_the_runtime_only_through_its_api():
    server = PACKAGE / "server"
    wrong = [f"{path.relative_to(PACKAGE)} imports {name}"
             for path in sorted(server.rglob("*.py")) if module_name(path) != SERVER_ENTRY
             for name in imports(path)
             if name.startswith("tidejax.runtime") and name != API and not name.startswith(API + ".")]
    assert not wrong, "the server imports the runtime beside its api:\n" + "\n".join(sorted(wrong))
    assert any(API in imports(path) for path in server.rglob("*.py"))


def test_tests_mirror_the_package_and_share_only_support():
    """Each folder under tests/ is a package of tidejax (or bench/, tools/), but support/ (the
    shared helpers) and data/; a test module imports helpers from tests.support, never another
    test module (its fixtures and helpers would run twice, once under each name)."""
    mirrored = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    allowed = mirrored | {"bench", "tools", "support", "data"}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert {"models", "runtime", "support"} <= folders <= allowed, sorted(folders - allowed)
    modules = sorted(TESTS.rglob("test_*.py"))
    assert len(modules) > 30
    wrong = [f"{path.relative_to(TESTS)} imports {name}" for path in modules
             for name in imports(path) if any(part.startswith("test_") for part in name.split("."))]
    assert not wrong, "a test module imports another:\n" + "\n".join(sorted(wrong))
