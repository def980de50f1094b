"""litft's modules form layers: no module imports one above it, at any place in the file, TYPE_CHECKING blocks included."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "litft"


def module_imports() -> dict:
    """Each litft module and the litft modules it imports anywhere in its file (a name imported from a package counts as
    the package's module holding it, where that is a module)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str:
        while name not in names:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("litft"):
                found |= {known(f"{node.module}.{alias.name}") for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {known(alias.name) for alias in node.names if alias.name.startswith("litft")}
        graph[module] = found - {module, "litft"}
    return graph


def test_no_module_imports_one_above_it():
    graph, state, cycles = module_imports(), {}, []

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in state:
                visit(imported, path + [imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert len(graph) > 40 and "litft.spec" in graph["litft.trainer"] and "litft.trainer" in graph["litft.jobs"]
    assert cycles == []
