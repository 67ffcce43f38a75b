"""Coding prompts made from a code corpus (`forerun train --code-prompts`): one per documented public
function or method, taken one file at a time in turn; what is private, undocumented, not Python or
not parsable gives none; the training run answers them and records where they came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.train.code_prompts import code_prompts
from forerun.train.corpus import UNPARSABLE, CorpusReport
from tests.test_train_unrolled import answer_args, model_folder  # noqa: F401  (a fixture)

TEXTS = '''"""A module."""


def wrap(text, width=70, *, tabsize=8, **options):
    """Wrap a single paragraph of text, returning a list of wrapped lines.

    More detail that the prompt leaves out.
    """


def undocumented(a):
    return a


def short(a):
    """Helper."""


def _private(a):
    """Private helpers are not a public API to write."""


class Wrapper:
    """A class."""

    def fill(self, text, *args):
        """Fill a single paragraph of text, returning a new string."""

    @classmethod
    def make(cls, width):
        """Make a wrapper of the given width."""

    def _hidden(self):
        """Private methods give no prompt either."""


class _Private:
    def public(self):
        """A public method of a private class gives none."""
'''

OTHER = '''def first(x):
    """Return the first item of the sequence x."""


def second(x):
    """Return the second item of the sequence x."""


def copy(text, width):
    """Wrap a single paragraph of text, returning a list of wrapped lines."""
'''


@pytest.fixture
def code(tmp_path: Path) -> Path:
    root = tmp_path / "code"
    (root / "pkg").mkdir(parents=True)
    (root / "a.py").write_text(TEXTS)
    (root / "pkg" / "b.py").write_text(OTHER)
    (root / "pkg" / "__init__.py").write_text('def hello(name):\n    """Say hello to the person named."""\n')
    (root / "_private.py").write_text('def shown(a):\n    """A private module is not a public API."""\n')
    (root / "broken.py").write_text("def broken(:\n")
    (root / "notes.txt").write_text('def in_text(a):\n    """Not Python source: no prompt."""\n')
    return root


def test_documented_public_functions_and_methods_become_prompts(code: Path) -> None:
    report = CorpusReport()
    prompts = code_prompts([code / "a.py"], report)
    assert [p.prompt_id.rsplit(":", 1)[1] for p in prompts] == ["wrap", "Wrapper.fill", "Wrapper.make"]
    assert prompts[0].text == (
        "Write a Python function `wrap(text, width, *, tabsize, **options)`: "
        "Wrap a single paragraph of text, returning a list of wrapped lines."
    )
    assert prompts[1].text == (
        "Write the method `fill(text, *args)` of a Python class `Wrapper`: "
        "Fill a single paragraph of text, returning a new string."
    )
    assert prompts[2].text.startswith("Write the method `make(width)` of a Python class `Wrapper`")
    assert {p.category for p in prompts} == {"coding"} and prompts[0].prompt_id == f"{code / 'a.py'}:wrap"


def test_files_are_taken_in_turn_and_the_same_text_is_kept_once(code: Path) -> None:
    report = CorpusReport()
    names = [p.prompt_id.rsplit(":", 1)[1] for p in code_prompts([code], report)]
    # a.py, pkg/__init__.py, pkg/b.py in turn; b.py's `copy` repeats a.py's `wrap` text word for word
    # under another signature, so it stays; private, broken and non-Python files give nothing.
    assert names == ["wrap", "hello", "first", "Wrapper.fill", "second", "Wrapper.make", "copy"]
    assert report.count(UNPARSABLE) == 1 and "1 unparsable Python" in report.line()


def test_a_long_docstring_is_cut_at_a_word(tmp_path: Path) -> None:
    source = tmp_path / "long.py"
    source.write_text(f'def f(a):\n    """{"word " * 200}"""\n')
    (prompt,) = code_prompts([source])
    summary = prompt.text.split(": ", 1)[1]
    assert summary.endswith("word ...") and len(summary) <= 404


def test_code_without_a_documented_public_function_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("def f(a):\n    return a\n")
    with pytest.raises(ForerunError, match=f"no documented public Python function under {tmp_path}"):
        code_prompts([tmp_path])


def test_train_answers_coding_prompts_and_records_them(model_folder, code, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "head"
    args = answer_args(model_folder, tmp_path / "unused.jsonl", out, "--answers", "3", "--code-prompts", str(code))
    args.remove("--prompts")
    args.remove(str(tmp_path / "unused.jsonl"))
    assert main(args) == 0
    training = json.loads((out / "config.json").read_text())["training"]
    assert training["prompts"] is None and training["code_prompts"] == [str(code)]
    assert training["eval_prompt_ids"] == [f"{code / 'a.py'}:wrap"]  # the first round is measured on
    assert training["prompt_ids"] == [f"{code / 'pkg' / '__init__.py'}:hello", f"{code / 'pkg' / 'b.py'}:first"] + [
        f"{code / 'a.py'}:Wrapper.fill"
    ]
    assert training["answers"] == 3 and training["hold_out_per_category"] is None


def test_train_mixes_coding_prompts_with_a_prompt_file(model_folder, code, tmp_path) -> None:  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"abc{i}", "category": "chat"}) + "\n" for i in range(3)))
    out = tmp_path / "head"
    args = answer_args(model_folder, prompts, out, "--answers", "4", "--code-prompts", str(code / "pkg"))
    assert main(args) == 0
    training = json.loads((out / "config.json").read_text())["training"]
    # One of each category is measured on; the rest are trained on, the categories in turn.
    assert training["eval_prompt_ids"] == ["1", f"{code / 'pkg' / '__init__.py'}:hello"]
    assert training["prompt_ids"] == ["2", f"{code / 'pkg' / 'b.py'}:first", "3", f"{code / 'pkg' / 'b.py'}:second"]


def test_a_missing_code_path_is_refused_before_the_model_loads(tmp_path, capsys) -> None:
    args = answer_args(tmp_path / "model", tmp_path / "p.jsonl", tmp_path / "out", "--code-prompts", "/nowhere")
    assert main(args) == 2
    assert "--code-prompts path /nowhere does not exist" in capsys.readouterr().err
