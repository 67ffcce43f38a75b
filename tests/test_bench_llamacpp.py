"""The llama.cpp peer without llama.cpp: missing or failing builds become notes, the command lines it
would run, the answers it parses, and a whole bench against a stand-in llama-server; plus the
decode-rate figures every contender gets."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from forerun.base.config import SamplingParams
from forerun.bench.contenders import decode_rate
from forerun.bench.llamacpp import (
    LLAMA_DRAFT,
    LLAMA_METHODS,
    LLAMA_NGRAM,
    LLAMA_PLAIN,
    LlamaCppUnavailable,
    peer,
    repack,
)
from forerun.bench.llamacpp import build as llama_build
from forerun.bench.llamacpp.completion import parse_completion, request_body
from forerun.bench.llamacpp.server import LlamaServer
from forerun.bench.llamacpp.server_spec import ServerSpec, server_specs
from forerun.bench.report import ReportContext, render
from forerun.bench.summary import OVERALL, by_task
from forerun.cli import main
from forerun.models.source import ModelSource
from forerun.models.testing import save_hf_folder, tiny_model
from forerun.models.tokenizer import Tokenizer
from tests.test_bench import bench_args as common_bench_args

PROMPTS = [{"prompt": "abc abc abc abc", "category": "code"}, {"prompt": "hello hello hello", "category": "chat"}]
MAX_TOKENS = 6

# A stand-in for llama-server: notes its command line, answers /health, and answers /completion
# with the prompt's last tokens, slowly enough that a decode rate can be measured.
FAKE_SERVER = r"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
with open(os.path.join(os.environ["FAKE_LLAMA_DIR"], f"{os.getpid()}.json"), "w") as f:
    json.dump(argv, f)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["n_predict"]
        tokens = (body["prompt"] * n)[-n:]
        time.sleep(0.004 * n)
        timings = {"prompt_n": len(body["prompt"]), "prompt_ms": 1.0, "prompt_per_second": 1000.0,
                   "predicted_n": n, "predicted_ms": 4.0 * n, "predicted_per_second": 250.0}
        if "--spec-type" in argv:
            timings.update(draft_n=2 * n, draft_n_accepted=n)
        self.send({"content": "", "tokens": tokens, "stop_type": "limit", "timings": timings})

    def send(self, answer):
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""

# What llama-server 0.3.36 answers on /completion (return_tokens true), trimmed of settings.
CANNED_ANSWER = {
    "index": 0,
    "content": "def f",
    "tokens": [],
    "id_slot": 0,
    "stop": True,
    "model": "target.gguf",
    "tokens_predicted": 3,
    "tokens_evaluated": 5,
    "has_new_line": False,
    "truncated": False,
    "stop_type": "eos",
    "stopping_word": "",
    "tokens_cached": 7,
    "timings": {
        "cache_n": 0,
        "prompt_n": 5,
        "prompt_ms": 40.0,
        "prompt_per_token_ms": 8.0,
        "prompt_per_second": 125.0,
        "predicted_n": 3,
        "predicted_ms": 100.0,
        "predicted_per_token_ms": 50.0,
        "predicted_per_second": 20.0,
        "draft_n": 4,
        "draft_n_accepted": 3,
    },
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench_llama")
    dataset = root / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return {
        "target": save_hf_folder(tiny_model(seed=0), root / "target"),
        "draft": save_hf_folder(tiny_model(seed=0, num_layers=1), root / "draft"),
        "dataset": dataset,
    }


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty FORERUN_HOME: whatever llama.cpp this machine has built is not seen."""
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def pretend_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny models are folders; let the peer take them for GGUF files (the servers are stand-ins)."""
    monkeypatch.setattr(peer, "resolve", lambda spec: ModelSource("gguf", Path(spec) / "model.gguf", spec))


def bench_args(folders: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return common_bench_args(folders, out, "--no-warmup", *extra, max_tokens=MAX_TOKENS)


def read_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


# --- unavailable: a note, never a crash -------------------------------------------------------


def test_a_failed_llama_build_is_noted_and_the_forerun_runs_go_on(
    capsys, folders: dict[str, Path], home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pretend_gguf(monkeypatch)

    def no_build(*_args, **_kwargs):
        raise LlamaCppUnavailable("could not download llama-cpp-python 0.3.36 with pip (no network)")

    monkeypatch.setattr(llama_build, "build", no_build)
    assert main(bench_args(folders, tmp_path / "out", "--methods", "plain", "--peers", "llama.cpp")) == 0
    assert "llama.cpp peer left out: could not download" in capsys.readouterr().err
    records = read_records(tmp_path / "out")
    assert {r["method"] for r in records} == {"plain"} and len(records) == len(PROMPTS)
    assert "llama.cpp peer left out: could not download" in (tmp_path / "out" / "report.md").read_text()


def test_a_model_folder_is_noted_as_not_runnable_by_llama_cpp(
    capsys, folders: dict[str, Path], home: Path, tmp_path: Path
) -> None:
    assert main(bench_args(folders, tmp_path / "out", "--methods", "plain", "--peers", "llama-plain")) == 0
    assert "llama.cpp peer left out: it runs .gguf files only" in capsys.readouterr().err
    assert {r["method"] for r in read_records(tmp_path / "out")} == {"plain"}


def test_a_binary_without_the_stamp_of_a_finished_build_is_not_found(home: Path) -> None:
    server = llama_build.server_path()
    server.parent.mkdir(parents=True)
    server.write_text("half built")
    assert llama_build.find_server() is None
    llama_build.stamp_path().write_text("{}")
    assert llama_build.find_server() == server


def test_a_failed_download_says_what_failed_and_leaves_no_stamp(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def pip_fails(command, **_kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and f"llama-cpp-python=={llama_build.VERSION}" in command
        return llama_build.subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version\n")

    monkeypatch.setattr(llama_build.subprocess, "run", pip_fails)
    with pytest.raises(
        LlamaCppUnavailable,
        match="could not download llama-cpp-python 0.3.36 with pip "
        r"\(ERROR: Could not find a version\)",
    ):
        llama_build.build(say=lambda _: None)
    assert not llama_build.stamp_path().exists() and llama_build.find_server() is None
    assert llama_build.main() == 1


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_a_failed_compile_names_the_step_and_the_log(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in sdist whose llama.cpp tree CMake refuses.
    tree = tmp_path / f"llama_cpp_python-{llama_build.VERSION}" / "vendor" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text('message(FATAL_ERROR "broken on purpose")\n')
    (tree / ".git").write_text("gitdir: ../../.git/modules/vendor/llama.cpp\n")
    sdist = tmp_path / llama_build.SDIST
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tmp_path / f"llama_cpp_python-{llama_build.VERSION}", arcname=f"llama_cpp_python-{llama_build.VERSION}")
    monkeypatch.setattr(llama_build, "_download", lambda folder, say: sdist)
    said: list[str] = []
    with pytest.raises(LlamaCppUnavailable, match=r"`cmake -B build .*` failed .*\n(.|\n)*broken on purpose"):
        llama_build.build(say=said.append)
    assert "about 10 minutes" in said[0] and str(llama_build.peer_dir()) in said[0]
    assert (llama_build.source_dir() / "CMakeLists.txt").is_file() and not (llama_build.source_dir() / ".git").exists()
    assert llama_build.find_server() is None
    # A second try compiles the tree already unpacked, without downloading again.
    monkeypatch.setattr(llama_build, "_download", lambda folder, say: pytest.fail("downloaded again"))
    with pytest.raises(LlamaCppUnavailable, match="broken on purpose"):
        llama_build.build(say=said.append)


# --- the command lines ------------------------------------------------------------------------


def test_server_flags_for_plain_draft_and_ngram() -> None:
    model, draft = Path("/m/target.gguf"), Path("/m/draft.gguf")
    plain = ServerSpec(LLAMA_PLAIN, 0, model, threads=3, context=300).flags()
    assert plain == ["-m", "/m/target.gguf", "-t", "3", "-td", "3", "-c", "300", "-np", "1", "-cram", "0", "--no-webui"]
    drafted = ServerSpec(LLAMA_DRAFT, 4, model, threads=3, context=300, draft=draft).flags()
    assert drafted[len(plain) :] == [
        "--spec-type",
        "draft-simple",
        "-md",
        "/m/draft.gguf",
        "--spec-draft-n-max",
        "4",
        "--spec-draft-p-min",
        "0.75",
    ]
    ngram = ServerSpec(LLAMA_NGRAM, 2, model, threads=3, context=300, ngram=3).flags()
    assert ngram[len(plain) :] == [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "3",
        "--spec-ngram-simple-size-m",
        "2",
    ]


def test_server_listens_on_loopback_at_its_port_and_records_flags_without_paths() -> None:
    spec = ServerSpec(LLAMA_DRAFT, 2, Path("/m/target.gguf"), 2, 100, Path("/m/draft.gguf"))
    server = LlamaServer(Path("/bin/llama-server"), spec, Path("/tmp/log"))
    server.port = 4321
    command = server.command()
    assert command[0] == "/bin/llama-server" and command[-4:] == ["--host", "127.0.0.1", "--port", "4321"]
    assert spec.options() == {
        "version": llama_build.VERSION,
        "threads": 2,
        "flags": "--spec-type draft-simple -md draft.gguf --spec-draft-n-max 2 --spec-draft-p-min 0.75",
    }


def test_specs_cover_each_k_and_leave_draft_out_without_a_draft_model() -> None:
    model = Path("m.gguf")
    specs = server_specs(model, None, [1, 3], 2, 100, LLAMA_METHODS)
    assert [(s.method, s.k) for s in specs] == [(LLAMA_PLAIN, 0), (LLAMA_NGRAM, 1), (LLAMA_NGRAM, 3)]
    specs = server_specs(model, Path("d.gguf"), [2], 2, 100, (LLAMA_DRAFT,))
    assert [(s.method, s.k, s.draft) for s in specs] == [(LLAMA_DRAFT, 2, Path("d.gguf"))]


FAKE_BENCH = """#!/bin/sh
echo run >> "$(dirname "$0")/probes"
[ "$FAKE_BENCH_CRASH" = 1 ] && kill -SEGV $$
exit 0
"""


@pytest.mark.parametrize("crash", [True, False])
def test_repacked_weights_that_crash_a_batch_turn_repacking_off_once_per_cpu(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash: bool
) -> None:
    (tmp_path / "llama-bench").write_text(FAKE_BENCH)
    (tmp_path / "llama-bench").chmod(0o755)
    monkeypatch.setenv("FAKE_BENCH_CRASH", "1" if crash else "0")
    binary = tmp_path / "llama-server"
    assert repack.repack_works(binary, Path("/m/target.gguf"), 2) is not crash
    assert repack.repack_works(binary, Path("/m/target.gguf"), 2) is not crash  # remembered, not probed again
    assert (tmp_path / "probes").read_text().count("run") == 1
    spec = server_specs(Path("/m/target.gguf"), None, [2], 2, 100, LLAMA_METHODS, repack=not crash)[0]
    assert ("--no-repack" in spec.flags()) is crash
    assert ("--no-repack" in spec.options().get("flags", "")) is crash


def test_without_llama_bench_repacking_stays_on(home: Path, tmp_path: Path) -> None:
    assert repack.repack_works(tmp_path / "llama-server", Path("/m/target.gguf"), 2)


def test_request_carries_the_prompt_ids_and_greedy_settings() -> None:
    body = request_body([5, 6, 7], SamplingParams(max_tokens=9, stop=("\n\n",)))
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 9 and body["stop"] == ["\n\n"]
    assert body["cache_prompt"] is False and body["return_tokens"] is True and body["ignore_eos"] is False
    assert body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["repeat_penalty"] == 1.0 and body["min_p"] == 0.0 and "seed" not in body
    sampled = request_body([1], SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3, ignore_eos=True))
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["seed"]) == (0.7, 0.9, 40, 3)
    assert sampled["ignore_eos"] is True


# --- the answers ------------------------------------------------------------------------------


def test_answer_parsing_keeps_tokens_timings_and_draft_counts(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("def f")[-5:] + [tokenizer.hf.convert_tokens_to_ids("<|im_end|>")]
    answer = {**CANNED_ANSWER, "tokens": ids}
    m = parse_completion(answer, 0.5, tokenizer, SamplingParams(), speculative=True)
    assert m.token_ids == ids and m.text.startswith("def f") and m.finish_reason == "stop"
    assert m.elapsed_s == 0.5 and m.first_token_s == pytest.approx(0.040)
    assert m.spec == {"num_draft_tokens": 4, "num_accepted_tokens": 3, "num_emitted_tokens": len(ids)}
    assert m.engine_timings["predicted_per_second"] == 20.0 and m.engine_timings["prompt_per_second"] == 125.0
    assert m.decode_tokens_per_s == pytest.approx((len(ids) - 1) / (0.5 - 0.040))


def test_answer_without_drafts_counts_zero_drafts_and_limit_means_length(tokenizer: Tokenizer) -> None:
    timings = {k: v for k, v in CANNED_ANSWER["timings"].items() if not k.startswith("draft")}
    answer = {**CANNED_ANSWER, "tokens": tokenizer.encode("ab"), "stop_type": "limit", "timings": timings}
    assert parse_completion(answer, 0.2, tokenizer, SamplingParams(), speculative=True).spec["num_draft_tokens"] == 0
    plain = parse_completion(answer, 0.2, tokenizer, SamplingParams(), speculative=False)
    assert plain.spec is None and plain.finish_reason == "length"


def test_answer_text_is_cut_at_a_stop_string(tokenizer: Tokenizer) -> None:
    answer = {**CANNED_ANSWER, "tokens": tokenizer.encode("ab\n\ncd"), "stop_type": "word"}
    m = parse_completion(answer, 0.2, tokenizer, SamplingParams(stop=("\n\n",)), speculative=False)
    assert m.text == "ab" and m.finish_reason == "stop"


def test_an_answer_without_tokens_is_an_error_not_an_empty_run(tokenizer: Tokenizer) -> None:
    with pytest.raises(Exception, match="lacks tokens"):
        parse_completion({"content": "x", "timings": {}}, 0.1, tokenizer, SamplingParams(), speculative=False)


# --- a whole bench against the stand-in server ------------------------------------------------


@pytest.fixture
def fake_server(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in llama-server found as the built one; returns the folder where each start notes its flags."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    started = tmp_path / "started"
    started.mkdir()
    monkeypatch.setenv("FAKE_LLAMA_DIR", str(started))
    monkeypatch.setattr(llama_build, "find_server", lambda: binary)
    pretend_gguf(monkeypatch)
    return started


def test_llama_contenders_run_beside_forerun_and_their_servers_stop(
    fake_server: Path, folders: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code = main(
        bench_args(
            folders,
            out,
            "--methods",
            "plain",
            "--speculative-model",
            str(folders["draft"]),
            "--sweep-k",
            "2,3",
            "--peers",
            "llama.cpp",
        )
    )
    assert code == 0
    records = read_records(out)
    llama = {(r["method"], r["k"]) for r in records if r["engine"] == "llama.cpp"}
    assert llama == {(LLAMA_PLAIN, 0)} | {(m, k) for m in (LLAMA_DRAFT, LLAMA_NGRAM) for k in (2, 3)}
    for r in records:
        if r["engine"] == "llama.cpp":
            assert (
                r["output_token_ids"] == r["output_token_ids"][:MAX_TOKENS] and r["num_generated_tokens"] == MAX_TOKENS
            )
            assert r["engine_timings"]["predicted_per_second"] == 250.0
            assert r["decode_tokens_per_s"] == pytest.approx(
                decode_rate(MAX_TOKENS, r["elapsed_s"], r["first_token_s"]), rel=1e-3
            )
    # One server per configuration, each started with torch's thread count, all stopped at the end.
    started = [(int(p.stem), json.loads(p.read_text())) for p in fake_server.glob("*.json")]
    assert len(started) == len(llama)
    threads = str(__import__("torch").get_num_threads())
    for pid, argv in started:
        assert argv[argv.index("-t") + 1] == threads and argv[argv.index("-td") + 1] == threads
        assert not _alive(pid)
    assert sum("--spec-draft-n-max" in argv for _, argv in started) == 2
    report = (out / "report.md").read_text()
    assert "## Decode rate × llama.cpp plain, by task kind" in report
    assert "| llama-plain (llama.cpp) | – |" in report
    assert f"llama-cpp-python {llama_build.VERSION}" in report and "--spec-draft-p-min 0.75" in report


def test_single_llama_contenders_can_be_named(fake_server: Path, folders: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert (
        main(
            bench_args(
                folders,
                out,
                "--methods",
                "plain",
                "--num-speculative-tokens",
                "2",
                "--peers",
                "llama-plain,llama-ngram",
            )
        )
        == 0
    )
    assert {(r["engine"], r["method"], r["k"]) for r in read_records(out)} == {
        ("forerun", "plain", 0),
        ("llama.cpp", LLAMA_PLAIN, 0),
        ("llama.cpp", LLAMA_NGRAM, 2),
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- decode rates in the summary and the report -----------------------------------------------


def rec(prompt: str, task: str, method: str, engine: str, k: int, tokens: int, elapsed: float, first: float) -> dict:
    return {
        "prompt_id": prompt,
        "task": task,
        "method": method,
        "engine": engine,
        "k": k,
        "num_generated_tokens": tokens,
        "elapsed_s": elapsed,
        "first_token_s": first,
        "decode_tokens_per_s": decode_rate(tokens, elapsed, first),
        "speedup_vs_plain": None,
        "identical_to_plain": None,
        "spec": None,
    }


def hand_made_records() -> list[dict]:
    # Decode rates (tokens 11, so 10 after the first): llama-plain 10/s on every prompt;
    # forerun plain 5, 10, 20 /s; forerun draft 20, 40, 40 /s.
    return [
        rec("1", "code", LLAMA_PLAIN, "llama.cpp", 0, 11, 1.5, 0.5),
        rec("2", "code", LLAMA_PLAIN, "llama.cpp", 0, 11, 1.5, 0.5),
        rec("3", "chat", LLAMA_PLAIN, "llama.cpp", 0, 11, 1.5, 0.5),
        rec("1", "code", "plain", "forerun", 0, 11, 2.5, 0.5),
        rec("2", "code", "plain", "forerun", 0, 11, 1.5, 0.5),
        rec("3", "chat", "plain", "forerun", 0, 11, 1.0, 0.5),
        rec("1", "code", "draft", "forerun", 3, 11, 1.0, 0.5),
        rec("2", "code", "draft", "forerun", 3, 11, 0.75, 0.5),
        rec("3", "chat", "draft", "forerun", 3, 11, 0.75, 0.5),
    ]


def test_decode_rate_is_pooled_and_compared_per_prompt_with_llama_plain() -> None:
    table = by_task(hand_made_records(), ["code", "chat"])
    code = {r.label: r for r in table["code"]}
    assert code["plain"].decode_tokens_per_s == pytest.approx(20 / 3.0)  # 20 tokens over 3 s
    assert code["plain"].vs_llama_plain == pytest.approx(0.75)  # median of 0.5 and 1.0
    assert code["draft K=3"].vs_llama_plain == pytest.approx(3.0)  # median of 2 and 4
    assert code[LLAMA_PLAIN].vs_llama_plain == pytest.approx(1.0)
    overall = {r.label: r for r in table[OVERALL]}
    assert overall["plain"].vs_llama_plain == pytest.approx(1.0)  # median of 0.5, 1, 2
    assert overall["draft K=3"].vs_llama_plain == pytest.approx(4.0)


def test_report_shows_decode_rates_and_the_llama_plain_table() -> None:
    ctx = ReportContext("forerun bench", {"CPU": "x"}, [], ["code", "chat"])
    report = render(hand_made_records(), ctx)
    table = report.split("## Decode rate × llama.cpp plain, by task kind\n", 1)[1].split("\n#", 1)[0]
    assert "| method | code | chat | overall |" in table
    assert "| plain | 0.75× | 2.00× | 1.00× |" in table
    assert "| draft K=3 | 3.00× | 4.00× | 4.00× |" in table
    overall = report.split("## Overall\n", 1)[1].split("\n#", 1)[0]
    assert "| decode tok/s |" in overall
    assert "| draft | 3 | – | 13.2 | 30.0 |" in overall  # 33 tokens in 2.5 s; 30 after the first in 1 s


def test_no_llama_plain_no_llama_table() -> None:
    records = [r for r in hand_made_records() if r["method"] != LLAMA_PLAIN]
    report = render(records, ReportContext("forerun bench", {"CPU": "x"}, [], ["code", "chat"]))
    assert "## Decode rate × llama.cpp plain" not in report and "| decode tok/s |" in report
