"""docs/architecture.md stays true to the code: its module table names every module there is, and
nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "forerun"


def table_modules(text: str) -> set[str]:
    return set(re.findall(r"^\| `([\w/]+\.py)` \|", text, flags=re.M))


def test_the_module_table_names_every_module_and_no_other():
    listed = table_modules((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    present = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.read_text(encoding="utf-8").strip()
    }
    assert sorted(present - listed) == [], "modules missing from docs/architecture.md's table"
    assert sorted(listed - present) == [], "docs/architecture.md's table names modules that are gone"


def test_the_table_reader_sees_a_row():
    assert table_modules("| `engine/batch.py` | batching |\n| not a row |") == {"engine/batch.py"}
