"""How much of the production code is prose: the share of its characters inside string literals (docstrings and
the rest), and of its lines that are comments. Figures, not asserts; run it before and after a change.

    python bench/code_prose.py [DIR ...]       from a checkout's root; default: include/eagle3 plugins dags

A string's characters are counted as written, quotes included; a docstring is a string that is the first statement
of a module, class or function. The figure that compares with other code bases is strings / all characters.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

REPO = Path.cwd()  # the checkout to measure: run it from its root
DEFAULT = ["include/eagle3", "plugins", "dags"]


def docstring_spans(tree: ast.AST) -> set[tuple[int, int]]:
    """(line, column) where each docstring starts."""
    spans = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                spans.add((first.lineno, first.col_offset))
    return spans


def measure(path: Path) -> dict[str, int]:
    source = path.read_text()
    docstrings = docstring_spans(ast.parse(source))
    lines = source.splitlines()
    counts = {"chars": len(source), "strings": 0, "docstrings": 0, "lines": len(lines), "comment_lines": 0}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING:  # (an f-string is one STRING token up to Python 3.11)
            counts["strings"] += len(token.string)
            if token.start in docstrings:
                counts["docstrings"] += len(token.string)
        elif token.type == tokenize.COMMENT and lines[token.start[0] - 1].lstrip().startswith("#"):
            counts["comment_lines"] += 1
    return counts


def main(argv: list[str]) -> None:
    roots = [REPO / root for root in (argv or DEFAULT)]
    totals = {"files": 0, "chars": 0, "strings": 0, "docstrings": 0, "lines": 0, "comment_lines": 0}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            counts = measure(path)
            totals["files"] += 1
            for key, value in counts.items():
                totals[key] += value
    chars = totals["chars"]
    print(
        f"{', '.join(str(r.relative_to(REPO)) for r in roots)}: {totals['files']} files, {totals['lines']} lines, "
        f"{chars} characters"
    )
    other = totals["strings"] - totals["docstrings"]
    print(
        f"string literals  {totals['strings'] / chars:6.1%} of the characters (docstrings "
        f"{totals['docstrings'] / chars:.1%}, other strings {other / chars:.1%})"
    )
    print(f"comment lines    {totals['comment_lines'] / max(1, totals['lines']):6.1%} of the lines")


if __name__ == "__main__":
    main(sys.argv[1:])
