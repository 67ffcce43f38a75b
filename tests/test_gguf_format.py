"""The `gguf` format: a GGUF model's own blocks through the native kernels and native layers.

Tiny models are written as GGUF files in the mixes real files have (K-quants with Q6_K for attn_v,
ffn_down and the LM head; Q5_0 / Q8_0 where rows are not a multiple of 256), then loaded as a user's
file would be. Row independence is checked as bit equality, never closeness.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forerun import drafters, native
from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters.lookahead import window_mask, window_offsets
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine
from forerun.models import attention, formats, native_layer
from forerun.models.gguf_format import GGUFEmbedding, GGUFLinear
from forerun.models.load import LoadedModel, load_model
from forerun.models.testing import save_hf_folder, tiny_model
from forerun.policy.pass_costs import PassCosts
from forerun.verification.tree import DraftTree
from forerun.verification.verify import VerifyJob, row_layout, verify, verify_many
from tests.conftest import perturbed
from tests.test_load import write_gguf
from tests.test_w8a8 import plain_rows

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.problem()}")

SLOW = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
K_SIZES = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)


def k_quant_mix(name: str) -> str | None:
    """What a Q4_K_M file holds: Q4_K, with Q6_K for attn_v and ffn_down of every other layer and
    for the LM head."""
    if name == "output.weight" or (name.endswith(("attn_v.weight", "ffn_down.weight")) and ".0." in f".{name}"):
        return "Q6_K"
    return "Q4_K"


def legacy_mix(name: str) -> str | None:
    """What the 0.5B draft's file holds where rows are not a multiple of 256: Q5_0, Q8_0 for the LM
    head and some attn_v, Q4_0 for the embedding."""
    if name == "output.weight" or name == "blk.1.attn_v.weight":
        return "Q8_0"
    return "Q4_0" if name == "token_embd.weight" else "Q5_0"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("gguf_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_HOME", str(folder / "home"))
        yield folder


@pytest.fixture(scope="module")
def k_file(home: Path) -> Path:
    return write_gguf(tiny_model(seed=7, num_layers=3, **K_SIZES), home / "k.gguf", quant=k_quant_mix)


@pytest.fixture(scope="module")
def legacy_file(home: Path) -> Path:
    return write_gguf(tiny_model(seed=8, num_layers=3), home / "legacy.gguf", quant=legacy_mix)


@pytest.fixture(scope="module")
def llama_file(home: Path) -> Path:
    """A llama model: its q and k rows stored as llama.cpp interleaves them, so the loader must reorder
    the blocks' rows (and the float path does the same to the dequantized weights)."""
    return write_gguf(
        tiny_model(seed=10, num_layers=2, architecture="llama"), home / "llama.gguf", arch="llama", quant="Q8_0"
    )


@pytest.fixture(scope="module")
def qwen3_file(home: Path) -> Path:
    """A Qwen3 model: each head's q and k normed before rope, by gains that are not ones; its query
    heads wider together (4 x 128) than its hidden size."""
    model = tiny_model(
        seed=11, num_layers=2, architecture="qwen3", qk_norm=True, attention_bias=False, **{**K_SIZES, "head_dim": 128}
    )
    gen = torch.Generator().manual_seed(12)
    for block in model.decoder.layers:
        for norm in (block.self_attn.q_norm, block.self_attn.k_norm):
            norm.weight.data = 0.5 + torch.rand(norm.weight.shape, generator=gen)
    return write_gguf(model, home / "qwen3.gguf", quant=k_quant_mix)


@pytest.fixture(scope="module", params=["k", "legacy", "llama", "qwen3"])
def model(request, k_file: Path, legacy_file: Path, llama_file: Path, qwen3_file: Path):
    path = {"k": k_file, "legacy": legacy_file, "llama": llama_file, "qwen3": qwen3_file}[request.param]
    return load_model(str(path), with_tokenizer=False, quantization="gguf")


# --- loading ---------------------------------------------------------------------------------------


def test_the_files_blocks_are_read_as_stored_and_nothing_is_converted(k_file: Path, home: Path) -> None:
    model = load_model(str(k_file), with_tokenizer=False, quantization="gguf")
    decoder = model.decoder
    block = decoder.layers[0]
    kinds = [native.TYPE_NAMES[p.type_id] for p in block.self_attn.qkv_proj.parts]
    assert kinds == ["Q4_K", "Q4_K", "Q6_K"]
    assert isinstance(decoder.lm_head, GGUFLinear) and isinstance(decoder.embed_tokens, GGUFEmbedding)
    assert [native.TYPE_NAMES[p.type_id] for p in decoder.lm_head.parts] == ["Q6_K"]
    assert not list((home / "home" / "converted").rglob("weights-*.safetensors"))
    assert decoder._native_layers() is not None


def test_the_format_stays_close_to_the_files_weights_in_float(model) -> None:
    # Against the same file dequantized to float32: only the rows' int8 activation blocks differ.
    reference = load_model(str(model.source.path), dtype="float32", with_tokenizer=False).decoder
    ids = list(range(3, 40, 2))
    approx = plain_rows(model.decoder, ids[:10], ids[10:])
    exact = plain_rows(reference, ids[:10], ids[10:])
    assert (approx - exact).norm() / exact.norm() < 0.03
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8


