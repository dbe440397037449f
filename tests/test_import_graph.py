"""The package's module-level imports form no cycle (read with ``ast``, nothing imported).

A cycle forces lazy imports inside functions and makes import order matter; the
kernels / sample split (a kernel's reference beside it, the sampler importing the
kernels, never the other way round) keeps the graph acyclic.
"""

import ast
from pathlib import Path

import mrv2

PKG = Path(mrv2.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(tree: ast.Module):
    """Import nodes at module level (also inside module-level if / try), not in functions."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try)):
            stack += node.body + node.orelse + getattr(node, "finalbody", [])
            stack += [s for h in getattr(node, "handlers", []) for s in h.body]


def _all_imports(tree: ast.Module):
    """Every import node, deferred ones (inside functions) included."""
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    """mrv2 module -> the mrv2 modules it imports (at module level; all with ``deferred``)."""
    walk = _all_imports if deferred else _module_level_imports
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule when one exists.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            deps |= {t for t in targets if t in files and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or ``None``."""
    color, parent = dict.fromkeys(graph, 0), {}
    for root in sorted(graph):
        if color[root]:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        color[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = 2
                stack.pop()
            elif color[nxt] == 1:
                path = [node]
                while path[-1] != nxt:
                    path.append(parent[path[-1]])
                return [*reversed(path), nxt]
            elif color[nxt] == 0:
                color[nxt], parent[nxt] = 1, node
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def test_the_walker_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "mrv2.kernels.top_k_top_p" in graph["mrv2.sample.sampler"]
    assert "mrv2.sample.states" in graph["mrv2.sample.sampler"]
    assert len(graph) > 50


def test_package_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_deferred_imports_do_not_hide_a_cycle():
    """An import moved into a function only hides a cycle (the old top_k_top_p <-> sampler)."""
    cycle = find_cycle(import_graph(deferred=True))
    assert cycle is None, "import cycle through a deferred import: " + " -> ".join(cycle)
