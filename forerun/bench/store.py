"""results.jsonl: one line per prompt x method x K x round, appended as each run ends, read back to resume.

A run interrupted mid-line leaves a torn last line; it is dropped on the next start. Every line
carries the settings that shape the numbers, so a resumed run refuses to mix in different ones.
"""

from __future__ import annotations

import json
from pathlib import Path

from forerun.base import files
from forerun.base.errors import ForerunError

Key = tuple[str, str, int, int]  # (prompt_id, method, k, round)


def record_key(record: dict) -> Key:
    return str(record["prompt_id"]), str(record["method"]), int(record["k"]), int(record.get("round", 0))


class ResultStore:
    def __init__(self, path: Path, settings: dict) -> None:
        self.path = path
        self.settings = settings
        self.records: list[dict] = self._load()
        self._by_key: dict[Key, dict] = {record_key(r): r for r in self.records}

    def has(self, prompt_id: str, method: str, k: int, round_: int = 0) -> bool:
        return (prompt_id, method, k, round_) in self._by_key

    def get(self, prompt_id: str, method: str, k: int, round_: int = 0) -> dict | None:
        return self._by_key.get((prompt_id, method, k, round_))

    def append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)
        self._by_key[record_key(record)] = record

    def check_options(self, method: str, k: int, options: dict) -> None:
        """A method's stored runs must have been made with the options asked for now."""
        for r in self.records:
            if r["method"] == method and r["k"] == k and r.get("options", {}) != options:
                raise ForerunError(
                    f"{self.path} holds {method} runs made with options {r.get('options')}, "
                    f"but this run asks for {options}; use another --out, or remove that file "
                    "to start over"
                )

    def _load(self) -> list[dict]:
        if not self.path.is_file():
            return []
        text = self.path.read_text()
        lines = text.split("\n")
        torn = lines.pop() if lines else ""  # after the last newline: empty, or a torn write
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ForerunError(
                    f"{self.path}, line {number}: not valid JSON; remove the line (or the "
                    "file, to start over) and run again"
                ) from None
            self._check_settings(record, number)
            records.append(record)
        if torn.strip():
            files.write_text(self.path, "".join(line + "\n" for line in lines))
        return records

    def _check_settings(self, record: dict, number: int) -> None:
        theirs = record.get("settings", {})
        if theirs == self.settings:
            return
        differ = sorted(k for k in set(theirs) | set(self.settings) if theirs.get(k) != self.settings.get(k))
        detail = "; ".join(f"{k}: {theirs.get(k)!r} there, {self.settings.get(k)!r} now" for k in differ)
        raise ForerunError(
            f"{self.path} (line {number}) holds results made with other settings ({detail}); "
            "use another --out, or remove that file to start over"
        )
