"""The `q4_0` format: a GGUF file's wider tensors re-blocked into Q4_0 once, kept, and the default for a
GGUF draft model (its weights change only the speed: output stays the target's)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from forerun import drafters, native
from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.engine.engine import Engine
from forerun.models import formats
from forerun.models.gguf_format import GGUFEmbedding, GGUFLinear
from forerun.models.load import REBLOCKED, load_model
from forerun.models.testing import save_hf_folder, tiny_model
from tests.conftest import perturbed
from tests.test_drafters_common import exact_marginals, keep_every_draft_always, speculative_samples, total_variation
from tests.test_gguf_format import K_SIZES, k_quant_mix, legacy_mix
from tests.test_load import write_gguf

pytestmark = pytest.mark.skipif(not native.available(), reason="forerun's native kernels are not built here")


def kinds(product: GGUFLinear) -> list[str]:
    return [native.TYPE_NAMES[p.type_id] for p in product.parts]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("q4_0_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_HOME", str(folder / "home"))
        yield folder


@pytest.fixture(scope="module")
def k_file(home: Path) -> Path:
    return write_gguf(tiny_model(seed=7, num_layers=2, **K_SIZES), home / "k.gguf", quant=k_quant_mix)


@pytest.fixture(scope="module")
def mixed_file(home: Path) -> Path:
    """The 0.5B draft's mix (Q5_0, Q8_0, a Q4_0 embedding) with one tensor left in F32."""
    return write_gguf(
        tiny_model(seed=8, num_layers=2),
        home / "mixed.gguf",
        quant=lambda name: None if name == "blk.1.attn_v.weight" else legacy_mix(name),
    )


def stores(home: Path) -> list[Path]:
    return list((home / "home" / "converted").rglob(REBLOCKED))


def test_tensors_wider_than_q4_0_are_reblocked_and_the_rest_kept(k_file: Path, mixed_file: Path) -> None:
    k_model = load_model(str(k_file), with_tokenizer=False, quantization="q4_0").decoder
    # Q4_K has Q4_0's 4.5 bits a weight: kept; Q6_K (attn_v, ffn_down of layer 0, the LM head) is not.
    assert kinds(k_model.layers[0].self_attn.qkv_proj) == ["Q4_K", "Q4_K", "Q4_0"]
    assert kinds(k_model.layers[0].mlp.down_proj) == ["Q4_0"] and kinds(k_model.layers[1].mlp.down_proj) == ["Q4_K"]
    assert kinds(k_model.lm_head) == ["Q4_0"]
    mixed = load_model(str(mixed_file), with_tokenizer=False, quantization="q4_0").decoder
    # Q5_0, Q8_0 and the F32 tensor (which `gguf` would run as w8a8) all become Q4_0 blocks.
    for block in mixed.layers:
        for product in (block.self_attn.qkv_proj, block.self_attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj):
            assert set(kinds(product)) == {"Q4_0"} and product.fallback is not None and not len(product.fallback)
    assert isinstance(mixed.embed_tokens, GGUFEmbedding)  # one row a token is read: kept as stored
    assert native.TYPE_NAMES[mixed.embed_tokens.type_id] == "Q4_0"
    assert mixed._native_layers() is not None


def test_the_reblocked_product_computes_gguf_pys_q4_0_of_the_files_weights(mixed_file: Path) -> None:
    decoder = load_model(str(mixed_file), with_tokenizer=False, quantization="q4_0").decoder
    reader = gguf.GGUFReader(str(mixed_file))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    rows, inputs = int(tensor.shape[1]), int(tensor.shape[0])
    weights = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(rows, -1)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_0)
    product = decoder.layers[0].mlp.down_proj
    assert torch.equal(product.parts[0].raw, torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8))
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0).copy())
    x = torch.randn(5, inputs, generator=torch.Generator().manual_seed(0))
    y, exact = product(x), x @ reference.reshape(rows, inputs).T
    assert (y - exact).norm() / exact.norm() < 0.02  # only the activations' int8 rounding
    file_weights = x @ torch.from_numpy(weights).T  # the re-blocking changed the weights: a little
    assert 0.005 < (y - file_weights).norm() / file_weights.norm() < 0.2


def test_reblocked_tensors_are_kept_and_read_back_and_a_damaged_store_is_remade(
    home: Path, k_file: Path, capsys
) -> None:
    for old in stores(home):
        old.unlink()
    first = load_model(str(k_file), with_tokenizer=False, quantization="q4_0").decoder
    assert "tensors re-blocked into Q4_0 (once" in capsys.readouterr().err
    [store] = stores(home)
    again = load_model(str(k_file), with_tokenizer=False, quantization="q4_0").decoder
    assert "re-blocked" not in capsys.readouterr().err
    assert torch.equal(again.lm_head.parts[0].raw, first.lm_head.parts[0].raw)
    store.write_bytes(b"not a safetensors file")
    remade = load_model(str(k_file), with_tokenizer=False, quantization="q4_0").decoder
    err = capsys.readouterr().err
    assert "cannot be read" in err and "tensors re-blocked into Q4_0" in err
    assert torch.equal(remade.lm_head.parts[0].raw, first.lm_head.parts[0].raw)
    ids = torch.arange(3, 12)
    assert torch.equal(
        remade(ids, torch.arange(9), remade.new_cache(9)).logits, first(ids, torch.arange(9), first.new_cache(9)).logits
    )


