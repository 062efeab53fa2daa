"""The folders are a map: no import circle, small modules, few at the top, and docs/layout.md matches the tree.

Imports are read from the source (``ast``), every one of them: at module level and inside
functions, except those only for type checkers (``if TYPE_CHECKING:``). ``from dcp_otel.x import y``
is an import of ``dcp_otel.x.y`` when that is a module, else of ``dcp_otel.x``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dcp_otel import processes
from dcp_otel.config import resolve_callable

PACKAGE = Path(__file__).parent.parent / "dcp_otel"
LAYOUT = PACKAGE.parent / "docs" / "layout.md"
MAX_TOP_LEVEL_MODULES, MAX_LINES = 12, 450


def module_names() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of this package that module ``name`` imports."""
    tree = ast.parse(path.read_text())
    for_type_checkers = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                         and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}  # fmt: skip

    def known(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in for_type_checkers:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in map(known, (t for t in targets if t.startswith("dcp_otel"))) if t and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_there_is_no_import_circle_inside_dcp_otel() -> None:
    graph = import_graph()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100  # the graph was read, not empty
    assert circles(graph) == []


def test_the_circle_check_can_fail(tmp_path: Path) -> None:
    """A circle is found, an import inside a function counts, one only for type checkers does not."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = tmp_path / "semconv.py"
    source.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from dcp_otel.tracing import builder\n\n\n"
                      "def late():\n    from dcp_otel.tracing import records\n")  # fmt: skip
    assert imports_of("dcp_otel.semconv", source, module_names()) == {"dcp_otel.tracing.records"}
    graph = import_graph()
    graph["dcp_otel.semconv"] = {"dcp_otel.tracing.records"}  # records imports semconv: now a circle
    assert any({"dcp_otel.semconv", "dcp_otel.tracing.records"} <= set(c) for c in circles(graph))


def test_the_rank_side_names_the_other_processes_entry_points_and_never_imports_them() -> None:
    graph = import_graph()
    other_processes = {m for m in graph if m.startswith("dcp_otel.processes.")}
    assert other_processes == {"dcp_otel.processes.daemon", "dcp_otel.processes.checkpoint_process",
                               "dcp_otel.processes.writer_process"}  # fmt: skip
    importers = {m for m, targets in graph.items() if targets & other_processes and not m.startswith("dcp_otel.processes")}
    assert importers == set()
    for spec in (processes.DAEMON_MAIN, processes.CHECKPOINT_PROCESS_MAIN, processes.WRITER_PROCESS_MAIN):
        assert callable(resolve_callable(spec)), spec


def test_at_most_twelve_modules_at_the_top_and_none_over_450_lines() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.fixture(scope="module")
def layout_text() -> str:
    return LAYOUT.read_text()


def test_the_layout_doc_names_every_module_and_folder_and_nothing_else(layout_text: str) -> None:
    block = re.search(r"```\n(dcp_otel/\n.*?)```", layout_text, re.S)
    assert block is not None, "docs/layout.md lost its tree"
    named: set[str] = set()
    folder = ""
    for line in block.group(1).splitlines():
        entry = re.match(r"^( *)(\w+/|\w+\.py)\s", line + " ")
        if not entry or entry.group(1) == "" and entry.group(2) == "dcp_otel/":
            continue
        depth, item = len(entry.group(1)), entry.group(2)
        if depth == 2:
            folder = item if item.endswith("/") else ""
            named.add(item)
        elif depth == 4 and folder:
            named.add(folder + item)
    in_tree = {str(p.relative_to(PACKAGE)) for p in PACKAGE.glob("*.py")}
    in_tree |= {f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    in_tree |= {f"{p.parent.name}/{p.name}" for p in PACKAGE.glob("*/*.py") if p.name != "__init__.py"}
    assert named == in_tree