def test_a_tensor_in_a_type_the_kernels_lack_runs_as_w8a8_and_is_named(home: Path, capsys) -> None:
    path = write_gguf(
        tiny_model(seed=9, num_layers=2),
        home / "f16.gguf",
        quant=lambda name: None if name == "blk.1.attn_v.weight" else "Q8_0",
    )
    model = load_model(str(path), with_tokenizer=False, quantization="gguf")
    err = capsys.readouterr().err
    assert "1 tensors are in block types the native kernels do not read" in err and "blk.1.attn_v.weight (F32)" in err
    decoder = model.decoder
    assert decoder._native_layers() is None  # the PyTorch path, still row-exact
    tree = DraftTree([5, 6, 7], [-1, 0, 0])
    cache = decoder.new_cache(20)
    decoder(torch.arange(3, 13), torch.arange(10), cache)
    verified = decoder(torch.tensor([4] + tree.tokens), tree.positions(10), cache, layout=row_layout(tree, 10)).logits[
        0
    ]
    for row in range(4):
        path_ = tree.path_to(row - 1) if row else []
        assert torch.equal(
            verified[row], plain_rows(decoder, list(range(3, 13)), [4] + [tree.tokens[i] for i in path_])[-1]
        )


def test_a_truncated_file_is_refused_naming_the_file_and_a_tensor(k_file: Path, home: Path) -> None:
    data = k_file.read_bytes()
    cut = home / "cut.gguf"
    cut.write_bytes(data[: len(data) - 3000])
    with pytest.raises(ForerunError, match=r"cut\.gguf.*(output\.weight|tensor).*(truncated|past the end|corrupt)"):
        load_model(str(cut), with_tokenizer=False, quantization="gguf")


def test_a_model_folder_cannot_take_the_gguf_format(tmp_path: Path) -> None:
    folder = save_hf_folder(tiny_model(seed=0), tmp_path / "hf")
    with pytest.raises(ForerunError, match="model folder; use w8a8"):
        load_model(str(folder), with_tokenizer=False, quantization="gguf")


def test_auto_picks_gguf_for_a_gguf_file_and_says_so(monkeypatch, capsys) -> None:
    monkeypatch.setattr(formats, "_said", set())
    assert formats.resolve("auto", "cpu", "gguf") == "gguf"
    assert "--quantization auto: gguf" in capsys.readouterr().err
    assert formats.resolve("auto", "cpu", "hf") != "gguf"


def test_a_model_in_a_format_keeps_it_for_auto_and_refuses_another(model) -> None:
    decoder = model.decoder
    assert formats.current(decoder) == "gguf"
    assert formats.quantize_(decoder, "auto") is decoder and formats.quantize_(decoder, "gguf") is decoder
    with pytest.raises(ForerunError, match="already in gguf; load it again to use w8a8"):
        formats.quantize_(decoder, "w8a8")
    assert isinstance(decoder.lm_head, GGUFLinear)


def test_a_reduced_vocabulary_head_scores_exactly_what_the_whole_head_does(model) -> None:
    from forerun.drafters.draft_vocab import reduced_head

    head = model.decoder.lm_head
    ids = torch.tensor([0, 5, 17, 40, 98])
    x = torch.randn(3, head.in_features)
    assert torch.equal(reduced_head(head, ids)(x), head(x)[:, ids])


# --- row independence ------------------------------------------------------------------------------


def random_tree(draw, size: int) -> DraftTree:
    return DraftTree(
        [draw(st.integers(0, 98)) for _ in range(size)], [draw(st.integers(-1, i - 1)) for i in range(size)]
    )


@SLOW
@given(data=st.data(), prefix_len=st.integers(1, 150), nodes=st.integers(0, 15), native_layers=st.booleans())
def test_every_verified_row_equals_plain_decoding_bit_for_bit(
    model, monkeypatch, data, prefix_len, nodes, native_layers
) -> None:
    decoder = model.decoder
    monkeypatch.setattr(decoder, "_native", False if native_layers else None)
    monkeypatch.setattr(decoder, "kv_cache_dtype", data.draw(st.sampled_from(["auto", "float32", "float16"])))
    monkeypatch.setattr(attention, "KEY_BLOCK", data.draw(st.sampled_from([4, 64])))
    prefix = data.draw(st.lists(st.integers(0, 98), min_size=prefix_len, max_size=prefix_len))
    tree, root = random_tree(data.draw, nodes), data.draw(st.integers(0, 98))
    cache = decoder.new_cache(prefix_len + nodes + 1)
    decoder(torch.tensor(prefix), torch.arange(prefix_len), cache)
    verified = decoder(
        torch.tensor([root] + tree.tokens), tree.positions(cache.length), cache, layout=row_layout(tree, cache.length)
    ).logits[0]
    for row in range(nodes + 1):
        path = tree.path_to(row - 1) if row else []
        alone = plain_rows(decoder, prefix, [root] + [tree.tokens[i] for i in path])[-1]
        assert torch.equal(verified[row], alone), f"row {row} of {nodes + 1} (path {path}) differs"


