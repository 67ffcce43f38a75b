"""Structured outputs (a JSON schema, a regular expression, a choice, a grammar): what a row allows,
that the text follows it, and that speculation stays exact under it (greedy token for token, sampled
in distribution with a negative control, batched as alone)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from forerun import drafters
from forerun.api import LLM
from forerun.base.config import SamplingParams, StructuredOutputsParams
from forerun.base.errors import FieldError, ForerunError
from forerun.base.tools import tool_choice
from forerun.cli import main
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine
from forerun.models.load import LoadedModel
from forerun.models.testing import TINY_VOCAB, save_hf_folder, tiny_model, tiny_tokenizer
from forerun.models.tokenizer import Tokenizer
from forerun.verification import grammar as grammar_module
from forerun.verification.grammar import Grammar, grammar_text, tool_call_grammar
from forerun.verification.sampling import adjusted
from tests.conftest import perturbed
from tests.test_batch import run_batched
from tests.test_drafters_common import (
    CONTROL_RUNS,
    ONE_EACH_SAMPLING,
    RUNS,
    SETTINGS,
    _cli,
    setting_id,
    speculative_samples,
    total_variation,
)
from tests.test_logit_adjustments import exact_adjusted_marginals

PAIRS = StructuredOutputsParams(regex=r"([a-j][0-9]){16}")  # letters and digits in turn: each row's own mask


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def target4(tok: Tokenizer) -> LoadedModel:
    return tiny_model(2, tokenizer=tok, name="target4", num_layers=4)


def allowed_text(tok: Tokenizer, row: torch.Tensor) -> set[str]:
    return {tok.piece(i) for i in row.nonzero().flatten().tolist()}


# --- the settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "exactly one of json, regex, choice, grammar and json_object, got none"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of .* got regex, choice"),
        ({"json": "{not json"}, "its text is not JSON"),
        ({"json": "[1, 2]"}, "must be a JSON schema"),
        ({"choice": []}, "choice must be a list of non-empty strings"),
        ({"choice": ["a", ""]}, "choice must be a list of non-empty strings"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json_object": "yes"}, "json_object must be true or false"),
        ({"json": False}, "the schema false, which no text follows"),
        ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be true or false"),
    ],
)
def test_a_structured_output_is_exactly_one_well_formed_thing(fields, message) -> None:
    with pytest.raises(FieldError, match=message):
        StructuredOutputsParams(**fields)


def test_a_schema_given_as_a_dict_keeps_its_order_and_the_params_stay_hashable() -> None:
    spec = StructuredOutputsParams(json={"type": "object", "required": ["b"]})
    assert spec.json == '{"type": "object", "required": ["b"]}' and spec.kind == "json"  # keys are written so
    params = SamplingParams(structured_outputs={"choice": ["x", "y"]})  # a dict is taken, as in vLLM
    assert params.structured_outputs == StructuredOutputsParams(choice=("x", "y")) and params.adjusts
    hash(params)


def test_ignore_eos_and_a_structured_output_are_refused_together() -> None:
    with pytest.raises(FieldError, match="ignore_eos would write past the end"):
        SamplingParams(ignore_eos=True, structured_outputs=PAIRS)


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputsParams(regex="a(b"), "(?s)the regex cannot be followed: .*unclosed group"),
        (StructuredOutputsParams(json={"type": "nothing"}), "(?s)the json cannot be followed: .*nothing"),
        (StructuredOutputsParams(grammar="start: missing_rule"), "the grammar cannot be followed"),
    ],
)
def test_a_grammar_that_cannot_be_followed_is_named_with_the_reason(spec, message) -> None:
    with pytest.raises(FieldError, match=message):
        grammar_text(spec)


def chained_refs(depth: int) -> dict:
    """A schema whose references chain `depth` deep (each object's one property the next object)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(depth)}
    return {"$defs": {**defs, f"d{depth}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


CHAINED_RULES = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(4000)) + 'r4000: "a"'


@pytest.mark.parametrize(
    "spec, first",
    [
        (StructuredOutputsParams(json=chained_refs(1500)), "{"),  # overflowed an 8 MiB stack in native code
        (StructuredOutputsParams(grammar=CHAINED_RULES), "a"),
    ],
)
def test_a_grammar_deep_enough_to_overflow_a_threads_stack_compiles_on_the_compile_thread(spec, first, tok) -> None:
    # Compiled on the test's own thread, each of these killed the process (SIGSEGV).
    assert allowed_text(tok, Grammar.start(spec, tok, TINY_VOCAB).allowed([[]])[0]) == {first}


def test_a_choice_of_thousands_that_share_a_start_is_one_alternation(target4, tok) -> None:
    choices = [f"option {i}" for i in range(2500)]  # a Lark rule of alternatives holds at most 2,000
    params = SamplingParams(max_tokens=12, structured_outputs={"choice": choices})
    out = Engine(target4).generate(tok.encode("x"), params)
    assert out.text in choices and out.finish_reason == "stop"


def json_after(tok, spec: StructuredOutputsParams, text: str) -> set[str]:
    grammar = Grammar.start(spec, tok, TINY_VOCAB)
    for token in tok.encode(text):
        grammar.advance(token)
    return allowed_text(tok, grammar.allowed([[]])[0])


def test_json_options_as_vllm_gives_them() -> None:
    spec = StructuredOutputsParams(json={"type": "object"}, json_object=None, whitespace_pattern=None)  # nulls: absent
    assert spec.kind == "json" and StructuredOutputsParams(json=True).json == "{}"  # `true`: any JSON value


def test_disable_any_whitespace_and_closed_objects_change_what_json_allows(tok) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert {" ", "\n"} <= json_after(tok, StructuredOutputsParams(json=schema), "{")
    assert not {" ", "\n"} & json_after(tok, StructuredOutputsParams(json=schema, disable_any_whitespace=True), "{")
    assert "," in json_after(tok, StructuredOutputsParams(json=schema), '{"a":1')  # another property may follow
    closed = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    assert "," not in json_after(tok, closed, '{"a":1') and "}" in json_after(tok, closed, '{"a":1')


# --- what a row allows ------------------------------------------------------------------------------


def test_each_row_allows_what_the_text_allows_after_its_own_path(tok) -> None:
    grammar = Grammar.start(PAIRS, tok, TINY_VOCAB)
    a, five = tok.encode("a")[0], tok.encode("5")[0]
    rows = grammar.allowed([[], [a], [a, five], [five]])
    letters, digits = set("abcdefghij"), set("0123456789")
    assert allowed_text(tok, rows[0]) == letters
    assert allowed_text(tok, rows[1]) == digits
    assert allowed_text(tok, rows[2]) == letters
    assert rows[3].all()  # a path the text cannot take: nothing reads this row (its parent refuses "5")
    assert allowed_text(tok, grammar.allowed([[]])[0]) == letters  # each path was rolled back


def test_a_paths_row_is_read_once_until_the_output_grows(tok, monkeypatch) -> None:
    grammar = Grammar.start(PAIRS, tok, TINY_VOCAB)
    reads = []
    read = grammar._next
    monkeypatch.setattr(grammar, "_next", lambda: reads.append(1) or read())
    a, five = tok.encode("a")[0], tok.encode("5")[0]
    first = grammar.allowed([[], [a]])  # a drafter's rows, then verification's over the same paths and one more
    again = grammar.allowed([[], [a], [a, five]])
    assert len(reads) == 3 and torch.equal(first, again[:2])
    grammar.advance(a)  # the output grew: the rows after it are read anew
    assert allowed_text(tok, grammar.allowed([[]])[0]) == set("0123456789") and len(reads) == 4


def test_the_bit_mask_reads_as_llguidances_own_byte_mask(tok) -> None:
    grammar = Grammar.start(StructuredOutputsParams(json={"type": "object"}), tok, TINY_VOCAB)
    grammar.advance(tok.encode("{")[0])
    bytes_mask = torch.tensor(list(grammar.matcher.compute_logit_bias())) > 0
    assert torch.equal(grammar.allowed([[]])[0], bytes_mask)
    assert 1 < int(bytes_mask.sum()) < TINY_VOCAB


def test_a_finished_text_allows_only_the_models_stop_tokens(tok) -> None:
    grammar = Grammar.start(StructuredOutputsParams(choice=["yes", "no"]), tok, TINY_VOCAB)
    for token in tok.encode("no"):
        grammar.advance(token)
    assert grammar.allowed([[]])[0].nonzero().flatten().tolist() == sorted(tok.stop_ids)


def test_a_token_outside_the_text_is_an_error_not_a_silent_skip(tok) -> None:
    grammar = Grammar.start(PAIRS, tok, TINY_VOCAB)
    with pytest.raises(ForerunError, match="does not continue the structured output"):
        grammar.advance(tok.encode("7")[0])


def test_a_grammar_that_runs_into_llguidances_limits_mid_answer_says_so_in_one_line(tok) -> None:
    import llguidance

    lark = "start: " + " | ".join(f'"option {i}"' for i in range(50))
    limits = llguidance.LLParserLimits(max_items_in_row=10)  # a row of 51 items is past it
    matcher = llguidance.LLMatcher(grammar_module._token_table(tok, TINY_VOCAB), lark, log_level=0, limits=limits)
    grammar = Grammar(matcher, TINY_VOCAB)
    with pytest.raises(ForerunError, match=r"^token \d+ does not continue the structured output: .*max is 10") as err:
        for token in tok.encode("option 1"):
            grammar.allowed([[]])
            grammar.advance(token)
    assert "\n" not in str(err.value)  # the reason's first line, not the parser's state


def test_min_tokens_holds_stop_tokens_off_only_while_the_text_has_more_to_say(tok) -> None:
    spec = StructuredOutputsParams(choice=["ok"])
    params = SamplingParams(min_tokens=5, structured_outputs=spec)
    grammar = Grammar.start(spec, tok, TINY_VOCAB)
    o, k = tok.encode("ok")
    logits = adjusted(torch.zeros(3, TINY_VOCAB), params, [], [[], [o], [o, k]], (), tok.stop_ids, grammar)
    finite = [row.isfinite().nonzero().flatten().tolist() for row in logits]
    assert finite[:2] == [[o], [k]]
    assert finite[2] == sorted(tok.stop_ids)  # "ok" is whole: it ends, min_tokens or not


# --- the text follows it ----------------------------------------------------------------------------


def test_greedy_and_sampled_texts_follow_the_regex_and_end(target4, tok) -> None:
    for params in (SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, temperature=1.0, seed=3)):
        out = Engine(target4).generate(tok.encode("x"), SamplingParams(**{**vars(params), "structured_outputs": PAIRS}))
        assert re.fullmatch(r"([a-j][0-9]){16}", out.text) and out.finish_reason == "stop"


def test_a_json_schema_gives_json_that_follows_it(target4, tok) -> None:
    schema = {
        "type": "object",
        "properties": {"tag": {"enum": ["red", "blue"]}, "id": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["tag", "id"],
        "additionalProperties": False,
    }
    compact = {tok.encode(c)[0]: -100.0 for c in " \n"}  # the tiny model would pad with whitespace
    params = SamplingParams(max_tokens=60, logit_bias=compact, structured_outputs=StructuredOutputsParams(json=schema))
    out = Engine(target4).generate(tok.encode("x"), params)
    value = json.loads(out.text)
    assert list(value) == ["tag", "id"]  # the schema's order, as OpenAI writes it
    assert isinstance(value["id"], int) and value["tag"] in ("red", "blue")


def test_a_choice_gives_one_of_the_choices_and_without_it_the_text_is_another(target4, tok) -> None:
    choices = ['say "hi"\nthen go', "stay"]
    params = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices))
    out = Engine(target4).generate(tok.encode("x"), params)
    assert out.text in choices and out.finish_reason == "stop"
    assert Engine(target4).generate(tok.encode("x"), SamplingParams(max_tokens=20)).text not in choices


