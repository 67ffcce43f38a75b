"""Qwen3 (each head's q and k normed before rope, `DecoderConfig.qk_norm`): a tiny random Qwen3 made
by transformers gives transformers' own logits through its Hugging Face folder and through a GGUF
file; in w8a8 and in the `gguf` format it stays close, and greedy speculation writes plain's text in
each. Also config.json as transformers 5 writes it (the rope's settings in `rope_parameters`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_load import IDS, logits_of, write_gguf

from forerun import native
from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.engine.engine import Engine
from forerun.models import w8a8
from forerun.models.load import load_model
from forerun.models.testing import TINY_VOCAB, save_hf_folder, tiny_model, tiny_tokenizer_folder

THETA = 500000.0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(transformers' Qwen3ForCausalLM, the folder it saved, with the tiny tokenizer beside it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # not hidden_size / heads, as in Qwen3's own configs
        max_position_embeddings=1024,
        rope_theta=THETA,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger than the init's: peaked distributions, norms far from 1
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    folder = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(str(folder))
    tiny_tokenizer_folder(folder)
    return model, folder


def transformers_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [T, vocab]


def test_the_folder_gives_transformers_logits(reference) -> None:
    model, folder = reference
    loaded = load_model(str(folder), dtype="float32")
    cfg = loaded.decoder.cfg
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim, cfg.rope_theta) == ("qwen3", True, 32, THETA)
    torch.testing.assert_close(logits_of(loaded, IDS), transformers_logits(model, IDS), rtol=1e-4, atol=1e-4)
    # with q's norms reset the logits are others: the test sees the norms
    for block in loaded.decoder.layers:
        block.self_attn.q_norm.weight.data.fill_(1.0)
    assert not torch.allclose(logits_of(loaded, IDS), transformers_logits(model, IDS), atol=1e-2)


def test_a_gguf_file_gives_the_same_logits_in_float_and_close_ones_in_its_own_blocks(reference, tmp_path) -> None:
    model, folder = reference
    original = load_model(str(folder), dtype="float32")
    path = write_gguf(original, tmp_path / "qwen3.gguf")
    loaded = load_model(str(path), dtype="float32", with_tokenizer=False)
    assert loaded.decoder.cfg == original.decoder.cfg
    torch.testing.assert_close(logits_of(loaded, IDS), transformers_logits(model, IDS), rtol=1e-4, atol=1e-4)
    q8 = write_gguf(original, tmp_path / "q8.gguf", quant="Q8_0")
    blocks = load_model(str(q8), quantization="gguf", with_tokenizer=False)
    want = transformers_logits(model, IDS)
    assert (logits_of(blocks, IDS) - want).abs().max() < 0.05 * want.abs().max()
    # decoding's own forward (a chain, row-exact, through the native layers) computes the same
    assert (blocks.decoder._native_layers() is not None) == native.available()
    chained = blocks.decoder.forward_chain(IDS, blocks.decoder.new_cache(len(IDS) + 1))
    torch.testing.assert_close(chained[0], logits_of(blocks, IDS)[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantization", [None, "w8a8", "gguf"])
def test_greedy_speculation_writes_plains_text(reference, tmp_path, quantization) -> None:
    model, folder = reference
    source = str(folder)
    if quantization == "gguf":
        source = str(write_gguf(load_model(str(folder), dtype="float32"), tmp_path / "q8.gguf", quant="Q8_0"))
    target = load_model(source, dtype="float32", quantization=quantization, with_tokenizer=False)
    if quantization == "w8a8":
        want = transformers_logits(model, IDS)
        # 7-bit activations (fbgemm without VNNI) round twice as coarsely as 8-bit ones
        bound = 0.05 * w8a8.levels(False) / w8a8.levels(w8a8.reduce_range_needed())
        assert (logits_of(target, IDS) - want).abs().max() < bound * want.abs().max()
    params = SamplingParams(max_tokens=40)
    plain = Engine(target).generate(IDS, params).token_ids
    for method in ("suffix", "early-exit"):
        llm = LLM(target, speculative_method=method, num_speculative_tokens=4, speculative_k_policy="fixed")
        got = llm.generate(IDS, params)[0]
        assert got.token_ids == plain, (quantization, method)
    assert len(set(plain)) > 3  # not one token over and over


# --- config.json as transformers 5 writes it -----------------------------------------------------


def test_the_rope_is_read_from_rope_parameters_and_scaled_ones_refused(tmp_path) -> None:
    folder = save_hf_folder(tiny_model(1), tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_theta": THETA, "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(raw))
    assert load_model(str(folder), dtype="float32").decoder.cfg.rope_theta == THETA
    raw["rope_parameters"] = {"rope_theta": THETA, "rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ForerunError, match="rope scaling"):
        load_model(str(folder), dtype="float32")


def test_a_qwen3_folder_loads_by_path_and_its_sliding_window_bounds_the_context(reference, tmp_path) -> None:
    _, folder = reference
    copy = Path(tmp_path / "windowed")
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    raw = json.loads((copy / "config.json").read_text())
    raw.update(use_sliding_window=True, sliding_window=256)
    (copy / "config.json").write_text(json.dumps(raw))
    assert load_model(str(copy), dtype="float32").decoder.cfg.max_position == 256