def test_auto_picks_q4_0_for_a_gguf_draft_and_gguf_for_the_target(monkeypatch, capsys) -> None:
    monkeypatch.setattr(formats, "_said", set())
    assert formats.resolve("auto", "cpu", "gguf", draft=True) == "q4_0"
    assert "--speculative-quantization auto: q4_0" in capsys.readouterr().err
    assert formats.resolve("auto", "cpu", "gguf") == "gguf"
    assert formats.resolve("auto", "cpu", "hf", draft=True) not in formats.NATIVE
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "problem", lambda: "no compiler")
    assert formats.resolve("q4_0", "cpu", "gguf", draft=True) == "w8a8"
    assert "--speculative-quantization q4_0: no compiler; using w8a8 instead" in capsys.readouterr().err
    assert formats.resolve("gguf", "cpu", "gguf") == "w8a8"  # the flag the user gave, named
    assert "--quantization gguf: no compiler; using w8a8 instead" in capsys.readouterr().err


def test_a_model_folder_cannot_take_q4_0(tmp_path: Path) -> None:
    folder = save_hf_folder(tiny_model(seed=0), tmp_path / "hf")
    with pytest.raises(ForerunError, match="q4_0 computes a GGUF file's blocks.*model folder; use w8a8"):
        load_model(str(folder), with_tokenizer=False, quantization="q4_0")


@pytest.fixture(scope="module")
def pair(home: Path) -> tuple[Path, Path]:
    """A target file and a draft file (the target perturbed, Q8_0 as the 0.5B's LM head is)."""
    base = tiny_model(seed=2, num_layers=4, **K_SIZES)
    target = write_gguf(base, home / "t.gguf", quant=k_quant_mix)
    return target, write_gguf(perturbed(base, 0.3), home / "d.gguf", quant=lambda name: "Q8_0")


def test_an_llm_drafts_with_a_q4_0_draft_by_default_and_greedy_output_is_the_targets(pair, monkeypatch) -> None:
    import forerun.api as api

    target_file, draft_file = pair
    # The tiny files carry no tokenizer: the LLM's own loads, without one.
    monkeypatch.setattr(api, "load_model", lambda *args, **kw: load_model(*args, **{**kw, "with_tokenizer": False}))
    llm = LLM(
        str(target_file),
        speculative_model=str(draft_file),
        quantization="auto",
        num_speculative_tokens=3,
        speculative_k_policy="fixed",  # tiny models: drafting pays nothing, so adaptive would hardly draft
    )
    draft = llm.spec.options["model"].decoder
    assert kinds(draft.lm_head) == ["Q4_0"] and kinds(llm.target.decoder.lm_head) == ["Q6_K"]
    plain = LLM(llm.target)
    prompts = [[5, 6, 7, 8], [40, 41, 9, 9, 9, 3]]
    params = SamplingParams(max_tokens=40)
    for prompt in prompts:
        spec = llm.generate([prompt], params)[0]
        assert spec.token_ids == plain.generate([prompt], params)[0].token_ids
        assert 0 < spec.metrics.num_accepted_tokens < spec.metrics.num_draft_tokens


SAMPLING = SamplingParams(temperature=1.0, top_k=4, max_tokens=8)


@pytest.fixture(scope="module")
def sampled(pair):
    """The target, a q4_0 draft model's drafter factory and the exact 2nd/3rd token marginals."""
    target_file, draft_file = pair
    target = load_model(str(target_file), with_tokenizer=False, quantization="gguf")
    draft = load_model(str(draft_file), with_tokenizer=False, quantization="q4_0", draft=True)
    prompt = [3 + (7 * i) % 90 for i in range(40)]

    def drafter():
        return drafters.create("draft", target, {"model": draft})

    return target, drafter, prompt, *exact_marginals(target, prompt, SAMPLING)


def test_sampled_tokens_with_a_q4_0_draft_follow_the_targets_distribution(sampled) -> None:
    target, drafter, prompt, second, third = sampled
    samples, metrics = speculative_samples(target, drafter(), 2, prompt, 500, SAMPLING)
    for position, exact in ((0, second), (1, third)):
        tv, tolerance = total_variation([s[position] for s in samples], exact)
        assert tv < tolerance, f"token {position + 2}: TV {tv:.4f} >= {tolerance:.4f}"
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


def test_negative_control_an_always_accepting_rule_fails_with_a_q4_0_draft(sampled, monkeypatch) -> None:
    target, drafter, prompt, second, third = sampled
    keep_every_draft_always(monkeypatch)
    samples, _ = speculative_samples(target, drafter(), 2, prompt, 150, SAMPLING)
    failures = [total_variation([s[i] for s in samples], exact) for i, exact in ((0, second), (1, third))]
    assert any(tv >= tolerance for tv, tolerance in failures)


def test_greedy_with_a_q4_0_draft_equals_plain_through_the_engine(sampled) -> None:
    target, drafter, prompt, *_ = sampled
    params = SamplingParams(max_tokens=30)
    plain = Engine(target).generate(prompt, params).token_ids
    assert Engine(target, drafter(), 4).generate(prompt, params).token_ids == plain
