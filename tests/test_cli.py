"""The `forerun` command, run in-process on tiny Hugging Face folders: output records and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.cli import build_parser, handler, main
from forerun.models import decoder as decoder_module
from forerun.models.embedded import EMBEDDED
from forerun.models.testing import save_hf_folder, tiny_model

RECORD_FIELDS = {
    "prompt_index",
    "text",
    "token_ids",
    "num_prompt_tokens",
    "num_generated_tokens",
    "finish_reason",
    "elapsed_s",
    "tokens_per_s",
    "first_token_s",
    "decode_tokens_per_s",
}
SPEC_FIELDS = {
    "num_speculative_tokens",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_emitted_tokens",
    "accepted_per_position",
    "acceptance_rate",
    "mean_accepted_length",
    "efficiency",
    "predicted_mean_accepted_length",
    "draft_seconds",
}


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("FORERUN_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=0), tmp_path_factory.mktemp("cli") / "tiny")


@pytest.fixture(scope="module")
def other_tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny model, but its tokenizer swaps the ids of 'a' and 'b'."""
    folder = save_hf_folder(tiny_model(seed=1), tmp_path_factory.mktemp("cli") / "swapped")
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def generate(capsys, folder: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli(capsys, "generate", "--model", str(folder), "--dtype", "float32", *extra)


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


# --- generate --json --------------------------------------------------------------------------


def test_generate_json_prints_one_record_per_prompt_matching_the_api(capsys, folder: Path) -> None:
    code, out, err = generate(capsys, folder, "--prompt", "hello there", "abc", "--max-tokens", "6", "--json")
    assert code == 0, err
    rows = records(out)
    assert [r["prompt_index"] for r in rows] == [0, 1]
    llm = LLM(str(folder), dtype="float32")
    for row, prompt in zip(rows, ["hello there", "abc"]):
        assert set(row) == RECORD_FIELDS  # no spec object without speculation
        want = llm.generate(prompt, SamplingParams(max_tokens=6))[0]
        assert row["token_ids"] == want.token_ids and row["text"] == want.text
        assert row["num_prompt_tokens"] == len(llm.tokenizer.encode(prompt))
        assert row["num_generated_tokens"] == len(row["token_ids"]) <= 6
        assert row["finish_reason"] == ("length" if len(row["token_ids"]) == 6 else "stop")
        assert row["elapsed_s"] > 0 and row["tokens_per_s"] > 0  # a generation takes time and writes tokens
        assert 0 <= row["first_token_s"] <= row["elapsed_s"]
        # The decode rate counts the tokens after the first over the time after the first.
        decode_s = row["elapsed_s"] - row["first_token_s"]
        if row["num_generated_tokens"] > 1 and decode_s > 0.005:  # both times are rounded to 0.1 ms
            assert row["decode_tokens_per_s"] == pytest.approx((row["num_generated_tokens"] - 1) / decode_s, rel=0.05)


def test_generate_reads_prompts_file_with_prompt_and_turns_records(capsys, folder: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "first", "id": 7}) + "\n\n" + json.dumps({"turns": ["second one", "a follow-up"]}) + "\n"
    )
    code, out, err = generate(
        capsys,
        folder,
        "--prompt",
        "zero",
        "--prompts-file",
        str(prompts),
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--json",
    )
    assert code == 0, err
    rows = records(out)
    assert [r["prompt_index"] for r in rows] == [0, 1, 2]
    assert [r["num_prompt_tokens"] for r in rows] == [len("zero"), len("first"), len("second one")]  # 1 char, 1 token
    assert all(r["num_generated_tokens"] == 4 and r["finish_reason"] == "length" for r in rows)


def test_generate_chat_wraps_the_prompt_in_the_chat_template(capsys, folder: Path) -> None:
    code, out, err = generate(capsys, folder, "--prompt", "hi", "--chat", "--max-tokens", "3", "--json")
    assert code == 0, err
    (row,) = records(out)
    wrapped = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert row["num_prompt_tokens"] == len(wrapped) - 2 * len("<|im_start|>") - len("<|im_end|>") + 3


