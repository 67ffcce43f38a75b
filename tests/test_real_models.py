"""The embedded real models: parity with transformers, stop tokens, and exact greedy speculation.

Every test here is `real`: it reads the embedded GGUF files (fetched once, then cached). Models are
loaded once per test class (class-scoped fixtures), so the float32 parity models are freed before
the bf16 pair is loaded. Outputs are short to keep the file within a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from forerun.api import LLM
from forerun.base.config import SamplingParams, StructuredOutputsParams
from forerun.base.tools import CallReader, tool_choice
from forerun.models.embedded import EMBEDDED
from forerun.models.fetch import model_file
from forerun.models.load import LoadedModel, load_model
from forerun.verification.grammar import tool_call_grammar

pytestmark = pytest.mark.real

DRAFT, TARGET = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
IM_END, END_OF_TEXT = 151645, 151643

# float32 on both sides over the same dequantized weights: only the order of float operations can
# differ. Measured on a 2-core AMD EPYC: bit-identical (0.0). Logits reach magnitudes of ~30, and a
# different kernel order moves them by ~1e-4 relative; 2e-2 allows for that, not for a real bug.
LOGIT_ATOL = 2e-2
# bf16 keeps ~3 significant digits: logits of magnitude ~20 carry rounding of ~0.1 per pass, and a
# verification pass over K+1 rows rounds differently from a one-row pass. Two candidates closer than
# this are a tie the target cannot break reliably in bf16; anything wider must never flip.
NEAR_TIE = 0.5

PARITY_PROMPTS = [
    "Write a Python function that reverses a string.",
    "What does the `yield` keyword do in Python? Answer in one sentence.",
    "Fix the bug: def add(a, b): return a - b",
]
PAIR_PROMPTS = [
    "Write a Python function is_palindrome(s) that ignores case.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that counts the rows of the table users.",
]
PAIR_MAX_TOKENS = 20


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def transformers_reference(name: str, dtype: torch.dtype):
    """transformers' own GGUF loading and modelling code on the same file: an independent reference."""
    from transformers import AutoModelForCausalLM

    path = model_file(EMBEDDED[name])
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def target_logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """One plain forward over `ids` from an empty cache: [T, vocab] float32."""
    decoder = model.decoder
    return decoder(torch.tensor(ids), torch.arange(len(ids)), decoder.new_cache(len(ids))).logits[0]


@pytest.fixture(scope="module", autouse=True)
def every_core():
    """conftest pins torch to one thread, right for tiny models; real ones want every core we have."""
    before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    yield
    torch.set_num_threads(before)


# Class scope: each class loads its models once and frees them when its tests are done, so the
# float32 parity models and the bf16 pair never sit in memory together.
@pytest.fixture(scope="class")
def llm() -> LLM:
    return LLM(DRAFT, dtype="float32")


@pytest.fixture(scope="class")
def reference():
    return transformers_reference(DRAFT, torch.float32)


@pytest.fixture(scope="class")
def prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.apply_chat(chat(p)) for p in PARITY_PROMPTS]


@pytest.fixture(scope="class")
def target() -> LoadedModel:
    return load_model(TARGET, "bfloat16")


@pytest.fixture(scope="class")
def draft() -> LoadedModel:
    return load_model(DRAFT, "bfloat16")


def test_the_real_tokenizer_streams_the_text_a_whole_decode_gives() -> None:
    # Text a token at a time (what a generation does after every token) against a whole decode of
    # the same ids: never more, never different; behind it only while a character is incomplete.
    from forerun.models.load import load_tokenizer_of

    tok = load_tokenizer_of(TARGET)
    gen = torch.Generator().manual_seed(0)
    lists = [
        tok.encode(text) for text in ("héllo wörld 日本語のテキスト 😀🎉 ñ", "def f(x):\n    return x ** 2  # ✓\n")
    ]
    lists.append(torch.randint(0, 151_643, (400,), generator=gen).tolist() + [IM_END, 9707, END_OF_TEXT, 11])
    for ids in lists:
        stream, text = tok.stream(), ""
        assert stream is not None
        for n, token in enumerate(ids, 1):
            text += stream.step(token)
            whole = tok.decode(ids[:n])
            assert whole.startswith(text) and (text == whole or whole.endswith("\ufffd")), n
        assert text == tok.decode(ids) or tok.decode(ids).endswith("\ufffd")