def test_the_native_layers_compute_what_the_pytorch_path_does(model, monkeypatch) -> None:
    # A row decoded on each path over the same cache comes out within float rounding; a prompt
    # prefilled on each path leaves keys that differ in the last bits, which can move a few
    # activations across an int8 level: both paths then stay as close to the file's weights in
    # float as each other.
    reference = load_model(str(model.source.path), dtype="float32", with_tokenizer=False).decoder
    decoder = model.decoder
    ids = list(range(5, 45))
    prepared = decoder._native_layers()
    fast = plain_rows(decoder, ids[:30], ids[30:])
    monkeypatch.setattr(decoder, "_native", None)
    slow = plain_rows(decoder, ids[:30], ids[30:])
    exact = plain_rows(reference, ids[:30], ids[30:])
    for rows in (fast, slow):
        assert (rows - exact).norm() / exact.norm() < 0.03
    cache = decoder.new_cache(31)
    decoder(torch.tensor(ids[:30]), torch.arange(30), cache)  # the PyTorch path's prefill
    first = {}
    for name, native_layers in (("pytorch", None), ("native", prepared)):
        monkeypatch.setattr(decoder, "_native", native_layers)
        layout = attention.RowLayout.chain(30, 1)
        first[name] = decoder(torch.tensor(ids[30:31]), torch.tensor([30]), cache, layout=layout).logits[0, 0]
        cache.truncate(30)
    assert (first["native"] - first["pytorch"]).norm() / first["pytorch"].norm() < 1e-5


def counting_layers(decoder, monkeypatch) -> list[int]:
    """The layer indices the decoder's native layers are called for, appended as they run."""
    prepared = decoder._native_layers()
    calls: list[int] = []
    lib = prepared.lib

    class Counting:
        def fr_layers(self, path, layers, order, count, *rest):
            calls.extend(order[:count])
            return lib.fr_layers(path, layers, order, count, *rest)

        def __getattr__(self, name: str):
            return getattr(lib, name)

    monkeypatch.setattr(prepared, "lib", Counting())
    return calls


def test_a_prompt_is_prefilled_through_the_native_layers_the_same_in_any_chunks(model, monkeypatch) -> None:
    decoder = model.decoder
    calls = counting_layers(decoder, monkeypatch)
    ids = torch.arange(3, 80)
    whole = decoder.new_cache(90)
    last = decoder(ids, torch.arange(77), whole, last_only=True).logits[0, 0]
    assert calls == list(range(decoder.cfg.num_layers))  # every layer in the native call, not PyTorch's ops
    for cut in (1, 16, 50):
        chunked = decoder.new_cache(90)
        decoder(ids[:cut], torch.arange(cut), chunked)
        rest = decoder(ids[cut:], torch.arange(cut, 77), chunked, last_only=True).logits[0, 0]
        assert torch.equal(rest, last), f"cut at {cut}"
        assert torch.equal(chunked.k[:, :, :, :77], whole.k[:, :, :, :77]), f"cut at {cut}"
        assert torch.equal(chunked.v[:, :, :, :77], whole.v[:, :, :, :77]), f"cut at {cut}"


def test_the_native_call_keeps_a_middle_layers_stream_for_every_row(model, monkeypatch) -> None:
    # Every row's residual stream after layer 0, as a forward that stops there leaves it (each
    # thread copies its own rows), and the layers after it still run on.
    decoder = model.decoder
    calls = counting_layers(decoder, monkeypatch)
    ids, positions, layout = torch.arange(3, 10), torch.arange(7), attention.RowLayout.chain(0, 7)
    whole = decoder(ids, positions, decoder.new_cache(16), layout=layout, hidden_layer=0)
    upto = decoder(ids, positions, decoder.new_cache(16), layout=layout, layers=[0], hidden_layer=0)
    assert calls == [*range(decoder.cfg.num_layers), 0]
    assert torch.equal(whole.layer_hidden, upto.layer_hidden)
    assert not torch.equal(whole.logits, upto.logits)