def test_speculative_json_has_spec_counters_and_the_plain_tokens(capsys, folder: Path) -> None:
    args = ("--prompt", "speculate", "--max-tokens", "12", "--ignore-eos", "--json")
    code, plain_out, err = generate(capsys, folder, *args)
    assert code == 0, err
    # Fixed K: a draft that is the target itself costs a pass per token, so the adaptive policy
    # would (rightly) stop drafting; this test is about the counters. Chains: no second-choice leaves.
    code, spec_out, err = generate(
        capsys,
        folder,
        *args,
        "--speculative-model",
        str(folder),
        "--num-speculative-tokens",
        "3",
        "--speculative-k-policy",
        "fixed",
        "--draft-second-choice",
        "2",
    )
    assert code == 0, err
    (plain,), (spec_row,) = records(plain_out), records(spec_out)
    assert set(spec_row) == RECORD_FIELDS | {"spec"}
    assert spec_row["token_ids"] == plain["token_ids"]  # greedy speculation is exact
    spec = spec_row["spec"]
    assert set(spec) == SPEC_FIELDS
    assert spec["num_speculative_tokens"] == 3 and len(spec["accepted_per_position"]) == 3
    assert spec["num_emitted_tokens"] == spec_row["num_generated_tokens"] == 12
    assert spec["num_accepted_tokens"] == sum(spec["accepted_per_position"])
    assert 0 < spec["num_draft_tokens"] <= 3 * spec["num_drafts"]
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"], abs=1e-4)
    # The draft is the target itself: nearly every draft token is kept, several tokens per pass.
    assert spec["acceptance_rate"] >= 0.8 and spec["mean_accepted_length"] > 2
    assert 0 < spec["efficiency"] <= 1 and 1 <= spec["predicted_mean_accepted_length"] <= 4


def test_kv_cache_dtype_reaches_the_target_and_the_draft_model(capsys, folder: Path, monkeypatch) -> None:
    made: list[torch.dtype] = []  # every cache's dtype, as the decoders make them
    real = decoder_module.KVCache
    monkeypatch.setattr(decoder_module, "KVCache", lambda *a: made.append(a[5]) or real(*a))
    args = ("--prompt", "speculate", "--max-tokens", "8", "--ignore-eos", "--json")
    code, plain_out, err = generate(capsys, folder, *args)
    assert code == 0, err
    assert set(made) == {torch.float32}  # auto on the PyTorch path: the activations' dtype
    made.clear()
    code, half_out, err = generate(capsys, folder, *args, "--kv-cache-dtype", "float16")
    assert code == 0, err
    assert set(made) == {torch.float16}
    made.clear()
    draft = ("--speculative-model", str(folder), "--num-speculative-tokens", "3", "--speculative-k-policy", "fixed")
    code, spec_out, err = generate(capsys, folder, *args, "--kv-cache-dtype", "float16", *draft)
    assert code == 0, err
    assert set(made) == {torch.float16} and len(made) >= 2  # the target's caches and the draft model's
    assert records(spec_out)[0]["token_ids"] == records(half_out)[0]["token_ids"]  # greedy speculation is exact


