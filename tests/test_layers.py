"""The package layering, checked on the source: no import cycle between modules, and no import from a lower layer
into a higher one. Imports inside functions count too: hiding one there does not make a cycle go away."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lowest first. A package may import its own modules and those of any package below it, never one above.
LAYERS = (
    # what the gateway and every replica share, importing no engine (no torch) and nothing above: log setup, request
    # errors and their HTTP shape, the gateway-replica wire names, body limit, slow-client guard, launch token
    "foundation",
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


# The gateway process's packages. It loads no engine: what it shares with a replica lives in foundation/.
ENGINE_FREE = ("gateway", "model_pool")


def _imports_into(packages: tuple[str, ...], target: str, edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} imports {imported}" for module, imported_all in edges.items()
                  if module.split(".")[0] in packages for imported in imported_all if imported.split(".")[0] == target)


def test_the_gateway_and_the_pool_never_import_runtimes():
    """runtimes/ is the replica's: its engines and its server. The gateway once took the error shape, the wire names
    and the HTTP guards from runtimes/server/, one import away from the engines; now both sides take them from
    foundation/, and the gateway and the pool import nothing of runtimes/, not even inside a function."""
    assert _imports_into(ENGINE_FREE, "runtimes", _imports(_modules())) == []


def test_the_runtimes_check_sees_an_import_inside_a_function(tmp_path):
    entry, server = tmp_path / "entry.py", tmp_path / "server.py"
    entry.write_text("def serve():\n    from runtimes.server import app\n")
    server.write_text("")
    modules = {"gateway.entry": entry, "runtimes.server.app": server}
    assert _imports_into(ENGINE_FREE, "runtimes", _imports(modules)) == ["gateway.entry imports runtimes.server.app"]


def _imports_torch(path: Path) -> bool:
    """Whether the module's source imports torch anywhere (inside functions too), type-checking-only imports aside."""
    pending: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            return True
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            pending.extend(node.orelse)  # annotations only: never imported at run time
            continue
        pending.extend(ast.iter_child_nodes(node))
    return False


def _torch_reached_from(packages: tuple[str, ...], modules: dict[str, Path],
                        edges: dict[str, set[str]]) -> dict[str, list[str]]:
    """For each module that imports torch and is reachable from the modules of `packages` (dotted names, e.g.
    "gateway" or "partitioner.planning"): one import path to it."""
    found: dict[str, list[str]] = {}
    for start in sorted(m for m in modules if any(m == p or m.startswith(f"{p}.") for p in packages)):
        seen, frontier = {start: [start]}, [start]
        while frontier:
            module = frontier.pop()
            for target in sorted(edges.get(module, ())):
                if target not in seen:
                    seen[target] = [*seen[module], target]
                    frontier.append(target)
        for module, path in seen.items():
            if _imports_torch(modules[module]):
                found.setdefault(module, path)
    return found


def test_the_gateway_and_the_pool_never_import_torch():
    """The gateway process holds no engine: nothing it imports, now or inside a function, reaches torch. (Its log
    setup came from the replica's worker module, and the planner read a local model's shape with the engine's config
    and loader, both importing torch: ~2.0 s to ready and ~250 MiB with an empty registry; ~0.7 s and ~70 MiB
    without.)"""
    modules = _modules()
    assert _torch_reached_from(ENGINE_FREE, modules, _imports(modules)) == {}


def test_importing_the_gateway_loads_no_torch():
    """The same, as the process sees it: importing the gateway's entry points and every pool module does not load
    torch (a check of the source misses an import made by name, or one a third-party package makes)."""
    entries = ["gateway.app", "gateway.server", *sorted(m for m in _modules() if m.split(".")[0] == "model_pool")]
    probe = (f"import importlib, sys\nfor name in {entries!r}:\n    importlib.import_module(name)\n"
             "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_torch_check_sees_a_path_through_a_function_level_import(tmp_path):
    engine, entry = tmp_path / "engine.py", tmp_path / "entry.py"
    engine.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
                      "def load():\n    import torch.nn\n")
    entry.write_text("def serve():\n    from runtimes.x import engine\n")
    modules = {"gateway.entry": entry, "runtimes.x.engine": engine}
    edges = {"gateway.entry": {"runtimes.x.engine"}}
    assert _torch_reached_from(("gateway",), modules, edges) == {
        "runtimes.x.engine": ["gateway.entry", "runtimes.x.engine"]}
    engine.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n")
    assert _torch_reached_from(("gateway",), modules, edges) == {}  # for annotations only
