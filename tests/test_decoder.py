"""The lean decoder: every way of feeding tokens (prefill, decode, chunks, masks, trees) agrees."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from forerun.models.decoder import Decoder
from forerun.models.testing import tiny_config, tiny_decoder
from forerun.verification.tree import DraftTree

ATOL = 1e-4
SEQ = [5, 17, 3, 99, 42, 8, 64, 1, 23, 77, 11, 50]


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    return tiny_decoder(tiny_config(num_layers=3), seed=1)


def full_logits(decoder: Decoder, tokens: list[int]) -> torch.Tensor:
    """One forward over the whole sequence from an empty cache: [T, vocab]."""
    cache = decoder.new_cache(64)
    return decoder(torch.tensor(tokens), torch.arange(len(tokens)), cache).logits[0]


def test_prefill_then_one_token_decodes_equal_one_full_forward(decoder):
    full = full_logits(decoder, SEQ)
    cache = decoder.new_cache(64)
    prefill = decoder(torch.tensor(SEQ[:4]), torch.arange(4), cache).logits[0]
    rows = [prefill]
    for i in range(4, len(SEQ)):
        rows.append(decoder(torch.tensor([SEQ[i]]), torch.tensor([i]), cache).logits[0])
    assert cache.length == len(SEQ)
    torch.testing.assert_close(torch.cat(rows), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [[5, 7], [1, 4, 3, 4], [3, 3, 3, 3]])
def test_chunked_prefill_equals_full_prefill(decoder, chunks):
    full = full_logits(decoder, SEQ)
    cache = decoder.new_cache(64)
    rows, start = [], 0
    for size in chunks:
        ids = SEQ[start : start + size]
        rows.append(decoder(torch.tensor(ids), torch.arange(start, start + size), cache).logits[0])
        start += size
    torch.testing.assert_close(torch.cat(rows), full, atol=ATOL, rtol=0)


def test_last_only_returns_the_last_row_of_the_full_forward(decoder):
    full = full_logits(decoder, SEQ)
    last = decoder(torch.tensor(SEQ), torch.arange(len(SEQ)), decoder.new_cache(64), last_only=True).logits[0]
    assert last.shape == (1, decoder.cfg.vocab_size)
    torch.testing.assert_close(last, full[-1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("past", [0, 5])
def test_explicit_causal_mask_gives_the_same_logits_as_the_default(decoder, past):
    t = len(SEQ) - past
    cache_a, cache_b = decoder.new_cache(64), decoder.new_cache(64)
    if past:
        decoder(torch.tensor(SEQ[:past]), torch.arange(past), cache_a)
        decoder(torch.tensor(SEQ[:past]), torch.arange(past), cache_b)
    ids, pos = torch.tensor(SEQ[past:]), torch.arange(past, len(SEQ))
    default = decoder(ids, pos, cache_a).logits
    causal = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)  # [T, past+T]
    explicit = decoder(ids, pos, cache_b, causal).logits
    torch.testing.assert_close(explicit, default, atol=ATOL, rtol=0)
    # A 3-d (batched) mask is the same mask.
    cache_c = decoder.new_cache(64)
    if past:
        decoder(torch.tensor(SEQ[:past]), torch.arange(past), cache_c)
    batched = decoder(ids, pos, cache_c, causal[None]).logits
    torch.testing.assert_close(batched, default, atol=ATOL, rtol=0)


def test_a_wrong_mask_changes_the_logits(decoder):
    # Guard for the mask tests above: the mask is actually used.
    t = len(SEQ)
    default = decoder(torch.tensor(SEQ), torch.arange(t), decoder.new_cache(64)).logits
    full = torch.ones(t, t, dtype=torch.bool)  # no causality
    leaky = decoder(torch.tensor(SEQ), torch.arange(t), decoder.new_cache(64), full).logits
    assert not torch.allclose(leaky[0, :-1], default[0, :-1], atol=1e-3)


def branching_tree() -> DraftTree:
    #            root
    #         /    |    \
    #       n0    n1     n2
    #      /  \    |
    #    n3   n4  n5
    #    |
    #    n6
    return DraftTree(tokens=[10, 20, 30, 40, 50, 60, 70], parents=[-1, -1, -1, 0, 0, 1, 3])


@pytest.mark.parametrize("past", [0, 6])
def test_tree_mask_gives_every_node_the_logits_of_its_root_to_node_path(decoder, past):
    tree = branching_tree()
    prompt, root = SEQ[:past], SEQ[past]
    cache = decoder.new_cache(64)
    if past:
        decoder(torch.tensor(prompt), torch.arange(past), cache)
    ids = torch.tensor([root] + tree.tokens)
    out = decoder(ids, tree.positions(past), cache, tree.attention_mask(past)).logits[0]  # [N+1, vocab]
    assert cache.length == past + len(tree) + 1
    for node in range(len(tree)):
        path = prompt + [root] + [tree.tokens[i] for i in tree.path_to(node)]
        expected = full_logits(decoder, path)[-1]
        torch.testing.assert_close(out[node + 1], expected, atol=ATOL, rtol=0, msg=f"node {node}")
    torch.testing.assert_close(out[0], full_logits(decoder, prompt + [root])[-1], atol=ATOL, rtol=0)


def test_positions_matter_through_rope(decoder):
    ids = torch.tensor(SEQ[:6])
    a = decoder(ids, torch.arange(6), decoder.new_cache(64)).logits
    gapped = decoder(ids, torch.tensor([0, 1, 2, 4, 5, 6]), decoder.new_cache(64)).logits
    torch.testing.assert_close(a[0, :3], gapped[0, :3], atol=ATOL, rtol=0)  # same relative positions
    assert not torch.allclose(a[0, 3:], gapped[0, 3:], atol=1e-3)


def test_rope_depends_on_relative_position_only(decoder):
    # Shifting every position by the same amount changes nothing: the score depends on i - j.
    ids = torch.tensor(SEQ[:6])
    a = decoder(ids, torch.arange(6), decoder.new_cache(64)).logits
    b = decoder(ids, torch.arange(6) + 3, decoder.new_cache(64)).logits
    torch.testing.assert_close(a, b, atol=1e-3, rtol=0)


def test_tree_nodes_need_depth_positions_not_row_numbers(decoder):
    tree = branching_tree()
    ids = torch.tensor([SEQ[0]] + tree.tokens)
    mask = tree.attention_mask(0)
    by_depth = decoder(ids, tree.positions(0), decoder.new_cache(16), mask).logits[0]
    by_row = decoder(ids, torch.arange(len(tree) + 1), decoder.new_cache(16), mask).logits[0]
    torch.testing.assert_close(by_depth[:2], by_row[:2], atol=ATOL, rtol=0)  # root and n0: same positions
    assert not torch.allclose(by_depth[2:], by_row[2:], atol=1e-3)


def test_layer_subset_equals_a_model_made_of_those_layers(decoder):
    ids, pos = torch.tensor(SEQ[:5]), torch.arange(5)
    cache = decoder.new_cache(16)
    out = decoder(ids, pos, cache, layers=[0, 2], output_hidden=True, hidden_layer=2)
    short = Decoder(tiny_config(num_layers=2))
    short.embed_tokens = decoder.embed_tokens
    short.layers = torch.nn.ModuleList([decoder.layers[0], decoder.layers[2]])
    short.norm, short.lm_head = decoder.norm, decoder.lm_head
    expected = short(ids, pos, short.new_cache(16))
    torch.testing.assert_close(out.logits, expected.logits, atol=ATOL, rtol=0)
    assert cache.length == 5
    assert torch.count_nonzero(cache.k[1, :, :, :5]) == 0  # a skipped layer leaves its cache alone
    assert torch.count_nonzero(cache.k[2, :, :, :5]) > 0
    assert not torch.allclose(out.logits, full_logits(decoder, SEQ[:5])[None], atol=1e-3)


def test_hidden_outputs_have_the_documented_shapes(decoder):
    cfg = decoder.cfg
    ids, pos = torch.tensor(SEQ[:7]), torch.arange(7)
    out = decoder(ids, pos, decoder.new_cache(16), output_hidden=True, hidden_layer=1)
    assert out.logits.shape == (1, 7, cfg.vocab_size) and out.logits.dtype == torch.float32
    assert out.hidden.shape == (1, 7, cfg.hidden_size)
    assert out.layer_hidden.shape == (1, 7, cfg.hidden_size)
    # hidden is the final-norm output the LM head reads.
    torch.testing.assert_close(decoder.lm_head(out.hidden), out.logits, atol=ATOL, rtol=0)
    last = decoder(ids, pos, decoder.new_cache(16), last_only=True, output_hidden=True)
    assert last.hidden.shape == (1, 1, cfg.hidden_size) and last.layer_hidden is None
    plain = decoder(ids, pos, decoder.new_cache(16))
    assert plain.hidden is None and plain.layer_hidden is None


def test_layer_hidden_is_the_residual_stream_after_that_layer(decoder):
    ids, pos = torch.tensor(SEQ[:4]), torch.arange(4)
    after_1 = decoder(ids, pos, decoder.new_cache(16), hidden_layer=1).layer_hidden
    upto_1 = decoder(ids, pos, decoder.new_cache(16), layers=[0, 1], hidden_layer=1).layer_hidden
    torch.testing.assert_close(after_1, upto_1, atol=ATOL, rtol=0)
    after_0 = decoder(ids, pos, decoder.new_cache(16), hidden_layer=0).layer_hidden
    assert not torch.allclose(after_0, after_1, atol=1e-3)


def test_batched_rows_equal_separate_runs(decoder):
    a, b = SEQ[:6], SEQ[6:12]
    cache = decoder.new_cache(16, batch=2)
    both = decoder(torch.tensor([a, b]), torch.arange(6), cache).logits
    torch.testing.assert_close(both[0], full_logits(decoder, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(both[1], full_logits(decoder, b), atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_grouped_query_attention_matches_repeated_kv_heads(heads, kv_heads):
    gqa = tiny_decoder(tiny_config(num_heads=heads, num_kv_heads=kv_heads), seed=3)
    assert gqa.new_cache(8).k.shape[2] == kv_heads
    # The same model with each kv head repeated for its query group is plain multi-head attention.
    mha = Decoder(tiny_config(num_heads=heads, num_kv_heads=heads))
    state = dict(gqa.state_dict())
    group, d = heads // kv_heads, gqa.cfg.head_dim
    for key in list(state):
        if key.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            w = state[key].view(kv_heads, d, *state[key].shape[1:])
            state[key] = w.repeat_interleave(group, dim=0).reshape(heads * d, *state[key].shape[1:])
    mha.load_state_dict(state)
    ids = torch.tensor(SEQ[:6])
    for split in (6, 3):  # prefill, then prefill + decode against the cache
        c1, c2 = gqa.new_cache(8), mha.new_cache(8)
        x = gqa(ids[:split], torch.arange(split), c1).logits
        y = mha(ids[:split], torch.arange(split), c2).logits
        for i in range(split, 6):
            x = gqa(ids[i : i + 1], torch.tensor([i]), c1).logits
            y = mha(ids[i : i + 1], torch.tensor([i]), c2).logits
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


def test_tied_embeddings_share_one_matrix():
    tied = tiny_decoder(tiny_config(tie_embeddings=True), seed=4)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    hidden = tied(torch.tensor([3, 4]), torch.arange(2), tied.new_cache(4), output_hidden=True)
    torch.testing.assert_close(hidden.logits, hidden.hidden @ tied.embed_tokens.weight.T, atol=ATOL, rtol=0)
    untied = tiny_decoder(tiny_config(tie_embeddings=False), seed=4)
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_unknown_architecture_is_refused_by_name():
    with pytest.raises(ValueError, match="gpt2"):
        Decoder(tiny_config(architecture="gpt2"))


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2"])
def test_every_supported_architecture_decodes_consistently(architecture):
    dec = tiny_decoder(tiny_config(architecture=architecture, num_layers=1), seed=2)
    assert (dec.layers[0].self_attn.q_proj.bias is not None) == (architecture == "qwen2")
    full = full_logits(dec, SEQ[:5])
    cache = dec.new_cache(8)
    dec(torch.tensor(SEQ[:4]), torch.arange(4), cache)
    last = dec(torch.tensor(SEQ[4:5]), torch.tensor([4]), cache).logits[0, 0]
    torch.testing.assert_close(last, full[-1], atol=ATOL, rtol=0)


def test_building_a_model_on_the_meta_device_does_not_import_torchs_compiler():
    """Every load builds the Decoder on the meta device; a random initialisation there (the embedding's)
    imports torch._dynamo, 1.3-1.7 s of every start (a fresh process: this one may have imported it)."""
    code = (
        "import sys, torch\n"
        "from forerun.models.decoder import Decoder\n"
        "from forerun.models.testing import tiny_config\n"
        "with torch.device('meta'):\n"
        "    decoder = Decoder(tiny_config())\n"
        "assert decoder.embed_tokens.weight.is_meta\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