def test_the_final_norm_and_head_in_one_call_are_the_norm_and_the_heads_product_bit_for_bit(model, monkeypatch) -> None:
    # A native forward scores its rows in one call (native_layer.score): the same bits as the final
    # norm then the head's own product, for the decoder's head and a reduced-vocabulary one, for one
    # row and several; a forward whose head the call cannot run takes the two apart: the same bits.
    decoder = model.decoder
    prepared = decoder._native_layers()
    x = torch.randn(70, decoder.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for head in (decoder.lm_head, decoder.lm_head.take_rows(torch.tensor([7, 1, 30, 2, 64]))):
        for rows in (x[2:3], x[:5], x):  # more than 64 rows: buffers made for the call
            scored, logits = native_layer.score(decoder, prepared, head, rows)
            apart = native_layer.final_norm(decoder.norm, rows)
            assert torch.equal(scored, apart) and torch.equal(logits, head(apart))
    ids, layout = torch.arange(3, 10), attention.RowLayout.chain(0, 7)
    fused = decoder(ids, torch.arange(7), decoder.new_cache(16), layout=layout, output_hidden=True)
    monkeypatch.setattr(prepared, "head", lambda module: None)
    two = decoder(ids, torch.arange(7), decoder.new_cache(16), layout=layout, output_hidden=True)
    assert torch.equal(fused.logits, two.logits) and torch.equal(fused.hidden, two.hidden)


@contextlib.contextmanager
def lean_runs() -> Iterator[list[bool]]:
    """Whether each call of native_layer.forward_rows inside the block ran (True) or left the
    forward to the general path (False), appended as they return."""
    ran: list[bool] = []
    inner = native_layer.forward_rows

    def spy(*args, **kwargs):
        out = inner(*args, **kwargs)
        ran.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_layer, "forward_rows", spy)
        yield ran


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_a_chain_forward_in_few_calls_is_the_general_forward_bit_for_bit(model, monkeypatch, kv) -> None:
    # Decoder.forward_chain (drafting, a catch-up) runs the embedding, the layers and the head as
    # native calls with little Python: its logits, its cache entries and its cache length are the
    # general forward's, for one row and several, after a filled cache, with the decoder's head and
    # a reduced one; past the shared buffers' rows it is the general forward itself.
    decoder = model.decoder
    monkeypatch.setattr(decoder, "kv_cache_dtype", kv)
    reduced = decoder.lm_head.take_rows(torch.tensor([7, 1, 30, 2, 64]))
    prompt = list(range(3, 40))
    for head in (None, reduced):
        for rows in ([11], [5, 9, 2], [(7 * i) % 90 for i in range(native_layer.SCRATCH_ROWS + 1)]):
            caches = [decoder.new_cache(160), decoder.new_cache(160)]
            for cache in caches:
                decoder.forward_ids(prompt, cache)
            start = len(prompt)
            general = decoder(
                torch.tensor(rows),
                torch.arange(start, start + len(rows)),
                caches[0],
                layout=attention.RowLayout.chain(start, len(rows)),
                last_only=True,
                head=head,
            ).logits[0]
            with lean_runs() as ran:
                lean = decoder.forward_chain(rows, caches[1], head)
            assert ran == [len(rows) <= native_layer.SCRATCH_ROWS]  # the lean path ran, up to the shared buffers
            assert lean.shape == general.shape == (1, (reduced if head else decoder.lm_head).out_features)
            assert torch.equal(lean, general)
            assert caches[0].length == caches[1].length == start + len(rows)
            end = start + len(rows)
            assert torch.equal(caches[0].k[..., :end, :], caches[1].k[..., :end, :])
            assert torch.equal(caches[0].v[..., :end, :], caches[1].v[..., :end, :])


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_a_verification_in_few_calls_is_the_general_forward_bit_for_bit(model, monkeypatch, kv) -> None:
    # Decoder.forward_layout (verify's target forward): every row's logits and normalised state, and
    # the cache entries, are the general forward's for a chain, a tree with branches, and a tree with
    # lookahead's masked window rows after its nodes.
    decoder = model.decoder
    monkeypatch.setattr(decoder, "kv_cache_dtype", kv)
    trie = DraftTree.trie([[10, 11, 12], [13], [10, 14]])
    trees = [
        DraftTree([5, 6, 7], [-1, 0, 1]),
        trie,
        DraftTree(trie.tokens, trie.parents, aux_tokens=[20, 21, 30, 31], aux_offsets=window_offsets(2, 2),
                  aux_mask=window_mask(2, 2)),
    ]  # fmt: skip
    for tree in trees:
        caches = [decoder.new_cache(64), decoder.new_cache(64)]
        for cache in caches:
            decoder.forward_ids(list(range(3, 30)), cache)
        rows = [9] + tree.tokens + tree.aux_tokens
        layout = row_layout(tree, 27)
        general = decoder(torch.tensor(rows), tree.positions(27), caches[0], layout=layout, output_hidden=True)
        with lean_runs() as ran:
            lean = decoder.forward_layout(rows, caches[1], row_layout(tree, 27))
        assert ran == [True]
        assert lean.logits.shape == general.logits.shape == (1, len(rows), decoder.lm_head.out_features)
        assert torch.equal(lean.logits, general.logits) and torch.equal(lean.hidden, general.hidden)
        assert caches[0].length == caches[1].length == 27 + len(rows)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_a_chain_forward_calls_the_kernels_three_times_and_turns_bad_input_away_untouched(model, monkeypatch) -> None:
    # The lean path is the embedding, the layers and the head, one call each; a token id the table
    # lacks or rows past the cache's room raise before any of them, the cache as it was; a head the
    # kernels cannot run leaves the forward to the general path, with the same logits.
    decoder = model.decoder
    prepared = decoder._native_layers()
    calls: list[str] = []
    lib = prepared.lib

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(lib, name)

    monkeypatch.setattr(prepared, "lib", Counting())
    cache = decoder.new_cache(20)
    decoder.forward_chain([3, 4], cache)
    assert calls == ["fr_dequantize_rows", "fr_layers", "fr_norm_head"] and cache.length == 2
    k_before = cache.k.clone()
    vocab = decoder.embed_tokens.num_embeddings
    with pytest.raises(IndexError, match=f"token id {vocab} out of range"):
        decoder.forward_chain([5, vocab], cache)
    slots = cache.max_len
    with pytest.raises(ValueError, match=f"KV cache overflow: {slots + 1} slots needed, {slots} allocated"):
        decoder.forward_chain(list(range(slots - 1)), cache)
    assert cache.length == 2 and torch.equal(cache.k, k_before)
    fused = decoder.forward_chain([6], cache)
    cache.truncate(2)
    calls.clear()
    monkeypatch.setattr(prepared, "head", lambda module: None)  # a head the kernels cannot run
    assert torch.equal(decoder.forward_chain([6], cache), fused) and calls == ["fr_layers"]


