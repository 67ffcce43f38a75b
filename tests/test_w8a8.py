"""w8a8: the product, its row independence, the whole forward's row independence, and its cache.

Row independence is checked as bit equality, never closeness: greedy speculation equals plain
decoding only if every verified row comes out exactly as it would alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forerun import drafters
from forerun.base import cpu
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.engine.engine import Engine
from forerun.models import attention, formats, w8a8
from forerun.models.attention import RowLayout
from forerun.models.decoder import Decoder
from forerun.models.load import load_model
from forerun.models.testing import tiny_model
from forerun.models.w8a8 import W8A8Linear, quantize_decoder_
from forerun.verification.tree import DraftTree
from forerun.verification.verify import row_layout
from tests.test_load import IDS, logits_of, write_gguf

SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def random_rows(seed: int, rows: int, width: int) -> torch.Tensor:
    """Rows with the awkward cases: an outlier column, a zero row, tiny and huge magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(rows, width, generator=gen)
        * torch.logspace(-3, 3, rows)[torch.randperm(rows, generator=gen)][:, None]
    )
    x[:, int(torch.randint(width, (1,), generator=gen))] *= 50
    if rows > 2:
        x[1] = 0.0
    return x


# --- the product -----------------------------------------------------------------------------------


def test_w8a8_product_is_close_to_the_float_product() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 96), torch.randn(48)
    x = torch.randn(7, 96)
    exact = x @ weight.T + bias
    error = (W8A8Linear.from_float(weight, bias)(x) - exact).norm() / exact.norm()
    assert error < 0.03


def usable_kernels() -> list[str]:
    """The w8a8 kernels this machine runs: fbgemm always, onednn where its product is exact, mixed
    where fbgemm's activations also have 8 bits."""
    kernels = ["fbgemm"]
    if w8a8.onednn_exact():
        kernels.append("onednn")
        if not w8a8.reduce_range_needed():
            kernels.append("mixed")
    return kernels