def test_a_model_without_a_tokenizer_is_told_before_any_work() -> None:
    with pytest.raises(ForerunError, match="needs the model's tokenizer"):
        Engine(tiny_model(0)).generate([5, 6], SamplingParams(structured_outputs=PAIRS))


def test_llm_generate_takes_vllms_structured_outputs(target4, tok) -> None:
    llm = LLM(target4)
    params = SamplingParams(max_tokens=8, structured_outputs={"regex": r"[0-9]{3}"})
    (result,) = llm.generate(["x"], params)
    assert re.fullmatch(r"[0-9]{3}", result.outputs[0].text)
    with pytest.raises(FieldError, match="the regex cannot be followed"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(("}))


# --- speculation stays exact ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs_prompt(target4, tok) -> list[int]:
    """Text the model wrote under the grammar itself: its n-grams recur in what it writes next."""
    out = Engine(target4).generate(
        tok.encode("x"), SamplingParams(temperature=1.0, top_k=4, max_tokens=40, seed=2, structured_outputs=PAIRS)
    )
    return tok.encode("x") + out.token_ids[:-1] + tok.encode("\n")


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("setting", SETTINGS, ids=setting_id)
def test_greedy_output_under_a_grammar_is_plain_decodings(target4, pairs_prompt, setting, k) -> None:
    params = SamplingParams(max_tokens=40, structured_outputs=PAIRS)
    plain = Engine(target4).generate(pairs_prompt, params).token_ids
    assert plain != Engine(target4).generate(pairs_prompt, SamplingParams(max_tokens=40)).token_ids  # it matters
    out = Engine(target4, drafters.create(setting[0], target4, setting[1]), k).generate(pairs_prompt, params)
    assert out.token_ids == plain
    # Drafts were kept under the masked rows (early exit's because it drafts inside the grammar too).
    assert 0 < out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens


def test_auto_drafts_the_tokens_a_grammar_forces_and_writes_plain_decodings_text(target4, tok) -> None:
    # A forced tool call: its tags, `{"name": "`, the name once told apart, `", "arguments": {"` and
    # a closed object's keys are each the one continuation the text allows: `auto` drafts them as
    # they are, free, and the target keeps them; the text is plain decoding's.
    flip = {"type": "function", "function": {"name": "flip", "parameters": {"properties": {}}, "strict": True}}
    add = {"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {"enum": [1, 22]}}}}}
    spec = tool_call_grammar(tool_choice([flip, add], "required", False), tok)
    params = SamplingParams(max_tokens=60, structured_outputs=spec)
    prompt = tok.encode("call")
    plain = Engine(target4).generate(prompt, params)
    drafter = drafters.create("auto", target4, {"model": perturbed(target4, 0.5)})
    out = Engine(target4, drafter, 5).generate(prompt, params)
    assert out.token_ids == plain.token_ids and tok.decode(out.token_ids).startswith("<tool_call>")
    assert drafter.steps["grammar"] >= 3 and out.metrics.num_accepted_tokens >= 20
    forced = Grammar.start(spec, tok, TINY_VOCAB).forced()
    assert tok.decode(forced) == '<tool_call>\n{"name": "'  # and no further: the name is a choice


@pytest.mark.parametrize("draft_vocab", [None, 60])
def test_a_draft_models_drafts_stay_inside_the_grammar_and_are_kept_more(target4, pairs_prompt, draft_vocab) -> None:
    params = SamplingParams(max_tokens=40, structured_outputs=PAIRS)
    plain = Engine(target4).generate(pairs_prompt, params).token_ids
    kept = []
    for masked in (True, False):
        options = {"model": perturbed(target4, 0.5), **({"draft_vocab": draft_vocab} if draft_vocab else {})}
        drafter = drafters.create("draft", target4, options)
        if not masked:
            drafter.follow = lambda grammar: None  # drafts from the draft model's own distribution
        out = Engine(target4, drafter, 3).generate(pairs_prompt, params)
        assert out.token_ids == plain
        kept.append(out.metrics.num_accepted_tokens)
    assert kept[0] >= 10 and kept[0] > 3 * kept[1], kept


def test_a_seeded_sample_under_a_grammar_is_plain_decodings_whatever_is_drafted(target4, pairs_prompt) -> None:
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40, structured_outputs=PAIRS)
    plain = Engine(target4).generate(pairs_prompt, params).token_ids
    for name, options in (("draft", {"model": perturbed(target4, 0.5)}), ("early-exit", {"layer": 2}), ("ngram", {})):
        engine = Engine(target4, drafters.create(name, target4, options), 3)
        assert engine.generate(pairs_prompt, params).token_ids == plain


# Wide and narrow positions in turn: the 2nd token from k-t, the 3rd from a-t (verified at a draft's row).
SAMPLED = SamplingParams(
    temperature=1.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"([a-t][k-t]){4}")
)


@pytest.fixture(scope="module")
def sampled_case(tok) -> tuple[LoadedModel, list[int], torch.Tensor, torch.Tensor]:
    target = tiny_model(0, tokenizer=tok, name="target2", num_layers=2)
    long = StructuredOutputsParams(regex=r"([a-t][k-t]){60}")
    out = Engine(target).generate(
        tok.encode("x"), SamplingParams(temperature=1.0, max_tokens=120, seed=1, structured_outputs=long)
    )
    prompt = tok.encode("x") + out.token_ids
    start = lambda: Grammar.start(SAMPLED.structured_outputs, tok, TINY_VOCAB)  # noqa: E731
    return (target, prompt, *exact_adjusted_marginals(target, prompt, SAMPLED, start))


def grammar_samples(case, tok, setting, runs: int):
    target, prompt = case[:2]
    start = lambda: Grammar.start(SAMPLED.structured_outputs, tok, TINY_VOCAB)  # noqa: E731
    options = {"model": perturbed(target, 0.2)} if setting[0] == "draft" else setting[1]
    drafter = drafters.create(setting[0], target, options)
    return speculative_samples(target, drafter, 2, prompt, runs, SAMPLED, start)


def test_forced_tokens_lead_the_draft_and_a_copied_text_goes_on_past_them(target4, tok) -> None:
    spec = StructuredOutputsParams(regex=r"(abcdefghij[0-9]){5}")
    grammar = Grammar.start(spec, tok, TINY_VOCAB)
    output = tok.encode("abcdefghij1abcdefghij2")
    for token in output:
        grammar.advance(token)
    drafter = drafters.create("auto", target4, {"model": perturbed(target4, 0.5)})
    context = tok.encode("x") + output
    drafter.start(context, target4.decoder.new_cache(64), 64)
    drafter.follow(grammar)
    forced = tok.encode("abcdefghij")
    assert grammar.forced() == forced and drafter.next_source(context, SamplingParams()) == "grammar"
    short = drafter.propose(context, 4, SamplingParams(), None)
    assert short.tokens == forced[:4] and short.is_chain
    copied = drafter.propose(context, 14, SamplingParams(), None)  # the letters were followed by a digit before
    assert copied.tokens[:10] == forced and len(copied) > 10 and copied.path_to(10)[:10] == list(range(10))
    assert set(tok.decode(copied.tokens[10:11])) <= set("12") and drafter.source == "grammar"


FORCED = SamplingParams(
    temperature=1.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"([a-t]x[k-t]){4}")
)


def test_sampled_tokens_after_forced_drafts_follow_the_masked_distribution(sampled_case, tok) -> None:
    # `auto` drafts the forced "x" after each letter; the token after it is drawn from the row its
    # verification scored: the 3rd token's distribution is the masked one.
    target, prompt = sampled_case[:2]
    start = lambda: Grammar.start(FORCED.structured_outputs, tok, TINY_VOCAB)  # noqa: E731
    second, third = exact_adjusted_marginals(target, prompt, FORCED, start)
    x = tok.encode("x")[0]
    assert float(second[x]) > 0.999  # the 2nd token is forced
    drafter = drafters.create("auto", target, {"model": perturbed(target, 0.2)})
    samples, metrics = speculative_samples(target, drafter, 2, prompt, RUNS, FORCED, start)
    assert all(s[0] == x for s in samples)
    tv, tolerance = total_variation([s[1] for s in samples], third)
    assert tv < tolerance, f"token 3: TV {tv:.4f} >= {tolerance:.4f}"
    # One step a run: the forced "x" kept, the 3rd token drawn from the row after it.
    assert drafter.steps["grammar"] == metrics.num_drafts == metrics.num_accepted_tokens == RUNS


@pytest.mark.parametrize("setting", [*ONE_EACH_SAMPLING, ("draft", {})], ids=setting_id)
def test_sampled_tokens_follow_the_masked_distribution(sampled_case, tok, setting) -> None:
    second, third = sampled_case[2:]
    samples, metrics = grammar_samples(sampled_case, tok, setting, RUNS)
    for position, exact in ((0, second), (1, third)):
        tv, tolerance = total_variation([s[position] for s in samples], exact)
        assert tv < tolerance, f"token {position + 2}: TV {tv:.4f} >= {tolerance:.4f}"
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


def test_negative_control_rows_that_miss_their_own_mask_fail_the_same_check(sampled_case, tok, monkeypatch) -> None:
    # Every row narrowed to what the root's position allows (a draft's row for a wide position gets
    # the narrow one): the texts still follow the grammar, and the check fails.
    second, third = sampled_case[2:]
    allowed = Grammar.allowed
    monkeypatch.setattr(Grammar, "allowed", lambda self, paths: (rows := allowed(self, paths)) & rows[:1])
    samples, _ = grammar_samples(sampled_case, tok, ("ngram", {}), CONTROL_RUNS)
    failures = [total_variation([s[i] for s in samples], exact) for i, exact in ((0, second), (1, third))]
    assert any(tv >= tolerance for tv, tolerance in failures)


def test_batched_requests_with_their_own_grammars_equal_each_run_alone(target4, tok, pairs_prompt) -> None:
    requests = [
        (pairs_prompt, SamplingParams(max_tokens=20, structured_outputs=PAIRS)),
        (pairs_prompt, SamplingParams(max_tokens=20)),
        (pairs_prompt, SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[k-t]+"))),
        (pairs_prompt, SamplingParams(temperature=0.8, max_tokens=20, seed=4, structured_outputs=PAIRS)),
    ]
    alone = [Engine(target4).generate(p, params).token_ids for p, params in requests]
    assert len({tuple(tokens) for tokens in alone}) == 4

    def new_engine() -> Engine:
        return Engine(target4, drafters.create("ngram", target4, {}), 3)

    assert run_batched(BatchEngine(new_engine, 4), requests) == alone


def test_the_token_table_and_a_grammars_matcher_are_made_once(tok, monkeypatch) -> None:
    new_template = grammar_module._new_template
    grammar_module._token_table.cache_clear()
    grammar_module._TEMPLATES.clear()
    made = []
    monkeypatch.setattr(grammar_module, "_new_template", lambda *args: made.append(args) or new_template(*args))
    first, second = Grammar.start(PAIRS, tok, TINY_VOCAB), Grammar.start(PAIRS, tok, TINY_VOCAB)
    assert grammar_module._token_table.cache_info().misses == 1 and len(made) == 1
    first.advance(tok.encode("a")[0])  # each output's matcher is its own
    assert allowed_text(tok, second.allowed([[]])[0]) == set("abcdefghij")


# --- the command line ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=2, num_layers=3), tmp_path_factory.mktemp("structured") / "tiny")


@pytest.mark.parametrize(
    "flags, spec",
    [
        (["--regex", "[0-9]{4}"], StructuredOutputsParams(regex="[0-9]{4}")),
        (["--choice", "left", "right"], StructuredOutputsParams(choice=["left", "right"])),
        (["--json-schema", '{"enum": [1, 22]}'], StructuredOutputsParams(json={"enum": [1, 22]})),
        (["--json-schema", "SCHEMA_FILE"], StructuredOutputsParams(json={"enum": [1, 22]})),
        (["--grammar-file", "LARK_FILE"], StructuredOutputsParams(grammar='start: "a" "b"+')),
    ],
)
def test_generate_takes_a_structured_output_and_writes_what_the_api_writes(folder, tmp_path, flags, spec) -> None:
    (tmp_path / "schema.json").write_text('{"enum": [1, 22]}')
    (tmp_path / "g.lark").write_text('start: "a" "b"+')
    files = {"SCHEMA_FILE": str(tmp_path / "schema.json"), "LARK_FILE": str(tmp_path / "g.lark")}
    flags = [files.get(flag, flag) for flag in flags]
    argv = ["generate", "--model", str(folder), "--dtype", "float32", "--prompt", "abc", "--max-tokens", "8"]
    (line,) = _cli([*argv, "--json", *flags, "--speculative-method", "ngram"])
    params = SamplingParams(max_tokens=8, structured_outputs=spec)
    want = LLM(str(folder), dtype="float32").generate("abc", params)[0].outputs[0]
    record = json.loads(line)
    assert record["token_ids"] == want.token_ids and record["text"] == want.text
    assert record["finish_reason"] == "stop" or spec.grammar is not None  # "b"+ may run to max_tokens


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--regex", "(("], "the regex cannot be followed"),
        (["--json-schema", "{oops"], "its text is not JSON"),
        (["--json-schema", "no-such-file.json"], "takes a schema's JSON or a file holding it"),
        (["--grammar-file", "/nonexistent/g.lark"], "--grammar-file: cannot read /nonexistent/g.lark"),
        (["--regex", "a", "--choice", "b"], "not allowed with argument"),
        (["--regex", "a", "--ignore-eos"], "ignore_eos would write past the end"),
    ],
)
def test_generate_names_a_bad_structured_output(folder, argv, message, capsys) -> None:
    base = ["generate", "--model", str(folder), "--dtype", "float32", "--prompt", "abc", "--max-tokens", "4"]
    try:
        code = main([*base, *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code != 0
    assert message in capsys.readouterr().err
