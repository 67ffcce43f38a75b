"""Log probabilities are the target's own, whatever drafts; n completions of one prompt share its prefill.

Row exactness (w8a8, and GGUF's blocks through the native kernels) makes the first checkable as bit
equality: a token kept from a draft comes out of a verification row that equals the row a plain
step computes, so its log probability must equal the plain run's to the last bit. On float32 models
rows of different passes differ in the last digits, so a direct forward is compared within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from forerun import drafters, native
from forerun.api import LLM
from forerun.base.config import MAX_LOGPROBS, SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters.base import Drafter
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine, RequestOutput, Running
from forerun.models.load import LoadedModel, load_model
from forerun.models.testing import tiny_model
from forerun.models.w8a8 import quantize_decoder_
from forerun.verification.logprobs import TokenLogprob
from tests.conftest import perturbed

PROMPT = [5, 6, 7, 8, 40, 41, 5, 6, 7, 8, 40]
GREEDY = SamplingParams(max_tokens=24, logprobs=5)
SAMPLED = SamplingParams(temperature=0.8, top_k=6, max_tokens=24, seed=7, logprobs=3)


@pytest.fixture(scope="module")
def w8a8() -> LoadedModel:
    model = tiny_model(seed=1, name="w8a8", num_layers=3)
    quantize_decoder_(model.decoder)
    return model


@pytest.fixture(scope="module")
def exact(request, w8a8: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A row-exact target: w8a8, or a GGUF file's Q8_0 blocks through the native kernels."""
    if request.param == "w8a8":
        return w8a8
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.problem()}")
    from tests.test_load import write_gguf

    folder = tmp_path_factory.mktemp("logprobs_gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_HOME", str(folder / "home"))
        path = write_gguf(tiny_model(seed=1, num_layers=3), folder / "t.gguf", quant="Q8_0")
        return load_model(str(path), with_tokenizer=False, quantization="gguf")


@pytest.fixture(scope="module")
def w8a8_draft() -> LoadedModel:
    """A noisy copy of the row-exact targets' weights, right often but not always; w8a8 too, so a
    batch's shared draft passes give each lane what it gets alone."""
    draft = perturbed(tiny_model(seed=1, name="draft", num_layers=3), 0.3)
    quantize_decoder_(draft.decoder)
    return draft


def drafter_of(method: str, target: LoadedModel, draft: LoadedModel | None = None):
    """A drafter by name; `draft` (a noisy float copy of the target by default) for the draft model."""
    if method == "draft":
        return drafters.create(method, target, {"model": draft or perturbed(target, 0.3)})
    return drafters.create(method, target, {"layer": 1} if method == "early-exit" else {})


