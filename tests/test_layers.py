"""The box-side library stands in layers: no module imports, even from inside a function, one that imports it back.

An import circle is what makes a package hard to take over: no module of the circle can be read, tested or moved
without the others, and function-local imports that keep it running hide it from the reader. Here every module's
imports are read from its source (ast: module-level and function-local alike), and the graph must have no cycle.

    python tests/test_layers.py     prints the layers, the lowest first: each module imports only from layers below
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_graphs import cycles, layers

REPO = Path(__file__).resolve().parents[1]
BOX_PACKAGE = REPO / "include" / "eagle3"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, function-local imports included. `from pkg import name` is an
    arrow to pkg.name when that is a module, else to pkg; an import of a submodule is not counted as one of its parent
    packages (Python imports the parent first, but the parent's code does not depend on the child for that)."""
    files = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        arrows = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                arrows |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                arrows |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names}
        graph[name] = {arrow for arrow in arrows if arrow in files and arrow != name}
    return graph


@pytest.mark.slow
def test_the_box_side_library_has_no_import_circle():
    graph = import_graph(BOX_PACKAGE)
    found = cycles(graph)
    assert not found, (
        "modules of include/eagle3 that import each other in a circle (function-local imports too): "
        + "; ".join(" <-> ".join(c) for c in found)
        + ". Move what they share into a module below both"
    )


# The folders (and top-level modules) of include/eagle3, the lowest first; a module imports only from its own rank or
# those below. docs/architecture.md's layout section walks the same order.
RANKS = [
    {"disk", "contracts", "engine_flags"},  # paths, atomic writes, the two sides' contracts: nothing of eagle3 below
    {"config", "jobs"},  # the run's schema; detached jobs and their progress beats
    {"data"},  # conversations -> samples -> the hidden-state store, and the split
    {"model", "target", "records"},  # the drafter and the target's facts; checkpoints and lineages
    {"engines", "capture"},  # serving the target; capturing its hidden states
    {"stages", "box", "demo"},  # `python -m eagle3 <stage>`; what else the control plane asks the box
    {"__main__"},
]


def rank_of(module: str) -> int:
    part = module.split(".")[1] if "." in module else module
    return next(rank for rank, names in enumerate(RANKS) if part in names)


def test_every_module_imports_only_from_its_folders_rank_or_below():
    """The layers stand as folders: no arrow points up (a record importing a stage, the data a model). A new folder
    or top-level module is placed in RANKS first."""
    graph = import_graph(BOX_PACKAGE)
    placed = {name for name in graph if name != "eagle3"}
    assert all(any((n.split(".")[1] if "." in n else n) in names for names in RANKS) for n in placed), sorted(
        n for n in placed if not any((n.split(".")[1]) in names for names in RANKS)
    )
    upward = sorted(f"{a} -> {b}" for a in placed for b in graph[a] if b != "eagle3" and rank_of(b) > rank_of(a))
    assert not upward, "imports that point up the layers: " + "; ".join(upward)


@pytest.mark.slow
def test_paths_inside_a_run_directory_are_spelled_only_in_the_layout():
    """The run directory's layout is named once (eagle3.disk.layout): a path such as evaluate/report.json written out
    again elsewhere, box side or control plane, would keep the old name when the layout changes."""
    from eagle3.disk import layout

    paths = {
        value for name, value in vars(layout).items() if name.isupper() and isinstance(value, str) and "/" in value
    }
    spelled = []
    for root in (BOX_PACKAGE, REPO / "plugins" / "eagle3_airflow", REPO / "dags"):
        for path in sorted(root.rglob("*.py")):
            if path == BOX_PACKAGE / "disk" / "layout.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in paths:
                    spelled.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert paths and not spelled, spelled


def test_the_graph_reader_sees_a_circle_hidden_in_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("def thing():\n    from pkg import a\n    return a\n")
    (package / "c.py").write_text("from . import a\n")
    graph = import_graph(package)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


if __name__ == "__main__":
    for floor, modules in enumerate(layers(import_graph(BOX_PACKAGE))):
        print(f"layer {floor}: {', '.join(m.removeprefix('eagle3.') or 'eagle3' for m in modules)}")


@pytest.mark.slow
def test_every_module_of_the_box_side_imports():
    """Each module imports in a fresh interpreter (a name moved out of a module its importers still name fails here
    rather than in the one stage that imports it)."""
    modules = sorted(name for name in import_graph(BOX_PACKAGE) if name != "eagle3.__main__")
    check = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    run = subprocess.run([sys.executable, "-c", check, *modules], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
