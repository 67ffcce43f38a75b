"""Reading a training corpus: files and folders of text or code turned into documents, then into
fixed-length token chunks for the target to label.

Folders are walked recursively in sorted order (the same corpus always gives the same chunks, so an
interrupted labelling run can skip what it already did). Hidden entries and build/cache folders are
not read; binary, oversize, empty and undecodable files are skipped and counted in a `CorpusReport`
the caller prints as one line, so nothing is dropped silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from forerun.base.errors import ForerunError

MAX_FILE_BYTES = 2 << 20  # larger files are mostly generated (minified code, data dumps, lock files)
SNIFF_BYTES = 8 << 10  # how much of a file the binary and text checks look at
CONTROL_SHARE = 0.30  # more control bytes than this in the sniffed part: binary
PRINTABLE_SHARE = 0.95  # a latin-1 reading must be at least this printable to count as text
EXAMPLES = 20  # example paths kept per skip reason
JUNK_FOLDERS = frozenset({"__pycache__", "node_modules", ".git", ".venv", "venv", "build", "dist"})

_TEXT_CONTROLS = frozenset(b"\t\n\r\f")
_CONTROLS = frozenset(range(32)) - _TEXT_CONTROLS | {0x7F}
_UTF32_BOMS = (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")  # checked first: UTF-32 LE starts like UTF-16 LE
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")

# Skip reasons, as they read in the report's line.
BINARY, TOO_LARGE, UNDECODABLE, EMPTY, UNREADABLE = "binary", "too_large", "undecodable", "empty", "unreadable"
UNPARSABLE = "unparsable"  # Python that does not parse, where prompts are made from code


@dataclass
class Document:
    path: Path
    text: str


@dataclass
class CorpusReport:
    """What reading a corpus did: files and bytes read, and files skipped by reason (with up to
    EXAMPLES example paths per reason)."""

    files: int = 0
    bytes: int = 0  # of the files read, as stored on disk
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[Path]] = field(default_factory=dict)
    max_file_bytes: int = MAX_FILE_BYTES

    def skip(self, reason: str, path: Path) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES:
            shown.append(path)

    def count(self, reason: str) -> int:
        return self.skipped.get(reason, 0)

    def line(self) -> str:
        """One line for the user, e.g. "read 120 files (1.4 MB); skipped 3 binary, 1 over 2 MiB"."""
        text = f"read {self.files} file{'' if self.files == 1 else 's'} ({_size(self.bytes)})"
        labels = {
            BINARY: "binary",
            TOO_LARGE: f"over {_cap(self.max_file_bytes)}",
            UNDECODABLE: "undecodable",
            EMPTY: "empty",
            UNREADABLE: "unreadable",
            UNPARSABLE: "unparsable Python",
        }
        parts = [f"{self.skipped[reason]} {label}" for reason, label in labels.items() if self.skipped.get(reason)]
        return text + (f"; skipped {', '.join(parts)}" if parts else "")


def iter_documents(
    paths: list[str | Path], report: CorpusReport | None = None, max_file_bytes: int = MAX_FILE_BYTES
) -> Iterator[Document]:
    """The text files under `paths` (files, or folders walked recursively in sorted order), each
    read once. Skipped files are counted in `report`. Raises ForerunError at once for a path that
    does not exist, and at the end when nothing at all was readable."""
    if not paths:
        raise ForerunError("no corpus given: pass --corpus with files or folders of text or code")
    roots = [Path(p) for p in paths]
    for root in roots:
        if not root.exists():
            raise ForerunError(
                f"corpus path {root} does not exist: check the spelling, or pass an existing file or folder"
            )
    report = report if report is not None else CorpusReport()
    report.max_file_bytes = max_file_bytes
    return _documents(roots, report, max_file_bytes)


def _documents(roots: list[Path], report: CorpusReport, max_file_bytes: int) -> Iterator[Document]:
    seen: set[Path] = set()  # a file reached twice (overlapping paths, links) is read once
    found = 0
    for root in roots:
        for path in _walk(root, set()):
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            text = _read(path, report, max_file_bytes)
            if text is not None:
                found += 1
                yield Document(path, text)
    if found == 0:
        names = ", ".join(str(r) for r in roots)
        raise ForerunError(
            f"no readable text in the corpus ({names}): {report.line()}; "
            "pass folders or files of text or source code (hidden, build and cache folders are not read)"
        )


def _walk(path: Path, visited: set[Path]) -> Iterator[Path]:
    """Files under `path` in sorted order; hidden entries and junk folders below it are left out.
    `visited` holds the folders already walked, so a linked folder cycle ends."""
    if not path.is_dir():
        yield path
        return
    real = path.resolve()
    if real in visited:
        return
    visited.add(real)
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".") or entry.name in JUNK_FOLDERS:
            continue
        child = path / entry.name
        if entry.is_dir():
            yield from _walk(child, visited)
        elif entry.is_file():
            yield child


def _read(path: Path, report: CorpusReport, max_file_bytes: int) -> str | None:
    """The file's text, or None after counting why it was skipped."""
    try:
        if path.stat().st_size > max_file_bytes:
            report.skip(TOO_LARGE, path)
            return None
        data = path.read_bytes()
    except OSError:
        report.skip(UNREADABLE, path)
        return None
    if len(data) > max_file_bytes:  # grew since stat
        report.skip(TOO_LARGE, path)
        return None
    text, reason = decode(data)
    if text is not None and not text.strip():
        text, reason = None, EMPTY
    if text is None:
        report.skip(reason, path)
        return None
    report.files += 1
    report.bytes += len(data)
    return text