def direct_logprobs(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain causal forward over `ids`: row i scores the token after ids[i]."""
    decoder = model.decoder
    logits = decoder(torch.tensor(ids), torch.arange(len(ids)), decoder.new_cache(len(ids))).logits[0]
    return torch.log_softmax(logits.float(), -1)  # [T, vocab]


def check_shape(entries: list[TokenLogprob], token_ids: list[int], top: int) -> None:
    assert [e.token_id for e in entries] == token_ids
    for e in entries:
        assert len(e.top) == top
        values = [v for _, v in e.top]
        assert values == sorted(values, reverse=True)
        if top:
            assert e.logprob <= values[0]
            if e.token_id in dict(e.top):
                assert dict(e.top)[e.token_id] == e.logprob


# --- the values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 2.5, float("nan"), True, "3"])
def test_a_bad_logprob_count_is_refused_naming_the_field(field, value) -> None:
    with pytest.raises(ForerunError, match=f"^{field} must be a whole number from 0 to 20"):
        SamplingParams(**{field: value})


def test_logprob_counts_from_none_to_twenty_are_taken() -> None:
    for value in (None, 0, 1, MAX_LOGPROBS):
        params = SamplingParams(logprobs=value, prompt_logprobs=value)
        assert params.logprobs == params.prompt_logprobs == value


@pytest.mark.parametrize("method", [None, "ngram", "draft", "early-exit"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_tokens_logprob_is_the_targets_raw_one_at_its_position(target, method, params) -> None:
    engine = Engine(target, drafter_of(method, target), 4) if method else Engine(target)
    out = engine.generate(PROMPT, params)
    if method == "draft":
        assert out.metrics.num_accepted_tokens > 0  # some tokens came from verified draft rows
    assert len(out.logprobs) == len(out.token_ids) == params.max_tokens
    check_shape(out.logprobs, out.token_ids, params.logprobs)
    # Raw: before temperature and top-k (a sampled run's processed values would differ).
    want = direct_logprobs(target, PROMPT + out.token_ids)[len(PROMPT) - 1 : -1]  # [n, vocab]
    got = torch.tensor([e.logprob for e in out.logprobs])
    assert torch.allclose(got, want.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-4)
    top_ids = torch.tensor([[i for i, _ in e.top] for e in out.logprobs])
    assert torch.equal(top_ids, want.topk(params.logprobs, -1).indices)
    if params.greedy:
        assert all(e.top[0] == (e.token_id, e.logprob) for e in out.logprobs)


@pytest.mark.parametrize("exact", ["w8a8", "gguf"], indirect=True)
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "early-exit"])
def test_greedy_speculation_gives_the_plain_runs_logprobs_bit_for_bit(exact, w8a8_draft, method) -> None:
    params = SamplingParams(max_tokens=24, logprobs=5, prompt_logprobs=3)
    plain = Engine(exact).generate(PROMPT, params)
    spec = Engine(exact, drafter_of(method, exact, w8a8_draft), 4).generate(PROMPT, params)
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.num_accepted_tokens > 0
    assert spec.logprobs == plain.logprobs  # every float equal, tops too
    assert spec.prompt_logprobs == plain.prompt_logprobs and len(plain.prompt_logprobs) == len(PROMPT)
    check_shape(plain.prompt_logprobs[1:], PROMPT[1:], 3)


def test_a_draft_models_own_distribution_would_not_pass_for_the_targets(w8a8, w8a8_draft) -> None:
    # The check above has teeth: where the draft model's tokens were kept, its log probabilities
    # differ from the target's, so reporting them instead would fail it.
    out = Engine(w8a8, drafter_of("draft", w8a8, w8a8_draft), 4).generate(PROMPT, GREEDY)
    draft_view = direct_logprobs(w8a8_draft, PROMPT + out.token_ids)[len(PROMPT) - 1 : -1]
    drafted = torch.tensor([e.logprob for e in out.logprobs])
    assert (drafted - draft_view.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]).abs().max() > 0.05


def test_prompt_logprobs_are_the_targets_at_each_prompt_position(target) -> None:
    out = Engine(target).generate(PROMPT, SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=4))
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    check_shape(out.prompt_logprobs[1:], PROMPT[1:], 4)
    want = direct_logprobs(target, PROMPT)[:-1]  # [T-1, vocab]
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    assert torch.allclose(got, want.gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0], atol=1e-5)
    assert torch.equal(torch.tensor([[i for i, _ in e.top] for e in out.prompt_logprobs[1:]]), want.topk(4, -1).indices)
    # Scoring the prompt leaves the first token's row as it was.
    alone = Engine(target).generate(PROMPT, SamplingParams(max_tokens=4, logprobs=2))
    assert alone.prompt_logprobs is None
    assert out.token_ids == alone.token_ids and out.logprobs == alone.logprobs


def test_a_long_prompt_is_scored_in_slices_that_join_up(target, monkeypatch) -> None:
    from forerun.verification import logprobs

    prompt = [(i * 7) % 90 + 3 for i in range(23)]
    whole = Engine(target).generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3)).prompt_logprobs
    monkeypatch.setattr(logprobs, "PROMPT_ROWS", 5)
    sliced = Engine(target).generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3)).prompt_logprobs
    assert len(sliced) == len(prompt)
    assert [e.token_id for e in sliced[1:]] == prompt[1:]
    for a, b in zip(whole[1:], sliced[1:]):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-5) and [i for i, _ in a.top] == [i for i, _ in b.top]


def test_each_step_carries_the_logprobs_of_its_tokens_cut_where_it_stops(target) -> None:
    # The target as its own draft: every draft is kept, so max_tokens falls inside a run of K + 1.
    engine = Engine(target, drafters.create("draft", target, {"model": target}), 4)
    result: list[RequestOutput] = []
    steps = list(engine.stream(PROMPT, SamplingParams(max_tokens=7, logprobs=1, prompt_logprobs=0), result))
    assert [len(s.token_ids) for s in steps] == [1, 5, 1]
    assert steps[0].prompt_logprobs == result[0].prompt_logprobs and len(steps[0].prompt_logprobs) == len(PROMPT)
    assert all(s.prompt_logprobs is None for s in steps[1:])
    for step in steps:
        assert [e.token_id for e in step.logprobs] == step.token_ids
    assert [e for s in steps for e in s.logprobs] == result[0].logprobs
    assert len(result[0].logprobs) == len(result[0].token_ids) == 7


def test_nothing_is_scored_when_no_logprobs_are_asked(target, monkeypatch) -> None:
    from forerun.engine import engine as engine_module

    def refuse(*args, **kwargs):
        raise AssertionError("log probabilities computed though none were asked")

    monkeypatch.setattr(engine_module, "token_logprobs", refuse)
    monkeypatch.setattr(engine_module, "prompt_logprobs", refuse)
    engine = Engine(target, drafter_of("ngram", target), 4)
    steps = list(engine.stream(PROMPT, SamplingParams(max_tokens=12)))
    assert all(s.logprobs is None for s in steps)
    out = engine.generate(PROMPT, SamplingParams(max_tokens=12))
    assert out.logprobs is None and out.prompt_logprobs is None


# --- batched ---------------------------------------------------------------------------------------


def drive(batch: BatchEngine, keys: list) -> dict:
    """Step `batch` until every lane in `keys` is finished; each key's StepOutputs in order."""
    steps: dict = {key: [] for key in keys}
    while any(not batch.lanes[key].run.seq.finished for key in keys):
        for key, result in batch.step().items():
            assert result.error is None, result.error
            steps[key].append(result.output)
    return steps


@pytest.mark.parametrize("method", [None, "ngram", "draft"])
def test_batched_lanes_carry_the_logprobs_each_gets_alone(w8a8, w8a8_draft, method) -> None:
    requests = [
        ([5, 6, 7, 5, 6, 7, 5], SamplingParams(max_tokens=14, logprobs=2, prompt_logprobs=1)),
        ([9, 10], SamplingParams(max_tokens=9)),
        ([1, 2, 3, 4, 1, 2, 3, 4, 1], SamplingParams(max_tokens=12, logprobs=0)),
        ([60, 61, 62, 60, 61], SamplingParams(max_tokens=11, logprobs=4)),
    ]
    llm = LLM(
        w8a8,
        speculative_model=w8a8_draft if method == "draft" else None,
        speculative_method=method,
        num_speculative_tokens=3,
        speculative_k_policy="fixed",
    )
    batch = BatchEngine(llm.new_engine, len(requests))
    firsts = {key: batch.add(key, prompt, params) for key, (prompt, params) in enumerate(requests)}
    steps = drive(batch, list(firsts))
    for key, (prompt, params) in enumerate(requests):
        out = batch.remove(key)
        alone = Engine(w8a8).generate(prompt, params)
        assert out.token_ids == alone.token_ids
        assert out.logprobs == alone.logprobs and out.prompt_logprobs == alone.prompt_logprobs
        if params.logprobs is None:
            assert out.logprobs is None and all(s.logprobs is None for s in steps[key])
        else:
            assert [e for s in [firsts[key]] + steps[key] for e in s.logprobs] == out.logprobs


# --- n completions sharing one prefill --------------------------------------------------------------


def count_prefills(model: LoadedModel, monkeypatch) -> list[int]:
    """Wrap the target's forward: one entry (the prompt's length) per forward that starts at position 0."""
    decoder = model.decoder
    forward = decoder.forward
    seen: list[int] = []

    def counted(tokens, positions, cache, *args, **kwargs):
        if int(positions.reshape(-1)[0]) == 0:
            seen.append(tokens.numel())
        return forward(tokens, positions, cache, *args, **kwargs)

    monkeypatch.setattr(decoder, "forward", counted)
    return seen


SEED = 1234


@pytest.mark.parametrize("method", [None, "ngram", "draft"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "greedy"])
def test_n_lanes_sharing_a_prefill_give_what_each_gives_alone(w8a8, w8a8_draft, monkeypatch, method, sampled) -> None:
    params = [
        SamplingParams(temperature=1.0 if sampled else 0.0, max_tokens=12, seed=SEED + i, logprobs=2, prompt_logprobs=2)
        for i in range(3)
    ]
    llm = LLM(
        w8a8,
        speculative_model=w8a8_draft if method == "draft" else None,
        speculative_method=method,
        num_speculative_tokens=3,
        speculative_k_policy="fixed",
    )
    alone = [llm.new_engine().generate(PROMPT, p) for p in params]
    batch = BatchEngine(llm.new_engine, 3)
    batch.prepare()
    prefills = count_prefills(w8a8, monkeypatch)
    firsts = [batch.add(0, PROMPT, params[0])]
    firsts += [batch.add(key, PROMPT, params[key], like=0) for key in (1, 2)]
    assert prefills == [len(PROMPT)]  # one prefill for the three
    drive(batch, [0, 1, 2])
    outs = [batch.remove(key) for key in range(3)]
    for first, out, want in zip(firsts, outs, alone):
        assert first.token_ids == want.token_ids[:1]
        assert out.token_ids == want.token_ids and out.logprobs == want.logprobs
        assert out.prompt_logprobs == want.prompt_logprobs
    if sampled:
        assert len({tuple(out.token_ids) for out in outs}) > 1  # their own seeds, their own draws


def test_the_engine_shares_a_prefill_and_cuts_prompt_logprobs_to_each_count(target, monkeypatch) -> None:
    alone = Engine(target).generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=9, seed=4, prompt_logprobs=1))
    engine = Engine(target)
    prefills = count_prefills(target, monkeypatch)
    first, _ = engine.begin(PROMPT, SamplingParams(temperature=1.0, max_tokens=6, seed=3, prompt_logprobs=4))
    second, _ = engine.begin(
        PROMPT, SamplingParams(temperature=1.0, max_tokens=9, seed=4, prompt_logprobs=1), like=first
    )
    assert prefills == [len(PROMPT)]
    assert torch.equal(second.cache.k[:, :, :, : len(PROMPT)], first.cache.k[:, :, :, : len(PROMPT)])
    assert [e.top for e in second.prompt_logprobs[1:]] == [e.top[:1] for e in first.prompt_logprobs[1:]]
    while not second.seq.finished:
        engine.step(second)
    out = engine.end(second)
    assert out.token_ids == alone.token_ids and out.prompt_logprobs == alone.prompt_logprobs
    # More alternatives than the first request scored: a prefill of its own.
    engine.begin(PROMPT, SamplingParams(prompt_logprobs=6), like=first)
    assert prefills == [len(PROMPT)] * 2


