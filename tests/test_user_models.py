"""A user's own model, as a vLLM or llama.cpp user brings it: a model folder or a GGUF file that is
incomplete, inconsistent or in an unreadable place gets a clear ForerunError saying what was wrong
and what to do (never a traceback from deep inside torch, never a silently wrong model), and a
failed or killed load leaves nothing in the cache that a later load would serve."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from forerun.api import LLM
from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.models import gguf_cache
from forerun.models.load import load_model
from forerun.models.testing import save_hf_folder, tiny_config, tiny_decoder, tiny_model
from tests.test_load import IDS, logits_of, write_gguf


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("FORERUN_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=21), tmp_path_factory.mktemp("user") / "tiny")


@pytest.fixture
def folder(original: Path, tmp_path: Path) -> Path:
    """A copy of a whole tiny model folder, for a test to damage."""
    return Path(shutil.copytree(original, tmp_path / "model"))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def split_into_shards(folder: Path) -> list[Path]:
    """The folder's weights as two shards and an index naming them, as `save_pretrained` writes them."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    shards = [folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for shard, half in zip(shards, halves):
        save_file({k: state[k] for k in half}, shard)
        weight_map.update({k: shard.name for k in half})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return shards


# --- model folders -------------------------------------------------------------------------------


def test_a_folder_without_tokenizer_files_is_refused_naming_what_it_needs(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(ForerunError, match=r"no tokenizer files.*tokenizer\.json"):
        load_model(str(folder))
    load_model(str(folder), with_tokenizer=False)  # the weights alone still load


def test_sharded_weights_load_and_a_shard_the_index_names_but_is_missing_is_named(folder: Path) -> None:
    expected = logits_of(load_model(str(folder), dtype="float32", with_tokenizer=False), IDS)
    shards = split_into_shards(folder)
    assert torch.equal(logits_of(load_model(str(folder), dtype="float32", with_tokenizer=False), IDS), expected)
    shards[1].unlink()
    with pytest.raises(ForerunError, match=f"{shards[1].name}.*missing"):
        load_model(str(folder), with_tokenizer=False)


def test_a_safetensors_file_the_index_does_not_name_is_not_read(folder: Path) -> None:
    expected = logits_of(load_model(str(folder), dtype="float32", with_tokenizer=False), IDS)
    split_into_shards(folder)
    embedding = load_file(folder / "model-00001-of-00002.safetensors").get("model.embed_tokens.weight")
    embedding = (
        embedding
        if embedding is not None
        else load_file(folder / "model-00002-of-00002.safetensors")["model.embed_tokens.weight"]
    )
    save_file({"model.embed_tokens.weight": torch.zeros_like(embedding)}, folder / "zz-consolidated.safetensors")
    assert torch.equal(logits_of(load_model(str(folder), dtype="float32", with_tokenizer=False), IDS), expected)


def test_a_tensor_in_two_files_without_an_index_is_refused_naming_both(folder: Path) -> None:
    state = load_file(folder / "model.safetensors")
    save_file({"model.norm.weight": torch.zeros_like(state["model.norm.weight"])}, folder / "extra.safetensors")
    with pytest.raises(ForerunError, match=r"model\.norm\.weight.*extra\.safetensors.*model\.safetensors"):
        load_model(str(folder), with_tokenizer=False)


def test_weights_the_config_leaves_unused_are_refused_not_dropped(folder: Path) -> None:
    edit_config(folder, num_hidden_layers=1)  # the weights hold 2 layers: running 1 is a wrong model
    with pytest.raises(ForerunError, match=r"does not use.*layers\.1\..*num_hidden_layers"):
        load_model(str(folder), with_tokenizer=False)


def test_a_rotary_table_saved_beside_the_weights_is_no_unused_weight(folder: Path) -> None:
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, folder / "model.safetensors")
    load_model(str(folder), with_tokenizer=False)


def test_a_tokenizer_with_more_tokens_than_the_model_has_rows_is_refused(folder: Path, tmp_path: Path) -> None:
    small = tmp_path / "small"
    cfg = tiny_config(vocab_size=40)
    save_hf_folder(tiny_model(seed=22), small)  # a tokenizer of 99 tokens
    decoder = tiny_decoder(cfg, seed=22)
    state = {f"model.{k}" if k != "lm_head.weight" else k: v for k, v in decoder.state_dict().items()}
    save_file(state, small / "model.safetensors")
    edit_config(small, vocab_size=40)
    with pytest.raises(ForerunError, match=r"tokenizer has 99 tokens.*40"):
        load_model(str(small))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"rope_theta": "abc"}, "rope_theta"),
        ({"rope_theta": 10**400}, "rope_theta"),  # too big for a float: named, not an OverflowError
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"rope_scaling": "linear"}, "rope_scaling"),
        ({"head_dim": -4}, "head_dim"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ],
)
def test_config_values_of_the_wrong_kind_are_named(folder: Path, changes: dict, needle: str) -> None:
    edit_config(folder, **changes)
    with pytest.raises(ForerunError, match=needle):
        load_model(str(folder), with_tokenizer=False)


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_an_activation_the_decoder_does_not_compute_is_refused(folder: Path, act: str) -> None:
    edit_config(folder, hidden_act=act)
    with pytest.raises(ForerunError, match=f"hidden_act '{act}'.*silu"):
        load_model(str(folder), with_tokenizer=False)
    edit_config(folder, hidden_act="silu")
    load_model(str(folder), with_tokenizer=False)