def test_a_decoder_the_native_layers_cannot_run_never_asks_for_the_kernels(monkeypatch) -> None:
    # Asking whether the kernels are available may build them: a bf16 decoder's cache dtype and
    # forwards are settled without asking.
    def asked() -> bool:
        raise AssertionError("native.available() was asked")

    monkeypatch.setattr(native, "available", asked)
    decoder = tiny_model(seed=3).decoder.to(torch.bfloat16)
    assert native_layer.prepare(decoder) is None
    assert decoder.new_cache(8).k.dtype == torch.bfloat16


def test_a_masked_or_batched_forward_keeps_the_pytorch_path(model, monkeypatch) -> None:
    decoder = model.decoder
    calls = counting_layers(decoder, monkeypatch)
    cache = decoder.new_cache(20)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    decoder(torch.arange(3, 13), torch.arange(10), cache, causal)  # an explicit mask
    batched = decoder.new_cache(20, batch=2)
    decoder(torch.arange(3, 23).view(2, 10), torch.arange(10), batched)  # two sequences in one cache
    assert calls == []


def assert_every_path_forwards_to_the_same_bits(decoder, monkeypatch, kv: str, cached: int) -> None:
    """A prompt of `cached` tokens, then a tree verified over it, on every path the CPU has: the
    logits and the cache each path leaves equal the scalar path's bit for bit."""
    monkeypatch.setattr(decoder, "kv_cache_dtype", kv)
    prepared = native_layer.prepare(decoder)
    logits, caches = {}, {}
    for path in native.paths():
        monkeypatch.setattr(prepared, "path", native.PATHS.index(path))
        monkeypatch.setattr(decoder, "_native", prepared)
        monkeypatch.setattr(decoder.lm_head, "kernel", path)
        tree = DraftTree([5, 6, 7, 8], [-1, 0, 1, 0])
        cache = caches[path] = decoder.new_cache(cached + 10)
        decoder(torch.arange(cached) % 50 + 3, torch.arange(cached), cache)
        logits[path] = decoder(
            torch.tensor([4] + tree.tokens), tree.positions(cached), cache, layout=row_layout(tree, cached)
        ).logits[0]
    assert caches["scalar"].k.dtype == getattr(torch, kv)
    for path, value in logits.items():
        assert torch.equal(value, logits["scalar"]), path
        assert torch.equal(caches[path].k, caches["scalar"].k) and torch.equal(caches[path].v, caches["scalar"].v)


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_every_path_computes_a_whole_forward_to_the_same_bits(model, monkeypatch, kv) -> None:
    # 50 cached slots: a span of 32 keys scored sixteen at a time, then a part span key by key.
    assert_every_path_forwards_to_the_same_bits(model.decoder, monkeypatch, kv, 50)


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("heads,head_dim", [(12, 128), (14, 48)])
def test_every_path_weighs_wide_head_groups_over_a_long_cache_to_the_same_bits(
    home: Path, monkeypatch, kv, heads, head_dim
) -> None:
    # Six or seven query heads to a key/value head (each path weighs its own number of heads at
    # once: six and one, four and three...), over 150 cached slots: several blocks of values, rows
    # requested ahead, a part block at the end; 48 wide heads have no whole multiple of the columns
    # a path weighs together.
    sizes = dict(hidden_size=128, intermediate_size=256, num_heads=heads, num_kv_heads=2, head_dim=head_dim)
    path = write_gguf(tiny_model(seed=13, num_layers=2, **sizes), home / f"wide{heads}.gguf", quant="Q8_0")
    model = load_model(str(path), with_tokenizer=False, quantization="gguf")
    assert model.decoder._native_layers() is not None
    assert_every_path_forwards_to_the_same_bits(model.decoder, monkeypatch, kv, 150)


def test_auto_keeps_a_float16_cache_where_the_native_layers_run(model, monkeypatch) -> None:
    decoder = model.decoder
    assert decoder.kv_cache_dtype == "auto" and decoder.new_cache(8).k.dtype == torch.float16
    monkeypatch.setattr(decoder, "_native", None)  # the PyTorch path: the activations' dtype
    assert decoder.new_cache(8).k.dtype == torch.float32
    decoder.set_kv_cache_dtype("float16")
    try:
        assert decoder.new_cache(8).v.dtype == torch.float16
    finally:
        decoder.set_kv_cache_dtype("auto")
    with pytest.raises(ForerunError, match="'int4' is none of auto, float32, float16"):
        decoder.set_kv_cache_dtype("int4")


def test_a_float16_cache_holds_the_float32_entries_rounded(model, monkeypatch) -> None:
    # The first layer's keys and values come from the embedding alone: the float16 cache holds the
    # float32 cache's, rounded to nearest even. The logits stay as close to the float32 cache's as
    # the format itself stays to the float weights' (the test above): a rounded key can move a few
    # activations across an int8 level.
    decoder = model.decoder
    caches, last = {}, {}
    for kv in ("float32", "float16"):
        monkeypatch.setattr(decoder, "kv_cache_dtype", kv)
        caches[kv] = decoder.new_cache(70)
        last[kv] = decoder(torch.arange(3, 70), torch.arange(67), caches[kv], last_only=True).logits[0, 0]
    wide, half = caches["float32"], caches["float16"]
    assert torch.equal(half.k[0, :, :, :67], wide.k[0, :, :, :67].half())
    assert torch.equal(half.v[0, :, :, :67], wide.v[0, :, :, :67].half())
    assert not torch.equal(half.k[1:, :, :, :67].float(), wide.k[1:, :, :, :67])  # later layers read rounded keys
    assert (last["float16"] - last["float32"]).norm() / last["float32"].norm() < 0.03