def decode(data: bytes) -> tuple[str | None, str]:
    """(text, "") for a text file's bytes, else (None, the skip reason).

    UTF-8 first (with or without a BOM); a UTF-16 or UTF-32 BOM decodes as such (before the binary
    check: their text holds NUL bytes); otherwise latin-1, but only when that reads as text."""
    if data.startswith(_UTF32_BOMS) or data.startswith(_UTF16_BOMS):
        try:
            return data.decode("utf-32" if data.startswith(_UTF32_BOMS) else "utf-16"), ""
        except UnicodeDecodeError:
            return None, UNDECODABLE
    if is_binary(data):
        return None, BINARY
    try:
        return data.decode("utf-8-sig"), ""
    except UnicodeDecodeError:
        pass
    text = data.decode("latin-1")
    sample = text[:SNIFF_BYTES]
    printable = sum(1 for c in sample if c.isprintable() or c in "\t\n\r\f")
    return (text, "") if printable >= PRINTABLE_SHARE * len(sample) else (None, UNDECODABLE)


def is_binary(data: bytes) -> bool:
    """A NUL byte in the first SNIFF_BYTES, or more than CONTROL_SHARE of them control bytes (other
    than tab, newline, carriage return and form feed)."""
    head = data[:SNIFF_BYTES]
    if b"\x00" in head:
        return True
    return sum(1 for b in head if b in _CONTROLS) > CONTROL_SHARE * len(head)


def token_chunks(
    documents: Iterable[Document],
    encode: Callable[[str], list[int]],
    chunk_tokens: int,
    separator_ids: list[int] | None = None,
) -> Iterator[list[int]]:
    """The documents' tokens as one stream, `separator_ids` (e.g. the end-of-text token) between
    consecutive documents, cut into chunks of exactly `chunk_tokens` tokens. A chunk may span
    documents. The last, shorter chunk is yielded only if it holds at least `chunk_tokens // 4`
    tokens (fewer would teach little per pass); the rest of the stream is dropped. Deterministic:
    the same documents give the same chunks."""
    if chunk_tokens < 1:
        raise ForerunError(f"chunk length must be at least 1 token, not {chunk_tokens}")
    buffer: list[int] = []
    first = True
    for doc in documents:
        if not first and separator_ids:
            buffer.extend(separator_ids)
        first = False
        buffer.extend(encode(doc.text))
        start = 0
        # A start index, and one trim per document: slicing the buffer at every chunk is quadratic.
        while len(buffer) - start >= chunk_tokens:
            yield buffer[start : start + chunk_tokens]
            start += chunk_tokens
        del buffer[:start]
    if buffer and len(buffer) >= chunk_tokens // 4:
        yield buffer


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _cap(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"