def test_generate_without_json_streams_text_and_summarises_on_stderr(capsys, folder: Path) -> None:
    code, out, err = generate(
        capsys,
        folder,
        "--prompt",
        "stream me",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--speculative-model",
        str(folder),
        "--num-speculative-tokens",
        "2",
    )
    assert code == 0, err
    want = LLM(str(folder), dtype="float32").generate("stream me", SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out == want.text + "\n"
    assert "[5 tokens in" in err and "finish: length" in err and "K=2" in err


# --- models -----------------------------------------------------------------------------------


def test_models_list_json_prints_one_row_per_embedded_model(capsys, home: Path) -> None:
    code, out, err = run_cli(capsys, "models", "list", "--json")
    assert code == 0, err
    rows = records(out)
    assert [r["name"] for r in rows] == list(EMBEDDED)
    for row in rows:
        model = EMBEDDED[row["name"]]
        assert row == {
            "name": model.name,
            "role": model.role,
            "path": str(home / "models" / model.filename),
            "bytes": model.size,
            "sha256": model.sha256,
            "fetched": False,
        }


def test_models_list_plain_names_every_model_and_its_state(capsys) -> None:
    code, out, _ = run_cli(capsys, "models", "list")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == len(EMBEDDED) and all("not fetched" in line for line in lines)


def test_models_fetch_unknown_name_exits_2_naming_the_known_ones(capsys) -> None:
    code, out, err = run_cli(capsys, "models", "fetch", "nope")
    assert code == 2 and out == ""
    assert "'nope'" in err and all(name in err for name in EMBEDDED)


# --- bad input: exit code 2 and one clear line on stderr --------------------------------------


def assert_user_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.startswith("error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def test_unknown_model_name_exits_2(capsys) -> None:
    code, out, err = run_cli(capsys, "generate", "--model", "no-such-model", "--prompt", "x")
    assert_user_error(code, err, "'no-such-model'", *EMBEDDED)
    assert out == ""


def test_prompts_file_line_without_prompt_or_turns_names_the_line(capsys, folder: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n\n" + json.dumps({"text": "no prompt"}) + "\n")
    code, out, err = generate(capsys, folder, "--prompts-file", str(prompts), "--json")
    assert_user_error(code, err, "line 3", "'prompt'", "'turns'")
    assert out == ""


def test_prompts_file_with_invalid_json_or_missing_file_exits_2(capsys, folder: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": \n')
    assert_user_error(*generate(capsys, folder, "--prompts-file", str(prompts))[::2], "line 2", "not valid JSON")
    assert_user_error(*generate(capsys, folder, "--prompts-file", str(tmp_path / "none.jsonl"))[::2], "does not exist")
    prompts.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    assert_user_error(*generate(capsys, folder, "--prompts-file", str(prompts))[::2], "not UTF-8")
    assert_user_error(*generate(capsys, folder, "--prompts-file", str(tmp_path))[::2], "is a folder", ".jsonl")


def test_a_prompts_file_with_a_byte_order_mark_is_read(capsys, folder: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "bom.jsonl"
    prompts.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "ab"}).encode() + b"\n")
    code, out, _ = generate(capsys, folder, "--prompts-file", str(prompts), "--json", "--max-tokens", "2")
    assert code == 0 and json.loads(out.splitlines()[0])["num_generated_tokens"] >= 1


def test_a_prompt_that_is_not_valid_unicode_exits_2_naming_the_character(capsys, folder: Path, tmp_path: Path) -> None:
    # A shell passes bytes that are not UTF-8 to Python as lone surrogates; a JSON file may escape one.
    assert_user_error(*generate(capsys, folder, "--prompt", "ab\udcff")[::2], "not valid Unicode", "character 2")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "\\ud800"}\n')
    assert_user_error(*generate(capsys, folder, "--prompts-file", str(prompts))[::2], "not valid Unicode")
    llm = LLM(str(folder), dtype="float32")  # the API's prompts and messages too
    with pytest.raises(ForerunError, match="not valid Unicode"):
        llm.generate("ab\udcff")
    with pytest.raises(ForerunError, match="not valid Unicode"):
        llm.chat([{"role": "user", "content": "ab\udcff"}])


def test_a_draft_vocabulary_below_one_token_exits_2_before_loading(capsys, folder: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(folder), "--speculative-model", str(folder), "--draft-vocab", "0"])
    assert exit_info.value.code == 2
    assert "--draft-vocab: must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ForerunError, match="--draft-vocab must be at least 1 token"):  # the API's
        LLM(str(folder), dtype="float32", speculative_model=str(folder), speculative_options={"draft_vocab": 0})


