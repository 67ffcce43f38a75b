"""Logits to probabilities (greedy, temperature, top-k, top-p), seeded sampling, and the settings' checks."""

from __future__ import annotations

import math

import pytest
import torch

from forerun.base.config import SamplingParams, SpeculativeConfig
from forerun.base.errors import ForerunError
from forerun.verification.sampling import draw_key, make_generator, position_uniform, probabilities, sample

# Hand-made logits whose softmax is exactly [0.4, 0.3, 0.15, 0.1, 0.05] (shuffled).
P5 = torch.tensor([0.15, 0.4, 0.05, 0.3, 0.1])
LOGITS = P5.log()[None]  # [1, 5]


def test_greedy_is_a_one_hot_at_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 4.0]])
    probs = probabilities(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    # Greedy ignores top-k / top-p: they cannot change the argmax.
    assert torch.equal(probabilities(logits, SamplingParams(top_k=2, top_p=0.1)), probs)


def test_temperature_one_is_the_softmax_and_other_temperatures_scale_the_logits():
    torch.testing.assert_close(probabilities(LOGITS, SamplingParams(temperature=1.0)), P5[None])
    for t in (0.5, 2.0):
        expected = (P5 ** (1 / t)) / (P5 ** (1 / t)).sum()
        torch.testing.assert_close(probabilities(LOGITS, SamplingParams(temperature=t))[0], expected)
    cold = probabilities(LOGITS, SamplingParams(temperature=0.05))[0]
    assert cold[1] > 0.99  # low temperature tends to the argmax


def test_output_is_float32_rows_that_sum_to_one():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    probs = probabilities(logits, SamplingParams(temperature=0.8, top_k=20, top_p=0.9))
    assert probs.dtype == torch.float32 and probs.shape == (3, 50)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_top_k_keeps_exactly_the_k_likeliest_renormalised(k):
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=k))[0]
    kept = set(torch.argsort(P5, descending=True)[:k].tolist())
    assert set(probs.nonzero().flatten().tolist()) == kept
    expected = torch.where(probs > 0, P5, 0.0)
    torch.testing.assert_close(probs, expected / expected.sum())


def test_top_k_at_or_above_the_vocabulary_keeps_everything():
    for k in (0, 5, 9):
        torch.testing.assert_close(probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=k))[0], P5)


def test_top_k_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [[False, False, True, True], [True, True, False, False]]


@pytest.mark.parametrize(
    "top_p,kept",
    [
        (0.35, {1}),  # 0.4 alone reaches 0.35
        (0.4, {1}),  # ... and 0.4 exactly
        (0.5, {1, 3}),  # 0.4 < 0.5 <= 0.7
        (0.7, {1, 3}),  # 0.4 + 0.3 reaches 0.7 exactly: no third token
        (0.8, {1, 3, 0}),  # 0.7 < 0.8 <= 0.85
        (0.9, {1, 3, 0, 4}),  # 0.85 < 0.9 <= 0.95
        (0.99, {1, 3, 0, 4, 2}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))[0]
    assert set(probs.nonzero().flatten().tolist()) == kept
    expected = torch.where(probs > 0, P5, 0.0)
    torch.testing.assert_close(probs, expected / expected.sum())


@pytest.mark.parametrize("top_p,kept", [(0.25, 1), (0.5, 2), (0.5000001, 3), (0.75, 3), (1.0, 4)])
def test_top_p_stops_as_soon_as_the_mass_is_reached_exactly(top_p, kept):
    # Four equal logits: softmax is exactly 0.25 each, so the cumulative masses are exact.
    probs = probabilities(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=top_p))[0]
    assert int((probs > 0).sum()) == kept