def test_the_kv_cache_dtype_reaches_the_target_and_a_loaded_draft_model(k_file: Path, home: Path) -> None:
    target, draft = (load_model(str(k_file), with_tokenizer=False, quantization="gguf") for _ in range(2))
    llm = LLM(target, speculative_model=draft, kv_cache_dtype="float32")
    assert target.decoder.new_cache(8).k.dtype == torch.float32
    assert draft.decoder.new_cache(8).k.dtype == torch.float32
    assert "kv_cache_dtype" not in llm.spec.options  # not handed to the drafter
    with pytest.raises(ForerunError, match="kv_cache_dtype 'half' is none of"):
        load_model(str(k_file), with_tokenizer=False, quantization="gguf", kv_cache_dtype="half")


def test_training_answers_step_as_the_engines_lanes_where_the_native_layers_run(model, monkeypatch) -> None:
    import forerun.train.data as data_module

    def padded(*_):
        raise AssertionError("padded rows where the native layers run: the engine's lanes are exact")

    monkeypatch.setattr(data_module, "padded_answers", padded)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    answered = [s.tokens for s in data_module.answer_prompts(model, prompts, 6, batch_size=3)]
    assert answered == [s.tokens for s in data_module.engine_answers(model, prompts, 6, 1)]
    assert all(len(tokens) > len(ids) for tokens, ids in zip(answered, prompts))


def test_answers_labelled_as_they_are_written_equal_the_labels_of_one_prefill(model) -> None:
    from forerun.train.data import engine_answers
    from forerun.train.labelled_answers import labelled_answers
    from forerun.train.soft_labels import label_chunk

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15], [3]]
    labelled = list(labelled_answers(model, prompts, 8, 3, 5))
    assert [tokens for tokens, _ in labelled] == [s.tokens for s in engine_answers(model, prompts, 8, 1)]
    stop = labelled[2][0][len(prompts[2]) + 3]  # the fourth token of an answer, as a stop token
    stopping = LoadedModel(model.name, model.decoder, SimpleNamespace(stop_ids=frozenset({stop})), model.source)
    cut = [
        tokens[: tokens.index(stop, len(ids)) + 1] if stop in tokens[len(ids) :] else tokens
        for ids, (tokens, _) in zip(prompts, labelled)
    ]
    stopped = list(labelled_answers(stopping, prompts, 8, 2, 5))
    assert [tokens for tokens, _ in stopped] == cut and len(cut[2]) <= len(prompts[2]) + 4
    first = list(labelled_answers(model, prompts, 1, 4, 5))  # one token each: fed once more for its label
    assert [tokens for tokens, _ in first] == [tokens[: len(ids) + 1] for ids, (tokens, _) in zip(prompts, labelled)]
    for tokens, labels in labelled + stopped + first:
        whole = label_chunk(model, tokens, 5)  # prompt + answer read again in one prefill
        assert labels.hidden.shape[0] == len(tokens)
        assert torch.equal(labels.hidden, whole.hidden) and torch.equal(labels.top_ids, whole.top_ids)
        torch.testing.assert_close(labels.top_probs, whole.top_probs, rtol=0, atol=1e-3)


def test_answers_are_labelled_as_written_only_where_the_native_layers_run(target) -> None:
    from forerun.train.labelled_answers import labelled_answers

    with pytest.raises(ForerunError, match="native layers"):
        next(labelled_answers(target, [[5, 6]], 4, 1, 5))


def _answer_args(answer_batch: int) -> argparse.Namespace:
    """`forerun train`'s arguments for three answers of six tokens, labelled top-4."""
    return argparse.Namespace(
        answers=3,
        max_tokens=6,
        answer_batch=answer_batch,
        top_k=4,
        progress=False,
        resume=False,
        prompts=None,
        code_prompts=None,
        hold_out=10,
    )


def test_train_labels_answers_where_the_native_layers_run_without_reading_them_again(model, tmp_path, monkeypatch):
    from forerun.commands import train as train_command
    from forerun.train import soft_labels
    from forerun.train.data import engine_answers

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    answers = [s.tokens for s in engine_answers(model, prompts, 6, 1)]
    expected = [soft_labels.label_chunk(model, tokens, 4) for tokens in answers]

    def read_again(*_):
        raise AssertionError("an answer read again to label it")

    monkeypatch.setattr(soft_labels, "label_chunk", read_again)
    args = _answer_args(answer_batch=2)
    run = train_command.Prompts(train=prompts, train_ids=["a", "b", "c"])
    record = train_command._answer_labels(args, model, tmp_path, tmp_path / "labels", run)
    assert record["answers"] == 3 and record["answer_positions"] == sum(map(len, answers))
    stored = list(soft_labels.read_labels(tmp_path / "labels"))
    assert [s.tokens.tolist() for s in stored] == answers
    for s, e in zip(stored, expected, strict=True):
        assert torch.equal(s.hidden, e.hidden) and torch.equal(s.top_ids, e.top_ids)
        torch.testing.assert_close(s.top_probs, e.top_probs, rtol=0, atol=1e-3)


