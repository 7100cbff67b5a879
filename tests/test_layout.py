"""The tree reads as the flow: no import circles, and a storage node needs only the
standard library. Imports inside functions count too: a lazy import is still a circle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("smoltorrent", "coordinator", "worker_server", "tasks", "beat")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            # The longest known module the name refers to (a module or a name inside it).
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(p, known) - {m} for m, p in known.items()}


def test_no_import_circle_between_modules() -> None:
    graph = _graph()
    # A package's __init__ is imported by every module under it; ignore those edges.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                circles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_worker_server_needs_only_the_standard_library() -> None:
    # smoltorrent.errors and smoltorrent.defaults are shared with the node, so they too
    # must stay standard-library only.
    paths = [*(ROOT / "worker_server").rglob("*.py"), *(ROOT / "smoltorrent").glob("[ed_]*.py")]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                assert top in sys.stdlib_module_names or top in ("worker_server", "smoltorrent"), (
                    f"{path.relative_to(ROOT)} imports {top}: a storage node installs the "
                    "standard library only"
                )


def test_lower_layers_never_import_upper_ones() -> None:
    """Data flows one way: cli -> tasks -> plan/dataplane/state -> worker_server."""
    forbidden = {
        "worker_server": ("coordinator", "tasks", "beat"),
        "coordinator.plan": (
            "coordinator.dataplane",
            "coordinator.state",
            "coordinator.cli",
            "coordinator.local",
            "tasks",
            "beat",
        ),
        "coordinator.dataplane": (
            "coordinator.state",
            "coordinator.cli",
            "coordinator.local",
            "tasks",
            "beat",
        ),
        "coordinator.state": ("coordinator.cli", "coordinator.local", "tasks", "beat"),
        "coordinator.local": ("coordinator.cli", "tasks", "beat"),
        "tasks": ("coordinator.cli", "coordinator.local"),
        "smoltorrent.errors": ("coordinator", "tasks", "beat", "worker_server"),
        "smoltorrent.defaults": ("coordinator", "tasks", "beat", "worker_server"),
    }
    wrong = []
    for module, deps in _graph().items():
        for layer, above in forbidden.items():
            if module == layer or module.startswith(layer + "."):
                wrong += [f"{module} imports {d}" for d in deps if d.startswith(above)]
    assert wrong == []


def test_the_store_and_gather_path_never_imports_torch() -> None:
    """torch is smoltorrent.dcp's (the integration imports it) and the API's, lazily, never
    the store or gather path's: coordinator, tasks, worker_server and beat import neither
    torch nor smoltorrent.dcp, even inside a function."""
    found = []
    for package in ("coordinator", "worker_server", "tasks", "beat"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    continue
                found += [
                    f"{path.relative_to(ROOT)}: {n}"
                    for n in names
                    if n.split(".")[0] == "torch" or n.startswith("smoltorrent.dcp")
                ]
    assert found == []
