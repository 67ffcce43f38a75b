"""Predicted outputs (OpenAI's `prediction`): the suffix drafter drafts from the text a request
expects, alone and inside `auto`; the answer is the target's whatever the prediction says (greedy,
and seeded sampling, token for token); the accepted and rejected prediction tokens are counted as
OpenAI's usage counts them, through the engine, LLM, the server and `forerun generate`."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import NAME, Served
from test_server_api import AUTH, post, stream

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import FieldError, ForerunError
from forerun.cli import main
from forerun.drafters.suffix import SuffixDrafter
from forerun.engine.engine import Engine
from forerun.engine.metrics import prediction_used
from forerun.models.testing import TINY_VOCAB, save_hf_folder
from tests.conftest import perturbed

PROMPT = "Rewrite: abc"


@pytest.mark.parametrize("value", [3, [1, -2], ["a"], [1.5], {"type": "content"}, "lone \ud800"])
def test_a_prediction_is_text_or_token_ids(value) -> None:
    with pytest.raises(FieldError) as caught:
        SamplingParams(prediction=value)
    assert caught.value.field == "prediction"
    assert SamplingParams(prediction=[3, 4]).prediction == (3, 4)


def test_the_kept_prediction_tokens_are_those_the_answer_holds_in_order() -> None:
    assert prediction_used([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6]) == (4, 1)
    assert prediction_used([1, 2, 3], []) == (0, 3)
    assert prediction_used([], [1, 2]) == (0, 0)
    assert prediction_used([3, 2, 1], [1, 2, 3]) == (1, 2)  # order counts: one of the three in turn
    # a walk, not a quadratic search: a long repetitive pair is counted at once
    assert prediction_used([7] * 50_000, [7] * 50_000 + [8]) == (50_000, 0)
    assert prediction_used(list(range(40)), list(range(20)) + [99, 98] + list(range(25, 40))) == (35, 5)


def test_the_suffix_drafter_drafts_the_predictions_continuation_until_the_next_request() -> None:
    drafter = SuffixDrafter(None)
    drafter.start([1, 2, 3], None, 64)
    context = [1, 2, 3, 7, 8]
    assert drafter.propose(context, 4, SamplingParams(), None) is None  # nothing to copy yet
    drafter.expect([5, 7, 8, 9, 10, 11, 12])
    assert drafter.propose(context, 4, SamplingParams(), None).tokens == [9, 10, 11, 12]
    # the prompt's own text wins a tie
    drafter.start([7, 8, 40, 41], None, 64)
    drafter.expect([5, 7, 8, 9, 10])
    assert drafter.propose([7, 8, 40, 41, 7, 8], 2, SamplingParams(), None).tokens == [40, 41]
    drafter.start([1, 2, 3], None, 64)
    drafter.expect([])
    assert drafter.propose(context, 4, SamplingParams(), None) is None


@pytest.fixture(scope="module")
def plain_text(target_tok) -> list[int]:
    ids = target_tok.tokenizer.encode(PROMPT)
    return Engine(target_tok).generate(ids, SamplingParams(max_tokens=40)).token_ids


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_greedy_output_is_the_targets_whatever_the_prediction(target_tok, plain_text, method) -> None:
    draft = perturbed(target_tok, 0.5, name="draft") if method == "auto" else None

    def fresh() -> LLM:  # no memory of an earlier answer to copy from
        return LLM(target_tok, speculative_model=draft, speculative_method=method, num_speculative_tokens=4)

    llm = fresh()
    right = llm.generate(PROMPT, SamplingParams(max_tokens=40, prediction=plain_text))[0]
    assert right.token_ids == plain_text
    assert right.prediction_tokens == (len(plain_text), 0)
    # the answer was copied from the prediction: few target passes for 40 tokens (auto's cost policy
    # picks its draft length from the machine's timings, so it may draft fewer a step than 4)
    metrics = right.metrics
    assert metrics.num_accepted_tokens >= (24 if method == "suffix" else 16), metrics.to_dict()  # of at most 31 at K 4
    assert metrics.num_accepted_tokens >= 0.8 * metrics.num_draft_tokens, metrics.to_dict()
    if method == "auto":
        assert llm.engine.drafter.steps["suffix"] > 0
    wrong = [(t * 7 + 3) % TINY_VOCAB for t in plain_text]
    missed = fresh().generate(PROMPT, SamplingParams(max_tokens=40, prediction=wrong))[0]
    assert missed.token_ids == plain_text
    accepted, rejected = missed.prediction_tokens
    assert accepted + rejected == len(wrong) and rejected > accepted
    alone = fresh().generate(PROMPT, SamplingParams(max_tokens=40))[0]
    assert alone.token_ids == plain_text and alone.prediction_tokens is None
    if method == "suffix":  # copying its own repeats only (auto has its draft model too)
        assert alone.metrics.num_accepted_tokens < right.metrics.num_accepted_tokens - 6


def test_a_seeded_sample_is_plain_decodings_with_a_prediction(target_tok) -> None:
    ids = target_tok.tokenizer.encode(PROMPT)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=11)
    want = Engine(target_tok).generate(ids, sampled).token_ids
    llm = LLM(target_tok, speculative_method="suffix", num_speculative_tokens=4)
    got = llm.generate(ids, SamplingParams(max_tokens=40, temperature=1.0, seed=11, prediction=want))[0]
    assert got.token_ids == want and got.metrics.num_accepted_tokens >= 24


def test_a_prediction_the_model_cannot_read_is_refused_before_any_work(target, target_tok) -> None:
    with pytest.raises(ForerunError, match="no tokenizer"):
        LLM(target).generate([1, 2], SamplingParams(max_tokens=2, prediction="text"))
    with pytest.raises(ForerunError, match="beyond the vocabulary"):
        LLM(target_tok).generate(PROMPT, SamplingParams(max_tokens=2, prediction=[1, TINY_VOCAB]))


# --- the server and the command line -------------------------------------------------------------


@pytest.fixture(scope="module")
def speculative(target_tok):
    s = Served(LLM(target_tok, speculative_method="suffix", num_speculative_tokens=4, speculative_k_policy="fixed"))
    yield s
    s.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_usage_counts_the_prediction_tokens_kept_and_refused(speculative, path) -> None:
    chat = path.endswith("chat/completions")
    ask = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    body = {"model": NAME, **ask, "max_tokens": 30, "temperature": 0}
    answer = post(speculative, body, path)
    text = answer["choices"][0]["message" if chat else "text"]
    text = text["content"] if chat else text
    assert "completion_tokens_details" not in answer["usage"]
    parts = [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:] + "xyz"}]
    for content in (text + "xyz", parts):
        predicted = post(speculative, {**body, "prediction": {"type": "content", "content": content}}, path)
        assert predicted["choices"] == answer["choices"]
        details = predicted["usage"]["completion_tokens_details"]
        assert details == {"accepted_prediction_tokens": len(text), "rejected_prediction_tokens": 3}
    chunks = stream(
        speculative,
        {**body, "prediction": {"type": "content", "content": text}, "stream_options": {"include_usage": True}},
        path,
    )
    assert chunks[-1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == len(text)


@pytest.mark.parametrize(
    "prediction",
    [
        "text",
        {"type": "text", "content": "a"},
        {"type": "content"},
        {"type": "content", "content": 3},
        {"type": "content", "content": [{"type": "image", "text": "a"}]},
        {"type": "content", "content": "a", "extra": 1},
    ],
)
def test_a_prediction_of_another_shape_is_a_400_naming_it(speculative, prediction) -> None:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "prediction": prediction}
    r = httpx.post(speculative.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text
    assert '{"type": "content", "content"' in r.json()["error"]["message"]


def test_generate_takes_a_prediction_file_and_reports_what_was_kept(target_tok, tmp_path, capsys) -> None:
    folder = save_hf_folder(target_tok, tmp_path / "model")
    plain = Engine(target_tok).generate(target_tok.tokenizer.encode(PROMPT), SamplingParams(max_tokens=12))
    (tmp_path / "expected.txt").write_text(plain.text)
    argv = ["generate", "--model", str(folder), "--dtype", "float32", "--max-tokens", "12", "--json"]
    argv += ["--speculative-method", "suffix", "--prompt", PROMPT]
    assert main([*argv, "--prediction-file", str(tmp_path / "expected.txt")]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] == plain.text
    assert (record["accepted_prediction_tokens"], record["rejected_prediction_tokens"]) == (12, 0)
    assert main([*argv, "--prediction-file", str(tmp_path / "missing.txt")]) != 0
    assert "--prediction-file: cannot read" in capsys.readouterr().err


def test_a_bench_prompt_with_a_prediction_runs_with_it_and_the_report_says_so(tmp_path) -> None:
    from forerun.base.prompts import load_prompts
    from forerun.bench.runner import BenchConfig, Case, _params_for, _settings_lines

    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"prompt": "a", "prediction": "b c"}) + "\n" + json.dumps({"prompt": "d"}) + "\n")
    with_it, without = load_prompts(str(file))
    sampling = SamplingParams(max_tokens=4)
    assert _params_for(with_it, sampling).prediction == "b c" and _params_for(without, sampling).prediction is None
    lines = dict(_settings_lines(BenchConfig("tiny", tmp_path), [Case(with_it, [1]), Case(without, [2])], []))
    assert lines["prediction"].startswith("1 prompts give one") and lines["chat template"] == "yes"
    file.write_text(json.dumps({"prompt": "a", "prediction": ["b"]}) + "\n")
    with pytest.raises(ForerunError, match="'prediction' must be a string"):
        load_prompts(str(file))


def test_the_server_names_a_prediction_it_cannot_read(target, speculative) -> None:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4}
    long = {"type": "content", "content": "ab" * 600}  # 1200 tokens, over the server's context
    r = httpx.post(speculative.url + "/v1/completions", json={**body, "prediction": long}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text
    served = Served(LLM(target))
    try:
        ids = {"model": NAME, "prompt": [1, 2], "max_tokens": 2, "prediction": {"type": "content", "content": "a"}}
        r = httpx.post(served.url + "/v1/completions", json=ids, headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prediction" and "no tokenizer" in r.text
    finally:
        served.stop()


def test_commands_that_do_not_read_a_prediction_or_a_suffix_say_so(tmp_path, capsys) -> None:
    from forerun.base.prompts import unread_fields

    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", "prediction": "c"}) + "\n")
    assert main(["generate", "--model", "nowhere", "--prompts-file", str(file)]) != 0
    assert "prompt 2 has a 'prediction', which forerun generate" in capsys.readouterr().err
    with pytest.raises(ForerunError, match="prompt 1 has a 'suffix', which forerun quality does not read"):
        unread_fields([{"prompt": "a", "suffix": "b"}], "forerun quality")
    unread_fields([{"prompt": "a", "suffix": "b"}], "forerun generate", reads=("suffix",))  # it reads suffixes