class TestDraftParityWithTransformers:
    """The 0.5B draft in float32 against transformers on the same GGUF file."""

    def test_stop_ids_hold_end_of_turn_and_end_of_text(self, llm: LLM) -> None:
        tok = llm.tokenizer
        assert {IM_END, END_OF_TEXT} <= tok.stop_ids
        assert tok.hf.convert_ids_to_tokens([IM_END, END_OF_TEXT]) == ["<|im_end|>", "<|endoftext|>"]

    def test_chat_template_is_qwen_chatml(self, llm: LLM, prompts: list[list[int]]) -> None:
        text = llm.tokenizer.hf.decode(prompts[0])
        assert "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n" in text
        assert text.endswith("<|im_start|>assistant\n")

    def test_logits_match_transformers(self, llm: LLM, reference, prompts: list[list[int]]) -> None:
        for ids in prompts:
            ours = target_logits(llm.target, ids)  # [T, vocab]
            with torch.inference_mode():
                theirs = reference(torch.tensor([ids])).logits[0].float()  # [T, vocab]
            diff = (ours - theirs).abs().max().item()
            print(f"max |logit difference| over {len(ids)} positions: {diff:.2e}")
            assert diff < LOGIT_ATOL
            assert torch.equal(ours.argmax(-1), theirs.argmax(-1))

    def test_greedy_32_tokens_match_transformers_generate(self, llm: LLM, reference, prompts: list[list[int]]) -> None:
        stops = sorted(llm.tokenizer.stop_ids)
        for ids in prompts[:2]:
            ours = llm.generate(ids, SamplingParams(max_tokens=32))[0].token_ids
            with torch.inference_mode():
                out = reference.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=32,
                    do_sample=False,
                    eos_token_id=stops,
                    pad_token_id=END_OF_TEXT,
                )
            theirs = out[0, len(ids) :].tolist()
            assert ours == theirs, llm.tokenizer.decode(ours) + " | " + llm.tokenizer.decode(theirs)

    def test_generation_ends_at_the_end_of_turn_token(self, llm: LLM) -> None:
        result = llm.chat(chat("Reply with only the word yes."), SamplingParams(max_tokens=16))[0]
        assert result.finish_reason == "stop"
        assert result.token_ids[-1] in (IM_END, END_OF_TEXT)
        assert "yes" in result.text.lower() and "<|im_end|>" not in result.text


class TestSpeculativePairIsExact:
    """Target 1.5B with the 0.5B draft, both bf16, K=4, greedy: the output is the target's own."""

    def test_speculative_output_equals_plain_or_parts_only_at_a_near_tie(
        self, target: LoadedModel, draft: LoadedModel, capsys, record_property
    ) -> None:
        plain = LLM(target)
        # Fixed K: every step drafts, so the acceptance below is the draft's, not the cost policy's choice.
        spec = LLM(target, speculative_model=draft, num_speculative_tokens=4, speculative_k_policy="fixed")
        params = SamplingParams(max_tokens=PAIR_MAX_TOKENS)
        identical, accepted, drafted, report = 0, 0, 0, []
        for text in PAIR_PROMPTS:
            ids = target.tokenizer.apply_chat(chat(text))
            start = time.perf_counter()
            want = plain.generate(ids, params)[0]
            mid = time.perf_counter()
            got = spec.generate(ids, params)[0]
            end = time.perf_counter()
            accepted += got.metrics.num_accepted_tokens
            drafted += got.metrics.num_draft_tokens
            line = (
                f"{text[:40]!r}: plain {len(want.token_ids)} tok {mid - start:.1f}s, "
                f"spec {end - mid:.1f}s, acceptance {got.metrics.acceptance_rate:.2f}"
            )
            if got.token_ids == want.token_ids:
                identical += 1
                report.append(line + ", identical")
                continue
            i = next(
                (j for j, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b),
                min(len(want.token_ids), len(got.token_ids)),
            )
            assert i < min(len(want.token_ids), len(got.token_ids)), "one output is a prefix of the other"
            logits = target_logits(target, ids + want.token_ids[:i])[-1]  # [vocab]
            top = logits.topk(2)
            gap = float(top.values[0] - top.values[1])
            report.append(line + f", first differs at {i}: gap {gap:.3f} between {top.indices.tolist()}")
            assert {want.token_ids[i], got.token_ids[i]} == set(top.indices.tolist()), report[-1]
            assert gap < NEAR_TIE, report[-1]
        assert identical >= 1, report  # bf16 rows may part at a near tie, but not on every prompt
        fraction = identical / len(PAIR_PROMPTS)
        record_property("identical_fraction", fraction)
        with capsys.disabled():
            print(
                f"\nspeculative (K=4, bf16) vs plain greedy: {identical}/{len(PAIR_PROMPTS)} fully identical; "
                f"acceptance {accepted}/{drafted}"
            )
            for line in report:
                print("  " + line)
        # A same-family draft on code prompts keeps most of its guesses; near zero means it is broken.
        assert drafted and accepted / drafted > 0.3