def test_answers_stop_at_the_labelling_budget_and_a_rerun_goes_on_from_there(model, tmp_path) -> None:
    from forerun.commands import train as train_command
    from forerun.train import soft_labels
    from forerun.train.data import engine_answers

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    answers = [s.tokens for s in engine_answers(model, prompts, 6, 1)]
    args = _answer_args(answer_batch=1)
    run = train_command.Prompts(train=prompts, train_ids=["a", "b", "c"])
    spent = train_command._answer_labels(args, model, tmp_path, tmp_path / "labels", run, budget_seconds=0.0)
    assert spent["answers"] == 1 and spent["answer_positions"] == len(answers[0])
    record = train_command._answer_labels(args, model, tmp_path, tmp_path / "labels", run, budget_seconds=None)
    assert record["answers"] == 3 and record["prompt_ids"] == ["a", "b", "c"]
    assert [s.tokens.tolist() for s in soft_labels.read_labels(tmp_path / "labels")] == answers


def test_sequences_verified_together_each_equal_their_verification_alone(model) -> None:
    decoder = model.decoder
    params = SamplingParams()
    jobs, alone = [], []
    for i, (length, tree) in enumerate(
        [(7, DraftTree([5, 6], [-1, 0])), (30, None), (64, DraftTree([9, 8, 7, 6], [-1, 0, 0, 2]))]
    ):
        caches = [decoder.new_cache(length + 6) for _ in range(2)]
        for cache in caches:
            decoder(torch.arange(length) % 90 + i, torch.arange(length), cache)
        jobs.append(VerifyJob(caches[0], 11 + i, tree, params))
        alone.append(verify(decoder, caches[1], 11 + i, tree, params))
    for together, single in zip(verify_many(decoder, jobs), alone):
        assert torch.equal(together.probs, single.probs) and torch.equal(together.hidden, single.hidden)


# --- greedy speculation equals plain decoding, for every drafter -----------------------------------


METHODS = [
    ("ngram", {}),
    ("suffix", {}),
    ("early-exit", {"layer": 2}),
    ("lookahead", {}),
    ("lookahead", {"window": 3, "ngram": 3, "guesses": 5}),
]


@pytest.fixture(scope="module")
def pair(home: Path):
    base = tiny_model(seed=2, num_layers=4, **K_SIZES)
    target = load_model(
        str(write_gguf(base, home / "t.gguf", quant=k_quant_mix)), with_tokenizer=False, quantization="gguf"
    )
    draft_file = write_gguf(perturbed(base, 0.3), home / "d.gguf", quant=lambda name: "Q8_0")
    return target, load_model(str(draft_file), with_tokenizer=False, quantization="auto")


@pytest.fixture(scope="module")
def prompt(pair) -> list[int]:
    """Text the target wrote itself (sampled), so its n-grams recur in what it writes next (seed 3:
    a text on which the noisy draft model's drafts are kept some of the time as well)."""
    out = Engine(pair[0]).generate([5, 6, 7], SamplingParams(temperature=1.0, top_k=4, max_tokens=40, seed=3))
    return [5, 6, 7] + out.token_ids


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("method,options", METHODS, ids=lambda v: str(v))
def test_greedy_speculation_equals_plain_for_every_drafter(pair, prompt, method, options, k) -> None:
    target = pair[0]
    params = SamplingParams(max_tokens=40)
    plain = Engine(target).generate(prompt, params).token_ids
    spec = Engine(target, drafters.create(method, target, options), k).generate(prompt, params)
    assert spec.token_ids == plain
    assert 0 < spec.metrics.num_accepted_tokens < spec.metrics.num_draft_tokens


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_greedy_speculation_with_a_gguf_draft_model_equals_plain(pair, prompt, method) -> None:
    target, draft = pair
    assert isinstance(draft.decoder.lm_head, GGUFLinear)  # auto took the file's own blocks
    params = SamplingParams(max_tokens=40)
    plain = Engine(target).generate(prompt, params).token_ids
    options = {"model": draft, "quantize": "auto"} if method == "draft" else {"model": draft, "long_match": 3}
    spec = Engine(target, drafters.create(method, target, options), 3).generate(prompt, params)
    assert spec.token_ids == plain
    assert 0 < spec.metrics.num_accepted_tokens < spec.metrics.num_draft_tokens


CARRIED = [
    (list(range(5, 13)), SamplingParams(max_tokens=30)),
    ([3 + i % 90 for i in range(130)], SamplingParams(max_tokens=6)),
    ([7, 8, 9] * 30, SamplingParams(temperature=1.0, top_k=5, max_tokens=6, seed=4)),
    ([98 - i % 60 for i in range(70)], SamplingParams(max_tokens=5)),
]


ROW_COSTS = PassCosts([8.0 + r for r in range(1, 17)])  # c(r) = 8 + r: a one-row pass 9, each row 1 more


def carry_all(batch: BatchEngine, requests, share: float) -> tuple[dict[int, list[int]], list[int]]:
    """Run `requests`: the first added whole, the rest started (their prompts chunked) and stepped
    in with `share`; each request's tokens, and the prompt rows each step carried."""
    tokens: dict[int, list[int]] = {0: batch.add(0, *requests[0]).token_ids}
    for key, (prompt, params) in enumerate(requests[1:], 1):
        batch.start(key, prompt, params)
    carried = []
    while batch.lanes or batch.prefilling:
        results = batch.step(share) if any(not lane.run.seq.finished for lane in batch.lanes.values()) else {}
        carried.append(batch.carried_rows)
        if not results:
            results = batch.prefill(1.0)
        for key, result in results.items():
            assert result.error is None, result.error
            tokens.setdefault(key, []).extend(result.output.token_ids)
        for key in [k for k, lane in batch.lanes.items() if lane.run.seq.finished]:
            batch.remove(key)
    return tokens, carried


