"""docs/architecture.md stays true to the tree: every path, test and Lua script it cites
exists, and every module of the packages and every script of the state rooms is named in
it, so a newcomer finds the module for any change and a rename or a new module that
forgets the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("smoltorrent", "coordinator", "worker_server", "tasks", "beat")
# What a cited path starts with: the repository's own folders and top-level files.
TOP = (
    *(f"{folder}/" for folder in (*PACKAGES, "tests", "docs", "bench", "deploy", "scripts")),
    "README.md",
    "pyproject.toml",
    "docker-compose.yml",
)
CITED = re.compile(r"`([^`\s]+)`")
TEST = re.compile(r"^(tests/[\w/]+\.py)::(\w+)$")


def _cited() -> list[str]:
    return [c for c in CITED.findall(DOC.read_text()) if c.startswith(TOP)]


def test_every_path_the_architecture_cites_exists() -> None:
    missing = []
    for cited in _cited():
        path = cited.split("::")[0]
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path]
        if not found or not all(p.exists() for p in found):
            missing.append(cited)
    assert missing == [], f"docs/architecture.md cites what does not exist: {missing}"


def test_every_test_the_architecture_cites_exists() -> None:
    tests = [m for c in _cited() if (m := TEST.match(c))]
    assert tests, "the invariants section names no test"
    missing = [
        m.group(0)
        for m in tests
        if not (ROOT / m.group(1)).is_file()
        or not re.search(rf"^\s*def {m.group(2)}\(", (ROOT / m.group(1)).read_text(), re.M)
    ]
    assert missing == [], f"docs/architecture.md names tests that do not exist: {missing}"


def test_every_lua_script_is_named_where_it_is() -> None:
    """The state rooms' scripts are cited as `room/name` (coordinator/state/lua/room/name.lua)."""
    lua = ROOT / "coordinator" / "state" / "lua"
    rooms = {p.name for p in lua.iterdir() if p.is_dir() and p.name != "includes"}
    cited = {c for c in CITED.findall(DOC.read_text()) if c.split("/")[0] in rooms}
    scripts = {f"{p.parent.name}/{p.stem}" for room in rooms for p in (lua / room).glob("*.lua")}
    assert sorted(cited - scripts) == [], "docs/architecture.md names scripts that do not exist"
    assert sorted(scripts - cited) == [], "docs/architecture.md does not name these scripts"


def test_every_module_is_named_in_the_architecture() -> None:
    cited = set(_cited())
    modules = sorted(
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py"
    )
    unnamed = [m for m in modules if m not in cited]
    assert unnamed == [], (
        f"add a line for each to docs/architecture.md (The rooms, or Where to change what):"
        f" {unnamed}"
    )
