"""Scaled rope (`DecoderConfig.rope_freq_factors`): Llama 3.1's and 3.2's "llama3" scaling and
"linear" scaling, from a Hugging Face folder (rope_scaling, or transformers 5's rope_parameters) and
from a GGUF file (llama.cpp's rope_freqs tensor, a linear scaling's metadata). A tiny random Llama
made by transformers with each scaling gives transformers' own logits through its folder and through
a GGUF file, the native layers run it, and greedy speculation writes plain's text; the same model
without the scaling gives other logits, so the tests see it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from test_load import logits_of, write_gguf

from forerun import native
from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.base.paths import forerun_home
from forerun.engine.engine import Engine
from forerun.models.decoder import llama3_rope_factors
from forerun.models.load import load_model
from forerun.models.testing import TINY_VOCAB, tiny_model, tiny_tokenizer_folder

# Positions past the wavelengths that scaling changes: theta 10000 and 32-wide heads put rope's
# frequencies on both sides of the original context (64) and between its two thresholds.
IDS = [(7 * i + 3) % TINY_VOCAB for i in range(80)]
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LINEAR = {"rope_type": "linear", "factor": 3.0}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Conversions of this test's own (a file converted by an earlier run is read again, so the test
    sees how the loader reads it now); the compiled kernels shared."""
    own = tmp_path / "home"
    own.mkdir()
    (own / "kernels").symlink_to(forerun_home() / "kernels", target_is_directory=True)
    monkeypatch.setenv("FORERUN_HOME", str(own))


def reference(folder, scaling: dict | None):
    """transformers' LlamaForCausalLM with `scaling`, saved into `folder` with the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        rope_parameters={"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # peaked distributions: rope's angles move the logits visibly
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(str(folder))
    tiny_tokenizer_folder(folder)
    return model


def transformers_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module", params=["llama3", "linear"])
def scaled(request, tmp_path_factory):
    scaling = {"llama3": LLAMA3, "linear": LINEAR}[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, reference(folder, scaling), folder


def test_the_folder_gives_transformers_logits_and_the_scaling_is_seen(scaled, tmp_path) -> None:
    kind, model, folder = scaled
    loaded = load_model(str(folder), dtype="float32")
    factors = loaded.decoder.cfg.rope_freq_factors
    assert factors is not None and len(factors) == 16
    want = transformers_logits(model, IDS)
    torch.testing.assert_close(logits_of(loaded, IDS), want, rtol=1e-4, atol=1e-4)
    if kind == "linear":
        assert set(factors) == {3.0}
    else:  # kept, blended and divided frequencies all present
        assert factors[0] == 1.0 and factors[-1] == 8.0 and any(1.0 < f < 8.0 for f in factors)
    # the same weights with plain rope: other logits
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_scaling", None)
    raw["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    plain_folder = tmp_path / "plain"
    plain_folder.mkdir()
    for f in folder.iterdir():
        (plain_folder / f.name).write_bytes(f.read_bytes())
    (plain_folder / "config.json").write_text(json.dumps(raw))
    plain = load_model(str(plain_folder), dtype="float32")
    assert plain.decoder.cfg.rope_freq_factors is None
    assert not torch.allclose(logits_of(plain, IDS), want, atol=1e-2)


def test_a_gguf_file_carries_the_scaling_as_llama_cpp_writes_it(scaled, tmp_path) -> None:
    kind, model, folder = scaled
    original = load_model(str(folder), dtype="float32")
    want = transformers_logits(model, IDS)
    if kind == "llama3":  # llama.cpp's converter: the factors as a rope_freqs tensor
        path = write_gguf(original, tmp_path / "m.gguf")
    else:  # a linear scaling as metadata, no tensor
        linear = {"extra": {"llama.rope.scaling.type": "linear"}, "floats": {"llama.rope.scaling.factor": 3.0}}
        path = write_gguf(original, tmp_path / "m.gguf", rope_freqs=False, **linear)
    loaded = load_model(str(path), dtype="float32", with_tokenizer=False)
    assert loaded.decoder.cfg == original.decoder.cfg
    again = load_model(str(path), dtype="float32", with_tokenizer=False)  # the config the first load cached
    assert again.decoder.cfg.rope_freq_factors == original.decoder.cfg.rope_freq_factors
    torch.testing.assert_close(logits_of(loaded, IDS), want, rtol=1e-4, atol=1e-4)
    # its own blocks through the native kernels: the file's weights in float, within the rows' int8 rounding
    q8 = write_gguf(original, tmp_path / "q8.gguf", quant="Q8_0")
    blocks = load_model(str(q8), quantization="gguf", with_tokenizer=False)
    in_float = logits_of(load_model(str(q8), dtype="float32", with_tokenizer=False), IDS)
    assert (logits_of(blocks, IDS) - in_float).norm() < 0.05 * in_float.norm()
    assert (blocks.decoder._native_layers() is not None) == native.available()
    chained = blocks.decoder.forward_chain(IDS, blocks.decoder.new_cache(len(IDS) + 1))
    torch.testing.assert_close(chained[0], logits_of(blocks, IDS)[-1], rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_tokens=30)
    plain_ids = Engine(blocks).generate(IDS, params).token_ids
    llm = LLM(blocks, speculative_method="suffix", num_speculative_tokens=4, speculative_k_policy="fixed")
    assert llm.generate(IDS, params)[0].token_ids == plain_ids


def test_llama3_factors_give_transformers_frequencies() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        head_dim=32, hidden_size=64, num_attention_heads=2, rope_parameters={"rope_theta": 10000.0, **LLAMA3}
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    factors = torch.tensor(llama3_rope_factors(32, 10000.0, 8.0, 1.0, 4.0, 64))
    torch.testing.assert_close(plain / factors, inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "scaling, words",
    [
        ({"rope_type": "yarn", "factor": 4.0}, "rope scaling"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "high_freq_factor"),
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "linear", "factor": -2}, "factor"),
    ],
)
def test_a_scaling_that_cannot_be_computed_is_refused_by_name(tmp_path, scaling, words) -> None:
    folder = tmp_path / "m"
    reference(folder, None)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"] = {"rope_theta": 10000.0, **scaling}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ForerunError, match=words):
        load_model(str(folder), dtype="float32")


@pytest.mark.parametrize("factors", [(1.0,) * 3, (1.0,) * 7 + (0.0,)])
def test_a_rope_freqs_tensor_that_is_not_one_positive_factor_a_frequency_is_refused(tmp_path, factors) -> None:
    model = tiny_model(2, architecture="llama")  # head_dim 16: 8 frequencies
    model.decoder.cfg = replace(model.decoder.cfg, rope_freq_factors=factors)
    path = write_gguf(model, tmp_path / "bad.gguf")
    with pytest.raises(ForerunError, match="rope_freqs.weight must hold 8 positive"):
        load_model(str(path), dtype="float32", with_tokenizer=False)