@pytest.fixture(scope="class")
def target_w8a8() -> LoadedModel:
    return load_model(TARGET, "bfloat16", quantization="w8a8")


@pytest.fixture(scope="class")
def draft_w8a8() -> LoadedModel:
    return load_model(DRAFT, "bfloat16", quantization="w8a8")


# Every drafter, each at a fixed K so every step verifies a draft (an adaptive K of 0 would make
# equality trivial); the draft model also with its reduced vocabulary.
W8A8_METHODS = [
    ("auto", {}),
    ("draft", {"draft_vocab": 32768}),
    ("suffix", {"min_match": 1}),
    ("ngram", {}),
    ("early-exit", {}),
    ("lookahead", {}),
]
W8A8_MAX_TOKENS = 32


def every_drafter_reproduces_plain(target: LoadedModel, draft: LoadedModel, label: str, capsys) -> None:
    """Every drafter at a fixed K over the pair: greedy output equal to plain token for token."""
    params = SamplingParams(max_tokens=W8A8_MAX_TOKENS)
    prompts = [target.tokenizer.apply_chat(chat(text)) for text in PAIR_PROMPTS]
    plain = LLM(target)
    want = [plain.generate(ids, params)[0].token_ids for ids in prompts]
    report, totals = [], [0, 0]
    for method, options in W8A8_METHODS:
        uses_draft = method in ("auto", "draft")
        spec = LLM(
            target,
            speculative_model=draft if uses_draft else None,
            speculative_method=method,
            speculative_options=options,
            num_speculative_tokens=3,
            speculative_k_policy="fixed",
        )
        drafted = accepted = 0
        for ids, expected in zip(prompts, want):
            got = spec.generate(ids, params)[0]
            assert got.token_ids == expected, (
                method,
                spec.tokenizer.decode(got.token_ids),
                spec.tokenizer.decode(expected),
            )
            drafted += got.metrics.num_draft_tokens
            accepted += got.metrics.num_accepted_tokens
        report.append(f"{method}: {accepted}/{drafted} draft tokens kept")
        assert drafted > 0, report[-1]
        totals[0] += drafted
        totals[1] += accepted
    with capsys.disabled():
        print(f"\n{label} pair, greedy, every drafter identical to plain: " + "; ".join(report))
    # Drafts were kept and rejected: verifications of many row counts and paths were compared.
    assert totals[0] > totals[1] > 0


class TestW8A8PairIsBitExact:
    """Target and draft in w8a8: a verified row's logits are bit-identical to one-row decoding's, so
    every drafter's greedy output equals plain greedy output token for token, no near-tie excuse."""

    def test_every_drafter_reproduces_plain_greedy_output_exactly(
        self, target_w8a8: LoadedModel, draft_w8a8: LoadedModel, capsys
    ) -> None:
        every_drafter_reproduces_plain(target_w8a8, draft_w8a8, "w8a8", capsys)


@pytest.fixture(scope="class")
def target_gguf() -> LoadedModel:
    return load_model(TARGET, quantization="gguf")


@pytest.fixture(scope="class")
def draft_gguf() -> LoadedModel:
    return load_model(DRAFT, quantization="gguf")


