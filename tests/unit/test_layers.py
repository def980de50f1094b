"""litft's house: a few modules at the top and packages by concern, in an order no import climbs (at any place in a file,
TYPE_CHECKING blocks included), with no import circle in litft/ or benchmarks/ and no function past 60 lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "litft"

# Lowest first: a module may import from its own package and from any package before it, never after.
ORDER = (
    "errors", "flag_checks", "config", "device", "ranks",  # the top-level modules: one exception, the flag groups, devices, ranks
    "data", "model", "checkpoint", "launch", "parallel", "rl", "objectives", "run", "cli", "estimate", "__main__",
)
TOP_LEVEL_LIMIT = 8  # modules beside the packages, __init__ and __main__ not counted
LONGEST_FUNCTION = 60


def module_imports(package: Path = PACKAGE, prefix: str = "litft") -> dict:
    """Each module under ``package`` and the modules of ``prefix`` it imports anywhere in its file (a name imported from a
    package counts as the package's module holding it, where that is a module)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str:
        while name not in names and "." in name:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix):
                found |= {known(f"{node.module}.{alias.name}") for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {known(alias.name) for alias in node.names if alias.name.startswith(prefix)}
        graph[module] = {name for name in found if name in names} - {module, prefix}
    return graph


def cycles_of(graph: dict) -> list:
    state, cycles = {}, []

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                cycles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in state:
                visit(imported, path + [imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else module


def test_no_import_climbs_the_package_order_and_none_goes_round():
    graph = module_imports()
    assert {layer(m) for m in graph} - {"litft"} == set(ORDER), "every package and top-level module has its place in ORDER"
    climbs = [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
              if layer(m) != "litft" and ORDER.index(layer(d)) > ORDER.index(layer(m))]
    assert climbs == []
    assert cycles_of(graph) == []
    assert "litft.run.spec" in graph["litft.run.trainer"] and "litft.run.trainer" in graph["litft.cli.jobs"]


def test_benchmarks_import_no_circle():
    scripts = ROOT / "benchmarks"
    graph = {}
    for path in scripts.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module.split(".")[-1] if node.module.startswith("benchmarks") else node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[path.stem] = {name for name in found if (scripts / f"{name}.py").is_file()} - {path.stem}
    assert cycles_of(graph) == []


def test_a_few_modules_at_the_top_each_package_says_its_concern_and_no_function_runs_past_60_lines():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= TOP_LEVEL_LIMIT, top
    for package in (p for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
        assert ast.get_docstring(ast.parse((package / "__init__.py").read_text())), f"{package.name}/__init__.py says its concern"
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
