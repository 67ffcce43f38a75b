"""vLLM's `stop_token_ids`: a request's own stop tokens end generation where plain decoding ends,
speculative or not, keep their text (a special token has none), hold with `ignore_eos`, wait for
`min_tokens`, and are refused clearly when they are no token ids of the model."""

from __future__ import annotations

import httpx
import pytest
from conftest import perturbed
from test_server import KEY, NAME, Served

from forerun import drafters
from forerun.api import LLM
from forerun.base.config import FieldError, SamplingParams
from forerun.base.errors import ForerunError
from forerun.engine.engine import Engine

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]
MAX = 40


def _stop_at(tokens: list[int], start: int) -> int:
    """The index of the first token at or after `start` not seen before it in `tokens`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def full(target_tok):
    return Engine(target_tok).generate(PROMPT, SamplingParams(max_tokens=MAX, ignore_eos=True))


@pytest.mark.parametrize("method", [None, "ngram", "draft"])
def test_a_stop_token_id_ends_where_plain_decoding_ends_with_its_text_kept(target_tok, tokenizer, full, method):
    i = _stop_at(full.token_ids, 3)
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, stop_token_ids=[full.token_ids[i]])
    drafter = None
    if method is not None:
        drafter = drafters.create(
            method, target_tok, {"model": perturbed(target_tok, 0.05)} if method == "draft" else {}
        )
    out = Engine(target_tok, drafter, 4).generate(PROMPT, params)
    assert out.token_ids == full.token_ids[: i + 1] and out.finish_reason == "stop"  # with ignore_eos too
    assert out.text == tokenizer.decode(full.token_ids[: i + 1]) and out.text.endswith(
        tokenizer.piece(params.stop_token_ids[0])
    )
    if method is not None:
        assert out.metrics.num_drafts > 0


def test_min_tokens_holds_a_stop_token_id_off(target_tok, full) -> None:
    i = _stop_at(full.token_ids, 3)
    token = full.token_ids[i]
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, stop_token_ids=[token], min_tokens=i + 3)
    out = Engine(target_tok).generate(PROMPT, params)
    assert len(out.token_ids) >= i + 3 and token not in out.token_ids[: i + 2]


@pytest.mark.parametrize("ids", [[-1], ["5"], [True], "5", [1.5]])
def test_stop_token_ids_that_are_not_token_ids_are_named(ids) -> None:
    with pytest.raises(FieldError, match="stop_token_ids must be a list of token ids"):
        SamplingParams(stop_token_ids=ids)


def test_a_stop_token_id_beyond_the_vocabulary_is_refused_before_any_work(target_tok) -> None:
    vocab = target_tok.decoder.cfg.vocab_size
    with pytest.raises(ForerunError, match=f"stop_token_ids names token {vocab}, beyond the vocabulary of {vocab}"):
        LLM(target_tok).generate([PROMPT], SamplingParams(stop_token_ids=[3, vocab]))


def test_the_server_takes_stop_token_ids_as_vllm_does(target_tok, tokenizer, full) -> None:
    served = Served(LLM(target_tok))
    try:
        i = _stop_at(full.token_ids, 3)
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "ignore_eos": True}
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(
            served.url + "/v1/completions", json={**body, "stop_token_ids": [full.token_ids[i]]}, headers=auth
        )
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (tokenizer.decode(full.token_ids[: i + 1]), "stop")
        for bad, said in (
            ([-1], "no token id of this model"),
            ("7", "must be a list of token ids"),
            ([10**6], "below"),
        ):
            r = httpx.post(served.url + "/v1/completions", json={**body, "stop_token_ids": bad}, headers=auth)
            assert r.status_code == 400 and said in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "stop_token_ids"
    finally:
        served.stop()