class TestGGUFPairIsBitExact:
    """Target and draft computed from the files' own blocks (Q4_K, Q6_K, Q5_0, Q8_0) by the native
    kernels and layers: a verified row is bit-identical to one-row decoding's, so every drafter's greedy
    output equals plain greedy output token for token."""

    def test_every_drafter_reproduces_plain_greedy_output_exactly(
        self, target_gguf: LoadedModel, draft_gguf: LoadedModel, capsys
    ) -> None:
        from forerun.models.gguf_format import GGUFLinear

        assert isinstance(target_gguf.decoder.lm_head, GGUFLinear) and target_gguf.decoder._native_layers()
        every_drafter_reproduces_plain(target_gguf, draft_gguf, "gguf", capsys)

    def test_a_json_schema_answer_follows_it_and_speculation_writes_the_same(
        self, target_gguf: LoadedModel, draft_gguf: LoadedModel, capsys
    ) -> None:
        schema = {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        }
        params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
        ids = target_gguf.tokenizer.apply_chat(chat("Describe a person, their name and age, as JSON."))
        plain = LLM(target_gguf).generate(ids, params)[0].outputs[0]
        value = json.loads(plain.text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and plain.finish_reason == "stop"
        report = []
        for method in ("auto", "suffix"):
            spec = LLM(
                target_gguf,
                speculative_model=draft_gguf if method == "auto" else None,
                speculative_method=method,
                num_speculative_tokens=3,
                speculative_k_policy="fixed",
            )
            got = spec.generate(ids, params)[0]
            assert got.token_ids == plain.token_ids, (method, got.outputs[0].text, plain.text)
            report.append(f"{method}: {got.metrics.num_accepted_tokens}/{got.metrics.num_draft_tokens} kept")
        with capsys.disabled():
            print(f"\ngguf pair, a JSON schema, {plain.text!r}: " + "; ".join(report))

    def test_a_forced_tool_call_names_its_arguments_and_speculation_writes_the_same(
        self, target_gguf: LoadedModel, draft_gguf: LoadedModel, capsys
    ) -> None:
        weather = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"],
                },
            },
        }
        choice = tool_choice([weather], {"type": "function", "function": {"name": "get_weather"}})
        params = SamplingParams(max_tokens=40, structured_outputs=tool_call_grammar(choice, target_gguf.tokenizer))
        messages = chat("What's the weather in Paris, in celsius?")
        plain = LLM(target_gguf).chat(messages, params, tools=[weather])[0]
        reader = CallReader()
        content, calls = reader.feed(plain.outputs[0].text)
        assert content + reader.finish()[0] == "" and [c.name for c in calls] == ["get_weather"], plain.outputs[0].text
        assert json.loads(calls[0].arguments)["city"] == "Paris" and plain.outputs[0].finish_reason == "stop"
        spec = LLM(target_gguf, speculative_model=draft_gguf, num_speculative_tokens=3, speculative_k_policy="fixed")
        got = spec.chat(messages, params, tools=[weather])[0]
        assert got.token_ids == plain.token_ids, (got.outputs[0].text, plain.outputs[0].text)
        # auto: the model answers with the call's JSON in a ```json block, which reads as the call
        free = LLM(target_gguf).chat(messages, SamplingParams(max_tokens=40), tools=[weather])[0].outputs[0].text
        reader = CallReader(["get_weather"])
        text, first = reader.feed(free)
        rest, last = reader.finish()
        assert text + rest == "" and [json.loads(c.arguments)["city"] for c in first + last] == ["Paris"], free
        with capsys.disabled():
            kept = f"{got.metrics.num_accepted_tokens}/{got.metrics.num_draft_tokens}"
            print(f"\ngguf pair, a forced tool call, {calls[0].arguments}: {kept} drafts kept")

    def test_the_coder_fills_in_a_gap_and_speculation_writes_the_same(
        self, target_gguf: LoadedModel, draft_gguf: LoadedModel, capsys
    ) -> None:
        prefix = "import json\n\n\ndef load(path):\n    with open(path) as f:\n"
        ids = target_gguf.tokenizer.infill(prefix, "\n    return data\n")
        assert target_gguf.tokenizer.infill_markers == (151659, 151661, 151660)  # <|fim_prefix|>, suffix, middle
        params = SamplingParams(max_tokens=24)
        plain = LLM(target_gguf).generate(ids, params)[0].outputs[0]
        assert "json.load(f)" in plain.text and "return data" not in plain.text, plain.text
        assert plain.finish_reason == "stop"
        spec = LLM(target_gguf, speculative_model=draft_gguf, num_speculative_tokens=3, speculative_k_policy="fixed")
        got = spec.generate(ids, params)[0]
        assert got.token_ids == plain.token_ids, (got.outputs[0].text, plain.text)
        with capsys.disabled():
            kept = f"{got.metrics.num_accepted_tokens}/{got.metrics.num_draft_tokens}"
            print(f"\ngguf pair, a filled-in gap, {plain.text!r}: {kept} drafts kept")