@SLOW
@given(
    rows=st.integers(1, 16),
    width=st.sampled_from([16, 64, 96, 896, 1536]),
    seed=st.integers(0, 10_000),
    kernel=st.sampled_from(usable_kernels()),
)
def test_a_rows_product_is_bit_identical_alone_or_in_any_batch(rows: int, width: int, seed: int, kernel: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    layer = W8A8Linear.from_float(
        torch.randn(40, width, generator=gen), torch.randn(40, generator=gen), kernel_name=kernel
    )
    x = random_rows(seed, rows, width)
    batch = layer(x)
    for i in range(rows):
        assert torch.equal(batch[i], layer(x[i : i + 1])[0]), f"row {i} of {rows} differs"
    assert torch.isfinite(batch).all()


@pytest.mark.skipif(
    not w8a8.onednn_exact() or w8a8.reduce_range_needed(),
    reason="onednn's int8 product does not run here, or fbgemm needs 7-bit activations",
)
@SLOW
@given(rows=st.integers(1, 20), width=st.sampled_from([16, 96, 896, 1536]), seed=st.integers(0, 10_000))
def test_every_kernel_gives_the_same_bits(rows: int, width: int, seed: int) -> None:
    # Each row's integer sums are exact and each kernel rounds sum * scale once, so mixing the
    # kernels by row count ("mixed") keeps every row exact.
    gen = torch.Generator().manual_seed(seed)
    qweight, scale = w8a8.quantize_weight(torch.randn(48, width, generator=gen))
    bias = torch.randn(48, generator=gen)
    x = random_rows(seed, rows, width)
    outputs = {k: W8A8Linear(qweight, scale, bias, kernel_name=k)(x) for k in ("fbgemm", "onednn", "mixed")}
    assert torch.equal(outputs["onednn"], outputs["fbgemm"])
    assert torch.equal(outputs["mixed"], outputs["fbgemm"])


@pytest.mark.skipif(
    not w8a8.onednn_exact() or w8a8.reduce_range_needed(),
    reason="onednn's int8 product does not run here, or fbgemm needs 7-bit activations",
)
def test_a_whole_decoder_computes_the_same_logits_through_either_kernel() -> None:
    # A prefill (many rows: onednn in "mixed") and one-row steps (fbgemm in "mixed").
    import copy

    model = tiny_model(seed=4, num_layers=2).decoder
    decoders = {k: quantize_decoder_(copy.deepcopy(model), kernel_name=k) for k in ("fbgemm", "mixed")}
    ids = torch.randint(0, 99, (24,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for k, decoder in decoders.items():
        cache = decoder.new_cache(30)
        rows = [decoder(ids[:20], torch.arange(20), cache).logits[0]]
        for i in range(20, 24):
            rows.append(decoder(ids[i : i + 1], torch.tensor([i]), cache, layout=RowLayout.chain(i, 1)).logits[0])
        logits[k] = torch.cat(rows)
    assert torch.equal(logits["mixed"], logits["fbgemm"])


@pytest.mark.parametrize(
    "flags,onednn,saturates,want",
    [
        ({"avx512f", "avx512_vnni", "amx_tile", "amx_int8"}, True, False, "mixed"),
        ({"avx512f", "avx512_vnni"}, True, False, "fbgemm"),  # onednn is measured faster with AMX only
        ({"avx2", "fma"}, True, True, "fbgemm"),
        ({"avx512f", "amx_tile", "amx_int8"}, False, False, "fbgemm"),  # no exact onednn product in this PyTorch
    ],
)
def test_the_kernel_is_chosen_for_the_cpu_it_finds(monkeypatch, flags, onednn, saturates, want) -> None:
    monkeypatch.delenv(w8a8.KERNEL_ENV, raising=False)
    monkeypatch.setattr(cpu, "flags", lambda: flags)
    monkeypatch.setattr(w8a8, "onednn_exact", lambda: onednn)
    monkeypatch.setattr(w8a8, "reduce_range_needed", lambda: saturates)
    w8a8.kernel.cache_clear()
    try:
        assert w8a8.kernel() == want
    finally:
        w8a8.kernel.cache_clear()


def test_an_asked_for_kernel_is_used_or_refused_with_the_choices(monkeypatch) -> None:
    monkeypatch.setattr(w8a8, "onednn_exact", lambda: True)
    monkeypatch.setattr(w8a8, "reduce_range_needed", lambda: True)
    try:
        for asked, want in (("fbgemm", "fbgemm"), (" ONEDNN ", "onednn")):
            monkeypatch.setenv(w8a8.KERNEL_ENV, asked)
            w8a8.kernel.cache_clear()
            assert w8a8.kernel() == want
        for asked, error in (
            ("cublas", r"not a w8a8 kernel; use one of mixed, onednn, fbgemm"),
            ("mixed", r"8-bit activations in fbgemm.*saturate"),
        ):
            monkeypatch.setenv(w8a8.KERNEL_ENV, asked)
            w8a8.kernel.cache_clear()
            with pytest.raises(ForerunError, match=error):
                w8a8.kernel()
    finally:
        w8a8.kernel.cache_clear()


def test_a_rows_largest_entry_is_represented_exactly() -> None:
    # Each row's peak becomes exactly ±127 levels, so a one-hot row returns its weight column
    # exactly (up to float rounding of the scales).
    weight = torch.randn(16, 64)
    layer = W8A8Linear.from_float(weight)
    dequantized = layer.qweight().float() * layer.scale[:, None]
    for value in (1.0, -2.5, 1e-4):
        x = torch.zeros(1, 64)
        x[0, 3] = value
        torch.testing.assert_close(layer(x)[0], value * dequantized[:, 3], rtol=1e-5, atol=0)


def test_seven_bit_activations_where_eight_would_saturate() -> None:
    # An all-ones row against weights of 127 overflows int16 pair sums on CPUs without VNNI.
    layer = W8A8Linear(torch.full((4, 64), 127, dtype=torch.int8), torch.full((4,), 1 / 127), None)
    assert layer.reduce_range == w8a8.reduce_range_needed()
    torch.testing.assert_close(layer(torch.ones(1, 64))[0], torch.full((4,), 64.0), rtol=0.01, atol=0)


def test_padded_width_leaves_two_columns_and_is_a_multiple_of_32() -> None:
    for width in (16, 30, 31, 32, 896, 1536, 8960):
        padded = w8a8.padded_width(width)
        assert padded % 32 == 0 and padded >= width + 2


def test_w8a8_on_a_device_without_fbgemm_names_the_formats_it_can_run() -> None:
    with pytest.raises(ForerunError, match=r"w8a8 does not run on cuda.*int8"):
        formats.check_device("w8a8", "cuda")


@pytest.mark.parametrize(
    "flags,fbgemm,device,want",
    [
        ({"avx2", "fma"}, True, "cpu", "w8a8"),
        ({"avx512f", "amx_bf16", "amx_tile", "amx_int8"}, True, "cpu", "w8a8"),  # measured faster than bf16 there too
        ({"avx512f", "amx_bf16", "amx_tile", "amx_int8"}, False, "cpu", None),  # bf16 rows are nearly free
        ({"avx2", "fma"}, False, "cpu", "int8"),
        (set(), True, "cuda", None),
    ],
)
def test_auto_picks_the_fastest_exact_format_for_the_cpu_it_finds(
    monkeypatch, capsys, flags, fbgemm, device, want
) -> None:
    monkeypatch.setattr(cpu, "flags", lambda: flags)
    monkeypatch.setattr(w8a8, "available", lambda device="cpu": fbgemm and torch.device(device).type == "cpu")
    monkeypatch.setattr(formats, "_said", set())
    assert formats.resolve("auto", device) == want
    assert f"--quantization auto: {want or 'none'}" in capsys.readouterr().err
    assert formats.resolve("int8", device) == "int8" and formats.resolve(None, device) is None


def test_a_quantized_decoder_stays_close_to_its_float_original() -> None:
    # Norm gains far from 1 and a prefill plus row-exact steps: a product that forgot a folded norm
    # gain or q's 1/sqrt(head_dim) would be far off.
    import copy

    model = tiny_model(seed=1, num_layers=3).decoder
    gen = torch.Generator().manual_seed(0)
    for block in model.layers:
        block.input_layernorm.weight.data = torch.rand(64, generator=gen) * 2 + 0.2
        block.post_attention_layernorm.weight.data = torch.rand(64, generator=gen) * 2 + 0.2
    quantized = quantize_decoder_(copy.deepcopy(model))
    ids = torch.randint(0, 99, (40,), generator=gen)

    def logits(decoder: Decoder) -> torch.Tensor:
        """A 30-token prefill, then 10 row-exact steps: [40, V]."""
        cache = decoder.new_cache(40)
        rows = [decoder(ids[:30], torch.arange(30), cache).logits[0]]
        for i in range(30, 40):
            rows.append(decoder(ids[i : i + 1], torch.tensor([i]), cache, layout=RowLayout.chain(i, 1)).logits[0])
        return torch.cat(rows)

    exact, approx = logits(model), logits(quantized)
    assert (approx - exact).norm() / exact.norm() < 0.06
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean() > 0.85


# --- the whole forward ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized() -> Decoder:
    return quantize_decoder_(tiny_model(seed=1, num_layers=3).decoder)


def plain_rows(decoder: Decoder, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of `tokens` decoded one at a time after `prefix`, as plain decoding computes them."""
    cache = decoder.new_cache(len(prefix) + len(tokens) + 1)
    decoder(torch.tensor(prefix), torch.arange(len(prefix)), cache)
    rows = []
    for token in tokens:
        at = cache.length
        rows.append(
            decoder(torch.tensor([token]), torch.tensor([at]), cache, layout=RowLayout.chain(at, 1)).logits[0, 0]
        )
    return torch.stack(rows)


def random_tree(draw, size: int) -> DraftTree:
    parents = [draw(st.integers(-1, i - 1)) for i in range(size)]
    return DraftTree([draw(st.integers(0, 98)) for _ in range(size)], parents)


@SLOW
@given(data=st.data(), prefix_len=st.integers(1, 150), nodes=st.integers(0, 15), block=st.sampled_from([4, 8, 64]))
def test_every_verified_row_equals_plain_decoding_bit_for_bit(
    quantized, monkeypatch, data, prefix_len: int, nodes: int, block: int
) -> None:
    # Small key blocks make rows of one verification straddle block edges; random trees make
    # branches whose ancestors must be moved into place.
    monkeypatch.setattr(attention, "KEY_BLOCK", block)
    prefix = data.draw(st.lists(st.integers(0, 98), min_size=prefix_len, max_size=prefix_len))
    tree = random_tree(data.draw, nodes)
    root = data.draw(st.integers(0, 98))
    cache = quantized.new_cache(prefix_len + nodes + 1)
    quantized(torch.tensor(prefix), torch.arange(prefix_len), cache)
    start = cache.length
    verified = quantized(
        torch.tensor([root] + tree.tokens), tree.positions(start), cache, layout=row_layout(tree, start)
    ).logits[0]  # [N+1, V]
    for row in range(nodes + 1):
        path = tree.path_to(row - 1) if row else []
        alone = plain_rows(quantized, prefix, [root] + [tree.tokens[i] for i in path])[-1]
        assert torch.equal(verified[row], alone), f"row {row} of {nodes + 1} (path {path}) differs"


def test_branch_moves_leave_the_cache_as_they_found_it(quantized) -> None:
    # A second branch borrows the first branch's slots while it is computed; they must come back.
    tree = DraftTree([5, 6, 7, 8, 9], [-1, 0, 1, 0, 3])
    cache = quantized.new_cache(40)
    quantized(torch.arange(10, 30), torch.arange(20), cache)
    quantized(torch.tensor([1] + tree.tokens), tree.positions(20), cache, layout=row_layout(tree, 20))
    moved = [k.clone() for k in cache.layer_k]
    chain = DraftTree([5, 6, 7], [-1, 0, 1])
    again = quantized.new_cache(40)
    quantized(torch.arange(10, 30), torch.arange(20), again)
    quantized(torch.tensor([1, 5, 6, 7]), chain.positions(20), again, layout=row_layout(chain, 20))
    for layer in range(quantized.cfg.num_layers):
        assert torch.equal(moved[layer][:, :24], again.layer_k[layer][:, :24])


def test_quantized_state_reloads_to_identical_logits(quantized) -> None:
    state = {k: v.clone() for k, v in quantized.state_dict().items()}
    with torch.device("meta"):
        skeleton = Decoder(quantized.cfg)
    reloaded = w8a8.load_decoder_(skeleton, state)
    ids = torch.tensor([3, 14, 15, 92, 65, 35])
    a = quantized(ids, torch.arange(6), quantized.new_cache(8)).logits
    b = reloaded(ids, torch.arange(6), reloaded.new_cache(8)).logits
    assert torch.equal(a, b)


def test_w8a8_gguf_load_is_cached_and_reloads_identically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    path = write_gguf(tiny_model(seed=3), tmp_path / "tiny.gguf")
    first = load_model(str(path), dtype="float32", with_tokenizer=False, quantization="w8a8")
    assert len(list((tmp_path / "home" / "converted").rglob("weights-float32-w8a8v2.safetensors"))) == 1

    def no_requantizing(decoder):
        raise AssertionError("the weights were quantized again although a w8a8 copy is cached")

    monkeypatch.setitem(
        formats.FORMATS,
        "w8a8",
        dataclasses.replace(formats.FORMATS["w8a8"], quantize=no_requantizing, shows_progress=False),
    )
    second = load_model(str(path), dtype="float32", with_tokenizer=False, quantization="w8a8")
    assert isinstance(second.decoder.lm_head, W8A8Linear)
    assert torch.equal(logits_of(second, IDS), logits_of(first, IDS))


# --- greedy speculation equals plain decoding, for every drafter -----------------------------------


METHODS = [
    ("ngram", {}),
    ("suffix", {}),
    ("suffix", {"min_match": 1, "branch_ratio": 0.3, "min_prob": 0.0}),
    ("early-exit", {"layer": 2}),
    ("lookahead", {}),
    ("lookahead", {"window": 3, "ngram": 3, "guesses": 5}),
]


@pytest.fixture(scope="module")
def w8a8_target():
    model = tiny_model(seed=2, name="target4", num_layers=4)
    quantize_decoder_(model.decoder)
    return model


@pytest.fixture(scope="module")
def prompt(w8a8_target) -> list[int]:
    """Text the model wrote itself (sampled), so its n-grams recur in what it writes next."""
    out = Engine(w8a8_target).generate([5, 6, 7], SamplingParams(temperature=1.0, top_k=4, max_tokens=40, seed=1))
    return [5, 6, 7] + out.token_ids


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("method,options", METHODS, ids=lambda v: str(v))
def test_w8a8_greedy_speculation_equals_plain_for_every_drafter(w8a8_target, prompt, method, options, k) -> None:
    params = SamplingParams(max_tokens=40)
    plain = Engine(w8a8_target).generate(prompt, params).token_ids
    spec = Engine(w8a8_target, drafters.create(method, w8a8_target, options), k).generate(prompt, params)
    assert spec.token_ids == plain
    assert 0 < spec.metrics.num_accepted_tokens < spec.metrics.num_draft_tokens


@pytest.mark.parametrize("k", [1, 4])
def test_w8a8_greedy_speculation_with_a_w8a8_draft_model_equals_plain(w8a8_target, prompt, k) -> None:
    from tests.conftest import perturbed

    draft = perturbed(tiny_model(seed=2, name="draft", num_layers=4), 0.3)
    params = SamplingParams(max_tokens=40)
    plain = Engine(w8a8_target).generate(prompt, params).token_ids
    drafter = drafters.create("draft", w8a8_target, {"model": draft, "quantize": "w8a8"})
    spec = Engine(w8a8_target, drafter, k).generate(prompt, params)
    assert spec.token_ids == plain
    assert 0 < spec.metrics.num_accepted_tokens < spec.metrics.num_draft_tokens


def test_quality_command_compares_formats_with_the_unquantized_model(tmp_path: Path, capsys) -> None:
    import json

    from forerun.cli import main
    from forerun.models.testing import save_hf_folder

    folder = save_hf_folder(tiny_model(seed=0), tmp_path / "tiny")
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        json.dumps({"prompt": "abc abc", "category": "code"})
        + "\n"
        + json.dumps({"prompt": "hello", "category": "chat"})
        + "\n"
    )
    assert (
        main(
            [
                "quality",
                "--model",
                str(folder),
                "--dtype",
                "float32",
                "--quantization",
                "w8a8",
                "int8",
                "--dataset",
                str(dataset),
                "--max-tokens",
                "6",
                "--json",
            ]
        )
        == 0
    )
    table = json.loads(capsys.readouterr().out)
    assert set(table) == {"w8a8", "int8"}
    for rows in table.values():
        assert set(rows) == {"code", "chat", "overall"}
        assert rows["overall"]["positions"] == 12
        assert 0 < rows["overall"]["top1_agree"] <= 12 and rows["overall"]["kl_sum"] > 0


@pytest.mark.parametrize("k", [2, 5])
def test_w8a8_greedy_auto_method_equals_plain_with_both_of_its_drafters(w8a8_target, prompt, k) -> None:
    from tests.conftest import perturbed

    draft = perturbed(tiny_model(seed=2, name="draft", num_layers=4), 0.3)
    params = SamplingParams(max_tokens=40)
    plain = Engine(w8a8_target).generate(prompt, params).token_ids
    drafter = drafters.create("auto", w8a8_target, {"model": draft, "quantize": "w8a8", "long_match": 3})
    spec = Engine(w8a8_target, drafter, k).generate(prompt, params)
    assert spec.token_ids == plain
    assert drafter.steps["suffix"] > 0 and drafter.steps["draft"] > 0
    assert 0 < spec.metrics.num_accepted_tokens < spec.metrics.num_draft_tokens