def test_a_sliding_window_bounds_the_context_it_is_exact_within(folder: Path) -> None:
    edit_config(folder, use_sliding_window=True, sliding_window=16)
    assert load_model(str(folder), with_tokenizer=False).decoder.cfg.max_position == 16
    edit_config(folder, use_sliding_window=False)  # qwen2 turns its window off so
    assert load_model(str(folder), with_tokenizer=False).decoder.cfg.max_position == 1024


# --- GGUF files ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_model(seed=23), tmp_path_factory.mktemp("user") / "tiny.gguf", quant="Q8_0")


def test_a_gguf_version_forerun_does_not_read_says_which_it_reads_not_to_download_again(
    gguf_file: Path, tmp_path: Path
) -> None:
    data = gguf_file.read_bytes()
    path = tmp_path / "v4.gguf"
    path.write_bytes(data[:4] + struct.pack("<I", 4) + data[8:])
    with pytest.raises(ForerunError, match="version 4.*versions 2 and 3") as err:
        load_model(str(path), with_tokenizer=False)
    assert "download it again" not in str(err.value)


@pytest.mark.parametrize("alignment", [0, 7])
def test_a_gguf_alignment_that_is_no_power_of_two_is_refused(
    gguf_file: Path, tmp_path: Path, monkeypatch, alignment: int
) -> None:
    import gguf

    write_header = gguf.GGUFWriter.write_header_to_file

    def aligned(self, *args, **kwargs):
        self.add_custom_alignment(32)
        return write_header(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", aligned)
    data = bytearray(write_gguf(tiny_model(seed=23), tmp_path / "a.gguf", quant="Q8_0").read_bytes())
    at = data.index(b"general.alignment") + len(b"general.alignment") + 4  # after the key and its type
    struct.pack_into("<I", data, at, alignment)
    path = tmp_path / "bad-alignment.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ForerunError, match=f"alignment {alignment}.*power of two"):
        load_model(str(path), with_tokenizer=False)


def test_a_gguf_without_a_tokenizer_says_so(gguf_file: Path) -> None:
    with pytest.raises(ForerunError, match="holds no tokenizer"):
        load_model(str(gguf_file), quantization="gguf")


def test_an_unreadable_gguf_is_named_not_a_traceback(gguf_file: Path, monkeypatch) -> None:
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_cache, "open", refused, raising=False)  # root reads any file: refuse as a user's would
    with pytest.raises(ForerunError, match=r"cannot read .*tiny\.gguf \(Permission denied\)"):
        load_model(str(gguf_file), with_tokenizer=False)


def test_a_damaged_cached_config_is_written_again_not_a_traceback(gguf_file: Path, home: Path) -> None:
    expected = logits_of(load_model(str(gguf_file), dtype="float32", with_tokenizer=False), IDS)
    (config,) = (home / "converted").glob("*/config.json")
    config.write_text('{"archi')
    assert torch.equal(logits_of(load_model(str(gguf_file), dtype="float32", with_tokenizer=False), IDS), expected)
    config.write_text(json.dumps({"architecture": "qwen2", "from_a_newer_forerun": 1}))
    assert torch.equal(logits_of(load_model(str(gguf_file), dtype="float32", with_tokenizer=False), IDS), expected)


def test_a_full_disk_while_converting_is_named_and_leaves_nothing(gguf_file: Path, home: Path, monkeypatch) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # part of a file, then the disk is full
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(ForerunError, match=r"cannot write .*weights-float32\.safetensors.*No space left on device"):
        load_model(str(gguf_file), dtype="float32", with_tokenizer=False)
    left = [p.name for p in (home / "converted").rglob("*") if p.is_file()]
    assert [name for name in left if name not in ("checksums.json", "config.json")] == []


def test_a_cache_that_cannot_be_written_is_named_with_what_to_do(gguf_file: Path, monkeypatch) -> None:
    real = os.replace

    def read_only(src, dst):
        if "converted" in str(dst):
            raise OSError(30, "Read-only file system")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(ForerunError, match=r"cannot write .*\(Read-only file system\).*FORERUN_HOME"):
        load_model(str(gguf_file), dtype="float32", with_tokenizer=False)


