"""forerun's packages form layers, and an import may only point down (or across one layer).

Every import statement is read from the source, the ones inside functions included, so a
function-level import cannot hide an arrow that climbs. The layers are the ones
docs/architecture.md draws.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "forerun"

# Lowest first. A module may import its own layer and any layer below it.
LAYERS: list[tuple[str, ...]] = [
    ("forerun.base",),
    ("forerun.native",),
    ("forerun.models", "forerun.heads"),
    ("forerun.verification",),
    ("forerun.policy",),
    ("forerun.drafters",),
    ("forerun.engine",),
    ("forerun.api", "forerun.serve"),
    ("forerun.train", "forerun.bench"),
    ("forerun.commands", "forerun.cluster"),
    ("forerun.cli", "forerun"),
]


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            # "forerun" (the package's face) is a layer of its own name alone, not of every module.
            inside = module.startswith(prefix + ".") and prefix != "forerun"
            if (module == prefix or inside) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS and docs/architecture.md")
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(source: str, here: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every forerun module that module `here` (its `source`) imports, wherever
    the statement sits."""
    package = here if is_package else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # `from forerun import native` imports a module; `from forerun.x import name` imports from one.
                candidate = f"{base}.{alias.name}"
                target = candidate if _is_module(candidate) else base
                found.append((node.lineno, target))
    return [(line, name) for line, name in found if name == "forerun" or name.startswith("forerun.")]


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    for path in SOURCES:
        layer_of(module_name(path))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_import_climbs_a_layer(path: Path):
    here = module_name(path)
    climbing = [
        f"line {line}: {here} (layer {layer_of(here)}) imports {name} (layer {layer_of(name)})"
        for line, name in imported(path.read_text(encoding="utf-8"), here, path.name == "__init__.py")
        if layer_of(name) > layer_of(here)
    ]
    assert not climbing, "\n".join(climbing)


def test_a_module_of_no_listed_package_has_no_layer():
    # The negative control of the test above: a new package must be placed, not fall into the top layer.
    with pytest.raises(AssertionError, match="forerun.newpkg.x is in no layer"):
        layer_of("forerun.newpkg.x")
    assert layer_of("forerun") == layer_of("forerun.cli") == len(LAYERS) - 1


def test_the_checker_sees_a_climbing_import():
    # The negative control: a function-level import from a higher layer is found.
    source = "def f():\n    from forerun.engine.engine import Engine\n    return Engine\n"
    assert [(2, "forerun.engine.engine")] == imported(source, "forerun.base.probe")
    assert layer_of("forerun.engine.engine") > layer_of("forerun.base.probe")


# No circle between modules: `forerun serve --ray` goes from cli.py to the cluster, which builds on
# commands/serve.py (commands and cluster share a layer), and commands/serve.py never imports the cluster.
# A registry package's modules may import the package they register in (drafters/__init__.py).
NAMED_CIRCLES: list[set[str]] = []


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The sets of two or more modules that import one another round a loop (strongly connected)."""
    order, low, stack, found = {}, {}, [], []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            ring = set()
            while not ring or v not in ring:
                ring.add(stack.pop())
            if len(ring) > 1:
                found.append(ring)

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in SOURCES:
        here, package = module_name(path), path.name == "__init__.py"
        names = {name for _, name in imported(path.read_text(encoding="utf-8"), here, package)}
        graph[here] = {name for name in names if package or not here.startswith(name + ".")}
    return graph


def test_modules_import_one_another_in_no_circle():
    assert sorted(map(sorted, circles(import_graph()))) == sorted(map(sorted, NAMED_CIRCLES))


def test_the_circle_finder_sees_a_circle_through_a_function_level_import():
    # The negative control: decoder -> native_layer at the top, native_layer -> decoder inside a function.
    graph = {
        "forerun.models.decoder": {name for _, name in imported("from forerun.models import native_layer\n", "x.y")},
        "forerun.models.native_layer": {
            name for _, name in imported("def f():\n    from forerun.models.decoder import Rope\n", "x.y")
        },
        "forerun.models.norm": set(),
    }
    assert circles(graph) == [{"forerun.models.decoder", "forerun.models.native_layer"}]
