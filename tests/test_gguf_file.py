"""The GGUF header reader (forerun/models/gguf_file.py): a tokenizer's string arrays are stepped over
without decoding, and the keys and tensors after them are read where they lie."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from forerun.models.gguf_file import GGUFFile, GGUFFormatError

TOKENS = [f"tok{i}" * (1 + i % 7) for i in range(5000)] + ["", "é€😀"]


def write(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 3)
    w.add_token_list(TOKENS)  # tokenizer.ggml.tokens: skipped
    w.add_string("general.name", "after the vocabulary")
    w.add_array("general.tags", ["a", "bc"])  # kept: not a tokenizer key
    w.add_tensor("t.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_keys_and_tensors_after_a_skipped_vocabulary_are_read(tmp_path: Path) -> None:
    f = GGUFFile(write(tmp_path / "m.gguf"))
    assert f.fields["tokenizer.ggml.tokens"].contents() is None  # stepped over, not decoded
    assert f.fields["general.name"].contents() == "after the vocabulary"
    assert f.fields["general.tags"].contents() == ["a", "bc"]
    assert f.fields["llama.block_count"].contents() == 3
    (t,) = f.tensors
    assert t.name == "t.weight" and np.array_equal(t.data, np.arange(12, dtype=np.float32).reshape(3, 4))
    # gguf-py's own reader sees the same vocabulary the reader stepped over
    tokens = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data] == TOKENS


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_file_cut_inside_the_vocabulary_is_refused_as_truncated(tmp_path: Path, where: float) -> None:
    data = write(tmp_path / "m.gguf").read_bytes()
    first, last = data.find(b"tok0"), data.find(b"\xc3\xa9\xe2\x82\xac")  # the vocabulary's first and last strings
    assert 0 < first < last
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: first + 2 + round(where * (last - first))])  # inside a string, or at the last one
    with pytest.raises(GGUFFormatError, match="truncated"):
        GGUFFile(cut)
