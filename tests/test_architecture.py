"""The package's rooms keep their rules: who may import whom, and no import cycles.

Read from the source with `ast` (imports inside functions count too), so a rule broken anywhere
in ``kvsidecar/`` fails here, whatever the tests exercise. docs/architecture.md explains the rooms.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvsidecar"

ROOMS = {
    "core",
    "wire",
    "memory",
    "node",
    "peer",
    "daemon",
    "client",
    "integrations",
    "bench",
    "face",
}
"""Rooms are the sub-packages; ``face`` is the top-level modules (cli, demo, status)."""

MAY_IMPORT: dict[str, set[str]] = {
    # room: the other rooms it may import, from the bottom floor up
    "wire": set(),
    "core": {"wire"},
    "memory": {"core", "wire"},
    # what the daemon and the peer both build on: the node's state, settings, copies, security
    "node": {"core", "wire", "memory"},
    "peer": {"node", "core", "wire", "memory"},
    "daemon": {"node", "peer", "core", "wire", "memory"},
    "client": {"core", "wire", "memory"},
    # engine integrations build on the client (and its wire and core types) only
    "integrations": {"client", "core", "wire"},
}
FORBIDDEN: dict[str, set[str]] = {
    room: ROOMS - allowed - {room} for room, allowed in MAY_IMPORT.items()
}
"""Per room, the rooms it must never import: every room it may not."""

FACE = {"cli", "demo", "status"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Iterator[tuple[str, Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield _module_name(path), path, ast.parse(path.read_text(), str(path))


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (imported for annotations only)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _imports(name: str, path: Path, tree: ast.Module, *, runtime_only: bool = False) -> set[str]:
    """Every kvsidecar module ``name`` imports, at any depth, resolved to dotted names.

    ``runtime_only`` leaves out imports under ``if TYPE_CHECKING:``, which never run.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = _type_checking_nodes(tree) if runtime_only else set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvsidecar"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            if not module.startswith("kvsidecar"):
                continue
            found.add(module)
            # ``from kvsidecar.wire import protocol`` imports the module kvsidecar.wire.protocol
            for alias in node.names:
                if (PACKAGE.parent / module.replace(".", "/") / f"{alias.name}.py").exists():
                    found.add(f"{module}.{alias.name}")
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] in FACE:
        return "face"
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "package"  # kvsidecar/__init__.py, exitcodes


GRAPH = {name: (_imports(name, path, tree), path) for name, path, tree in _modules()}
RUNTIME = {name: _imports(name, path, tree, runtime_only=True) for name, path, tree in _modules()}


def test_the_rooms_exist() -> None:
    rooms = {_room(m) for m in GRAPH}
    assert rooms - {"package"} == ROOMS


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_it_may(room: str) -> None:
    broken = []
    for module, (imports, _) in GRAPH.items():
        if _room(module) != room:
            continue
        broken.extend(
            f"{module} imports {target}" for target in imports if _room(target) in FORBIDDEN[room]
        )
    assert not broken, "\n".join(sorted(broken))


def test_nothing_imports_the_integrations() -> None:
    broken = [
        f"{module} imports {target}"
        for module, (imports, _) in GRAPH.items()
        for target in imports
        if _room(target) == "integrations" and _room(module) != "integrations"
    ]
    assert not broken, "\n".join(sorted(broken))


VLLM_FACING = {
    "kvsidecar.integrations.vllm.connector",
    "kvsidecar.integrations.vllm.metrics",
    "kvsidecar.integrations.vllm.carried",
}
"""The modules that import vLLM: the connector, and its metrics and metadata types, which only
the connector uses."""


def test_only_the_vllm_connector_imports_vllm() -> None:
    """vLLM lives in its own venv: the package imports without it. Only the connector (which
    ``kvsidecar.integrations.vllm`` loads lazily) and the modules only it imports use vLLM."""
    users = {m for m, (imports, _) in GRAPH.items() if imports & VLLM_FACING} - VLLM_FACING
    assert users <= {"kvsidecar.integrations.vllm"}, users
    importers = set()
    for module, _path, tree in _modules():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                importers.add(module)
    assert importers == VLLM_FACING


def test_only_the_cli_imports_bench() -> None:
    broken = [
        f"{module} imports {target}"
        for module, (imports, _) in GRAPH.items()
        for target in imports
        if _room(target) == "bench" and _room(module) != "bench" and module != "kvsidecar.cli"
    ]
    assert not broken, "\n".join(sorted(broken))


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    cycles: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return cycles


def test_no_import_cycles_between_modules() -> None:
    """Lazy imports inside functions count: a cycle is a cycle however it is hidden.

    Imports for annotations only (``if TYPE_CHECKING:``) never run and do not count; the room
    rules above still see them.
    """
    # A module importing its own parent package (its __init__ runs first) is not a cycle.
    edges = {
        m: {t for t in imports if t in GRAPH and t != m and not m.startswith(t + ".")}
        for m, imports in RUNTIME.items()
    }
    assert not _cycles(edges), "\n".join(_cycles(edges))
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]


def test_the_rule_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The walk above resolves relative and lazy imports; a checker that sees none passes all."""
    src = "def f():\n    from ..daemon import server\n    from kvsidecar.client import aio\n"
    path = PACKAGE / "core" / "example.py"
    found = _imports("kvsidecar.core.example", path, ast.parse(src))
    assert "kvsidecar.daemon.server" in found
    assert "kvsidecar.client.aio" in found
    assert _room("kvsidecar.daemon.server") in FORBIDDEN["core"]
    assert _room("kvsidecar.daemon.server") in FORBIDDEN["peer"]