def test_an_unknown_speculative_method_exits_2_before_loading_naming_the_known_ones(
    capsys, folder: Path, monkeypatch
) -> None:
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    code, out, err = generate(capsys, folder, "--prompt", "x", "--speculative-method", "bogus")
    assert_user_error(code, err, "'bogus'", "ngram", "eagle", "auto")


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--speculative-head", "heads/eagle"], ["--speculative-head is a flag of", "eagle", "no speculative method"]),
        (
            ["--speculative-method", "ngram", "--speculative-head", "h"],
            ["--speculative-head", "--speculative-method ngram does not use it"],
        ),
        (["--draft-vocab", "100"], ["--draft-vocab is a flag of --speculative-method auto or draft"]),
        (["--speculative-quantization", "q4_0"], ["--speculative-quantization is a flag of"]),
        (["--speculative-method", "suffix", "--lookahead-window", "5"], ["--lookahead-window", "suffix does not"]),
        (["--speculative-method", "eagle", "--medusa-choices", "[[0]]"], ["--medusa-choices", "eagle does not"]),
        (["--speculative-model", ""], ["--speculative-model is empty"]),
    ],
)
def test_a_drafter_flag_the_method_in_use_does_not_take_exits_2_before_loading(
    capsys, folder: Path, monkeypatch, flags, needles
) -> None:
    """Not silently dropped: the run it names is not the run it would get."""
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    assert_user_error(*generate(capsys, folder, "--prompt", "x", *flags)[::2], *needles)


def test_drafter_flags_at_their_defaults_or_of_the_method_in_use_are_taken(capsys, folder: Path) -> None:
    code, _, err = generate(capsys, folder, "--prompt", "x", "--max-tokens", "2", "--lookahead-window", "4")
    assert code == 0, err  # its default: not a flag given
    flags = ["--speculative-method", "lookahead", "--lookahead-window", "5", "--max-tokens", "2"]
    code, _, err = generate(capsys, folder, "--prompt", "x", *flags)
    assert code == 0, err


def test_negative_temperature_names_temperature(capsys, folder: Path) -> None:
    code, out, err = generate(capsys, folder, "--prompt", "x", "--temperature", "-1")
    assert_user_error(code, err, "temperature", "-1")
    assert out == ""


def test_prompt_plus_max_tokens_beyond_context_exits_2_before_generating(capsys, folder: Path) -> None:
    code, out, err = generate(capsys, folder, "--prompt", "0123456789", "--max-tokens", "1015", "--json")
    assert_user_error(code, err, "10 tokens", "1015", "1025", "1024")
    assert out == ""


def test_speculative_tokens_below_one_exits_2(capsys, folder: Path) -> None:
    code, _, err = generate(
        capsys, folder, "--prompt", "x", "--speculative-model", str(folder), "--num-speculative-tokens", "0"
    )
    assert_user_error(code, err, "num_speculative_tokens", "0")


def test_draft_with_a_different_tokenizer_names_the_first_differing_id(
    capsys, folder: Path, other_tokenizer_folder: Path
) -> None:
    from transformers import AutoTokenizer

    a_id = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("a")
    code, out, err = generate(capsys, folder, "--prompt", "x", "--speculative-model", str(other_tokenizer_folder))
    assert_user_error(code, err, f"id {a_id}", "'a'", "'b'")
    assert out == ""


def test_no_prompt_exits_2(capsys, folder: Path) -> None:
    assert_user_error(*generate(capsys, folder)[::2], "no prompt given")


def test_malformed_flags_exit_2_through_argparse(capsys, folder: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(folder), "--temperature", "hot"])
    assert exit_info.value.code == 2
    assert "--temperature" in capsys.readouterr().err


def test_serve_with_ray_goes_to_the_cluster_and_without_it_to_one_engine() -> None:
    from forerun.cluster.app import run_cluster
    from forerun.commands import serve

    parser = build_parser()
    assert handler(parser.parse_args(["serve", "--model", "m", "--ray"])) is run_cluster
    assert handler(parser.parse_args(["serve", "--model", "m"])) is serve.run
    assert handler(parser.parse_args(["models", "list"])) is not run_cluster
