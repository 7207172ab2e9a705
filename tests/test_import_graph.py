"""The control plane (plugins/eagle3_airflow) stands in layers: no module imports, even from inside a function, one that
imports it back.

A circle hidden behind function-local imports still runs (each import waits until the call), but no module of it can
be read, tested or moved without the others. So every import of the package's own modules counts, at any depth:
module level, inside a function or method, and under `if TYPE_CHECKING:`. Those last never run, but a module that
names another's type in its signatures depends on it for its reader and for a type checker alike, and the layering
is about reading a module without the ones above it. What is not an import is not counted: a dotted path in a string
(notify.py names its own late_run so to Airflow's DeadlineAlert).

    python tests/test_import_graph.py     prints the layers, the lowest first: each module imports only from below
"""

from __future__ import annotations

import ast
import re
from collections import deque
from pathlib import Path

from tests.import_graphs import cycles, layers

REPO = Path(__file__).resolve().parents[1]
CONTROL_PLANE = REPO / "plugins" / "eagle3_airflow"
INIT = "__init__"


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """{module: {module of the same package it imports: the line of its first such import}}, by file stem (the
    package itself is `__init__`). `from package import name` is an arrow to the module `name` when there is one,
    else to the package; relative imports are resolved against the package."""
    files = {path.stem: path for path in sorted(package.glob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        arrows: dict[str, int] = {}
        for target, line in imported(ast.parse(path.read_text(), str(path)), package.name, set(files)):
            if target != module:
                arrows[target] = min(line, arrows.get(target, line))
        graph[module] = arrows
    return graph


def imported(tree: ast.AST, package: str, modules: set[str]):
    """(module of `package`, line) for every import in `tree` that names one, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package:
                    yield INIT, node.lineno
                elif alias.name.startswith(package + ".") and alias.name.split(".")[1] in modules:
                    yield alias.name.split(".")[1], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1 or (node.level == 0 and (node.module or "").split(".")[0] != package):
                continue  # another package
            inside = [part for part in (node.module or "").split(".")[1 if node.level == 0 else 0 :] if part]
            if inside:  # from package.module import ..., from .module import ...
                if inside[0] in modules:
                    yield inside[0], node.lineno
            else:  # from package import x, from . import x: a module, or a name the package defines
                for alias in node.names:
                    yield (alias.name if alias.name in modules else INIT), node.lineno


def shortest_circle(graph: dict[str, dict[str, int]], start: str) -> list[str]:
    """The shortest circle through `start`, as the modules in import order (start first, not repeated); [] if none."""
    came_from: dict[str, str] = {}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        for target in sorted(graph[node]):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1]
            if target not in came_from:
                came_from[target] = node
                todo.append(target)
    return []


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """A component: its shortest circle, spelled as the file:line imports a reader follows round, then every arrow
    inside it (the imports to move or cut)."""
    circle = min((shortest_circle(graph, module) for module in component), key=len)
    steps = [
        f"{module}.py:{graph[module][target]} imports {target}"
        for module, target in zip(circle, circle[1:] + circle[:1], strict=True)
    ]
    inside = [
        f"{module}.py:{line} -> {target}"
        for module in component
        for target, line in sorted(graph[module].items(), key=lambda arrow: arrow[1])
        if target in component
    ]
    return f"{', '.join(component)}\n    circle: " + " -> ".join(steps) + "\n    arrows inside: " + ", ".join(inside)


def reach(graph: dict[str, dict[str, int]], module: str) -> set[str]:
    """Every module `module` imports, directly or through others."""
    reached, todo = set(), [module]
    while todo:
        for target in set(graph[todo.pop()]) - reached:
            reached.add(target)
            todo.append(target)
    return reached


def test_the_control_plane_has_no_import_circle():
    graph = import_graph(CONTROL_PLANE)
    found = cycles(graph)
    assert not found, (
        "modules of plugins/eagle3_airflow that import each other in a circle (function-local and "
        "TYPE_CHECKING imports too):\n  "
        + "\n  ".join(describe(graph, c) for c in found)
        + "\nMove what they share into a module below all of them"
    )


def test_the_settings_stand_below_what_uses_them():
    """The settings (deployment.py) hold data and checks: they import the form, the pools and the allow-lists they
    are checked against, never the plan, the tasks or what builds Airflow's notifiers and operators from them."""
    graph = import_graph(CONTROL_PLANE)
    above = reach(graph, "deployment") - {INIT, "params", "pools", "allowlist"}
    assert not above, f"deployment.py reaches {sorted(above)} ({', '.join(sorted(graph['deployment']))} directly)"


def test_plugins_readme_lists_every_module_below_what_it_imports():
    """plugins/README.md lists the modules in layers: each after every module it imports, so it reads top down."""
    listed = re.findall(r"^(\w+)\.py ", (REPO / "plugins" / "README.md").read_text(), re.MULTILINE)
    graph = import_graph(CONTROL_PLANE)
    assert sorted(listed) == sorted(set(graph) - {INIT}), "plugins/README.md does not list each module once"
    early = [
        f"{module} before {target}"
        for position, module in enumerate(listed)
        for target in graph[module]
        if target != INIT and target not in listed[:position]
    ]
    assert not early, f"plugins/README.md lists a module before one it imports: {early}"


def test_the_graph_reader_sees_every_kind_of_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    files = {
        "__init__.py": "NAME = 1\n",
        "a.py": "from pkg.b import thing\n",
        "b.py": "def thing():\n    from pkg import a\n    return a\n",  # a circle, hidden in a function
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n",
        "d.py": "import pkg.e as e\nfrom . import NAME\nfrom pkgx import f\nimport os\n",
        "e.py": "class E:\n    def m(self):\n        import pkg\n        from .. import other\n",
        "f.py": "",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph == {
        INIT: {},
        "a": {"b": 1},
        "b": {"a": 2},
        "c": {"d": 3},
        "d": {"e": 1, INIT: 2},
        "e": {INIT: 3},
        "f": {},
    }
    assert cycles(graph) == [["a", "b"]]
    assert describe(graph, ["a", "b"]) == (
        "a, b\n    circle: a.py:1 imports b -> b.py:2 imports a\n    arrows inside: a.py:1 -> b, b.py:2 -> a"
    )
    assert layers({**graph, "b": {}}) == [[INIT, "b", "f"], ["a", "e"], ["d"], ["c"]]  # the circle cut


if __name__ == "__main__":
    for floor, modules in enumerate(layers(import_graph(CONTROL_PLANE))):
        print(f"layer {floor}: {', '.join(modules)}")
