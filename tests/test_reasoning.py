"""Reasoning read apart from the answer (`--reasoning-parser`, vLLM's): qwen3's and deepseek_r1's
rules on whole answers, the same split whatever pieces the text arrives in (hypothesis), and chat
responses over a server whose answers a regular expression makes think: `reasoning_content` beside
`content`, whole and streamed, before a tool call too; completions keep the text as written."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import NAME, Served
from test_server_api import post, stream

from forerun.api import LLM
from forerun.base.errors import ForerunError
from forerun.base.reasoning import CLOSE, OPEN, ReasoningReader, split


@pytest.mark.parametrize(
    "parser, text, reasoning, content",
    [
        ("qwen3", "<think>\nhm\n</think>\n\nYes.", "\nhm\n", "\n\nYes."),
        ("qwen3", "  <think>a</think>b", "a", "b"),
        ("qwen3", "Yes, no thinking.", "", "Yes, no thinking."),
        ("qwen3", "<think>cut short", "cut short", ""),
        ("qwen3", "a <think>b</think>", "", "a <think>b</think>"),  # not at the start: content
        ("qwen3", "<thin", "", "<thin"),
        ("deepseek_r1", "hm</think>Yes.", "hm", "Yes."),
        ("deepseek_r1", "<think>hm</think>Yes.", "hm", "Yes."),
        ("deepseek_r1", "all reasoning, cut", "all reasoning, cut", ""),
        ("deepseek_r1", "x </thin", "x </thin", ""),
        ("deepseek_r1", "", "", ""),
    ],
)
def test_each_parser_splits_a_whole_answer_its_way(parser, text, reasoning, content) -> None:
    assert split(parser, text) == (reasoning, content)


def test_an_unknown_parser_is_named() -> None:
    with pytest.raises(ForerunError, match="qwen3, deepseek_r1"):
        ReasoningReader("r2")


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "ink>", "/think", " ", "\n", "a", "b"]))


@settings(max_examples=500, deadline=None)
@given(parts=PIECES, cuts=st.lists(st.integers(0, 40), max_size=8), parser=st.sampled_from(["qwen3", "deepseek_r1"]))
def test_streamed_pieces_give_the_whole_answers_split(parts, cuts, parser) -> None:
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    reader, reasoning, content = ReasoningReader(parser), "", ""
    for start, stop in zip(bounds, bounds[1:]):
        r, c = reader.feed(text[start:stop])
        reasoning, content = reasoning + r, content + c
    r, c = reader.finish()
    assert (reasoning + r, content + c) == split(parser, text)
    # the parts are the text, less what the rule takes out: at most the tags and the space before <think>
    taken = len(text) - len(reasoning + r + content + c)
    assert 0 <= taken and (taken == 0 or OPEN in text or CLOSE in text)


# --- over the server -------------------------------------------------------------------------------

THINK = "<think>ab c</think>done"
FLIP = {"type": "function", "function": {"name": "flip", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def thinking(target_tok):
    s = Served(LLM(target_tok), reasoning_parser="qwen3")
    yield s
    s.stop()


def ask(text: str, **fields) -> dict:
    chat = [{"role": "user", "content": "think"}]
    body = {"model": NAME, "messages": chat, "max_tokens": 80, "temperature": 0}
    return {**body, "structured_outputs": {"regex": _escaped(text)}, **fields}


def _escaped(text: str) -> str:
    return re.escape(text)


def test_chat_answers_give_their_reasoning_apart_whole_and_streamed(thinking) -> None:
    message = post(thinking, ask(THINK), "/v1/chat/completions")["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("ab c", "done")
    assert message["reasoning"] == "ab c"  # vLLM's newer name beside the older
    deltas = [c["choices"][0]["delta"] for c in stream(thinking, ask(THINK), "/v1/chat/completions") if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "ab c"
    assert "".join(d.get("reasoning", "") for d in deltas) == "ab c"
    # the message sent back as the openai library dumps it (both names) is taken
    back = [{"role": "user", "content": "think"}, dict(message), {"role": "user", "content": "x"}]
    assert post(thinking, {"model": NAME, "messages": back, "max_tokens": 1}, "/v1/chat/completions")["choices"]
    assert "".join(d.get("content", "") or "" for d in deltas) == "done"
    plain = post(thinking, ask("no thought"), "/v1/chat/completions")["choices"][0]["message"]
    assert (plain["reasoning_content"], plain["content"]) == (None, "no thought")
    # completions keep the text as the model wrote it
    text = post(thinking, {"model": NAME, "prompt": "x", "max_tokens": 80, "temperature": 0, **_regex(THINK)})
    assert text["choices"][0]["text"] == THINK


def _regex(text: str) -> dict:
    return {"structured_outputs": {"regex": _escaped(text)}}


def test_a_tool_call_after_the_reasoning_is_read_as_a_call(thinking) -> None:
    answer = '<think>flip it</think><tool_call>\n{"name": "flip", "arguments": {}}\n</tool_call>'
    body = ask(answer, tools=[FLIP], max_tokens=200)
    choice = post(thinking, body, "/v1/chat/completions")["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "flip it" and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["flip"]
    assert choice["finish_reason"] == "tool_calls"
    chunks = [c["choices"][0] for c in stream(thinking, body, "/v1/chat/completions") if c["choices"]]
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "flip it"
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["flip"]
    assert not "".join(d.get("content") or "" for d in deltas) and chunks[-1]["finish_reason"] == "tool_calls"


def test_without_a_parser_the_tags_stay_in_the_content(target_tok) -> None:
    served = Served(LLM(target_tok))
    try:
        message = post(served, ask(THINK), "/v1/chat/completions")["choices"][0]["message"]
        assert message["content"] == THINK and "reasoning_content" not in message and "reasoning" not in message
    finally:
        served.stop()
