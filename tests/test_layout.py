"""The package layout's rules over the import graph (DESIGN.md, rules of the house 1 and 5): a
family package never imports another family, the shared layers import no family, and nothing
under tidejax/models imports tidejax.pallas (models reach kernels only through residency).
Read from the source with ast: nothing is imported, so it costs no JAX start-up."""

from __future__ import annotations

import ast
from pathlib import Path

MODELS = Path(__file__).resolve().parents[1] / "tidejax" / "models"
SHARED = "layers"  # the one package under models/ that is not a family


def module_name(path: Path) -> str:
    parts = path.relative_to(MODELS.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; `from a import b` counts a and a.b)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
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


def test_models_never_import_pallas():
    wrong = [f"{path.relative_to(MODELS)} imports {name}" for path, found in modules().items()
             for name in found if name == "tidejax.pallas" or name.startswith("tidejax.pallas.")]
    assert not wrong, "models reach kernels only through residency:\n" + "\n".join(sorted(wrong))


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
