"""`forerun bench` end to end on a tiny random model and a three-prompt JSONL, plus its bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.base.prompts import MT_BENCH, SPEC_BENCH_FILE, load_prompts
from forerun.bench import runner
from forerun.bench.contenders import build_forerun_contenders
from forerun.bench.runner import BenchConfig, run_bench, valid_methods
from forerun.bench.summary import OVERALL, by_task, predicted_length
from forerun.cli import main
from forerun.commands.bench import ANY_HEAD, HEAD_METHODS
from forerun.models.testing import save_hf_folder, tiny_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PROMPTS = [
    {"prompt": "abc abc abc abc abc abc", "category": "code"},
    {"turns": ["the cat the cat the cat", "and then?"], "category": "chat"},
    {"prompt": "hello hello hello hello", "category": "chat"},
]
KS = (1, 2)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench")
    dataset = root / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return {
        "root": root,
        "target": save_hf_folder(tiny_model(seed=0), root / "target"),
        "draft": save_hf_folder(tiny_model(seed=0, num_layers=1), root / "draft"),
        "dataset": dataset,
    }


# Every method that runs without a trained head (medusa and eagle need one: tests/test_heads.py).
METHODS = [m for m in valid_methods() if m not in (*HEAD_METHODS, ANY_HEAD)]  # heads: tests/test_heads.py


def bench_args(folders: dict[str, Path], out: Path, *extra: str, max_tokens: int = MAX_TOKENS) -> list[str]:
    return [
        "bench",
        "--model",
        str(folders["target"]),
        "--dtype",
        "float32",
        "--dataset",
        str(folders["dataset"]),
        "--max-tokens",
        str(max_tokens),
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


@pytest.fixture(scope="module")
def full_run(folders: dict[str, Path]) -> Path:
    """Every registered method at K = 1 and 2, with the transformers peers, once for the module."""
    out = folders["root"] / "full"
    code = main(
        bench_args(
            folders,
            out,
            "--methods",
            ",".join(METHODS),
            "--speculative-model",
            str(folders["draft"]),
            "--sweep-k",
            ",".join(map(str, KS)),
            "--peers",
            "transformers",
        )
    )
    assert code == 0
    return out


def read_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def section(report: str, heading: str) -> str:
    """The text under `### heading` (or `## heading`) up to the next heading of any level."""
    start = report.index(f"{heading}\n")
    rest = report[start + len(heading) + 1 :]
    return rest.split("\n#", 1)[0]


# --- a whole run ------------------------------------------------------------------------------


def test_results_hold_one_line_per_prompt_method_and_k(full_run: Path) -> None:
    records = read_records(full_run)
    speculative = len(METHODS) - 1
    peers = 1 + 2 * len(KS)  # hf-plain, then hf-assisted and hf-prompt-lookup per K
    assert len(records) == len(PROMPTS) * (1 + speculative * len(KS) + peers)
    keys = {(r["prompt_id"], r["method"], r["k"]) for r in records}
    assert len(keys) == len(records)
    draft = next(r for r in records if r["method"] == "draft")
    assert {"num_accepted_tokens", "num_target_forwards", "accepted_per_position"} <= set(draft["spec"])
    assert {"tokens_per_s", "first_token_s", "speedup_vs_plain", "identical_to_plain", "settings"} <= set(draft)


def test_runs_of_a_prompt_are_interleaved_with_plain_first(full_run: Path) -> None:
    order = [(r["prompt_id"], r["method"]) for r in read_records(full_run)]
    prompt_ids = [p for p, _ in order]
    blocks = [prompt_ids[i] for i in range(len(prompt_ids)) if i == 0 or prompt_ids[i] != prompt_ids[i - 1]]
    assert blocks == ["1", "2", "3"]  # each prompt's runs back to back
    firsts = [m for i, (p, m) in enumerate(order) if i == 0 or order[i - 1][0] != p]
    assert firsts == ["plain"] * len(PROMPTS)


def test_greedy_outputs_of_every_forerun_method_equal_plain(full_run: Path) -> None:
    records = [r for r in read_records(full_run) if r["engine"] == "forerun"]
    assert {r["method"] for r in records} == set(METHODS)
    assert all(r["identical_to_plain"] for r in records)
    overall = section((full_run / "report.md").read_text(), "## Overall")
    for line in overall.splitlines():
        if line.startswith("| ") and "(transformers)" not in line and not line.startswith("| method"):
            assert "| 100% |" in line, line


def test_transformers_peers_run_on_the_same_prompts(full_run: Path) -> None:
    records = read_records(full_run)
    peers = {(r["method"], r["k"]) for r in records if r["engine"] == "transformers"}
    assert peers == {("hf-plain", 0)} | {(m, k) for m in ("hf-assisted", "hf-prompt-lookup") for k in KS}
    hf_plain = [r for r in records if r["method"] == "hf-plain"]
    assert all(r["num_generated_tokens"] == MAX_TOKENS or r["finish_reason"] == "stop" for r in hf_plain)
    # The target's forwards are counted: plain takes one per token; greedy assisted generation keeps
    # the same drafts as forerun's draft method, so it takes the same number of forwards; prompt
    # lookup keeps some copies on these repetitive prompts, so it takes fewer than one per token.
    for r in hf_plain:
        assert r["spec"] == {
            "num_target_forwards": r["num_generated_tokens"],
            "num_emitted_tokens": r["num_generated_tokens"],
        }
    forwards = {(r["prompt_id"], r["method"], r["k"]): r["spec"]["num_target_forwards"] for r in records if r["spec"]}
    for (prompt, method, k), count in forwards.items():
        if method == "hf-assisted":
            assert count == forwards[(prompt, "draft", k)]
    lookup = [r for r in records if r["method"] == "hf-prompt-lookup"]
    assert sum(r["spec"]["num_target_forwards"] for r in lookup) < sum(r["num_generated_tokens"] for r in lookup)


def test_report_starts_with_the_command_and_the_machine(full_run: Path, folders: dict[str, Path]) -> None:
    report = (full_run / "report.md").read_text()
    command = report.split("```sh\n", 1)[1].split("\n", 1)[0]
    assert command.startswith(f"forerun bench --model {folders['target']} --dtype float32")
    assert "--sweep-k 1,2" in command and "--peers transformers" in command
    for field in ("| CPU |", "| threads |", "| torch |", "| dtype | float32 |"):
        assert field in report
    # The KV cache as forerun's contenders resolved `auto`: float32 models on PyTorch's path.
    assert "- KV cache: float32\n" in report
    assert read_records(full_run)[0]["settings"]["kv_cache_dtype"] == "auto"


def test_report_has_a_row_per_method_in_every_category_and_overall(full_run: Path) -> None:
    report = (full_run / "report.md").read_text()
    for heading in ("### code", "### chat", "## Overall"):
        table = section(report, heading)
        assert "| plain | – | 1.00× |" in table
        for method in METHODS[1:]:
            for k in KS:
                assert f"| {method} | {k} |" in table, (heading, method, k)
        assert "| hf-plain (transformers) |" in table
    matrix = section(report, "## Speedup over plain decoding, by task kind")
    assert "| method | code | chat | overall |" in matrix
    assert "| draft K≤2 |" in matrix  # adaptive by default: K is the most a step drafts


def test_every_record_has_its_decode_rate_and_the_report_shows_it(full_run: Path) -> None:
    records = read_records(full_run)
    for r in records:
        n, after_first = r["num_generated_tokens"], r["elapsed_s"] - r["first_token_s"]
        expected = (n - 1) / after_first if n > 1 and after_first > 0 else None
        assert r["decode_tokens_per_s"] == pytest.approx(expected, rel=1e-3), r["method"]
    assert any(r["decode_tokens_per_s"] for r in records)
    overall = section((full_run / "report.md").read_text(), "## Overall")
    assert "| tokens/s | decode tok/s | TTFT ms |" in overall
    assert "× llama.cpp plain" not in overall  # no llama.cpp in this run


def test_draft_time_per_token_is_recorded_and_reported(full_run: Path) -> None:
    records = [r for r in read_records(full_run) if r["engine"] == "forerun" and r["method"] != "plain"]
    assert all(r["spec"]["draft_seconds"] > 0 for r in records if r["spec"]["num_draft_tokens"])
    header, rule, *rows = [
        line
        for line in section((full_run / "report.md").read_text(), "## Overall").splitlines()
        if line.startswith("|")
    ]
    column = header.split(" | ").index("draft ms per token")
    cells = {(row.split(" | ")[0].lstrip("| "), row.split(" | ")[1]): row.split(" | ")[column] for row in rows}
    drafting = {(r["method"], r["k"]) for r in records if r["spec"]["num_draft_tokens"]}
    assert drafting, "no method drafted: the test has nothing to check"
    for method, k in drafting:
        specs = [r["spec"] for r in records if (r["method"], r["k"]) == (method, k)]
        expected = 1000 * sum(s["draft_seconds"] for s in specs) / sum(s["num_draft_tokens"] for s in specs)
        assert float(cells[(method, str(k))]) == pytest.approx(expected, abs=0.006), (method, k)
    assert cells[("plain", "–")] == "–"


def test_plots_are_png_files_that_open(full_run: Path) -> None:
    for name in ("speedup_by_task.png", "acceptance_by_position.png", "sweep_k.png"):
        path = full_run / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        assert matplotlib.image.imread(str(path)).ndim == 3
        assert f"]({name})" in (full_run / "report.md").read_text()


def test_a_second_identical_run_makes_no_new_runs(full_run: Path, folders: dict[str, Path]) -> None:
    before = (full_run / "results.jsonl").read_text()
    code = main(
        bench_args(
            folders,
            full_run,
            "--methods",
            ",".join(METHODS),
            "--speculative-model",
            str(folders["draft"]),
            "--sweep-k",
            "1,2",
        )
    )  # peers left out: their lines stay
    assert code == 0
    assert (full_run / "results.jsonl").read_text() == before
    assert "(transformers)" not in (full_run / "report.md").read_text()  # the report covers this command


# --- resuming ---------------------------------------------------------------------------------


def small_config(folders: dict[str, Path], out: Path, **changes) -> BenchConfig:
    fields = dict(
        model=str(folders["target"]),
        out=out,
        methods=["plain", "draft"],
        speculative_model=str(folders["draft"]),
        dataset=str(folders["dataset"]),
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
        ks=[2],
        dtype="float32",
        warmup=False,
        progress=False,
    )
    return BenchConfig(**{**fields, **changes})


def test_an_interrupted_run_resumes_where_it_stopped(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured = runner._measure
    calls = []

    def stop_after_three(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return measured(*args)

    monkeypatch.setattr(runner, "_measure", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_bench(small_config(folders, tmp_path))
    assert len(read_records(tmp_path)) == 3
    assert "interrupted after 3 of 6 runs" in (tmp_path / "report.md").read_text()
    with (tmp_path / "results.jsonl").open("a") as f:
        f.write('{"prompt_id": "3", "meth')  # a write torn by the interruption
    monkeypatch.setattr(runner, "_measure", measured)
    first_three = (tmp_path / "results.jsonl").read_text().splitlines()[:3]
    result = run_bench(small_config(folders, tmp_path))
    assert result.ran == 3
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert lines[:3] == first_three and len(lines) == 6
    assert all(r["identical_to_plain"] for r in read_records(tmp_path))


def test_a_quantized_draft_is_loaded_quantized_once_and_recorded(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forerun.models import formats

    loads, quantized = [], []
    load, quantize = runner.load_model, formats.quantize_
    monkeypatch.setattr(runner, "load_model", lambda *a, **kw: loads.append(kw.get("quantization")) or load(*a, **kw))
    monkeypatch.setattr(formats, "quantize_", lambda *a: quantized.append(a[1]) or quantize(*a))
    options = {"draft": {"quantize": "int8", "min_confidence": 0.0}}
    run_bench(small_config(folders, tmp_path, method_options=options, ks=[1, 2]))
    assert loads == [None, "int8"]  # the target as asked, the draft in int8
    assert quantized == ["int8"]  # once, while loading: not again per drafter
    drafts = [r for r in read_records(tmp_path) if r["method"] == "draft"]
    assert drafts and all(r["options"]["quantize"] == "int8" for r in drafts)
    assert all(r["identical_to_plain"] for r in drafts)


def test_a_method_named_with_a_draft_format_runs_beside_the_method_on_every_prompt(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = []
    load = runner.load_model
    monkeypatch.setattr(runner, "load_model", lambda *a, **kw: loads.append(kw.get("quantization")) or load(*a, **kw))
    extra = ("--methods", "plain,draft,draft:int8", "--speculative-model", str(folders["draft"]))
    extra += ("--num-speculative-tokens", "2", "--speculative-k-policy", "fixed", "--no-warmup")
    assert main(bench_args(folders, tmp_path, *extra)) == 0
    assert loads == [None, None, "int8"]  # the target, then the draft once in each format
    records = read_records(tmp_path)
    by_method = {m: [r for r in records if r["method"] == m] for m in ("plain", "draft", "draft:int8")}
    assert len({len(rs) for rs in by_method.values()}) == 1 and by_method["plain"]  # every prompt, each of them
    assert all("quantize" not in r["options"] for r in by_method["draft"])
    assert all(r["options"]["quantize"] == "int8" and r["spec"]["num_drafts"] for r in by_method["draft:int8"])
    assert all(r["identical_to_plain"] for r in records)
    assert "| draft:int8 K=2 |" in (tmp_path / "report.md").read_text()


FORMAT_REFUSED = ("METHOD:FORMAT names a draft model's format", "q4_0")
DRAFT_OPTIONS, NGRAM_OPTIONS = "branch, draft_vocab", "ngram_max, ngram_min"


@pytest.mark.parametrize(
    "method,said,unsaid",
    [
        ("draft:q9", FORMAT_REFUSED, ()),  # a format that does not exist
        ("ngram:int8", FORMAT_REFUSED, ()),  # a format for a method without a draft model
        ("draft:colour=2", ("METHOD:OPTION=VALUE names one of", DRAFT_OPTIONS), (NGRAM_OPTIONS,)),
        ("ngram:branch=1", ("METHOD:OPTION=VALUE names one of", NGRAM_OPTIONS), (DRAFT_OPTIONS,)),
    ],
)
def test_a_method_variant_that_cannot_run_is_refused_with_what_can(
    capsys, folders: dict[str, Path], tmp_path: Path, method: str, said: tuple[str, ...], unsaid: tuple[str, ...]
) -> None:
    extra = ("--methods", f"plain,{method}", "--speculative-model", str(folders["draft"]))
    assert main(bench_args(folders, tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert f"method {method!r}: " in err
    assert all(s in err for s in said) and not any(s in err for s in unsaid)
    assert not (tmp_path / "results.jsonl").exists()


def test_a_method_named_with_an_option_runs_its_drafter_with_that_option_set(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    extra = ("--methods", "plain,draft,draft:second_choice=0", "--speculative-model", str(folders["draft"]))
    extra += ("--num-speculative-tokens", "2", "--speculative-k-policy", "fixed", "--no-warmup")
    assert main(bench_args(folders, tmp_path, *extra)) == 0
    records = read_records(tmp_path)
    by_method = {m: [r for r in records if r["method"] == m] for m in ("plain", "draft", "draft:second_choice=0")}
    assert len({len(rs) for rs in by_method.values()}) == 1 and by_method["plain"]
    assert all("second_choice" not in r["options"] for r in by_method["draft"])
    assert all(r["options"]["second_choice"] == 0 for r in by_method["draft:second_choice=0"])
    assert all(r["identical_to_plain"] for r in records)


def test_resuming_with_other_settings_names_what_differs(folders: dict[str, Path], tmp_path: Path) -> None:
    run_bench(small_config(folders, tmp_path, methods=["plain"]))
    with pytest.raises(ForerunError, match=r"max_tokens: 8 there, 4 now"):
        run_bench(small_config(folders, tmp_path, methods=["plain"], sampling=SamplingParams(max_tokens=4)))


# --- bad input --------------------------------------------------------------------------------


def test_unknown_method_lists_the_valid_ones(capsys, folders: dict[str, Path], tmp_path: Path) -> None:
    assert main(bench_args(folders, tmp_path, "--methods", "plain,medusa-x")) == 2
    err = capsys.readouterr().err
    assert "unknown method 'medusa-x'" in err
    assert all(m in err for m in valid_methods())
    assert not (tmp_path / "results.jsonl").exists()


def test_unknown_category_lists_the_valid_ones(capsys, folders: dict[str, Path], tmp_path: Path) -> None:
    assert main(bench_args(folders, tmp_path, "--categories", "chat,poetry")) == 2
    err = capsys.readouterr().err
    assert "unknown category 'poetry'" in err and "code, chat" in err


def test_dataset_line_without_prompt_or_turns_names_the_line(capsys, folders: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"category": "chat", "text": "no prompt here"}\n')
    assert main(bench_args(folders, tmp_path / "out", "--dataset", str(bad))) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "'prompt'" in err and "'turns'" in err


def test_draft_method_without_a_draft_model_says_so(capsys, folders: dict[str, Path], tmp_path: Path) -> None:
    assert main(bench_args(folders, tmp_path, "--methods", "plain,draft")) == 2
    assert "--speculative-model" in capsys.readouterr().err


def test_transformers_peer_on_a_model_it_cannot_load_is_noted_and_the_rest_runs(
    capsys, folders: dict[str, Path], tmp_path: Path
) -> None:
    # forerun reads any *.safetensors in the folder; transformers looks for model.safetensors only.
    odd = save_hf_folder(tiny_model(seed=0), tmp_path / "odd")
    (odd / "model.safetensors").rename(odd / "weights.safetensors")
    args = bench_args(
        folders,
        tmp_path / "out",
        "--methods",
        "plain,draft",
        "--speculative-model",
        str(folders["draft"]),
        "--peers",
        "transformers",
        "--no-warmup",
    )
    args[args.index("--model") + 1] = str(odd)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "transformers peer left out: it could not load the model" in err
    records = read_records(tmp_path / "out")
    assert {r["method"] for r in records} == {"plain", "draft"} and len(records) == 2 * len(PROMPTS)
    assert "could not load the model" in (tmp_path / "out" / "report.md").read_text()


def test_peers_can_name_single_transformers_contenders(folders: dict[str, Path], tmp_path: Path) -> None:
    args = bench_args(
        folders,
        tmp_path / "out",
        "--methods",
        "plain,ngram",
        "--num-speculative-tokens",
        "2",
        "--peers",
        "hf-prompt-lookup",
        "--no-warmup",
    )
    assert main(args) == 0
    methods = {(r["engine"], r["method"], r["k"]) for r in read_records(tmp_path / "out")}
    assert methods == {("forerun", "plain", 0), ("forerun", "ngram", 2), ("transformers", "hf-prompt-lookup", 2)}


def test_unknown_peer_is_refused_with_the_valid_names(capsys, folders: dict[str, Path], tmp_path: Path) -> None:
    assert main(bench_args(folders, tmp_path / "out", "--methods", "plain", "--peers", "vllm")) == 2
    err = capsys.readouterr().err
    assert "unknown peer 'vllm'" in err and "hf-prompt-lookup" in err


# --- the bundled data set and the sums --------------------------------------------------------


def test_spec_bench_is_bundled_with_its_licence_and_filters_by_task_kind() -> None:
    assert "Apache License" in (SPEC_BENCH_FILE.parent / "SPEC_BENCH_LICENSE").read_text()[:100]
    assert "Apache" in (SPEC_BENCH_FILE.parent / "SPEC_BENCH_NOTICE").read_text()
    prompts = load_prompts("spec-bench")
    assert len(prompts) == 480
    mt = load_prompts("spec-bench", [MT_BENCH])
    assert len(mt) == 80 and {p.task for p in mt} == {MT_BENCH} and len({p.category for p in mt}) == 8
    two_each = load_prompts("spec-bench", ["translation", "writing"], limit_per_category=2)
    assert [p.category for p in two_each] == ["writing", "writing", "translation", "translation"]
    assert two_each[0].prompt_id == "81"  # Spec-Bench's own question_id
    # An MT-bench category asked for by name reports as itself; the rest of MT-bench stays folded.
    assert {p.task for p in load_prompts("spec-bench", ["coding"])} == {"coding"}
    mixed = load_prompts("spec-bench", [MT_BENCH, "coding"])
    assert len(mixed) == 80 and {p.task for p in mixed if p.category == "coding"} == {"coding"}
    assert {p.task for p in mixed if p.category != "coding"} == {MT_BENCH}
    assert {p.task for p in two_each} == {"writing", "translation"}


def test_summary_takes_median_speedup_and_pools_acceptance() -> None:
    def rec(prompt: str, method: str, k: int, speedup: float, spec: dict | None) -> dict:
        return {
            "prompt_id": prompt,
            "task": "t",
            "method": method,
            "engine": "forerun",
            "k": k,
            "num_generated_tokens": 10,
            "elapsed_s": 1.0,
            "first_token_s": 0.1,
            "speedup_vs_plain": speedup,
            "identical_to_plain": True,
            "spec": spec,
        }

    def spec(drafted: int, accepted: int, forwards: int, per_position: list[int]) -> dict:
        return {
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "num_target_forwards": forwards,
            "num_emitted_tokens": 10,
            "num_drafts": drafted // 2,
            "accepted_per_position": per_position,
        }

    records = [
        rec("1", "plain", 0, 1.0, None),
        rec("2", "plain", 0, 1.0, None),
        rec("3", "plain", 0, 1.0, None),
        rec("1", "ngram", 2, 1.0, spec(8, 6, 5, [4, 2])),
        rec("2", "ngram", 2, 3.0, spec(4, 0, 10, [0, 0])),
        rec("3", "ngram", 2, 1.5, spec(4, 2, 8, [2, 0])),
    ]
    rows = {r.label: r for r in by_task(records, ["t"])[OVERALL]}
    ngram = rows["ngram K=2"]
    assert ngram.speedup == 1.5
    assert ngram.acceptance_rate == pytest.approx(8 / 16)
    assert ngram.mean_accepted_length == pytest.approx(30 / 23)
    assert ngram.predicted_length == pytest.approx(predicted_length(0.5, 2)) == pytest.approx(1.75)
    assert ngram.per_position == pytest.approx([6 / 8, 2 / 8])
    assert rows["plain"].tokens_per_s == pytest.approx(10.0) and rows["plain"].acceptance_rate is None
    # Records of the adaptive policy say so in their label.
    for r in records[3:]:
        r["options"] = {"k_policy": "adaptive"}
    assert "ngram K≤2" in {r.label for r in by_task(records, ["t"])[OVERALL]}


def test_a_prompt_run_in_rounds_counts_once_at_its_median() -> None:
    """Each round's ratio is to that round's base; a prompt's rounds give their median, then the
    median over prompts. The llama.cpp base of the other round would give other figures."""

    def rec(prompt: str, method: str, round_: int, decode: float, speedup: float, identical: bool = True) -> dict:
        return {
            "prompt_id": prompt,
            "task": "t",
            "method": method,
            "engine": "llama.cpp" if method == "llama-plain" else "forerun",
            "k": 0 if method in ("plain", "llama-plain") else 2,
            "round": round_,
            "num_generated_tokens": 11,
            "elapsed_s": 1.0,
            "first_token_s": 0.1 * (round_ + 1),
            "decode_tokens_per_s": decode,
            "speedup_vs_plain": speedup,
            "identical_to_plain": identical,
        }

    records = [
        # prompt 1: llama.cpp at 10, then 20 tokens/s; ngram at 20, 20, 60: ratios 2, 1, 3 -> median 2
        rec("1", "llama-plain", 0, 10.0, 1.0),
        rec("1", "llama-plain", 1, 20.0, 1.0),
        rec("1", "llama-plain", 2, 20.0, 1.0),
        rec("1", "ngram", 0, 20.0, 1.2),
        rec("1", "ngram", 1, 20.0, 1.4),
        rec("1", "ngram", 2, 60.0, 9.0, identical=False),
        # prompt 2, one round: ratio 4
        rec("2", "llama-plain", 0, 10.0, 1.0),
        rec("2", "ngram", 0, 40.0, 2.0),
    ]
    ngram = next(r for r in by_task(records, ["t"])[OVERALL] if r.method == "ngram")
    assert ngram.prompts == 2
    assert ngram.vs_llama_plain == pytest.approx(3.0)  # median of prompt 1's 2 and prompt 2's 4
    assert ngram.speedup == pytest.approx((1.4 + 2.0) / 2)  # prompt 1's median of 1.2, 1.4, 9.0
    assert ngram.identical == pytest.approx(0.5)  # prompt 1 differed in one round
    assert ngram.ttft_ms == pytest.approx(1000 * (0.2 + 0.1) / 2)


def test_rounds_repeat_every_contender_on_a_prompt_before_the_next(folders: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "rounds"
    run_bench(small_config(folders, out, rounds=2))
    order = [(r["prompt_id"], r["method"], r["round"]) for r in read_records(out)]
    assert order[:4] == [("1", "plain", 0), ("1", "draft", 0), ("1", "plain", 1), ("1", "draft", 1)]
    assert len(order) == len(set(order)) == 2 * 2 * len(PROMPTS)
    draft = [r for r in read_records(out) if r["method"] == "draft"]
    plain = {(r["prompt_id"], r["round"]): r for r in read_records(out) if r["method"] == "plain"}
    for r in draft:  # each round's speedup is to that round's plain run
        mine = plain[r["prompt_id"], r["round"]]
        assert r["speedup_vs_plain"] == pytest.approx(r["tokens_per_s"] / mine["tokens_per_s"], rel=1e-3)
    report = (out / "report.md").read_text()
    assert "- rounds: 2: every run on a prompt repeated back to back; per-prompt medians" in report
    draft_row = next(line for line in section(report, "## Overall").splitlines() if line.startswith("| draft |"))
    assert draft_row.endswith(f"| {len(PROMPTS)} |")  # prompts, not runs
    # One more round resumes the folder: only the new round's runs are made.
    assert run_bench(small_config(folders, out, rounds=3)).ran == 2 * len(PROMPTS)
    with pytest.raises(ForerunError, match="--rounds must be at least 1"):
        run_bench(small_config(folders, tmp_path / "none", rounds=0))


def test_no_round_drafts_from_an_earlier_rounds_answer(folders: dict[str, Path], tmp_path: Path) -> None:
    """The suffix memory keeps earlier answers: a repeated prompt would be drafted from its own. Each
    round starts from what the first started from, so greedy rounds draft alike; the next prompt
    still finds the first prompt's answer in the memory, as in a one-round run."""
    out = tmp_path / "memory"
    config = small_config(folders, out, methods=["plain", "suffix"], k_policy="fixed", rounds=3)
    run_bench(config)
    suffix = [r for r in read_records(out) if r["method"] == "suffix"]
    for prompt in {r["prompt_id"] for r in suffix}:
        drafts = [
            (r["spec"]["num_draft_tokens"], r["spec"]["num_accepted_tokens"], r["output_token_ids"])
            for r in sorted(suffix, key=lambda r: r["round"])
            if r["prompt_id"] == prompt
        ]
        assert len(drafts) == 3 and drafts[0] == drafts[1] == drafts[2]
    one_round = tmp_path / "one-round"
    run_bench(small_config(folders, one_round, methods=["plain", "suffix"], k_policy="fixed"))

    def counters(records: list[dict]) -> dict[str, tuple]:
        return {
            r["prompt_id"]: (r["spec"]["num_draft_tokens"], r["spec"]["num_accepted_tokens"], r["output_token_ids"])
            for r in records
            if r["method"] == "suffix" and r.get("round", 0) == 0
        }

    assert counters(suffix) == counters(read_records(one_round))


