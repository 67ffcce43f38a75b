"""Prompt files: a JSONL of prompts, and the bundled Spec-Bench question set filtered by category."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from forerun.base.errors import ForerunError

SPEC_BENCH = "spec-bench"
SPEC_BENCH_FILE = Path(__file__).resolve().parent.parent / "data" / "spec_bench_question.jsonl"

# Spec-Bench reports MT-bench's eight categories as one task kind, "multi-turn conversation".
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MT_BENCH = "mt_bench"
DEFAULT_CATEGORY = "default"  # for prompts whose line has no `category`


@dataclass(frozen=True)
class Prompt:
    prompt_id: str  # stable across runs of the same file: the question_id, else the record number
    category: str  # as written in the file
    task: str  # the task kind reports group by (Spec-Bench folds MT-bench into one, unless one is asked for)
    text: str  # the first user turn (with a suffix: the text before the gap)
    suffix: str | None = None  # the text after a gap the answer fills in (`Tokenizer.infill`); None: none
    prediction: str | None = None  # what the answer is expected to be (`SamplingParams.prediction`)


def load_prompts(
    dataset: str, categories: list[str] | None = None, limit_per_category: int | None = None
) -> list[Prompt]:
    """Prompts of `dataset` ("spec-bench" or a JSONL path), in file order.

    `categories` keeps only those categories; a task kind (e.g. mt_bench) names all of its
    categories. A category asked for by its own name is its prompts' task kind (`coding` reports as
    coding, not as mt_bench). `limit_per_category` keeps the first N prompts of each category.
    """
    is_spec_bench = dataset == SPEC_BENCH
    path = SPEC_BENCH_FILE if is_spec_bench else Path(dataset).expanduser()
    if not is_spec_bench and not path.is_file():
        raise ForerunError(f"dataset {dataset!r} is neither 'spec-bench' nor an existing JSONL file")
    records = read_prompts_file(path)
    ids = _prompt_ids(records)
    prompts = [
        Prompt(
            ids[i], _category(r), _task(_category(r), is_spec_bench), r["prompt"], r.get("suffix"), r.get("prediction")
        )
        for i, r in enumerate(records)
    ]
    if categories:
        wanted, named = _expand_categories(categories, prompts), set(categories)
        prompts = [replace(p, task=p.category) if p.category in named else p for p in prompts if p.category in wanted]
    if limit_per_category is not None:
        if limit_per_category < 1:
            raise ForerunError(f"--limit-per-category must be at least 1, got {limit_per_category}")
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= limit_per_category:
                kept.append(p)
        prompts = kept
    return prompts


def unread_fields(records: list[dict], command: str, reads: tuple[str, ...] = ()) -> None:
    """A clear error where a prompt record holds a `suffix` or a `prediction` that `command` does not
    read (it would run the prompt without it); `reads`: the ones it does."""
    for number, record in enumerate(records, 1):
        for name in ("suffix", "prediction"):
            if name not in reads and record.get(name) is not None:
                raise ForerunError(
                    f"prompt {record.get('prompt_id', number)} has a '{name}', which {command} does not read "
                    "(forerun bench does): take it out of the file"
                )


def in_turn(groups: list[list]) -> list:
    """The groups' items taken one group at a time in turn (the first of each, then the second of
    each, ...), so that the first N items cover as many groups as they can."""
    return [group[i] for i in range(max(map(len, groups), default=0)) for group in groups if i < len(group)]


def valid_unicode(text: str, what: str) -> str:
    """`text` if it is valid Unicode (a lone surrogate, from a JSON escape or a shell's bytes, is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ForerunError(
            f"{what} is not valid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start}; "
            "write surrogates in pairs (or the character itself), and give files and arguments as UTF-8"
        ) from None
    return text


def in_vocabulary(ids: list[int], vocab_size: int) -> list[int]:
    """Token ids as plain ints if every one is below `vocab_size` and not negative."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ForerunError(f"token id {bad} is outside the vocabulary (0 to {vocab_size - 1})")
    return [int(t) for t in ids]


def read_prompts_file(path: str | Path) -> list[dict]:
    """JSONL records with `prompt` (or `turns`, whose first item is used), a `suffix` where the
    answer fills the gap between them, a `prediction` of the answer; other fields are kept."""
    path = Path(path)
    if path.is_dir():
        raise ForerunError(f"prompts file {path} is a folder: give a .jsonl file, one JSON object a line")
    if not path.is_file():
        raise ForerunError(f"prompts file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is no text
    except UnicodeDecodeError as exc:
        raise ForerunError(f"prompts file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:  # unreadable: its permissions, a device error
        raise ForerunError(f"prompts file {path} cannot be read ({exc.strerror or exc})") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ForerunError(f"{path}, line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ForerunError(f"{path}, line {number}: expected a JSON object with 'prompt' or 'turns'")
        if isinstance(obj.get("prompt"), str):
            text = obj["prompt"]
        elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
            text = obj["turns"][0]
        else:
            raise ForerunError(f"{path}, line {number}: missing 'prompt' (a string) or 'turns' (a list of strings)")
        for name, what in (("suffix", "the text after the gap"), ("prediction", "the answer expected")):
            value = obj.get(name)
            if value is not None and not isinstance(value, str):
                raise ForerunError(f"{path}, line {number}: '{name}' must be a string ({what})")
            if value is not None:
                valid_unicode(value, f"{path}, line {number}: the {name}")
        records.append({**obj, "prompt": valid_unicode(text, f"{path}, line {number}: the prompt")})
    if not records:
        raise ForerunError(f"prompts file {path} holds no prompts")
    return records


def _category(record: dict) -> str:
    value = record.get("category")
    return str(value) if value not in (None, "") else DEFAULT_CATEGORY


def _task(category: str, is_spec_bench: bool) -> str:
    return MT_BENCH if is_spec_bench and category in MT_BENCH_CATEGORIES else category


def _prompt_ids(records: list[dict]) -> list[str]:
    # question_id only when every record has a distinct one; otherwise the 1-based record number.
    ids = [str(r.get("question_id")) for r in records]
    if all(r.get("question_id") is not None for r in records) and len(set(ids)) == len(ids):
        return ids
    return [str(i + 1) for i in range(len(records))]


def _expand_categories(asked: list[str], prompts: list[Prompt]) -> set[str]:
    present = list(dict.fromkeys(p.category for p in prompts))
    groups: dict[str, set[str]] = {}
    for p in prompts:
        if p.task != p.category:
            groups.setdefault(p.task, set()).add(p.category)
    wanted: set[str] = set()
    for name in asked:
        if name in groups:
            wanted |= groups[name]
        elif name in present:
            wanted.add(name)
        else:
            valid = ", ".join(present + sorted(groups))
            raise ForerunError(f"unknown category {name!r}; this dataset has: {valid}")
    return wanted


def task_order(prompts: list[Prompt]) -> list[str]:
    """Task kinds in the order they first appear."""
    return list(dict.fromkeys(p.task for p in prompts))
