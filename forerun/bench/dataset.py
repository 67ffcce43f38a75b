"""Benchmark prompts: the bundled Spec-Bench question set or a user's JSONL, filtered by category."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forerun.commands.common import read_prompts_file
from forerun.errors import ForerunError

SPEC_BENCH = "spec-bench"
SPEC_BENCH_FILE = Path(__file__).resolve().parent.parent / "data" / "spec_bench_question.jsonl"

# Spec-Bench reports MT-bench's eight categories as one task kind, "multi-turn conversation".
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MT_BENCH = "mt_bench"
DEFAULT_CATEGORY = "default"   # for prompts whose line has no `category`


@dataclass(frozen=True)
class Prompt:
    prompt_id: str     # stable across runs of the same file: the question_id, else the record number
    category: str      # as written in the file
    task: str          # the task kind reports group by (Spec-Bench folds MT-bench into one)
    text: str          # the first user turn


def load_prompts(dataset: str, categories: list[str] | None = None,
                 limit_per_category: int | None = None) -> list[Prompt]:
    """Prompts of `dataset` ("spec-bench" or a JSONL path), in file order.

    `categories` keeps only those categories; a task kind (e.g. mt_bench) names all of its
    categories. `limit_per_category` keeps the first N prompts of each category.
    """
    is_spec_bench = dataset == SPEC_BENCH
    path = SPEC_BENCH_FILE if is_spec_bench else Path(dataset).expanduser()
    if not is_spec_bench and not path.is_file():
        raise ForerunError(f"dataset {dataset!r} is neither 'spec-bench' nor an existing JSONL file")
    records = read_prompts_file(path)
    ids = _prompt_ids(records)
    prompts = [Prompt(ids[i], _category(r), _task(_category(r), is_spec_bench), r["prompt"])
               for i, r in enumerate(records)]
    if categories:
        wanted = _expand_categories(categories, prompts)
        prompts = [p for p in prompts if p.category in wanted]
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
