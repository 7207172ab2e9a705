"""Graph walks both import-graph tests share (tests/test_layers.py: include/eagle3; tests/test_import_graph.py: the
control plane): a graph maps each module to the modules it imports (any collection of names)."""

from __future__ import annotations

from collections.abc import Collection, Mapping


def cycles(graph: Mapping[str, Collection[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layers(graph: Mapping[str, Collection[str]]) -> list[list[str]]:
    """Modules by layer: a module's layer is one above the highest it imports (0: it imports none of the package)."""
    level: dict[str, int] = {}

    def height(node: str) -> int:
        if node not in level:
            level[node] = 1 + max((height(target) for target in graph[node]), default=-1)
        return level[node]

    for node in graph:
        height(node)
    return [sorted(n for n, h in level.items() if h == floor) for floor in range(max(level.values()) + 1)]
