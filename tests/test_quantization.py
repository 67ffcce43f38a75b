"""int8 weights: close to the full-precision layer, cached once per GGUF, and exact under speculation."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from forerun import LLM, SamplingParams
from forerun.base.errors import ForerunError
from forerun.models import formats, linear
from forerun.models.linear import Int8Linear, Linear, quantize_int8_
from forerun.models.load import load_model
from forerun.models.testing import tiny_model
from tests.test_load import IDS, logits_of, write_gguf


def test_int8_linear_is_close_to_the_float_layer() -> None:
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=True)
    layer.weight.data = torch.randn(32, 64)
    layer.bias.data = torch.randn(32)
    x = torch.randn(5, 64)
    q = Int8Linear(layer)
    error = (q(x) - layer(x)).abs().max() / layer(x).abs().max()
    assert q.qweight.dtype == torch.int8 and error < 0.02


def test_int8_rows_are_computed_independently_of_how_many_rows_come_along() -> None:
    # Verification feeds K+1 rows where plain decoding feeds one: each row must come out the same.
    torch.manual_seed(1)
    layer = Linear(64, 48)
    layer.weight.data = torch.randn(48, 64)
    q = Int8Linear(layer)
    x = torch.randn(6, 64)
    alone = torch.cat([q(x[i : i + 1]) for i in range(6)])
    torch.testing.assert_close(q(x), alone, rtol=0, atol=0)


@pytest.mark.parametrize("int8", [False, True])
def test_many_row_products_through_the_shared_float_buffer_match_row_by_row(
    int8: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prefill takes the float32 path (one scratch buffer shared by every layer): two layers used in turn
    # must each see their own weight, and every row agree with that row computed alone (one-row
    # decoding's kernel) up to rounding, not bit for bit: the int8 kernel rounds to bf16 before it
    # adds the bias, the float path rounds once, at the end.
    monkeypatch.setattr(linear, "_UPCAST_BF16", True)  # bf16 takes the float path on every CPU, not only AVX2
    buffered = []
    float_weight = linear._float_weight
    monkeypatch.setattr(linear, "_float_weight", lambda weight: buffered.append(weight.shape) or float_weight(weight))
    torch.manual_seed(2)
    layers = []
    for out in (40, 24):
        layer = Linear(64, out, bias=True)
        layer.weight.data, layer.bias.data = torch.randn(out, 64), torch.randn(out)
        layer = layer.to(torch.bfloat16)
        layers.append(Int8Linear(layer) if int8 else layer)
    x = torch.randn(80, 64, dtype=torch.bfloat16)
    for layer in layers + layers:
        with linear.prefill():
            many = layer(x).float()  # [80, out]
        for i in range(80):
            alone = layer(x[i : i + 1]).float()[0]  # [out]
            assert (many[i] - alone).abs().max() <= 0.02 * alone.abs().max(), f"row {i} of {tuple(many.shape)}"
    # The four many-row products, and only they, went through the buffer, in the layers' order.
    assert buffered == [torch.Size([40, 64]), torch.Size([24, 64])] * 2


def test_prefills_in_two_threads_do_not_share_the_float_buffer() -> None:
    # Two requests prefilling at once must not overwrite each other's float32 copy of a weight.
    weight = torch.randn(40, 64, dtype=torch.bfloat16)
    pointers = []
    both_done = threading.Barrier(2)

    def work() -> None:
        pointers.append(linear._float_weight(weight).data_ptr())
        both_done.wait()  # both threads (and their buffers) alive until both have looked

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(pointers)) == 2


@pytest.mark.parametrize("int8", [False, True])
def test_outside_a_prefill_many_rows_come_out_exactly_as_one_row(int8: bool) -> None:
    # Verification of a big tree: every row must equal what one-row decoding computes.
    torch.manual_seed(3)
    layer = Linear(64, 32)
    layer.weight.data = torch.randn(32, 64)
    layer = layer.to(torch.bfloat16)
    layer = Int8Linear(layer) if int8 else layer
    x = torch.randn(80, 64, dtype=torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(80)])
    torch.testing.assert_close(layer(x), alone, rtol=0, atol=0)


def test_quantize_replaces_every_linear_of_the_decoder() -> None:
    decoder = quantize_int8_(tiny_model(seed=2).decoder)
    kinds = {type(m) for m in decoder.modules()}
    assert Int8Linear in kinds and Linear not in kinds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_gguf_load_is_cached_and_reloads_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    path = write_gguf(tiny_model(seed=3), tmp_path / "tiny.gguf")
    first = load_model(str(path), dtype=dtype, with_tokenizer=False, quantization="int8")
    cached = list((tmp_path / "home" / "converted").rglob(f"weights-{dtype}-int8.safetensors"))
    assert len(cached) == 1

    def no_requantizing(module):
        raise AssertionError("the weights were quantized again although an int8 copy is cached")

    monkeypatch.setitem(formats.FORMATS, "int8", dataclasses.replace(formats.FORMATS["int8"], quantize=no_requantizing))
    second = load_model(str(path), dtype=dtype, with_tokenizer=False, quantization="int8")
    assert isinstance(second.decoder.lm_head, Int8Linear)
    torch.testing.assert_close(logits_of(second, IDS), logits_of(first, IDS), rtol=0, atol=0)


def test_unknown_quantization_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ForerunError, match="int4.*int8, w8a8"):
        load_model("anything", quantization="int4")


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculation_with_int8_target_and_draft_equals_plain_int8(k: int) -> None:
    target, draft = tiny_model(seed=4), tiny_model(seed=4)
    quantize_int8_(target.decoder)
    params = SamplingParams(max_tokens=24)
    prompt = [[5, 9, 14, 2 + 1, 40]]
    plain = LLM(target).generate(prompt, params)[0]
    spec = LLM(
        target, speculative_model=draft, num_speculative_tokens=k, speculative_options={"quantize": "int8"}
    ).generate(prompt, params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.num_accepted_tokens > 0


def test_int8_weights_loaded_out_of_alignment_are_copied_to_aligned_memory() -> None:
    buffer = torch.zeros(64 * 33, dtype=torch.int8)
    weight = buffer[3 : 3 + 64 * 32].view(64, 32)  # 3 bytes off: as a memory map may give
    weight.copy_(torch.arange(64 * 32).remainder(255).sub(127).to(torch.int8).view(64, 32))
    assert weight.data_ptr() % formats.WEIGHT_ALIGNMENT != 0
    aligned = formats._aligned(weight)
    assert aligned.data_ptr() % formats.WEIGHT_ALIGNMENT == 0
    assert torch.equal(aligned, weight)
    x, scale = torch.randn(5, 32, dtype=torch.bfloat16), torch.rand(64, dtype=torch.bfloat16)
    torch.ops.aten._weight_int8pack_mm(x, aligned, scale)  # crashed the process on AVX-512 bf16 CPUs
