"""Imports point one way: recipes -> patches.core; patches -> patches.core; no cycles; no helper twice."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("patches", "cosmos_framework_ext", "miles_ext")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _module_level_imports(path: Path) -> set[str]:
    """Modules imported at module level (not inside a function), resolved to absolute names."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, (ast.If, ast.Try)):  # version/optional-import guards still run at import
            body.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for h in getattr(node, "handlers", []):
                body.extend(h.body)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _module_level_imports(path) if m in modules and m != name}
    return graph


def _layer(module: str) -> str:
    if module.startswith("patches.core"):
        return "core"
    return module.split(".")[0]


def test_patches_imports_no_recipe_and_core_imports_nothing_above_it():
    for mod, deps in _graph().items():
        layer = _layer(mod)
        for dep in deps:
            if layer == "core":
                assert _layer(dep) == "core", f"{mod} (shared core) imports {dep}"
            elif layer == "patches":
                assert _layer(dep) in ("core", "patches"), f"{mod} imports the recipe module {dep} at module level"


def test_recipes_import_only_the_core_of_patches_and_not_each_other_beyond_shared_data():
    for mod, deps in _graph().items():
        if _layer(mod) in ("cosmos_framework_ext", "miles_ext"):
            bad = [d for d in deps if _layer(d) == "patches"]
            assert not bad, f"{mod} imports patch machinery {bad}: recipes import patches.core only"


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [node, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])


def test_the_cycle_check_can_fail(tmp_path):
    """Planted: two modules importing each other are reported."""
    pkg = tmp_path / "patches"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from patches import a\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        try:
            test_no_import_cycles()
        except AssertionError as e:
            assert "import cycle" in str(e)
        else:
            raise AssertionError("a planted cycle was not found")
    finally:
        ROOT = saved


def test_no_helper_defined_twice_across_packages():
    """A top-level function or class name defined in two packages is a helper written twice."""
    allowed = {"main", "parse_args", "run", "get_preset", "build_transformer", "build_vae"}
    seen: dict[str, str] = {}
    dupes = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in allowed:
                    key = node.name.lstrip("_")
                    where = seen.setdefault(key, pkg)
                    if where != pkg:
                        dupes.append(f"{node.name} in {pkg} and {where}")
    assert not dupes, dupes
