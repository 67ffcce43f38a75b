"""Corpus reading (forerun/train/corpus.py) and the target's soft labels over it
(forerun/train/soft_labels.py): what is read and skipped, how text becomes chunks, and that stored
labels are the target's own distribution, resumable shard for shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forerun.base.errors import ForerunError
from forerun.models.testing import TINY_VOCAB, tiny_model
from forerun.train.corpus import CorpusReport, Document, iter_documents, token_chunks
from forerun.train.soft_labels import (
    MANIFEST,
    label_chunk,
    make_label_shards,
    read_labels,
    soft_targets,
)

# --- reading a corpus -----------------------------------------------------------------------------


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


def test_folders_are_walked_in_sorted_order_skipping_hidden_and_junk(tmp_path: Path):
    write(tmp_path / "b.py", "b = 2\n")
    write(tmp_path / "a" / "z.md", "z\n")
    write(tmp_path / "a" / "y.txt", "y\n")
    write(tmp_path / "c.txt", "c\n")
    write(tmp_path / ".hidden.txt", "hidden\n")
    for junk in (".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", ".cache"):
        write(tmp_path / junk / "inside.txt", "junk\n")
    docs = list(iter_documents([tmp_path]))
    assert [d.path.relative_to(tmp_path).as_posix() for d in docs] == ["a/y.txt", "a/z.md", "b.py", "c.txt"]
    assert [d.text for d in docs] == ["y\n", "z\n", "b = 2\n", "c\n"]


def test_binary_and_oversize_files_are_skipped_and_reported(tmp_path: Path):
    write(tmp_path / "code.py", "print('hello')\n")
    write(tmp_path / "image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    write(tmp_path / "controls.dat", bytes([1, 2, 3, 4, 5, 6, 7, 8]) * 40 + b"a few letters")
    write(tmp_path / "huge.txt", "x" * 5000)
    write(tmp_path / "blank.txt", "  \n\t\n")
    report = CorpusReport()
    docs = list(iter_documents([tmp_path], report, max_file_bytes=4096))
    assert [d.path.name for d in docs] == ["code.py"]
    assert (report.files, report.bytes) == (1, len("print('hello')\n"))
    assert (report.count("binary"), report.count("too_large"), report.count("empty")) == (2, 1, 1)
    assert sorted(p.name for p in report.examples["binary"]) == ["controls.dat", "image.png"]
    assert report.examples["too_large"] == [tmp_path / "huge.txt"]
    assert report.line() == "read 1 file (15 B); skipped 2 binary, 1 over 4 KiB, 1 empty"


def test_the_report_line_names_the_default_cap_and_sizes():
    report = CorpusReport(files=120, bytes=1_400_000)
    report.skip("binary", Path("a.bin"))
    report.skip("too_large", Path("big.txt"))
    assert report.line() == "read 120 files (1.4 MB); skipped 1 binary, 1 over 2 MiB"


def test_latin1_and_utf16_files_are_decoded(tmp_path: Path):
    text = "café au lait, naïve façade\n"
    write(tmp_path / "a_latin1.txt", text.encode("latin-1"))
    write(tmp_path / "b_utf16.txt", text.encode("utf-16"))  # with a BOM
    write(tmp_path / "c_utf8bom.txt", b"\xef\xbb\xbf" + text.encode("utf-8"))
    report = CorpusReport()
    assert [d.text for d in iter_documents([tmp_path], report)] == [text, text, text]
    assert report.skipped == {}


def test_random_high_bytes_are_not_taken_for_latin1(tmp_path: Path):
    gen = torch.Generator().manual_seed(0)
    noise = bytes((torch.randint(1, 256, (2000,), generator=gen)).tolist())  # no NUL, not UTF-8
    write(tmp_path / "noise.bin", noise)
    write(tmp_path / "ok.txt", "fine\n")
    report = CorpusReport()
    assert [d.path.name for d in iter_documents([tmp_path], report)] == ["ok.txt"]
    assert report.count("undecodable") + report.count("binary") == 1


def test_a_missing_path_is_an_error_naming_it(tmp_path: Path):
    missing = tmp_path / "no" / "such" / "folder"
    with pytest.raises(ForerunError, match="no/such/folder"):
        iter_documents([missing])


def test_a_folder_with_nothing_readable_is_an_error_naming_it(tmp_path: Path):
    corpus = tmp_path / "blobs"
    write(corpus / "a.bin", b"\x00\x01\x02" * 100)
    write(corpus / ".git" / "config", "[core]\n")
    with pytest.raises(ForerunError, match="blobs.*1 binary"):
        list(iter_documents([corpus]))


def test_a_file_reached_twice_is_read_once(tmp_path: Path):
    write(tmp_path / "a.txt", "a\n")
    assert len(list(iter_documents([tmp_path, tmp_path / "a.txt"]))) == 1


# --- token chunks ---------------------------------------------------------------------------------


def char_encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_chunks_are_exact_with_separators_between_documents():
    docs = [Document(Path("a"), "abcdefg"), Document(Path("b"), "hij"), Document(Path("c"), "klmnopqrs")]
    chunks = list(token_chunks(docs, char_encode, chunk_tokens=4, separator_ids=[0]))
    # the stream abcdefg 0 hij 0 klmnopqrs is 21 tokens: five chunks of 4 and a tail of 1 (>= 4 // 4: kept)
    stream = [*char_encode("abcdefg"), 0, *char_encode("hij"), 0, *char_encode("klmnopqrs")]
    assert [t for c in chunks for t in c] == stream
    assert [len(c) for c in chunks] == [4, 4, 4, 4, 4, 1]
    assert chunks == list(token_chunks(docs, char_encode, chunk_tokens=4, separator_ids=[0]))


def test_a_short_tail_is_dropped_and_a_long_one_kept():
    docs = [Document(Path("a"), "x" * 21), Document(Path("b"), "y" * 10)]
    # 21 + 10 = 31 tokens, chunks of 8: three whole, a tail of 7 (>= 8 // 4): kept
    assert [len(c) for c in token_chunks(docs, char_encode, chunk_tokens=8)] == [8, 8, 8, 7]
    # chunks of 10: three whole, a tail of 1 (< 10 // 4): dropped
    assert [len(c) for c in token_chunks(docs, char_encode, chunk_tokens=10)] == [10, 10, 10]
    assert list(token_chunks(docs, char_encode, chunk_tokens=10, separator_ids=[0, 0])) == [
        [ord("x")] * 10,
        [ord("x")] * 10,
        [ord("x"), 0, 0, *[ord("y")] * 7],
        [ord("y")] * 3,  # two separators make the tail 3 tokens (>= 10 // 4): kept
    ]


# --- soft labels ----------------------------------------------------------------------------------


def chunk_of(seed: int, length: int) -> list[int]:
    return torch.randint(0, TINY_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_labels_are_the_targets_own_distribution_at_every_position():
    target = tiny_model(seed=0)
    tokens = chunk_of(1, 40)
    labels = label_chunk(target, tokens, top_k=7)
    decoder = target.decoder
    out = decoder(torch.tensor(tokens), torch.arange(len(tokens)), decoder.new_cache(len(tokens)), output_hidden=True)
    logits, hidden = out.logits[0], out.hidden[0]  # [T, vocab], [T, hidden]
    top, ids = logits.topk(7, dim=-1)
    assert labels.top_ids.dtype == torch.int32 and labels.top_probs.dtype == torch.float16
    assert labels.hidden.dtype == torch.bfloat16 and labels.hidden.shape == (40, decoder.cfg.hidden_size)
    assert torch.equal(labels.top_ids, ids.to(torch.int32))
    torch.testing.assert_close(labels.top_probs.float(), logits.softmax(-1).gather(-1, ids), atol=1e-3, rtol=0)
    torch.testing.assert_close(labels.hidden.float(), hidden, atol=1e-2, rtol=1e-2)
    assert (labels.top_probs[:, :-1] >= labels.top_probs[:, 1:]).all()


def test_labels_are_scored_in_blocks_like_the_whole(monkeypatch):
    target = tiny_model(seed=0)
    tokens = chunk_of(2, 30)
    whole = label_chunk(target, tokens, top_k=5)
    monkeypatch.setattr("forerun.train.soft_labels.LOGIT_BYTES", 4 * TINY_VOCAB * 7)  # 7 rows at a time
    blocks = label_chunk(target, tokens, top_k=5)
    assert torch.equal(whole.top_ids, blocks.top_ids)
    torch.testing.assert_close(whole.top_probs, blocks.top_probs, atol=1e-3, rtol=0)


CHUNKS = [chunk_of(10 + i, 12 + i) for i in range(6)]  # 12..17 tokens


def test_shards_give_back_what_was_labelled(tmp_path: Path):
    target = tiny_model(seed=0)
    manifest = make_label_shards(target, CHUNKS, tmp_path, top_k=4, shard_tokens=30, progress=False)
    assert len(manifest.shards) >= 3
    assert (manifest.chunks_done, manifest.tokens) == (6, sum(len(c) for c in CHUNKS))
    saved = json.loads((tmp_path / MANIFEST).read_text())
    assert (saved["top_k"], saved["target"], saved["shards"]) == (4, "tiny", manifest.shards)
    stored = list(read_labels(tmp_path))
    assert len(stored) == 6
    for chunk, back in zip(CHUNKS, stored):
        labels = label_chunk(target, chunk, top_k=4)
        assert back.tokens.tolist() == chunk
        assert torch.equal(back.hidden, labels.hidden)
        assert torch.equal(back.top_ids, labels.top_ids)
        assert torch.equal(back.top_probs, labels.top_probs)


def test_an_interrupted_run_resumes_to_the_same_shards(tmp_path: Path):
    target = tiny_model(seed=0)
    two = len(CHUNKS[0]) + len(CHUNKS[1])
    shard_tokens = 2 * 12  # every two chunks fill a shard, so both runs cut shards alike
    whole = make_label_shards(target, CHUNKS, tmp_path / "whole", top_k=3, shard_tokens=shard_tokens, progress=False)
    first = make_label_shards(
        target, iter(CHUNKS), tmp_path / "cut", top_k=3, shard_tokens=shard_tokens, budget_tokens=two, progress=False
    )
    assert first.chunks_done == 2
    resumed = make_label_shards(
        target, iter(CHUNKS), tmp_path / "cut", top_k=3, shard_tokens=shard_tokens, progress=False
    )
    assert (resumed.chunks_done, resumed.tokens, resumed.shards) == (whole.chunks_done, whole.tokens, whole.shards)
    for name in whole.shards:
        a, b = load_file(str(tmp_path / "whole" / name)), load_file(str(tmp_path / "cut" / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)


def test_a_folder_of_another_top_k_or_target_is_refused(tmp_path: Path):
    make_label_shards(tiny_model(seed=0), CHUNKS[:1], tmp_path, top_k=4, progress=False)
    with pytest.raises(ForerunError, match="new folder"):
        make_label_shards(tiny_model(seed=0), CHUNKS, tmp_path, top_k=5, progress=False)
    with pytest.raises(ForerunError, match="new folder"):
        make_label_shards(tiny_model(seed=0, name="other"), CHUNKS, tmp_path, top_k=4, progress=False)


def test_soft_targets_put_all_mass_on_the_listed_ids():
    ids = torch.tensor([[3, 1, 7], [0, 5, 2]], dtype=torch.int32)
    probs = torch.tensor([[0.5, 0.2, 0.1], [0.9, 0.05, 0.01]], dtype=torch.float16)
    dense = soft_targets(ids, probs, vocab_size=10)
    assert dense.shape == (2, 10) and dense.dtype == torch.float32
    torch.testing.assert_close(dense.sum(-1), torch.ones(2))
    listed = torch.zeros(2, 10, dtype=torch.bool).scatter_(1, ids.long(), True)
    assert (dense[~listed] == 0).all() and (dense[listed] > 0).all()
    torch.testing.assert_close(dense[0, 3] / dense[0, 1], torch.tensor(0.5 / 0.2), rtol=1e-3, atol=0)
