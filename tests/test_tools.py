"""Tool calling: tools and tool_choice checked, calls read back from text (whole and streamed give
the same), the forced call's grammar, a conversation's earlier calls for the template, and the chat
route end to end: required, a named function and auto, whole and streamed, and with speculation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import NAME, Served
from test_server_api import AUTH, post, stream

from forerun.api import LLM
from forerun.base.chat import chat_turns
from forerun.base.config import SamplingParams
from forerun.base.errors import FieldError, ForerunError
from forerun.base.tools import CALL_CLOSE, CALL_OPEN, CallReader, tool_choice
from forerun.cli import main
from forerun.models.testing import TINY_VOCAB, save_hf_folder, tiny_model
from forerun.verification.grammar import Grammar, tool_call_grammar

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two digits",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}},
            "required": ["a", "b"],
        },
        "strict": True,
    },
}
FLIP = {"type": "function", "function": {"name": "flip", "parameters": {"type": "object", "properties": {}}}}


def block(name: str, arguments: str) -> str:
    return f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{CALL_CLOSE}'


# --- tools and tool_choice -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "tools, choice, parallel, field, words",
    [
        ([ADD], "maybe", None, "tool_choice", "none, auto, required"),
        ([ADD], {"type": "function", "function": {"name": "sub"}}, None, "tool_choice", "which tools does not list"),
        ([ADD], {"type": "function"}, None, "tool_choice", "names a function"),
        (None, "required", None, "tool_choice", "needs tools"),
        ({"add": ADD}, None, None, "tools", "must be a list"),
        ([{"type": "code_interpreter"}], None, None, "tools", "tools[0] must be"),
        ([{**ADD, "extra": 1}], None, None, "tools", "unknown field 'extra'"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools", "letters, digits"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            None,
            "tools",
            "of an object",
        ),
        (
            [{"type": "function", "function": {"name": "f", "returns": {}}}],
            None,
            None,
            "tools",
            "unknown field 'returns'",
        ),
        ([ADD, ADD], None, None, "tools", "'add' twice"),
        ([ADD] * 129, None, None, "tools", "at most 128"),
        ([ADD], None, "yes", "parallel_tool_calls", "true or false"),
        (None, None, "yes", "parallel_tool_calls", "true or false"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(tools, choice, parallel, field, words) -> None:
    with pytest.raises(FieldError, match=re.escape(words)) as caught:
        tool_choice(tools, choice, parallel)
    assert caught.value.field == field


def test_tool_choice_reads_openais_forms() -> None:
    assert tool_choice(None) is None and tool_choice([], "auto") is None
    assert tool_choice([ADD]).choice == "auto" and not tool_choice([ADD]).forced
    named = tool_choice([ADD, FLIP], {"type": "function", "function": {"name": "flip"}}, False)
    assert named.forced and (named.choice, named.name) == ("function", "flip") and not named.parallel
    assert [f["name"] for f in named.functions] == ["flip"]
    assert [f["name"] for f in tool_choice([ADD, FLIP], "required").functions] == ["add", "flip"]
    # a function may be named as a choice is: naming it still calls it alone
    required = {"type": "function", "function": {"name": "required"}}
    only = tool_choice([ADD, required], {"type": "function", "function": {"name": "required"}})
    assert [f["name"] for f in only.functions] == ["required"] and tool_choice(
        [ADD, required], "required"
    ).choice == "required"
    assert len(tool_choice([ADD, required], "required").functions) == 2


# --- reading calls -------------------------------------------------------------------------------


def read(text: str, names=("f", "g")) -> tuple[str, list]:
    reader = CallReader(names)
    content, calls = reader.feed(text)
    rest, last = reader.finish()
    return content + rest, [(c.name, json.loads(c.arguments)) for c in calls + last]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("just text", "just text", []),
        (block("add", '{"a": 1}'), "", [("add", {"a": 1})]),
        ("Let me add.\n\n" + block("add", '{"a": 1}') + "\n", "Let me add.", [("add", {"a": 1})]),
        (block("f", "{}") + "\n" + block("g", '{"x": [1]}'), "", [("f", {}), ("g", {"x": [1]})]),
        (block("f", "{}") + "\n\nDone.", "Done.", [("f", {})]),
        # arguments written as a JSON string, or under "parameters", as some models write them
        (f'{CALL_OPEN}{{"name": "f", "arguments": "{{\\"a\\": 2}}"}}{CALL_CLOSE}', "", [("f", {"a": 2})]),
        (f'{CALL_OPEN}{{"name": "f", "parameters": {{"a": 3}}}}{CALL_CLOSE}', "", [("f", {"a": 3})]),
        # what makes no call stays text, as written
        ("a\n" + CALL_OPEN + "not json" + CALL_CLOSE, "a\n" + CALL_OPEN + "not json" + CALL_CLOSE, []),
        (CALL_OPEN + '{"arguments": {}}' + CALL_CLOSE, CALL_OPEN + '{"arguments": {}}' + CALL_CLOSE, []),
        ("cut \n" + CALL_OPEN + '\n{"name": "f", "argu', "cut \n" + CALL_OPEN + '\n{"name": "f", "argu', []),
        ("x < y and <tool_ca", "x < y and <tool_ca", []),
        ("ends with space  ", "ends with space  ", []),
        # one call of an offered function alone, without tags: bare, or in a ```json block
        ('{"name": "f", "arguments": {"a": 1}}', "", [("f", {"a": 1})]),
        ('\n```json\n{"name": "g", "arguments": {}}\n```\n', "", [("g", {})]),
        ('```json\n{"name": "h", "arguments": {}}\n```', '```json\n{"name": "h", "arguments": {}}\n```', []),
        ('{"name": "f", "arguments": {}} and more', '{"name": "f", "arguments": {}} and more', []),
        ('{"name": "f", "arguments": {}, "why": 1}', '{"name": "f", "arguments": {}, "why": 1}', []),
        ('```python\n{"name": "f"}\n```', '```python\n{"name": "f"}\n```', []),
        ('{"name": "f", "argu', '{"name": "f", "argu', []),
        ("{x} is a set", "{x} is a set", []),
        # text on both sides of calls keeps what stood before the first of them
        ("I will add.\n\n" + block("f", "{}") + "\n\nThen I report.", "I will add.\n\nThen I report.", [("f", {})]),
        ("Adding " + block("f", "{}") + " now", "Adding now", [("f", {})]),
        ("a\n" + block("f", "{}") + "\n" + block("g", "{}") + "\nb", "a\nb", [("f", {}), ("g", {})]),
        # what Python cannot parse or UTF-8 cannot carry is no call
        (CALL_OPEN + '{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}" + CALL_CLOSE, None, []),
        ('{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}", None, []),
        (CALL_OPEN + '{"name": "f", "arguments": {"s": "\\ud800"}}' + CALL_CLOSE, None, []),
        ('{"name": "f", "arguments": "{\\"s\\": \\"\\ud800\\"}"}', None, []),
    ],
)
def test_calls_and_content_are_read_from_an_answer(text, content, calls) -> None:
    assert read(text) == (text if content is None else content, calls)


def test_an_answer_that_may_be_a_bare_call_is_scanned_once_and_parsed_once(monkeypatch) -> None:
    # Held while it may be one call, a long answer is read a character at a time as it arrives
    # (the server's event loop runs this) and parsed once, when its object closes.
    parses = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **kw: parses.append(len(text)) or loads(text, *a, **kw))
    text = '{"name": "f", "arguments": {' + ", ".join(f'"k{i}": "{{[\\"]}}"' for i in range(2000)) + "}}"
    reader = CallReader(["f"])
    given = [reader.feed(c) for c in text]
    assert all(g == ("", []) for g in given) and len(parses) == 1
    content, [call] = reader.finish()
    assert content == "" and len(json.loads(call.arguments)) == 2000


PIECES = st.sampled_from(
    ["Hi", " ", "\n", "<", "<tool", CALL_OPEN, CALL_CLOSE, '{"name": "f", "arguments": {"a": 1}}', "}", "x y"]
    + [block("f", '{"a": 1}'), block("g", "{}"), "```json\n", "```", '{"name": "g", "arguments": {}}']
)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=14), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_a_streamed_answer_reads_as_the_whole_one(pieces, cuts) -> None:
    # Fed in any pieces, the reader gives out the same content and calls as for the whole text,
    # and an answer without calls is its text exactly: nothing is lost while text is held.
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    reader, content, calls = CallReader(["f", "g"]), "", []
    for start, end in zip(bounds, bounds[1:]):
        more, new = reader.feed(text[start:end])
        content, calls = content + more, calls + new
    rest, last = reader.finish()
    content, calls = content + rest, calls + last
    whole_content, whole_calls = read(text)
    assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == (whole_content, whole_calls)
    if not whole_calls:
        assert content == text


# --- a conversation's earlier calls --------------------------------------------------------------


def test_an_answers_calls_and_their_results_go_to_the_template(tokenizer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": true}'}}
    turns = chat_turns(
        [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
        ]
    )
    assert turns[1]["content"] == "" and turns[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": True}
    text = tokenizer.decode(tokenizer.apply_chat(turns, tools=[ADD]))
    assert "tools: add" in text and block("add", '{"a": 1, "b": true}') in text


@pytest.mark.parametrize(
    "message, words",
    [
        ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "only an assistant"),
        ({"role": "assistant", "content": None}, "content must be a string"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "JSON object",
        ),
        (  # nested past what Python parses: refused, not a crash
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}]},
            "JSON object",
        ),
        ({"role": "assistant", "content": "", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}, "is not"),
        ({"role": "assistant", "content": "", "tool_calls": [{"id": 7, "function": {"name": "f"}}]}, "is not"),
    ],
)
def test_a_bad_call_in_the_conversation_is_refused(message, words) -> None:
    with pytest.raises(ForerunError, match=words):
        chat_turns([message])


def test_a_template_without_tools_refuses_them(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(tokenizer.hf, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ForerunError, match="does not show the model tools"):
        tokenizer.apply_chat([{"role": "user", "content": "a"}], tools=[ADD])
    assert not tokenizer.writes_tool_calls


# --- the forced call's grammar -------------------------------------------------------------------


def follows(grammar: Grammar, tokenizer, text: str) -> bool:
    for token in tokenizer.encode(text):
        if not grammar.allowed([()])[0, token]:
            return False
        grammar.advance(token)
    return True


def test_a_forced_call_follows_the_template_and_the_functions_parameters(tokenizer) -> None:
    required = tool_call_grammar(tool_choice([ADD, FLIP], "required"), tokenizer)
    good = block("add", '{"a": 3, "b": false}') + "\n" + block("flip", "{}")
    assert follows(Grammar.start(required, tokenizer, TINY_VOCAB), tokenizer, good)
    for bad in (
        block("add", '{"a": 12, "b": false}'),  # past the maximum
        block("add", '{"a": 3, "b": false, "c": 1}'),  # strict: no other property
        block("add", '{"a":3,"b":false}'),  # not as the template writes JSON
        block("sub", "{}"),  # no such function
        "Sure! " + block("flip", "{}"),
    ):
        assert not follows(Grammar.start(required, tokenizer, TINY_VOCAB), tokenizer, bad), bad
    named = tool_call_grammar(tool_choice([ADD, FLIP], {"type": "function", "function": {"name": "flip"}}), tokenizer)
    assert not follows(Grammar.start(named, tokenizer, TINY_VOCAB), tokenizer, block("add", '{"a": 3, "b": false}'))
    untyped = {"type": "function", "function": {"name": "g", "parameters": {"properties": {}}}}
    arguments = tool_call_grammar(tool_choice([untyped], "required"), tokenizer)  # an object, typed or not
    assert not follows(Grammar.start(arguments, tokenizer, TINY_VOCAB), tokenizer, block("g", "5"))
    assert follows(Grammar.start(arguments, tokenizer, TINY_VOCAB), tokenizer, block("g", "{}"))
    one = Grammar.start(named, tokenizer, TINY_VOCAB)
    assert follows(one, tokenizer, block("flip", '{"extra": 1}'))  # not strict: open, as JSON Schema's objects
    assert set(one.allowed([()])[0].nonzero().flatten().tolist()) <= set(tokenizer.stop_ids)  # one call, then the end


# --- through the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(target_tok):
    s = Served(LLM(target_tok))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def speculative(target_tok):
    s = Served(LLM(target_tok, speculative_method="ngram", num_speculative_tokens=3, speculative_k_policy="fixed"))
    yield s
    s.stop()


def ask(**fields) -> dict:
    body = {"model": NAME, "messages": [{"role": "user", "content": "add"}], "max_tokens": 120, "temperature": 0}
    return {**body, "tools": [ADD, FLIP], **fields}


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


def streamed_message(served, body: dict) -> tuple[dict, str]:
    """A stream's deltas put together as OpenAI's client does; its last finish reason."""
    content, calls, reason = "", {}, None
    for chunk in stream(served, body, "/v1/chat/completions"):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                calls.setdefault(call["index"], call)
            reason = choice["finish_reason"] or reason
    tool_calls = [calls[i] for i in sorted(calls)]
    return {"content": content or None, "tool_calls": tool_calls}, reason


def test_required_makes_the_answer_calls_whole_and_streamed(plain, speculative) -> None:
    reply = post(plain, ask(tool_choice="required"), "/v1/chat/completions")["choices"][0]
    message, calls = reply["message"], calls_of(reply["message"])
    assert message["content"] is None and reply["finish_reason"] == "tool_calls" and calls
    for name, arguments in calls:
        assert name in ("add", "flip")
        if name == "add":
            assert set(arguments) == {"a", "b"} and 0 <= arguments["a"] <= 9 and isinstance(arguments["b"], bool)
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    got, reason = streamed_message(plain, ask(tool_choice="required"))
    assert reason == "tool_calls" and got["content"] is None and calls_of(got) == calls
    assert [c["index"] for c in got["tool_calls"]] == list(range(len(calls)))
    again = post(speculative, ask(tool_choice="required"), "/v1/chat/completions")["choices"][0]
    assert calls_of(again["message"]) == calls  # speculation writes the same calls


def test_a_named_function_is_called_once_and_ends_with_stop(plain) -> None:
    body = ask(tool_choice={"type": "function", "function": {"name": "add"}})
    reply = post(plain, body, "/v1/chat/completions")["choices"][0]
    assert reply["finish_reason"] == "stop" and [name for name, _ in calls_of(reply["message"])] == ["add"]
    one = post(plain, ask(tool_choice="required", parallel_tool_calls=False), "/v1/chat/completions")["choices"][0]
    assert len(calls_of(one["message"])) == 1


def test_auto_reads_calls_and_leaves_other_text_as_content(plain) -> None:
    # The tiny model writes no calls of its own: auto gives its text as content, as without tools;
    # the same text written by a model that calls reads as its call.
    reply = post(plain, ask(max_tokens=12), "/v1/chat/completions")["choices"][0]
    assert reply["message"]["content"] and "tool_calls" not in reply["message"] and reply["finish_reason"] == "length"
    none = post(plain, ask(max_tokens=12, tool_choice="none"), "/v1/chat/completions")["choices"][0]
    assert none["message"]["content"] == reply["message"]["content"]
    forced = post(plain, ask(tool_choice="required"), "/v1/chat/completions")["choices"][0]
    history = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": forced["message"]["tool_calls"]},
        {"role": "tool", "tool_call_id": forced["message"]["tool_calls"][0]["id"], "content": "4"},
    ]
    follow_up = post(plain, ask(messages=history, max_tokens=8), "/v1/chat/completions")
    history[1] = {"role": "assistant", "content": ""}
    without = post(plain, ask(messages=history, max_tokens=8), "/v1/chat/completions")
    # the call went back to the template: its block's characters (one token each here) in the prompt
    written = len(block("add", forced["message"]["tool_calls"][0]["function"]["arguments"]))
    assert follow_up["usage"]["prompt_tokens"] - without["usage"]["prompt_tokens"] >= written


def test_the_openai_library_reads_the_calls(plain) -> None:
    body = ask(tool_choice={"type": "function", "function": {"name": "add"}})
    completion = plain.client().chat.completions.create(**body)
    [call] = completion.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"a", "b"}


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "give one of them"),
        ({"tool_choice": "required", "ignore_eos": True}, "ignore_eos", "structured output"),
        (
            {
                "tools": [
                    ADD,
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
                    },
                ],
                "tool_choice": "required",
            },
            "tools",
            "tools[1] ('f'): its parameters cannot be followed",
        ),
    ],
)
def test_a_bad_tool_request_is_refused_naming_the_field(plain, fields, param, words) -> None:
    r = httpx.post(plain.url + "/v1/chat/completions", json=ask(**fields), headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text


def test_tools_belong_to_chat(plain) -> None:
    body = {"model": NAME, "prompt": "a", "tools": [ADD]}
    r = httpx.post(plain.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "belongs to /v1/chat/completions" in r.json()["error"]["message"]


def test_a_template_that_writes_no_calls_is_refused_unless_nothing_is_called(plain, monkeypatch) -> None:
    template = plain.llm.tokenizer.hf.chat_template.replace("<tool_call>", "<call>")
    monkeypatch.setattr(plain.llm.tokenizer.hf, "chat_template", template)
    r = httpx.post(plain.url + "/v1/chat/completions", json=ask(), headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "<tool_call>" in r.text
    answer = post(plain, ask(tool_choice="none", max_tokens=4), "/v1/chat/completions")["choices"][0]
    assert answer["message"]["content"] and "tool_calls" not in answer["message"]
    bare = "{% for m in messages %}{{ m.content }}{% endfor %}"  # a template that shows no tools
    monkeypatch.setattr(plain.llm.tokenizer.hf, "chat_template", bare)
    r = httpx.post(plain.url + "/v1/chat/completions", json=ask(tool_choice="none"), headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "does not show the model tools" in r.text


def test_an_answer_that_is_one_bare_call_reads_as_that_call_whole_and_streamed(plain) -> None:
    # A schema holds the tiny model to the JSON of one call of "add" without tags, as small models
    # answer a tool request: auto reads it as the call; streamed, it is held until whole.
    call = {
        "type": "object",
        "properties": {"name": {"const": "add"}, "arguments": ADD["function"]["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    body = ask(structured_outputs={"json": call, "disable_any_whitespace": True})
    reply = post(plain, body, "/v1/chat/completions")["choices"][0]
    assert reply["finish_reason"] == "tool_calls" and reply["message"]["content"] is None
    [(name, arguments)] = calls_of(reply["message"])
    assert name == "add" and set(arguments) == {"a", "b"}
    got, reason = streamed_message(plain, body)
    assert reason == "tool_calls" and calls_of(got) == [(name, arguments)] and got["content"] is None


# --- the command line ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=2, num_layers=2), tmp_path_factory.mktemp("tools") / "tiny")


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "tools.json"
    path.write_text(json.dumps([ADD, FLIP]))
    return path


def test_generate_calls_a_named_function_as_the_api_does(folder, tools_file, capsys) -> None:
    argv = ["generate", "--model", str(folder), "--dtype", "float32", "--prompt", "add", "--chat", "--json"]
    argv += ["--max-tokens", "80", "--tools", str(tools_file), "--tool-choice", "add", "--speculative-method", "ngram"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    llm = LLM(str(folder), dtype="float32")
    named = tool_choice([ADD, FLIP], {"type": "function", "function": {"name": "add"}})
    forced = tool_call_grammar(named, llm.tokenizer)
    messages = [{"role": "user", "content": "add"}]
    want = llm.chat(messages, SamplingParams(max_tokens=80, structured_outputs=forced), tools=[ADD, FLIP])[0]
    assert record["token_ids"] == want.token_ids and [c["name"] for c in record["tool_calls"]] == ["add"]
    assert set(json.loads(record["tool_calls"][0]["arguments"])) == {"a", "b"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tool-choice", "required"], "--tool-choice chooses among --tools"),
        (["--tools", "TOOLS"], "add --chat"),
        (["--chat", "--tools", "/nonexistent.json"], "--tools: cannot read /nonexistent.json"),
        (["--chat", "--tools", "NOT_JSON"], "is not JSON"),
        (["--chat", "--tools", "TOOLS", "--tool-choice", "sub"], "--tool-choice: tool_choice names 'sub'"),
        (["--chat", "--tools", "TOOLS", "--tool-choice", "required", "--regex", "a"], "leave out the structured"),
    ],
)
def test_generate_names_a_bad_tool_flag(folder, tools_file, tmp_path, argv, message, capsys) -> None:
    (tmp_path / "bad.json").write_text("[{")
    argv = [{"TOOLS": str(tools_file), "NOT_JSON": str(tmp_path / "bad.json")}.get(a, a) for a in argv]
    base = ["generate", "--model", str(folder), "--dtype", "float32", "--prompt", "add", "--max-tokens", "4"]
    assert main([*base, *argv]) != 0
    assert message in capsys.readouterr().err


def test_bench_measures_forced_calls_beside_plain(folder, tools_file, tmp_path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"prompt": "add", "category": "code"}) + "\n")
    argv = ["bench", "--model", str(folder), "--dtype", "float32", "--dataset", str(dataset), "--out", str(tmp_path)]
    argv += ["--max-tokens", "80", "--methods", "plain,ngram", "--no-progress", "--no-warmup"]
    assert main([*argv, "--tools", str(tools_file), "--tool-choice", "required", "--no-parallel-tool-calls"]) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    runs = [r for r in records if "method" in r]
    assert {r["method"] for r in runs} == {"plain", "ngram"} and all(r["identical_to_plain"] for r in runs)
    assert all(r["text"].startswith(CALL_OPEN) and r["text"].count(CALL_OPEN) == 1 for r in runs)
    report = (tmp_path / "report.md").read_text()
    assert "add, flip; tool_choice 'required', one call (a structured output)" in report


def test_an_answer_the_server_fails_to_shape_is_an_error_not_a_cut_connection(plain, monkeypatch) -> None:
    from forerun.serve.responses import Reply

    def broken(*args, **kwargs):
        raise RecursionError("deep")

    monkeypatch.setattr(Reply, "chunk", broken)
    monkeypatch.setattr(Reply, "complete", broken)
    r = httpx.post(plain.url + "/v1/chat/completions", json=ask(max_tokens=4), headers=AUTH, timeout=60)
    assert r.status_code == 500 and "failed to shape the answer: RecursionError" in r.json()["error"]["message"]
    with httpx.stream(
        "POST", plain.url + "/v1/chat/completions", json=ask(max_tokens=4, stream=True), headers=AUTH
    ) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert "failed to shape the answer" in events[-2] and events[-1] == "data: [DONE]"
    monkeypatch.undo()
    assert post(plain, ask(max_tokens=4), "/v1/chat/completions")["choices"]  # and the server answers on


# --- tags a vocabulary marks special -------------------------------------------------------------


@pytest.fixture(scope="module")
def special_tags(tmp_path_factory: pytest.TempPathFactory):
    """A server over a vocabulary whose <tool_call> tags are special tokens (as some fine-tunes add them)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from forerun.models.load import LoadedModel
    from forerun.models.source import ModelSource
    from forerun.models.testing import tiny_config, tiny_decoder, tiny_tokenizer_folder
    from forerun.models.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_tokenizer_folder(tmp_path_factory.mktemp("special"))))
    hf.add_tokens([AddedToken(tag, special=True, normalized=False) for tag in (CALL_OPEN, CALL_CLOSE)], True)
    tokenizer = Tokenizer(hf)
    model = LoadedModel(
        "target",
        tiny_decoder(tiny_config(vocab_size=len(hf)), 0),
        tokenizer,
        ModelSource("memory", Path("."), "target"),
    )
    s = Served(LLM(model))
    yield s
    s.stop()


