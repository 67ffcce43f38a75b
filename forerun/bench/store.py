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
RECORD_KEYS = ("prompt_id", "method", "k", "settings")  # what every result line holds


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
        lines = self.path.read_bytes().split(b"\n")
        torn = lines.pop() if lines else b""  # after the last newline: empty, or a torn write
        records, kept = [], []
        for number, raw in enumerate(lines, 1):
            line = self._text(raw, number)
            kept.append(line)
            if line.strip():
                records.append(self._record(line, number))
        if torn.strip():
            files.write_text(self.path, "".join(line + "\n" for line in kept))
        return records

    def _text(self, raw: bytes, number: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._bad_line(number, "not UTF-8 text") from None

    def _record(self, line: str, number: int) -> dict:
        """Line `number`, read and checked: one result made with this run's settings."""
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise self._bad_line(number, "not valid JSON") from None
        if not isinstance(record, dict) or any(key not in record for key in RECORD_KEYS):
            raise self._bad_line(number, f"not a result line (a JSON object with {', '.join(RECORD_KEYS)})")
        try:
            record_key(record)
        except (TypeError, ValueError):
            raise self._bad_line(number, "not a result line (its k and round are not whole numbers)") from None
        if not isinstance(record["settings"], dict):
            raise self._bad_line(number, "not a result line (its settings are not a JSON object)")
        self._check_settings(record, number)
        return record

    def _bad_line(self, number: int, what: str) -> ForerunError:
        return ForerunError(
            f"{self.path}, line {number}: {what}; remove the line (or the file, to start over) and run again"
        )

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
