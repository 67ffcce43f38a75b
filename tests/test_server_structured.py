"""Structured outputs through `forerun serve`: OpenAI's response_format (json_object, json_schema, and
the openai library's `parse` with a pydantic model), vLLM's structured_outputs and guided_* fields;
whole and streamed, sampled, and the same text with speculation."""

from __future__ import annotations

import json
import re

import httpx
import pydantic
import pytest
from test_server import NAME, Served
from test_server_api import post, stream

from forerun.api import LLM

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def plain(target_tok):
    s = Served(LLM(target_tok))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def speculative(target_tok):
    llm = LLM(target_tok, speculative_method="ngram", num_speculative_tokens=3, speculative_k_policy="fixed")
    s = Served(llm)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def compact(target_tok) -> dict:
    """A logit bias that holds whitespace off: the tiny model pads JSON with it wherever JSON allows."""
    return {str(i): -100 for i in target_tok.tokenizer.encode(" \n")}


def chat(served, compact: dict, **fields) -> dict:
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "give me json"}],
        "max_tokens": 40,
        "temperature": 0,
    }
    return post(served, {**body, "logit_bias": compact, **fields}, "/v1/chat/completions")


def test_a_json_schema_response_follows_the_schema_and_speculation_writes_the_same(plain, speculative, compact) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    reply = chat(plain, compact, response_format=response_format)
    value = json.loads(reply["choices"][0]["message"]["content"])
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert chat(speculative, compact, response_format=response_format)["choices"] == reply["choices"]


def test_json_object_gives_a_json_object(plain, compact) -> None:
    reply = chat(plain, compact, response_format={"type": "json_object"}, max_tokens=60)
    content = reply["choices"][0]["message"]["content"]
    assert content.startswith("{")
    if reply["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    text = chat(plain, compact, response_format={"type": "text"}, max_tokens=8)["choices"][0]["message"]["content"]
    assert not text.startswith("{")  # plain text is what it was


@pytest.mark.parametrize(
    "fields, check",
    [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-c]{2}", t)),
        ({"guided_regex": "[0-9]{3}-[a-c]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-c]{2}", t)),
        ({"structured_outputs": {"choice": ["north", "south"]}}, lambda t: t in ("north", "south")),
        ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
        ({"guided_json": SCHEMA}, lambda t: set(json.loads(t)) == {"n", "ok"}),
        ({"structured_outputs": {"grammar": 'start: "x" ("y" | "z")*'}}, lambda t: re.fullmatch("x[yz]*", t)),
    ],
)
def test_vllms_fields_give_text_that_follows_them_whole_and_streamed(plain, compact, fields, check) -> None:
    body = {"model": NAME, "prompt": "abc", "max_tokens": 30, "temperature": 0, "logit_bias": compact, **fields}
    whole = post(plain, body)["choices"][0]["text"]
    assert check(whole), whole
    streamed = "".join(c["choices"][0]["text"] for c in stream(plain, body) if c["choices"])
    assert streamed == whole


def test_sampled_choices_each_follow_the_regex(plain) -> None:
    body = {"model": NAME, "prompt": "abc", "max_tokens": 12, "n": 4, "temperature": 1.0, "seed": 7}
    choices = post(plain, {**body, "guided_regex": "[a-e]{4,8}"})["choices"]
    texts = [c["text"] for c in choices]
    assert all(re.fullmatch("[a-e]{4,8}", t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled, not one text four times


def test_the_openai_librarys_parse_reads_a_pydantic_model_back(plain, compact) -> None:
    class Answer(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        ok: bool
        word: str = pydantic.Field(max_length=6)

    completion = plain.client().chat.completions.parse(
        model=NAME,
        messages=[{"role": "user", "content": "answer"}],
        response_format=Answer,
        temperature=0,
        max_tokens=40,
        logit_bias=compact,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer) and len(parsed.word) <= 6


def test_vllms_own_serialisation_with_nulls_and_options_is_taken(plain, compact) -> None:
    vllm_shape = {
        "json": None,
        "regex": "[0-9]{3}",
        "choice": None,
        "grammar": None,
        "json_object": None,
        "disable_any_whitespace": False,
        "disable_additional_properties": False,
        "whitespace_pattern": None,
        "disable_fallback": False,
        "structural_tag": None,
    }
    body = {"model": NAME, "prompt": "abc", "max_tokens": 8, "temperature": 0, "structured_outputs": vllm_shape}
    assert re.fullmatch("[0-9]{3}", post(plain, body)["choices"][0]["text"])


def test_strict_json_schema_takes_no_property_the_schema_does_not_name(plain, compact, target_tok) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    comma = {str(i): 100 for i in target_tok.tokenizer.encode(",")}  # the model would go on to another key
    reply = chat(plain, {**compact, **comma}, response_format=response_format, max_tokens=30)
    assert list(json.loads(reply["choices"][0]["message"]["content"])) == ["ok"]


def test_a_schema_whose_references_chain_deep_is_answered_and_the_server_stays_up(plain) -> None:
    depth = 1500  # overflowed the request's thread's stack in native code and killed the server
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(depth)}
    schema = {"$defs": {**defs, f"d{depth}": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    body = {"model": NAME, "prompt": "abc", "max_tokens": 4, "temperature": 0, "guided_json": schema}
    assert post(plain, body)["choices"][0]["text"].startswith("{")
    assert httpx.get(plain.url + "/health", timeout=5).status_code == 200