def test_prompts_carried_in_the_steps_come_out_as_alone(k_file: Path, home: Path) -> None:
    model = load_model(str(k_file), with_tokenizer=False, quantization="gguf")
    alone = [Engine(model).generate(prompt, params).token_ids for prompt, params in CARRIED]
    llm = LLM(model, speculative_method="ngram", num_speculative_tokens=3)
    batch = BatchEngine(llm.new_engine, 4)
    batch._costs = ROW_COSTS
    tokens, carried = carry_all(batch, CARRIED, share=1.0)
    for key in range(len(CARRIED)):
        # A seeded request writes plain decoding's text whatever was drafted (and whether a lane
        # drafts follows timings).
        assert tokens[key] == alone[key], key
    assert sum(carried) >= 90 and max(carried) == 9  # ten steps and more carried prompt rows, nine at most


def test_a_step_carries_the_next_prompts_rows_once_the_oldest_is_through(k_file: Path, home: Path) -> None:
    model = load_model(str(k_file), with_tokenizer=False, quantization="gguf")
    requests = [
        ([5, 6, 7], SamplingParams(max_tokens=12)),
        ([10 + i for i in range(5)], SamplingParams(max_tokens=4)),
        ([20 + i for i in range(5)], SamplingParams(temperature=1.0, top_k=5, max_tokens=4, seed=2)),
        ([30 + i for i in range(30)], SamplingParams(max_tokens=4)),
    ]
    alone = [Engine(model).generate(prompt, params).token_ids for prompt, params in requests]
    batch = BatchEngine(LLM(model).new_engine, 4)
    batch._costs = ROW_COSTS
    tokens, carried = carry_all(batch, requests, share=1.0)
    assert [tokens[key] for key in range(len(requests))] == alone
    # Nine rows a step: the first prompt's five and the second's first four, then the second's last
    # and the third's first eight; one prompt a step would carry 5, then 1.
    assert carried[:4] == [9, 9, 9, 9]


def test_the_rows_a_step_carries_add_its_share_of_one_row_passes_whatever_its_lanes(k_file: Path, home: Path) -> None:
    """A batch of few lanes (its prompts hold it back) carries as many prompt rows as a wide one: the
    rows may add `share` one-row passes' time to the step, not a share of the lanes' own pass."""
    model = load_model(str(k_file), with_tokenizer=False, quantization="gguf")
    for lanes in (1, 3):
        batch = BatchEngine(LLM(model).new_engine, 4)
        batch._costs = ROW_COSTS
        for key in range(lanes):
            batch.add(key, [5 + key, 6, 7], SamplingParams(max_tokens=10))
        batch.start(lanes, [3 + i % 90 for i in range(130)], SamplingParams(max_tokens=2))
        carried = []
        for share in (1.0, 0.5):
            batch.step(share)
            carried.append(batch.carried_rows)
        assert carried == [9, 4]


def test_a_target_whose_prefill_is_no_chain_of_exact_rows_carries_nothing(k_file: Path, home: Path) -> None:
    model = load_model(str(k_file), with_tokenizer=False, quantization="w8a8")
    assert not model.decoder.chain_prefill
    alone = [Engine(model).generate(prompt, params).token_ids for prompt, params in CARRIED]
    tokens, carried = carry_all(BatchEngine(LLM(model).new_engine, 4), CARRIED, share=1.0)
    assert [tokens[key] for key in range(len(CARRIED))] == alone and not any(carried)


def test_steps_that_carry_prompt_rows_still_measure_the_batchs_rates(k_file: Path, home: Path) -> None:
    """While prompts wait (most steps of a full server) the batch still learns whether drafting
    pays: a carrying step records its rate on the lanes' time, the carried rows' cost taken off."""
    model = load_model(str(k_file), with_tokenizer=False, quantization="gguf")
    batch = BatchEngine(LLM(model, speculative_method="ngram", num_speculative_tokens=3).new_engine, 4)
    batch._costs = ROW_COSTS
    for key in range(2):
        batch.add(key, [5 + key, 6, 7], SamplingParams(max_tokens=10))
    batch.start(2, [3 + i % 90 for i in range(130)], SamplingParams(max_tokens=2))
    bucket = batch.rates[(2).bit_length()]
    batch.step(1.0)
    assert batch.carried_rows > 0
    assert (bucket.drafting, bucket.plain) != (None, None)
    # The carried rows' share by the pass costs: c(2 + 9) - c(2) = 9 of a 20 s step; at least a tenth.
    planned = [(key, lane, SimpleNamespace(tree=None)) for key, lane in batch.lanes.items()]
    batch.carried_rows = 9
    assert batch._lanes_seconds(20.0, planned) == 11.0
    assert batch._lanes_seconds(5.0, planned) == 0.5
    batch.carried_rows = 0
    assert batch._lanes_seconds(5.0, planned) == 5.0
