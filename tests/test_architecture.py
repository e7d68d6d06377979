"""The import rules, read from EVERY import statement (function bodies and ``if``/``try`` blocks included).

Rooms and who may import whom (an arrow points at what a module may import):

- ``patches.core``: imports only ``patches.core``;
- ``patches`` (the machinery and tables): ``patches.core`` and ``patches``; a recipe only by import string;
- ``<wing>.levers``: ``patches.core`` and its own wing's levers;
- ``<wing>.recipe``: ``patches.core``, its own wing's levers and recipe;
- ``<wing>.upstream``: ``patches.core`` and its own wing's levers; nothing imports it (the patch tables name it by
  import string);
- the two wings (``cosmos_framework_ext``, ``miles_ext``) never import each other;
- nothing imports in a circle, lazy imports included.

Each rule has a planted violation in a scratch tree that the checker must report.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("patches", "cosmos_framework_ext", "miles_ext")
WINGS = ("cosmos_framework_ext", "miles_ext")
ROOMS = ("levers", "recipe", "upstream")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path`` (every ``from X import y`` also yields ``X.y``,
    which names a submodule when ``y`` is one)."""
    tree = ast.parse(path.read_text())
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
            found += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return [(line, m) for line, m in found if m.split(".")[0] in PACKAGES]


def room(module: str) -> str:
    """``core``, ``patches``, ``<wing>.<room>`` or ``<wing>`` (the wing's ``__init__``)."""
    parts = module.split(".")
    if parts[0] == "patches":
        return "core" if parts[1:2] == ["core"] else "patches"
    if len(parts) > 1 and parts[1] in ROOMS:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def allowed(src: str, dst: str) -> bool:
    """May a module in room ``src`` import one in room ``dst``?"""
    if src == "core":
        return dst == "core"
    if src == "patches":
        return dst in ("core", "patches")
    wing, _, r = src.partition(".")
    if dst in ("core",):
        return True
    if dst.split(".")[0] != wing:  # the other wing, or the patch machinery
        return False
    if dst == f"{wing}.upstream":
        return r == "upstream"  # only by import string from outside
    if r in ("levers", "upstream"):
        return dst == f"{wing}.levers"
    if r == "recipe":
        return dst in (f"{wing}.levers", f"{wing}.recipe")
    return dst == wing  # the wing's __init__ imports nothing of its rooms


def graph(root: Path) -> tuple[dict[str, Path], dict[str, set[str]], list[str]]:
    """Modules, their project-internal imports, and every rule violation (``file:line: ...``)."""
    modules = {module_name(p, root): p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    problems = []
    for mod, path in modules.items():
        for line, dep in imports_of(path, root):
            if dep not in modules or dep == mod:
                continue  # a name imported from a module, or the module itself
            edges[mod].add(dep)
            if not allowed(room(mod), room(dep)):
                problems.append(f"{path.relative_to(root)}:{line}: {mod} ({room(mod)}) imports {dep} ({room(dep)})")
    return modules, edges, problems


def cycles(edges: dict[str, set[str]]) -> list[str]:
    """One line per import cycle found (depth-first)."""
    state: dict[str, int] = {}
    found: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges[node]):
            if state.get(dep) == 1:
                found.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [n])
    return found


def check(root: Path) -> list[str]:
    """Every violation of the import rules under ``root``."""
    _, edges, problems = graph(root)
    return problems + [f"import cycle: {c}" for c in cycles(edges)]


def test_the_tree_keeps_the_import_rules():
    assert check(ROOT) == []


def test_every_wing_module_sits_in_a_room():
    for wing in WINGS:
        loose = [p.name for p in (ROOT / wing).glob("*.py") if p.name != "__init__.py"]
        assert not loose, f"{wing} has modules outside levers/, recipe/ and upstream/: {loose}"


# ------------------------------------------------------------------------------------------ planted violations
PLANTED = {
    "patches/core/bad.py": "def f():\n    import patches.guard\n",                       # core -> machinery, lazily
    "patches/table.py": "def f():\n    from cosmos_framework_ext.levers import ema\n",   # machinery -> recipe wing
    "cosmos_framework_ext/levers/ema.py": "from cosmos_framework_ext.recipe import train\n",  # lever -> its recipe
    "cosmos_framework_ext/recipe/train.py": "try:\n    from miles_ext.levers import lora\nexcept ImportError:\n    pass\n",
    "cosmos_framework_ext/upstream/patches.py": "def f():\n    from patches import guard\n",  # wing -> machinery
    "miles_ext/levers/lora.py": "def f():\n    from miles_ext.upstream import patches\n",  # lever -> upstream room
    "miles_ext/recipe/a.py": "def f():\n    from . import b\n",                          # a lazy cycle
    "miles_ext/recipe/b.py": "from miles_ext.recipe import a\n",
}
WANT = [
    "patches.core.bad (core) imports patches.guard",
    "patches.table (patches) imports cosmos_framework_ext.levers.ema",
    "cosmos_framework_ext.levers.ema (cosmos_framework_ext.levers) imports cosmos_framework_ext.recipe.train",
    "cosmos_framework_ext.recipe.train (cosmos_framework_ext.recipe) imports miles_ext.levers.lora",
    "cosmos_framework_ext.upstream.patches (cosmos_framework_ext.upstream) imports patches.guard",
    "miles_ext.levers.lora (miles_ext.levers) imports miles_ext.upstream.patches",
    "import cycle: miles_ext.recipe.a -> miles_ext.recipe.b -> miles_ext.recipe.a",
]


@pytest.fixture()
def planted(tmp_path: Path) -> Path:
    for rel, text in {**PLANTED, "patches/guard.py": "", "miles_ext/upstream/patches.py": "",
                      "miles_ext/levers/__init__.py": ""}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("want", WANT, ids=[w.split(" (")[0] for w in WANT])
def test_a_planted_violation_is_reported(planted, want):
    found = check(planted)
    assert any(want in line for line in found), found


def test_allowed_imports_are_not_reported(tmp_path):
    """The arrows the rules allow: recipe -> its levers and core, upstream -> its levers, machinery -> core."""
    files = {
        "patches/core/a.py": "from patches.core import b\n", "patches/core/b.py": "",
        "patches/run.py": "def f():\n    from patches.core import a\n    from patches import guard\n",
        "patches/guard.py": "",
        "miles_ext/levers/x.py": "from patches.core import a\nfrom miles_ext.levers import y\n",
        "miles_ext/levers/y.py": "", "miles_ext/recipe/r.py": "from miles_ext.levers import x\nfrom . import s\n",
        "miles_ext/recipe/s.py": "", "miles_ext/upstream/u.py": "from miles_ext.levers import x\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert check(tmp_path) == []


def test_no_helper_defined_twice_across_packages():
    """A top-level function or class name defined in two packages is a helper written twice."""
    allowed_names = {"main", "parse_args", "run", "get_preset", "build_transformer", "build_vae", "meta_transformer"}
    seen: dict[str, str] = {}
    dupes = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in allowed_names:
                    key = node.name.lstrip("_")
                    where = seen.setdefault(key, pkg)
                    if where != pkg:
                        dupes.append(f"{node.name} in {pkg} and {where}")
    assert not dupes, dupes
