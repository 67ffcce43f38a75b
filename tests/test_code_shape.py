"""House rules a reader relies on, checked on the source: a function fits on a screen, and the
drafter protocol is read in forerun/drafters/base.py, not probed for with getattr."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "forerun"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_FUNCTION_LINES = 60


def long_functions(source: str, label: str) -> list[str]:
    return [
        f"{label}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_functions_fit_on_a_screen(path: Path):
    assert not long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))


def test_the_length_check_sees_a_long_function():
    source = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert long_functions(source, "probe.py") == [f"probe.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]


# getattr/hasattr on a drafter: the hooks have defaults in the Drafter base class instead.
PROBING = re.compile(r"\b(getattr|hasattr)\(\s*(self\.)?(drafter|_drafter|d)\b")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_drafter_hook_is_probed(path: Path):
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [f"{n}: {line.strip()}" for n, line in enumerate(lines, 1) if PROBING.search(line)] == []


def test_the_probe_check_sees_getattr_on_a_drafter():
    assert PROBING.search('end = getattr(self.drafter, "end", None)')
    assert PROBING.search('max_rows = getattr(drafter, "max_rows", None)')
