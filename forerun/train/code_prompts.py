"""Coding prompts made from a code corpus: one per documented public function or method of its
Python files, e.g. "Write a Python function `wrap(text, width)`: Wrap a single paragraph of text,
returning a list of wrapped lines."

The target's answers to them teach a draft head how the target writes code in a chat answer, which
neither corpus text (no assistant turn) nor Spec-Bench's training prompts (no coding ones) show.
The prompts are taken one file at a time in turn, so the first N cover as many files as they can.
"""

from __future__ import annotations

import ast
from pathlib import Path

from forerun.base.errors import ForerunError
from forerun.base.prompts import Prompt, in_turn
from forerun.train.corpus import UNPARSABLE, CorpusReport, iter_documents

CATEGORY = "coding"
MIN_SUMMARY_CHARS = 12  # shorter docstrings ("Helper.", "TODO") say too little to write code from
MAX_SUMMARY_CHARS = 400


def code_prompts(paths: list[str | Path], report: CorpusReport | None = None) -> list[Prompt]:
    """A prompt for every documented public function and public class's public method in the
    public Python modules under `paths`, one file at a time in turn; the same text twice is kept once.
    Files that are not Python, or do not parse, give none (the latter counted in `report`).
    Raises ForerunError when no prompt comes out."""
    report = report if report is not None else CorpusReport()
    per_file: list[list[Prompt]] = []
    for document in iter_documents(paths, report):
        if document.path.suffix != ".py" or _private(document.path):
            continue
        try:
            tree = ast.parse(document.text)
        except (SyntaxError, ValueError):
            report.skip(UNPARSABLE, document.path)
            continue
        found = [Prompt(f"{document.path}:{name}", CATEGORY, CATEGORY, text) for name, text in _prompts(tree)]
        if found:
            per_file.append(found)
    seen: set[str] = set()
    prompts = []
    for prompt in in_turn(per_file):
        if prompt.text not in seen:
            seen.add(prompt.text)
            prompts.append(prompt)
    if not prompts:
        names = ", ".join(str(p) for p in paths)
        raise ForerunError(
            f"no documented public Python function under {names}: pass folders of Python sources "
            "whose functions have docstrings"
        )
    return prompts


def _private(path: Path) -> bool:
    """A private module (`_pydecimal.py`; not `__init__.py`): not a public API to write code against."""
    return path.name.startswith("_") and path.name != "__init__.py"


def _prompts(tree: ast.Module) -> list[tuple[str, str]]:
    """(qualified name, prompt) for the module's documented public functions and methods."""
    out = []
    for node in tree.body:
        if _public_function(node):
            summary = _summary(node)
            if summary:
                out.append((node.name, f"Write a Python function `{node.name}({_arguments(node)})`: {summary}"))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                summary = _summary(item) if _public_function(item) else None
                if summary:
                    signature = f"{item.name}({_arguments(item, method=True)})"
                    out.append(
                        (
                            f"{node.name}.{item.name}",
                            f"Write the method `{signature}` of a Python class `{node.name}`: {summary}",
                        )
                    )
    return out


def _public_function(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")


def _summary(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The docstring's first paragraph on one line, or None when it is missing or too short."""
    doc = ast.get_docstring(node)
    if not doc:
        return None
    summary = " ".join(doc.strip().split("\n\n")[0].split())
    if len(summary) < MIN_SUMMARY_CHARS:
        return None
    return summary if len(summary) <= MAX_SUMMARY_CHARS else summary[:MAX_SUMMARY_CHARS].rsplit(" ", 1)[0] + " ..."


def _arguments(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool = False) -> str:
    """The parameter names as a call would show them (`a, b, *args, key, **kwargs`), without a
    method's self or cls."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if method and names and names[0] in ("self", "cls"):
        names = names[1:]
    if a.vararg:
        names.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        names.append("*")
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append(f"**{a.kwarg.arg}")
    return ", ".join(names)