class FeatureReader(Drafter):
    """A drafter that reads the target's features and never proposes."""

    reads_features = True

    def __init__(self) -> None:
        self.fed: list[int] = []

    def start(self, prompt_ids, target_cache, max_len) -> None:
        pass

    def features(self, hidden: torch.Tensor) -> None:
        self.fed.append(hidden.shape[0])

    def propose(self, context, k, params, generator):
        return None

    def observe(self, num_accepted, aux_logits=None) -> None:
        pass


def test_a_drafter_that_reads_features_gets_a_prefill_of_its_own(target, monkeypatch) -> None:
    first, _ = Engine(target).begin(PROMPT, SamplingParams())
    reader = FeatureReader()
    prefills = count_prefills(target, monkeypatch)
    run, _ = Engine(target, reader, 2).begin(PROMPT, SamplingParams(), like=first)
    assert prefills == [len(PROMPT)] and reader.fed == [len(PROMPT)]
    assert run.cache.length == len(PROMPT)


def test_sharing_a_prefill_is_refused_when_it_cannot_serve(w8a8) -> None:
    llm = LLM(w8a8)
    batch = BatchEngine(llm.new_engine, 4)
    batch.add("a", PROMPT, SamplingParams(max_tokens=5))
    with pytest.raises(ForerunError, match="names no running request"):
        batch.add("b", PROMPT, SamplingParams(max_tokens=5), like="nobody")
    with pytest.raises(ForerunError, match="same prompt"):
        batch.add("b", PROMPT[:-1], SamplingParams(max_tokens=5), like="a")
    batch.step()
    with pytest.raises(ForerunError, match="already stepped"):
        batch.add("b", PROMPT, SamplingParams(max_tokens=5), like="a")
    assert list(batch.lanes) == ["a"] and len(batch.idle) + len(batch.lanes) <= 4  # nothing leaked


def test_running_keeps_the_prefill_logits_only_until_its_first_step(target) -> None:
    engine = Engine(target)
    run, _ = engine.begin(PROMPT, SamplingParams(max_tokens=4))
    assert isinstance(run, Running) and run.prefill_logits.shape == (1, target.decoder.cfg.vocab_size)
    engine.step(run)
    assert run.prefill_logits is None