def test_calls_whose_tags_are_special_tokens_are_read(special_tags) -> None:
    assert special_tags.llm.tokenizer.tool_tags_special
    # One function whose only arguments are {}: each answer is one or more calls of it, sampled.
    flip = {"type": "function", "function": {"name": "flip", "parameters": {"properties": {}}, "strict": True}}
    body = ask(tools=[flip], tool_choice="required", n=8, temperature=1.0, seed=3, max_tokens=300)
    choices = post(special_tags, body, "/v1/chat/completions")["choices"]
    finished = [c for c in choices if c["finish_reason"] != "length"]
    for choice in finished:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    # several calls in one answer (read only from their tags: one call alone would read bare)
    assert any(len(calls_of(c["message"])) >= 2 for c in finished)


def test_skip_special_tokens_false_keeps_their_text(plain) -> None:
    start = plain.llm.tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    body = {"model": NAME, "prompt": "ab", "max_tokens": 3, "temperature": 0, "logit_bias": {str(start): 100}}
    assert post(plain, body)["choices"][0]["text"] == ""
    assert post(plain, {**body, "skip_special_tokens": False})["choices"][0]["text"] == "<|im_start|>" * 3
    streamed = "".join(
        c["choices"][0]["text"] for c in stream(plain, {**body, "skip_special_tokens": False}) if c["choices"]
    )
    assert streamed == "<|im_start|>" * 3
    with pytest.raises(FieldError, match="skip_special_tokens must be True or False"):
        SamplingParams(skip_special_tokens="no")
