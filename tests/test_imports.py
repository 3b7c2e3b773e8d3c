"""The package's import structure: no import cycle among lily's modules (imports inside
functions count: a lazy import still ties the modules together) and no module using a
private name (``_name``) of another, by ``from m import _name`` or ``m._name``.

Run alone: ``python -m pytest -q tests/test_imports.py`` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module under lily/."""
    out = {}
    for p in sorted((ROOT / "lily").rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def scan(name: str, path: Path, mods: dict[str, Path]) -> tuple[set[str], list[str]]:
    """(the lily modules ``name`` imports, its uses of other modules' private names)."""
    tree = ast.parse(path.read_text(), str(path))
    deps: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}  # local name -> module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods:
                    deps.add(a.name)
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in mods:  # a submodule
                    deps.add(sub)
                    aliases[a.asname or a.name] = sub
                    continue
                deps.add(node.module)
                if a.name.startswith("_") and node.module != name:
                    private.append(f"{name}:{node.lineno} imports {node.module}.{a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):  # fmt: skip
            private.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    deps.discard(name)
    return deps, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(root_mods: dict[str, Path]) -> tuple[list[list[str]], list[str]]:
    graph, private = {}, []
    for name, path in root_mods.items():
        graph[name], found = scan(name, path, root_mods)
        private += found
    return cycles(graph), private


def test_no_import_cycle_and_no_private_import():
    found_cycles, private = check(modules())
    assert found_cycles == [], f"import cycles: {found_cycles}"
    assert private == [], "private names used across modules:\n" + "\n".join(private)


def tiny_package(tmp_path: Path, sources: dict[str, str]) -> dict[str, Path]:
    """A package ``lily`` of the given modules (name -> source) under ``tmp_path``, as
    ``modules()`` lists one."""
    pkg = tmp_path / "lily"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    mods = {"lily": pkg / "__init__.py"}
    for name, src in sources.items():
        (pkg / f"{name}.py").write_text(src)
        mods[f"lily.{name}"] = pkg / f"{name}.py"
    return mods


def test_the_check_finds_a_cycle_and_a_private_import(tmp_path):
    """The checker itself, on a small package that has both faults."""
    mods = tiny_package(tmp_path, {
        "a": "def f():\n    from lily.b import g\n",
        "b": "import lily.a as a\n\ndef g():\n    return a._hidden\n",
        "c": "from lily.a import _secret\n",
    })  # fmt: skip
    found_cycles, private = check(mods)
    assert found_cycles == [["lily.a", "lily.b"]]
    assert private == ["lily.b:4 uses lily.a._hidden", "lily.c:1 imports lily.a._secret"]


def defined(path: Path) -> set[str]:
    """The names a module binds at its top level (in if/try blocks too): what
    ``from module import name`` can take from it."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text(), str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


def missing_names(mods: dict[str, Path]) -> list[str]:
    """Every ``from lily.m import n`` whose n module m does not define (nor is a submodule):
    an ImportError waiting for the first run of a file no CPU test imports (a GPU
    benchmark), found without importing it."""
    out, cache = [], {}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0
                    and node.module in mods):  # fmt: skip
                continue
            if node.module not in cache:
                cache[node.module] = defined(mods[node.module])
            for a in node.names:
                if (a.name != "*" and a.name not in cache[node.module]
                        and f"{node.module}.{a.name}" not in mods):  # fmt: skip
                    out.append(f"{name}:{node.lineno} imports {a.name} from {node.module}")
    return out


def test_every_imported_name_exists():
    missing = missing_names(modules())
    assert missing == [], "names imported from modules that lack them:\n" + "\n".join(missing)


def test_the_check_finds_a_missing_name(tmp_path):
    mods = tiny_package(tmp_path, {
        "a": "X = 1\nif X:\n    from math import pi as Y\n\ndef f(): pass\n",
        "b": "from lily.a import X, Y, f\nfrom lily.a import Z\n",
    })  # fmt: skip
    assert missing_names(mods) == ["lily.b:2 imports Z from lily.a"]
