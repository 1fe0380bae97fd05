"""Imports run one way (docs/design.md): recipe -> graph -> passes -> runtime -> engine -> lowering
-> ranks and programs -> benchmarks, CLI, server (model widening lives with the models: loading
a program reaches nothing in bench/); no module imports, even inside a function, one
that imports it back."""

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "specgraph"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module -> the specgraph modules it imports (at its top or inside a function)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specgraph"):
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("specgraph")]
            else:
                continue
            graph.add_edges_from((name, target) for target in targets if target in modules and target != name)
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {[' -> '.join(c + c[:1]) for c in cycles[:5]]}"


def test_the_runtime_and_the_passes_import_nothing_above_them():
    graph = import_graph()
    above_runtime = ("specgraph.program", "specgraph.lower", "specgraph.worker", "specgraph.launch",
                     "specgraph.engine", "specgraph.bench", "specgraph.cli", "specgraph.export")
    for module in graph:
        reached = nx.descendants(graph, module)
        if module.startswith("specgraph.runtime"):
            assert not [m for m in reached if m.startswith(above_runtime)], module
        if module.startswith("specgraph.passes"):
            drafting = ("specgraph.draft", "specgraph.growing", "specgraph.runtime", *above_runtime)
            assert not [m for m in reached if m.startswith(drafting)], module


def test_loading_a_program_imports_nothing_from_the_benchmarks():
    """bench/ measures programs; building one (recipe to Program, and the server over it) needs
    nothing of it: only the command line and the load generator reach specgraph.bench."""
    graph = import_graph()
    loading = {"specgraph.program", "specgraph.serve.server", "specgraph.worker"}
    reached = set().union(*(nx.descendants(graph, m) | {m} for m in loading))
    assert not sorted(m for m in reached if m.startswith("specgraph.bench"))
    importers = {m for m in graph if not m.startswith("specgraph.bench")
                 and any(t.startswith("specgraph.bench") for t in graph.successors(m))}
    assert importers <= {"specgraph.cli", "specgraph.loadgen"}, importers