def test_top_p_applies_after_top_k_and_temperature():
    # top_k=3 leaves [0.4, 0.3, 0.15] / 0.85; top_p=0.8 then needs 0.4/0.85 + 0.3/0.85 = 0.82 -> two tokens.
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))[0]
    assert set(probs.nonzero().flatten().tolist()) == {1, 3}
    # At temperature 0.5 the masses become [16, 9, 2.25, 1, .25] / 28.5: 16/28.5 = 0.56 reaches 0.55 alone.
    hot = probabilities(LOGITS, SamplingParams(temperature=0.5, top_p=0.55))[0]
    assert set(hot.nonzero().flatten().tolist()) == {1}


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    probs = torch.full((4, 1000), 1e-3)
    a = sample(probs, make_generator(7))
    b = sample(probs, make_generator(7))
    c = sample(probs, make_generator(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.shape == (4,) and a.dtype == torch.long


def test_sampling_follows_the_probabilities():
    gen = make_generator(0)
    probs = P5[None].expand(20_000, -1)
    counts = torch.bincount(sample(probs, gen), minlength=5).float() / 20_000
    # 4 standard errors of a frequency estimate of 20,000 draws is at most 4 * 0.5 / sqrt(20000) = 0.014.
    assert (counts - P5).abs().max() < 0.014


def test_sampling_never_draws_a_masked_token():
    probs = probabilities(
        torch.randn(2000, 30, generator=torch.Generator().manual_seed(1)), SamplingParams(temperature=1.0, top_k=3)
    )
    drawn = sample(probs, make_generator(3))
    assert bool((probs.gather(-1, drawn[:, None]) > 0).all())


def test_unseeded_generators_draw_fresh_seeds():
    assert make_generator(None).initial_seed() != make_generator(None).initial_seed()


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_p", math.nan),
        ("top_k", -1),
        ("top_k", 2.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", math.nan),
        ("max_tokens", 1.5),
    ],
)
def test_invalid_sampling_params_raise_naming_the_field(field, value):
    with pytest.raises(ForerunError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("stop", [("",), ("ok", ""), (3,)])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(ForerunError, match="stop"):
        SamplingParams(stop=stop)


def test_valid_sampling_params_and_stop_normalisation():
    p = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, max_tokens=1, stop="END")
    assert p.stop == ("END",) and not p.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams().greedy


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-45, 1e-300])
def test_a_temperature_below_the_epsilon_is_greedy_not_nonsense(temperature):
    # Dividing by 1e-40 overflows float32 to inf and the softmax to NaN (sampled as the last id).
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    assert torch.equal(probabilities(logits, params), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("temperature", [1e30, 3.4e38, 1e39, 8.8e306])
def test_a_temperature_past_float32_is_uniform_over_the_allowed_tokens_not_nonsense(temperature):
    # 8.8e306 was infinity in float32, a structured output's masked -inf / inf NaN, the row NaN, and
    # the draw a token the grammar refused (a server 500 the schema fuzzer found).
    logits = torch.tensor([[0.1, 2.0, float("-inf"), 1.9, float("-inf")]])
    probs = probabilities(logits, SamplingParams(temperature=temperature))
    assert torch.allclose(probs, torch.tensor([[1 / 3, 1 / 3, 0.0, 1 / 3, 0.0]]))
    assert int(sample(probs, make_generator(0))[0]) in (0, 1, 3)


def test_a_repetition_penalty_near_zero_gives_the_repeated_tokens_the_row_not_nan():
    from forerun.verification.sampling import adjusted

    params = SamplingParams(temperature=0.5, repetition_penalty=1e-40)  # positive logits / 1e-40: +inf
    logits = adjusted(torch.tensor([[0.5, 2.0, -1.0, 1.0]]), params, [1, 3], [()])
    assert torch.isinf(logits[0, 1]) and torch.isinf(logits[0, 3])
    assert torch.equal(probabilities(logits, params), torch.tensor([[0.0, 0.5, 0.0, 0.5]]))


@pytest.mark.parametrize("top_p", [1e-46, 1e-50, 5e-324, 1e-9])
def test_any_top_p_keeps_the_likeliest_token(top_p):
    # top_p under float32's smallest number compares as 0 and once dropped every token (NaN rows).
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0))


def test_seeds_across_the_generator_range_are_taken():
    firsts = set()
    for seed in (-(2**63), 2**64 - 1, 0, 2**32):
        again = [torch.rand(4, generator=make_generator(SamplingParams(seed=seed).seed)) for _ in range(2)]
        assert torch.equal(*again)  # the seed is taken: the same draws each time
        # The tokens' draws are keyed by all 64 bits of it.
        firsts.add(position_uniform(draw_key(seed, make_generator(seed)), 0))
    assert len(firsts) == 4
    # So are the generator's own draws (speculation's acceptance uniforms): torch's CPU generator
    # reads 32 bits of its seed, so seeds 0, 2**32 and -2**63 once gave it one stream.
    streams = {tuple(torch.rand(4, generator=make_generator(seed)).tolist()) for seed in (0, 2**32, -(2**63), 1)}
    assert len(streams) == 4


def test_speculative_config_needs_at_least_one_token_when_speculating():
    with pytest.raises(ForerunError, match="num_speculative_tokens"):
        SpeculativeConfig("draft", 0)
    SpeculativeConfig(None, 0)  # plain decoding ignores K
