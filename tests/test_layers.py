"""The package layering, checked on the source: no import cycle between modules, and no import from a lower layer
into a higher one. Imports inside functions count too: hiding one there does not make a cycle go away."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lowest first. A package may import its own modules and those of any package below it, never one above.
LAYERS = (
    "policies",  # pure decisions: lanes, queues, admission, rate limits, routing
    "registry",  # the registry YAML: schema, validation, the store and its watcher
    "runtimes",  # the engines and a replica's HTTP server
    "partitioner",  # devices, plans, applying them, time-slicing
    "model_pool",  # instance groups: launching, supervising and choosing replicas
    "gateway",  # the public HTTP entry: routing, forwarding, admin
    "bench",  # load generation and measurement
    "multiserve",  # the command line and the worker process's assembly
)


def _modules() -> dict[str, Path]:
    modules = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from a.b import c` of a module c counts as a.b.c)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def test_every_package_is_in_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "tests"}
    assert packages == set(LAYERS), f"add new packages to LAYERS: {sorted(packages - set(LAYERS))}"


def test_no_import_cycle_between_modules():
    assert _cycles(_imports(_modules())) == []


def _upward(edges: dict[str, set[str]]) -> list[str]:
    rank = {package: i for i, package in enumerate(LAYERS)}
    return sorted(f"{module} imports {target}" for module, targets in edges.items() for target in targets
                  if rank[target.split(".")[0]] > rank[module.split(".")[0]])


def test_no_import_from_a_lower_layer_into_a_higher_one():
    assert _upward(_imports(_modules())) == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    edges = {"policies.a": {"policies.b"}, "policies.b": {"policies.a"}, "registry.c": {"gateway.d"}}
    assert _cycles(edges) == [["policies.a", "policies.b"]]
    assert _upward(edges) == ["registry.c imports gateway.d"]
