"""The import drawing of ARCHITECTURE.md, checked: every import points down or within its area, the
two services never import each other, no import circle, one namespace.

Read from the source with ``ast`` (every import, module level or inside a function), so the check
needs nothing installed and names the offending line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The repository's top-level packages; each is installed as hmakv.<name> (hmakv/<name> links it).
LINKED = ("producer", "kvlog", "bridge", "consumers")
# What a service may know of the producer: the payloads, the ZMQ transport and its CURVE keys,
# the block hashes.
CONTRACTS = frozenset(
    {
        "hmakv.producer.events",
        "hmakv.producer.protocol",
        "hmakv.producer.curve",
        "hmakv.producer.hashing",
    }
)
# Each area and the areas it may import (its own always); the tooling of hmakv/ sits on top.
ALLOWED: dict[str, frozenset[str]] = {
    "hmakv.producer": frozenset(),
    "hmakv.kvlog": frozenset({"contracts"}),
    "hmakv.bridge": frozenset({"contracts", "hmakv.kvlog"}),
    "hmakv.consumers": frozenset({"contracts", "hmakv.kvlog"}),
    "hmakv.kafka": frozenset(),
    "hmakv.vllm": frozenset({"hmakv.producer", "hmakv.kafka"}),
    # The demo's summary replays its own traffic through the routing study.
    "hmakv.demo": frozenset(
        {"hmakv.producer", "hmakv.kvlog", "hmakv.kafka", "hmakv.vllm", "hmakv.routing"}
    ),
    # The fleet benchmark runs the services as processes, the hops' ceilings in its own, and
    # reads the services' metrics pages as the demo does; its scale study builds one index.
    "hmakv.fleet": frozenset(
        {
            "hmakv.producer",
            "hmakv.kvlog",
            "hmakv.bridge",
            "hmakv.consumers",
            "hmakv.kafka",
            "hmakv.demo",
        }
    ),
    # The routing study runs the engine, the bridge's fan-out and the index in one process.
    "hmakv.routing": frozenset(
        {"hmakv.producer", "hmakv.kvlog", "hmakv.bridge", "hmakv.consumers"}
    ),
}


@dataclass(frozen=True)
class Import:
    module: str
    target: str
    line: int


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    paths = [
        *(REPO / "hmakv").rglob("*.py"),
        *(p for n in LINKED for p in (REPO / n).rglob("*.py")),
    ]
    for path in paths:
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[0] != "hmakv":
            parts = ("hmakv", *parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(modules: dict[str, Path]) -> Iterator[Import]:
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                yield Import(module, name, node.lineno)


def _area(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _internal_edges() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for imp in _imports(modules):
        if imp.target in modules and imp.target != imp.module:
            edges[imp.module].add(imp.target)
    return edges


def test_the_repository_packages_are_linked_into_the_namespace() -> None:
    for name in LINKED:
        link = REPO / "hmakv" / name
        assert link.is_symlink() and link.resolve() == (REPO / name).resolve(), link


def test_nothing_imports_a_package_outside_the_namespace() -> None:
    """``producer.events`` and ``hmakv.producer.events`` would be two modules with two sets of
    classes: only the namespaced name is used, in the code as in the tests and benchmarks."""
    modules = _modules()
    sources = [*modules.values(), *REPO.glob("tests/**/*.py"), *REPO.glob("benchmarks/**/*.py")]
    wrong = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            wrong += [f"{path}:{node.lineno} {n}" for n in names if n.split(".")[0] in LINKED]
    assert not wrong


def test_every_import_points_down_or_within_its_area() -> None:
    wrong = []
    for imp in _imports(_modules()):
        if not imp.target.startswith("hmakv."):
            continue
        source, target = _area(imp.module), _area(imp.target)
        if source not in ALLOWED or source == target:
            continue
        allowed = ALLOWED[source]
        if target in allowed or ("contracts" in allowed and imp.target in CONTRACTS):
            continue
        if "contracts" in allowed and imp.target.rsplit(".", 1)[0] in CONTRACTS:
            continue  # ``from hmakv.producer.events import X`` also yields "...events.X"
        wrong.append(f"{imp.module}:{imp.line} imports {imp.target}")
    assert not wrong


def test_no_import_circle() -> None:
    """Tarjan's strongly connected components over module imports: any with two or more members
    is a circle (a module importing itself is not counted)."""
    edges = _internal_edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in edges[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                circles.append(sorted([module, *component]))

    for module in edges:
        if module not in index:
            visit(module)
    assert not circles