def test_records_written_before_rounds_existed_are_round_zero(folders: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "old"
    run_bench(small_config(folders, out))
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for record in lines:
        del record["round"]  # as results.jsonl files of earlier versions hold them
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert run_bench(small_config(folders, out)).ran == 0  # resumed: nothing run again
    assert run_bench(small_config(folders, out, rounds=2)).ran == len(lines)  # round 1 only


def test_the_warm_up_leaves_nothing_in_the_suffix_memory(folders: dict[str, Path], tmp_path: Path) -> None:
    """The warm-up runs the first prompt: remembered, its answer would draft that prompt's measured run."""
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    run_bench(small_config(folders, warm, methods=["plain", "suffix"], k_policy="fixed", warmup=True))
    run_bench(small_config(folders, cold, methods=["plain", "suffix"], k_policy="fixed"))

    def counters(out: Path) -> list[tuple]:
        return [
            (r["prompt_id"], r["spec"]["num_draft_tokens"], r["spec"]["num_accepted_tokens"])
            for r in read_records(out)
            if r["method"] == "suffix"
        ]

    assert counters(warm) == counters(cold)


def test_every_bench_run_pays_its_whole_prefill() -> None:
    """The warm-up's prompt is the first one measured: no contender keeps prompt rows between runs."""
    contenders = build_forerun_contenders(tiny_model(seed=3), ["ngram"], [2], {"ngram": {}})
    assert [c.method for c in contenders] == ["plain", "ngram"]
    assert all(c.llm.prefix_cache is None for c in contenders)