# --- interrupted writes ----------------------------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_writers_temporaries_are_removed_by_the_next_write(tmp_path: Path) -> None:
    target, host = tmp_path / "weights.safetensors", socket.gethostname()
    dead, dead_too = dead_pid(), dead_pid()
    orphan_file = tmp_path / f".weights.safetensors.{host}-{dead}.tmp"
    orphan_file.write_bytes(b"\0" * 1000)
    orphan_folder = tmp_path / f".weights.safetensors.{host}-{dead_too}.tmp"
    (orphan_folder).mkdir()
    (orphan_folder / "part").write_bytes(b"\0")
    live = tmp_path / f".weights.safetensors.{host}-{os.getppid()}.tmp"  # another process writing now
    live.write_bytes(b"\0")
    elsewhere = tmp_path / f".weights.safetensors.other-host-{dead}.tmp"  # a machine sharing FORERUN_HOME
    elsewhere.write_bytes(b"\0")
    other = tmp_path / f".other.{host}-{dead}.tmp"  # another file's: left to its own next write
    other.write_bytes(b"\0")
    files.save_tensors(target, {"x": torch.ones(3)})
    assert torch.equal(load_file(target)["x"], torch.ones(3))
    kept = [target.name, live.name, elsewhere.name, other.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_a_folder_where_a_file_is_written_is_named_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "weights.safetensors").mkdir()
    with pytest.raises(ForerunError, match="a folder stands where the file goes; move it away"):
        files.save_tensors(tmp_path / "weights.safetensors", {"x": torch.ones(3)})
    (tmp_path / "plain").write_bytes(b"\0")
    with pytest.raises(ForerunError, match="a file stands in its path"):
        files.save_tensors(tmp_path / "plain" / "weights.safetensors", {"x": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "weights.safetensors"]  # no temporary left


def test_safetensors_own_temporary_file_is_made_inside_the_writers_temporary(tmp_path: Path, monkeypatch) -> None:
    """safetensors writes a temporary of its own (`.tmpXXXXXX`) beside the file it is given and
    renames it: a process killed then leaves it where the next write finds it, not in the cache."""
    import safetensors.torch

    seen: list[Path] = []
    real = safetensors.torch.save_file

    def spy(tensors, filename, metadata=None):
        seen.append(Path(filename))
        real(tensors, filename, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", spy)
    files.save_tensors(tmp_path / "w.safetensors", {"x": torch.ones(2)})
    (written,) = seen
    assert written.parent.parent == tmp_path and written.parent.name.startswith(".w.safetensors.")
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_a_load_killed_while_converting_is_converted_again_whole(
    gguf_file: Path, home: Path, tmp_path: Path, monkeypatch
) -> None:
    """A conversion killed midway (SIGKILL: no clean-up runs) leaves only a temporary; the next load
    converts again, removes it, and gives the model's own logits."""
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "clean"))
    expected = logits_of(load_model(str(gguf_file), dtype="float32", with_tokenizer=False), IDS)
    monkeypatch.setenv("FORERUN_HOME", str(home))
    code = (
        "import os, signal, safetensors.torch as st\n"
        "from forerun.models.load import load_model\n"
        "def killed(tensors, filename, metadata=None):\n"
        "    open(filename, 'wb').write(b'half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "st.save_file = killed\n"
        f"load_model({str(gguf_file)!r}, dtype='float32', with_tokenizer=False)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FORERUN_HOME": str(home)}, timeout=120)
    assert run.returncode == -9
    assert [p.name for p in (home / "converted").rglob("*.tmp")]  # what the killed load left
    assert torch.equal(logits_of(load_model(str(gguf_file), dtype="float32", with_tokenizer=False), IDS), expected)
    assert [p.name for p in (home / "converted").rglob("*.tmp")] == []


# --- the Python API ---------------------------------------------------------------------------------


def test_an_unknown_llm_argument_is_named_with_the_known_ones(original: Path) -> None:
    with pytest.raises(ForerunError, match=r"unknown_kwarg.*speculative_model"):
        LLM(str(original), unknown_kwarg=1)
    with pytest.raises(ForerunError, match="max_model_len"):
        LLM(str(original), max_model_len=512)


def test_a_draft_model_that_is_not_there_is_named_before_the_target_loads(original: Path, monkeypatch, capsys) -> None:
    import forerun.api

    monkeypatch.setattr(forerun.api, "load_model", lambda *a, **k: pytest.fail("the target loaded first"))
    with pytest.raises(ForerunError, match=r"/no/such/draft\.gguf: no such file"):
        LLM(str(original), speculative_model="/no/such/draft.gguf")
    argv = ["generate", "--model", str(original), "--speculative-model", "/no/such/draft.gguf", "--prompt", "x"]
    assert main(argv) == 2
    assert "/no/such/draft.gguf: no such file" in capsys.readouterr().err
