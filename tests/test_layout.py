"""The package layout stays layered: no module imports against the rule its package states, and no import
circle exists anywhere, between packages or inside one.

Each package (and each top-level module of ``client``) says on a ``May import:`` line of its docstring which
other parts of psyswarm it may import; a module without a rule of its own follows its nearest package's.
Every import counts, lazy ones inside functions and ``TYPE_CHECKING`` ones included: they are how the CLI stays
fast and how annotations name types, not a way round the layering.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("client", "coordinator_program", "local_backend")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stated_rule(path: Path) -> list[str] | None:
    """The dotted names a file's ``May import:`` line allows, or None when its docstring states no rule."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = doc.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("May import:"):
            text = line.removeprefix("May import:")
            for more in lines[i + 1:]:
                if not more.strip():
                    break
                text += " " + more
            text = text.strip().rstrip(".")
            if text.startswith("nothing"):
                return []
            return [name.strip() for name in text.split(",")]
    return None


def imported_names(path: Path, package: str) -> list[tuple[int, str]]:
    """Every psyswarm name a file imports, absolute, with its line (``from a import b`` imports ``a.b``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] in TOP_PACKAGES]
    return found


def within(name: str, unit: str) -> bool:
    return name == unit or name.startswith(unit + ".")


def violations(root: Path) -> list[str]:
    """``file:line imports X, outside its rule (unit: allowed)`` for every import against a stated rule."""
    rules: dict[str, list[str]] = {}
    for top in TOP_PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            rule = stated_rule(path)
            if rule is not None:
                rules[module_name(path, root)] = rule
    found = []
    for top in TOP_PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(path, root)
            unit = max((u for u in rules if within(module, u)), key=len, default=None)
            if unit is None:
                continue
            package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
            for line, name in imported_names(path, package):
                allowed = within(name, unit) or any(within(name, a) for a in rules[unit])
                if not allowed:
                    found.append(f"{path.relative_to(root)}:{line} imports {name}, outside the rule of {unit}: "
                                 f"{', '.join(rules[unit]) or 'nothing'}")
    return found


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each psyswarm module and the psyswarm modules it imports. ``from a import b`` imports the module ``a.b``
    when there is one, else ``a``. A module importing its own package (whose ``__init__`` re-exports it) is not
    an edge: the package is where it is defined, not something above it."""
    paths = {module_name(p, root): p for top in TOP_PACKAGES for p in sorted((root / top).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        edges = set()
        for _, name in imported_names(path, package):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module and not within(module, name):
                edges.add(name)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module (Tarjan's
    algorithm, iterative so that a deep chain of imports cannot exhaust Python's stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_imports_against_its_package_rule():
    assert violations(ROOT) == []


def test_every_client_package_and_top_level_module_states_its_rule():
    units = [p for p in (ROOT / "client").iterdir() if (p / "__init__.py").exists() or p.suffix == ".py"]
    unstated = [p.name for p in units if p.name != "__init__.py"
                and stated_rule(p / "__init__.py" if p.is_dir() else p) is None]
    assert unstated == []


def test_an_upward_import_is_reported(tmp_path):
    (tmp_path / "client" / "witness").mkdir(parents=True)
    (tmp_path / "client" / "pipeline").mkdir()
    (tmp_path / "client" / "__init__.py").write_text('"""Top."""\n')
    (tmp_path / "client" / "pipeline" / "__init__.py").write_text('"""Pipe.\n\nMay import: client.stages.\n"""\n')
    (tmp_path / "client" / "witness" / "__init__.py").write_text(
        '"""Records.\n\nMay import: client.identity,\nclient.stages.\n"""\n')
    (tmp_path / "client" / "witness" / "judge.py").write_text(
        "from client.stages import stage_name\nfrom . import records\n\n\ndef f():\n"
        "    from client.pipeline.model import build_stage\n")
    assert violations(tmp_path) == [
        "client/witness/judge.py:6 imports client.pipeline.model.build_stage, outside the rule of client.witness: "
        "client.identity, client.stages"]


def test_no_import_circle_anywhere():
    assert circles(module_graph(ROOT)) == []


def test_a_circle_inside_a_package_is_reported(tmp_path):
    models = tmp_path / "client" / "models"
    models.mkdir(parents=True)
    (tmp_path / "client" / "__init__.py").write_text('"""Top."""\n')
    (models / "__init__.py").write_text('"""Models."""\nfrom client.models.spec import Spec\n')
    (models / "spec.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from client.models.stages import Stage\nfrom client.models import weights\n")
    (models / "stages.py").write_text("def build():\n    from client.models.sources import load\n")
    (models / "sources.py").write_text("from client.models.spec import Spec\n")
    (models / "weights.py").write_text("from client.models import Spec\n")  # its own package: not an edge
    assert circles(module_graph(tmp_path)) == [["client.models.sources", "client.models.spec", "client.models.stages"]]


def unresolved_imports(root: Path) -> list[str]:
    """``file:line name`` for every psyswarm name a file imports, lazily or not, that does not exist: a lazy import
    is not run until its command is, so a rename that missed one would otherwise surface in front of a user."""
    import importlib

    found = []
    for top in TOP_PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(path, root)
            package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
            for line, name in imported_names(path, package):
                parent, _, attribute = name.rpartition(".")
                try:
                    importlib.import_module(name)
                    continue
                except ImportError:
                    pass
                try:
                    if hasattr(importlib.import_module(parent), attribute):
                        continue
                except ImportError:
                    pass
                found.append(f"{path.relative_to(root)}:{line} {name}")
    return found


def test_every_import_resolves():
    assert unresolved_imports(ROOT) == []
