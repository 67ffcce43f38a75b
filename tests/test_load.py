"""Loading models from names, GGUF files and Hugging Face folders, and the errors a user can cause.

Tiny random models are written to GGUF with gguf.GGUFWriter under llama.cpp's tensor names (the
mapping below is written out independently of the loader's), then loaded back through
`load_model`; the loaded decoder must give the original logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.models import gguf_loader
from forerun.models.embedded import EMBEDDED
from forerun.models.load import LoadedModel, load_model
from forerun.models.testing import gguf_bytes, save_hf_folder, tiny_model

# Hugging Face name (without "model.") -> llama.cpp name, as llama.cpp's converter writes them.
_TOP = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, layer, rest = hf.split(".", 2)  # layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave q/k rows for llama.cpp's rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model: LoadedModel,
    path: Path,
    arch: str | None = None,
    quant: gguf.GGMLQuantizationType | str | Callable[[str], str | None] | None = None,
    skip_keys: tuple[str, ...] = (),
    extra: dict | None = None,
    floats: dict | None = None,
    rope_freqs: bool = True,
) -> Path:
    """Write `model` as llama.cpp would: metadata under `arch.*`, F32 tensors (2-D ones quantized if
    asked: one type for all, or per tensor, a function of its llama.cpp name returning a type name
    or None for F32); `extra` string and `floats` float32 metadata; the rope's factors as llama.cpp's
    rope_freqs tensor unless `rope_freqs` is False)."""
    cfg = model.decoder.cfg
    arch = arch or cfg.architecture
    w = gguf.GGUFWriter(str(path), arch)
    meta = {
        "block_count": cfg.num_layers,
        "context_length": cfg.max_position,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_heads,
        "attention.head_count_kv": cfg.num_kv_heads,
        "attention.key_length": cfg.head_dim,
    }
    for key, value in meta.items():
        if key not in skip_keys:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    for key, value in (floats or {}).items():
        w.add_float32(key, value)
    state = model.decoder.state_dict()
    for hf, tensor in state.items():
        if hf == "lm_head.weight" and cfg.tie_embeddings:
            continue  # llama.cpp omits output.weight when tied
        array = tensor.float().numpy().copy()
        if arch in ("llama", "mistral"):
            if ".q_proj." in hf:
                array = llama_cpp_permute(array, cfg.num_heads)
            elif ".k_proj." in hf:
                array = llama_cpp_permute(array, cfg.num_kv_heads)
        kind = quant(llama_cpp_name(hf)) if callable(quant) else quant
        if kind is not None and array.ndim == 2:
            qtype = kind if isinstance(kind, gguf.GGMLQuantizationType) else gguf.GGMLQuantizationType[kind]
            w.add_tensor(llama_cpp_name(hf), gguf_bytes(array, qtype.name), raw_dtype=qtype)
        else:
            w.add_tensor(llama_cpp_name(hf), array)
    if cfg.rope_freq_factors is not None and rope_freqs:  # as llama.cpp's converter writes Llama 3.1's scaling
        w.add_tensor("rope_freqs.weight", np.array(cfg.rope_freq_factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits_of(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    decoder = model.decoder
    cache = decoder.new_cache(len(ids))
    return decoder(torch.tensor(ids), torch.arange(len(ids)), cache).logits[0]  # [T, vocab]


IDS = [5, 17, 42, 3, 88, 60, 7, 21, 33, 90]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("FORERUN_HOME", str(home))
    return home


def _cache_files(home: Path) -> list[str]:
    root = home / "converted"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


# --- GGUF round trips -------------------------------------------------------------------------


def test_gguf_round_trip_gives_the_original_logits_and_config(home: Path, tmp_path: Path) -> None:
    original = tiny_model(seed=1)
    path = write_gguf(original, tmp_path / "tiny.gguf")
    loaded = load_model(str(path), dtype="float32", with_tokenizer=False)
    assert loaded.decoder.cfg == original.decoder.cfg
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(original, IDS), rtol=0, atol=1e-5)


def test_gguf_without_output_weight_ties_the_lm_head_to_the_embedding(home: Path, tmp_path: Path) -> None:
    original = tiny_model(seed=2, tie_embeddings=True)
    path = write_gguf(original, tmp_path / "tied.gguf")
    loaded = load_model(str(path), dtype="float32", with_tokenizer=False)
    assert loaded.decoder.cfg.tie_embeddings
    assert loaded.decoder.lm_head.weight is loaded.decoder.embed_tokens.weight
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(original, IDS), rtol=0, atol=1e-5)


def test_gguf_q8_0_tensors_dequantize_close_to_the_original(home: Path, tmp_path: Path) -> None:
    original = tiny_model(seed=3)
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = write_gguf(original, tmp_path / "q8.gguf", quant=q8)
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {q8}
    loaded = load_model(str(path), dtype="float32", with_tokenizer=False)
    # Each matrix is exactly what Q8_0 keeps of the original (so nothing was transposed or scaled) ...
    for name, weight in original.decoder.state_dict().items():
        if weight.dim() == 2:
            kept = gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), q8), q8)
            torch.testing.assert_close(loaded.decoder.state_dict()[name], torch.from_numpy(kept), rtol=0, atol=0)
    # ... and the logits stay close: ~8 bits per weight move them by about a percent of their spread.
    want, got = logits_of(original, IDS), logits_of(loaded, IDS)
    assert not torch.equal(got, want)  # really quantized, not silently stored as F32
    assert (got - want).abs().mean() < 0.02 * want.std()
    assert (got - want).abs().max() < 0.1 * want.std()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "with-bias"])
def test_llama_gguf_q_and_k_rows_are_unpermuted(home: Path, tmp_path: Path, bias: bool) -> None:
    original = tiny_model(seed=4, architecture="llama", attention_bias=bias)
    path = write_gguf(original, tmp_path / "llama.gguf")
    loaded = load_model(str(path), dtype="float32", with_tokenizer=False)
    assert loaded.decoder.cfg.architecture == "llama" and loaded.decoder.cfg.attention_bias == bias
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.self_attn.k_proj.weight"):
        torch.testing.assert_close(loaded.decoder.state_dict()[name], original.decoder.state_dict()[name])
    if bias:
        torch.testing.assert_close(
            loaded.decoder.layers[0].self_attn.k_proj.bias, original.decoder.layers[0].self_attn.k_proj.bias
        )
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(original, IDS), rtol=0, atol=1e-5)


def test_gguf_loads_in_bfloat16_close_to_float32(home: Path, tmp_path: Path) -> None:
    original = tiny_model(seed=5)
    path = write_gguf(original, tmp_path / "tiny.gguf")
    loaded = load_model(str(path), dtype="bfloat16", with_tokenizer=False)
    assert loaded.decoder.dtype == torch.bfloat16
    want, got = logits_of(original, IDS), logits_of(loaded, IDS)
    assert (got - want).abs().max() < 0.1 * want.std()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_second_load_of_a_gguf_reads_the_converted_cache(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = tiny_model(seed=6)
    path = write_gguf(original, tmp_path / "tiny.gguf")
    first = load_model(str(path), dtype="float32", with_tokenizer=False)
    sha = files.sha256_file(path)
    cache = home / "converted" / sha[:24]
    assert (cache / "weights-float32.safetensors").is_file() and (cache / "config.json").is_file()
    assert not [f for f in _cache_files(home) if f.endswith(".tmp")]

    def no_gguf_reading(*args, **kwargs):
        raise AssertionError("the GGUF file was read again although a converted copy is cached")

    monkeypatch.setattr(gguf_loader, "open_reader", no_gguf_reading)
    monkeypatch.setattr(gguf_loader, "iter_tensors", no_gguf_reading)
    monkeypatch.setattr(files, "sha256_file", no_gguf_reading)  # the checksum is remembered too
    second = load_model(str(path), dtype="float32", with_tokenizer=False)
    torch.testing.assert_close(logits_of(second, IDS), logits_of(first, IDS), rtol=0, atol=0)
    with pytest.raises(AssertionError, match="read again"):  # another dtype is a new conversion
        load_model(str(path), dtype="bfloat16", with_tokenizer=False)


def _downgrade_cache_to_version_1(cache: Path) -> None:
    """Make a cache look as the first converter left it: no version field, and (for llama) the
    wrongly un-permuted q/k rows it wrote; here simply zeros, which no correct conversion gives."""
    from safetensors.torch import load_file, save_file

    config = json.loads((cache / "config.json").read_text())
    assert config.pop("conversion") == 2
    (cache / "config.json").write_text(json.dumps(config))
    weights = cache / "weights-float32.safetensors"
    save_file({k: torch.zeros_like(v) for k, v in load_file(str(weights)).items()}, str(weights))


def test_llama_cache_from_the_old_converter_is_rebuilt(home: Path, tmp_path: Path) -> None:
    original = tiny_model(seed=19, architecture="llama")
    path = write_gguf(original, tmp_path / "llama.gguf")
    load_model(str(path), dtype="float32", with_tokenizer=False)
    cache = home / "converted" / files.sha256_file(path)[:24]
    _downgrade_cache_to_version_1(cache)
    loaded = load_model(str(path), dtype="float32", with_tokenizer=False)
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(original, IDS), rtol=0, atol=1e-5)
    assert json.loads((cache / "config.json").read_text())["conversion"] == 2


def test_qwen2_cache_from_the_old_converter_stays_in_use(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tiny_model(seed=20), tmp_path / "qwen.gguf")
    load_model(str(path), dtype="float32", with_tokenizer=False)
    _downgrade_cache_to_version_1(home / "converted" / files.sha256_file(path)[:24])
    monkeypatch.setattr(gguf_loader, "open_reader", lambda *a: pytest.fail("a valid qwen2 cache was rebuilt"))
    loaded = load_model(str(path), dtype="float32", with_tokenizer=False)
    assert float(loaded.decoder.embed_tokens.weight.abs().sum()) == 0.0  # the cached (zeroed) weights


def test_changed_gguf_at_the_same_path_is_converted_again(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_model(seed=7), path)
    load_model(str(path), dtype="float32", with_tokenizer=False)
    other = tiny_model(seed=8)
    write_gguf(other, path)
    loaded = load_model(str(path), dtype="float32", with_tokenizer=False)
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(other, IDS), rtol=0, atol=1e-5)


# --- Hugging Face folders ---------------------------------------------------------------------


def test_hf_folder_loads_with_tokenizer_and_matches(home: Path, tmp_path: Path) -> None:
    original = tiny_model(seed=9)
    folder = save_hf_folder(original, tmp_path / "tiny-hf")
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.source.kind == "hf" and loaded.decoder.cfg == original.decoder.cfg
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(original, IDS), rtol=0, atol=0)
    tok = loaded.tokenizer
    # The folder's tokenizer.json is used as written (character-level: one token per character,
    # spaces and newlines included), not rebuilt by the class transformers registers for qwen2.
    text = "def f(a, b):\n    return a b"
    assert tok.encode(text) == [tok.hf.convert_tokens_to_ids(c) for c in text]
    assert tok.decode(tok.encode(text)) == text
    assert {tok.hf.convert_tokens_to_ids("<|im_end|>"), tok.hf.convert_tokens_to_ids("<|endoftext|>")} <= tok.stop_ids
    assert _cache_files(home) == []  # a folder is already in a fast format: nothing converted


def test_a_models_tokenizer_alone_reads_no_weights(home: Path, tmp_path: Path, monkeypatch) -> None:
    from forerun.models import load as load_module
    from forerun.models.load import load_tokenizer_of
    from forerun.models.testing import tiny_tokenizer_folder

    folder = save_hf_folder(tiny_model(seed=9), tmp_path / "tiny-hf")
    text = "def f(a, b):\n    return a b"
    whole = load_model(str(folder), dtype="float32").tokenizer

    def no_weights(*args, **kwargs):
        raise AssertionError("read the weights for a tokenizer")

    monkeypatch.setattr(load_module, "read_hf_folder", no_weights)
    assert load_tokenizer_of(str(folder)).encode(text) == whole.encode(text)
    # A GGUF file: its tokenizer folder is written, its weights are not dequantized (a client of a
    # server that holds the model, as bench-serve is, keeps no bf16 copy).
    path = write_gguf(tiny_model(seed=1), tmp_path / "t.gguf")
    asked, tok_dir = [], tiny_tokenizer_folder(tmp_path / "tok")

    def convert(source, dtype, with_tokenizer, convert=True):
        asked.append((with_tokenizer, convert))
        return SimpleNamespace(tokenizer=tok_dir)

    monkeypatch.setattr(load_module, "convert_gguf", convert)
    assert load_tokenizer_of(str(path)).encode(text) and asked == [(True, False)]


def test_hf_folder_with_tied_embeddings_shares_the_matrix(home: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    original = tiny_model(seed=10, tie_embeddings=True)
    # save_hf_folder cannot write tied weights (safetensors refuses shared memory): write the folder
    # untied, then drop lm_head.weight and mark the embeddings tied, as real tied checkpoints are.
    untied = tiny_model(seed=10)
    folder = save_hf_folder(untied, tmp_path / "tied-hf")
    state = load_file(str(folder / "model.safetensors"))
    state.pop("lm_head.weight")
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    loaded = load_model(str(folder), dtype="float32", with_tokenizer=False)
    assert loaded.decoder.lm_head.weight is loaded.decoder.embed_tokens.weight
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(original, IDS), rtol=0, atol=0)


# --- what a user can get wrong ----------------------------------------------------------------


def test_unknown_model_name_lists_the_embedded_ones(home: Path) -> None:
    with pytest.raises(ForerunError) as err:
        load_model("qwen-does-not-exist")
    for name in EMBEDDED:
        assert name in str(err.value)


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_model_name_is_refused_not_read_as_the_current_folder(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    (tmp_path / "config.json").write_text("{}")  # a model folder as the current folder
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ForerunError, match="the model name is empty"):
        load_model(spec)


@pytest.mark.parametrize("spec", ["/no/such/dir/model.gguf", "models/model.gguf", "./model-folder"])
def test_missing_file_says_so_and_never_tries_the_hub(home: Path, monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    import huggingface_hub

    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("a missing local path was sent to the hub")
    )
    with pytest.raises(ForerunError, match="no such file"):
        load_model(spec)


def test_file_with_a_bad_header_is_refused_clearly(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ForerunError, match=r"x\.gguf is not a GGUF file"):
        load_model(str(path))
    assert _cache_files(home) == []


def test_gguf_magic_with_a_garbage_body_is_refused_clearly(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "y.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ForerunError, match="not a readable GGUF file"):
        load_model(str(path), with_tokenizer=False)
    assert [f for f in _cache_files(home) if f != "checksums.json"] == []


def test_truncated_gguf_raises_and_leaves_no_half_written_cache(home: Path, tmp_path: Path) -> None:
    whole = write_gguf(tiny_model(seed=11), tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(
        ForerunError, match=r"cut\.gguf is not a readable GGUF file: tensor \S+ runs past the end.*truncated"
    ):
        load_model(str(path), dtype="float32", with_tokenizer=False)
    # Only complete files: the checksum index may be there, nothing else (no weights, config, .tmp).
    assert [f for f in _cache_files(home) if f != "checksums.json"] == []
    assert not [d for d in (home / "converted").iterdir() if d.is_dir()]


def test_not_a_gguf_suffix_is_refused(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ForerunError, match=r"not a \.gguf file"):
        load_model(str(path))


def test_unsupported_gguf_architecture_is_named_with_the_supported_ones(home: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_model(seed=12), tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ForerunError) as err:
        load_model(str(path), with_tokenizer=False)
    message = str(err.value)
    assert "'gpt2'" in message and all(a in message for a in ("llama", "mistral", "qwen2"))
    assert [f for f in _cache_files(home) if f != "checksums.json"] == []


def test_unsupported_config_json_architecture_is_named_with_the_supported_ones(home: Path, tmp_path: Path) -> None:
    folder = save_hf_folder(tiny_model(seed=13), tmp_path / "gpt2-hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ForerunError) as err:
        load_model(str(folder))
    assert "'gpt2'" in str(err.value) and "qwen2" in str(err.value) and "llama" in str(err.value)


def test_a_config_json_that_is_not_json_or_lacks_a_size_is_named(home: Path, tmp_path: Path) -> None:
    folder = save_hf_folder(tiny_model(seed=13), tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text("{bad json")
    with pytest.raises(ForerunError, match=r"config\.json is not readable JSON"):
        load_model(str(folder))
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ForerunError, match="not a JSON object"):
        load_model(str(folder))
    del config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "64"}))
    with pytest.raises(ForerunError, match="'hidden_size', 'num_attention_heads'"):
        load_model(str(folder))


def test_a_damaged_safetensors_file_is_named_not_a_traceback(home: Path, tmp_path: Path) -> None:
    folder = save_hf_folder(tiny_model(seed=13), tmp_path / "hf")
    (weights,) = folder.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ForerunError, match=f"{weights.name} is not a readable safetensors file.*download the model"):
        load_model(str(folder))


def test_gguf_missing_a_metadata_key_names_it(home: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_model(seed=14), tmp_path / "nolayers.gguf", skip_keys=("block_count",))
    with pytest.raises(ForerunError, match=r"qwen2\.block_count"):
        load_model(str(path), with_tokenizer=False)


def test_gguf_with_rope_scaling_is_refused_not_silently_wrong(home: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_model(seed=15), tmp_path / "yarn.gguf", extra={"qwen2.rope.scaling.type": "yarn"})
    with pytest.raises(ForerunError, match="rope scaling"):
        load_model(str(path), with_tokenizer=False)


def test_folder_without_config_json_or_weights_is_refused(home: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ForerunError, match="no config.json"):
        load_model(str(empty))
    folder = save_hf_folder(tiny_model(seed=16), tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ForerunError, match=r"no \*\.safetensors"):
        load_model(str(folder))


def test_weights_that_contradict_config_json_raise_forerun_error(home: Path, tmp_path: Path) -> None:
    folder = save_hf_folder(tiny_model(seed=17), tmp_path / "wrong-hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ForerunError, match="do not match"):
        load_model(str(folder), with_tokenizer=False)


def test_hub_id_without_network_says_to_pass_a_path(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ForerunError) as err:
        load_model("someone/some-model")
    assert "'someone/some-model'" in str(err.value) and "pass a local path" in str(err.value)


def test_unknown_dtype_and_device_are_named(home: Path, tmp_path: Path) -> None:
    folder = save_hf_folder(tiny_model(seed=18), tmp_path / "tiny-hf")
    with pytest.raises(ForerunError, match="unknown dtype 'float8'"):
        load_model(str(folder), dtype="float8")
    with pytest.raises(ForerunError, match="unknown device 'tpu'"):
        load_model(str(folder), device="tpu")
