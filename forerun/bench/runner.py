"""The bench loop: load once, warm up, run every method back to back on each prompt, record, report.

Per prompt the order is forerun plain, then each method at each K, then the peers (transformers,
then llama.cpp, whose servers are started once and stopped on every way out); so slow drift in
the machine (thermal, other load) touches every method alike, and each method's speedup is a ratio
to a plain run made moments before on the same prompt. With `rounds` above one, that sequence runs
that many times on a prompt before the next (`round` in each record), each round's ratios taken
to its own plain runs; the report gives each prompt the median of its rounds.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from forerun import drafters
from forerun.base import files
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.base.prompts import Prompt, load_prompts, task_order
from forerun.base.tools import ToolChoice
from forerun.bench import llamacpp, machine
from forerun.bench.contenders import (
    PLAIN,
    Contender,
    Measurement,
    build_forerun_contenders,
    draft_format_of,
    drafter_of,
    option_of,
)
from forerun.bench.llamacpp import peer as llama_peer
from forerun.bench.plots import PLOTS, draw_all
from forerun.bench.report import ReportContext, write_report
from forerun.bench.store import ResultStore
from forerun.bench.summary import by_task
from forerun.bench.transformers_peer import HF_METHODS, PEERS, transformers_contenders
from forerun.models.load import QUANTIZATIONS, LoadedModel, load_model
from forerun.verification.grammar import tool_sampling

WARMUP_TOKENS = 16
LLAMA_CONTEXT_SLACK = 16  # llama-server's context beyond prompt + max tokens


@dataclass
class BenchConfig:
    model: str  # target: embedded name, .gguf, folder or hub id
    out: Path  # results.jsonl, report.md and the plots go here
    methods: list[str] = field(default_factory=lambda: [PLAIN])  # "plain" and drafter names
    method_options: dict[str, dict] = field(default_factory=dict)  # each drafter's own settings
    speculative_model: str | None = None  # the draft model, for "draft" and hf-assisted
    dataset: str = "spec-bench"  # "spec-bench" or a JSONL path
    categories: list[str] | None = None  # None keeps all
    limit_per_category: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ks: list[int] = field(default_factory=lambda: [5])  # K values; more than one is a sweep
    k_policy: str = "adaptive"  # adaptive: K is the most a step drafts; fixed: every step's
    peers: list[str] = field(default_factory=list)  # e.g. ["transformers", "llama.cpp"]
    dtype: str = "bfloat16"
    device: str = "cpu"
    quantization: str | None = None  # "int8": the target's weights in int8
    kv_cache_dtype: str = "auto"  # what the target's and the draft model's KV caches store
    chat: bool = True  # wrap prompts in the chat template when there is one
    tools: ToolChoice | None = None  # functions the chat template shows the model, and how it may call them
    warmup: bool = True
    progress: bool = True  # a tqdm bar on stderr
    rounds: int = 1  # every contender's run on a prompt, this many times over (medians per prompt)
    command: str = "forerun bench"  # shown at the top of report.md


@dataclass
class Case:
    prompt: Prompt
    ids: list[int]  # the prompt as token ids, the same for every contender


@dataclass
class BenchResult:
    out: Path
    records: list[dict]  # this command's records (prompts and contenders it names)
    ran: int  # runs made now; the rest came from an earlier, interrupted run
    notes: list[str]


def valid_methods() -> list[str]:
    return [PLAIN] + drafters.available()


def check_methods(methods: list[str], speculative_model: str | None) -> None:
    valid = valid_methods()
    for method in methods:
        if drafter_of(method) not in valid:
            raise ForerunError(f"unknown method {method!r}; valid methods: {', '.join(valid)}")
        needs_draft = drafters.needs_draft_model(drafter_of(method))
        fmt = draft_format_of(method)
        if fmt is not None and (not needs_draft or fmt not in QUANTIZATIONS):
            raise ForerunError(
                f"method {method!r}: METHOD:FORMAT names a draft model's format ({', '.join(QUANTIZATIONS)}) "
                f"for a method that runs one ({', '.join(drafters.draft_model_methods())})"
            )
        option, known = option_of(method), drafters.cli_options(drafter_of(method)).values()
        if option is not None and option[0] not in known:
            raise ForerunError(
                f"method {method!r}: METHOD:OPTION=VALUE names one of {drafter_of(method)}'s options "
                f"({', '.join(sorted(known)) or 'it has none'})"
            )
        if needs_draft and not speculative_model:
            raise ForerunError(f"method {method} needs a draft model: add --speculative-model")


def check_config(cfg: BenchConfig) -> None:
    check_methods(cfg.methods, cfg.speculative_model)
    for peer in cfg.peers:
        if peer not in PEERS:
            raise ForerunError(f"unknown peer {peer!r}; valid peers: {', '.join(PEERS)}")
    if not cfg.ks or any(k < 1 for k in cfg.ks):
        raise ForerunError(f"every K must be at least 1, got {cfg.ks}")
    if cfg.rounds < 1:
        raise ForerunError(f"--rounds must be at least 1, got {cfg.rounds}")


OUTPUTS = ("results.jsonl", "report.md", "run.json", *PLOTS)  # what a run writes into its folder


def run_bench(cfg: BenchConfig) -> BenchResult:
    check_config(cfg)
    cfg = replace(cfg, ks=sorted(set(cfg.ks)))
    prompts = load_prompts(cfg.dataset, cfg.categories, cfg.limit_per_category)
    if not prompts:
        raise ForerunError(f"no prompts left in {cfg.dataset} after filtering by category")
    files.make_folder(cfg.out, "--out", OUTPUTS, "the bench")  # before any model loads
    store = ResultStore(cfg.out / "results.jsonl", settings_of(cfg))
    target = _load_target(cfg)
    cfg = _with_tool_grammar(cfg, target)
    notes: list[str] = []
    cases = _encode(prompts, target, cfg, notes)
    contenders = _contenders(cfg, target, notes, context=max(len(case.ids) for case in cases) + cfg.sampling.max_tokens)
    ran = 0
    try:
        for c in contenders:
            store.check_options(c.method, c.k, c.options)
        pending = [
            (case, c, round_)
            for case in cases
            for round_ in range(cfg.rounds)
            for c in contenders
            if not store.has(case.prompt.prompt_id, c.method, c.k, round_)
        ]
        earlier = len(cases) * len(contenders) * cfg.rounds - len(pending)
        if pending and earlier and any(_remembers(c) for c in contenders):
            notes.append(
                f"{earlier} runs came from an earlier start of this command: the suffix memory of the runs made "
                "now holds only the answers of this start's runs"
            )
        try:
            if pending and cfg.warmup:
                _warm_up(contenders, pending[0][0].ids, cfg.sampling)
            with tqdm(total=len(pending), desc="bench", unit="run", disable=not cfg.progress, file=sys.stderr) as bar:
                memory = _RoundMemory(contenders) if cfg.rounds > 1 else None
                for case, c, round_ in pending:
                    bar.set_postfix_str(f"{case.prompt.task} {c.method}" + (f" K={c.k}" if c.k else ""))
                    if memory is not None:
                        memory.before(case, c, round_)
                    store.append(_measure(case, c, _params_for(case.prompt, cfg.sampling), store, round_))
                    ran += 1
                    bar.update()
        except KeyboardInterrupt:
            notes.append(f"interrupted after {ran} of {len(pending)} runs; the same command resumes where it stopped")
            write_outputs(cfg, store, cases, contenders, notes)
            raise
    finally:
        _close(contenders)  # llama-server processes stop on every way out
    records = write_outputs(cfg, store, cases, contenders, notes)
    return BenchResult(cfg.out, records, ran, notes)


def _remembers(c: Contender) -> bool:
    """Whether a contender's runs remember earlier ones (forerun's suffix memory: contenders.py)."""
    return hasattr(c, "remembered")


class _RoundMemory:
    """What the contenders remember across runs (forerun's suffix memory), kept as a one-round bench
    would have it: a prompt's later rounds start from what its first round started from, not from
    its own earlier answer. (Every round gives the same answer, greedy or seeded per prompt, so the
    memory after the last round is what the first left.)"""

    def __init__(self, contenders: list[Contender]) -> None:
        self.keeping = [c for c in contenders if _remembers(c)]
        self.prompt: str | None = None
        self.start: dict[int, list[list[int]] | None] = {}  # id(contender) -> what it remembered before

    def before(self, case: Case, c: Contender, round_: int) -> None:
        """Called before each run: on a prompt's first run note every memory, on a later round restore it."""
        if case.prompt.prompt_id != self.prompt:
            self.prompt = case.prompt.prompt_id
            self.start = {id(k): k.remembered() for k in self.keeping}
        if round_ > 0 and id(c) in self.start:
            c.recall(self.start[id(c)])


def settings_of(cfg: BenchConfig) -> dict:
    """What shapes every number: a resumed run must match these exactly."""
    s = cfg.sampling
    settings = {
        "model": cfg.model,
        "speculative_model": cfg.speculative_model,
        "dataset": cfg.dataset,
        "chat": cfg.chat,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "quantization": cfg.quantization,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "seed": s.seed,
        "stop": list(s.stop),
        "ignore_eos": s.ignore_eos,
    }
    if cfg.tools is not None:
        tools = cfg.tools
        settings["tools"] = {"functions": list(tools.tools), "choice": tools.described, "parallel": tools.parallel}
    return json.loads(json.dumps(settings))


def _load_target(cfg: BenchConfig) -> LoadedModel:
    target = load_model(  # once, for every method
        cfg.model, cfg.dtype, cfg.device, quantization=cfg.quantization, kv_cache_dtype=cfg.kv_cache_dtype
    )
    if target.tokenizer is None:
        raise ForerunError(f"model {cfg.model} has no tokenizer; the bench needs one to encode its prompts")
    return target


def _with_tool_grammar(cfg: BenchConfig, target: LoadedModel) -> BenchConfig:
    """The sampling the tools ask for (a forced call's structured output; the call tags' text kept
    where the vocabulary marks them special), made with the target's tokenizer."""
    if cfg.tools is None:
        return cfg
    if not getattr(target.tokenizer.hf, "chat_template", None):
        raise ForerunError(f"{cfg.model} has no chat template to show the model tools: leave out --tools")
    return replace(cfg, sampling=tool_sampling(cfg.sampling, cfg.tools, target.tokenizer))


def _encode(prompts: list[Prompt], target: LoadedModel, cfg: BenchConfig, notes: list[str]) -> list[Case]:
    tok = target.tokenizer
    chat = cfg.chat and bool(getattr(tok.hf, "chat_template", None))
    if cfg.chat and not chat:
        notes.append("the model has no chat template: prompts were given as plain text")
    limit = target.decoder.cfg.max_position
    cases, too_long = [], []
    tools = cfg.tools.tools if cfg.tools is not None else None
    for p in prompts:
        if p.suffix is not None:  # a gap to fill in: the model's own prompt for that, no chat turn
            ids = tok.infill(p.text, p.suffix)
        elif chat:
            ids = tok.apply_chat([{"role": "user", "content": p.text}], tools=tools)
        else:
            ids = tok.encode(p.text)
        if len(ids) + cfg.sampling.max_tokens > limit:
            too_long.append(p.prompt_id)
        else:
            cases.append(Case(p, ids))
    if too_long:
        notes.append(
            f"{len(too_long)} prompts left out: prompt plus max tokens exceeds the model's context "
            f"of {limit} tokens (ids {', '.join(too_long[:10])}{', ...' if len(too_long) > 10 else ''})"
        )
    if not cases:
        raise ForerunError(f"every prompt is longer than the model's context of {limit} tokens minus max tokens")
    return cases


def _contenders(cfg: BenchConfig, target: LoadedModel, notes: list[str], context: int) -> list[Contender]:
    """forerun's methods, then the peers asked for. `context`: the longest prompt plus max tokens."""
    options = {m: dict(o) for m, o in cfg.method_options.items()}
    recorded = {m: dict(o) for m, o in options.items()}
    loaded: dict = {}  # the draft model, loaded once for every method that runs it
    for method in (m for m in cfg.methods if drafters.needs_draft_model(drafter_of(m))):
        draft_opts = options.setdefault(method, {})
        # Loaded once, already in its format (a cached quantized copy when there is one); the
        # drafter must not quantize it again, but the record keeps the setting.
        quantize = draft_opts.pop("quantize", None)
        if quantize not in loaded:
            draft = load_model(
                cfg.speculative_model, cfg.dtype, cfg.device, quantization=quantize, draft=True, tokens_like=target
            )
            draft.decoder.set_kv_cache_dtype(cfg.kv_cache_dtype)
            loaded[quantize] = draft
        draft_opts["model"] = loaded[quantize]
        draft_opts.setdefault("dtype", cfg.dtype)
        draft_opts.setdefault("device", cfg.device)
        recorded[method] = {**draft_opts, **({"quantize": quantize} if quantize else {})}
    contenders: list[Contender] = list(
        build_forerun_contenders(target, cfg.methods, cfg.ks, options, recorded, cfg.k_policy)
    )
    hf_methods = HF_METHODS if "transformers" in cfg.peers else tuple(m for m in HF_METHODS if m in cfg.peers)
    if hf_methods:
        confidence = float(options.get("draft", {}).get("min_confidence", 0.0))
        setup = transformers_contenders(
            cfg.model, cfg.speculative_model, cfg.ks, cfg.dtype, cfg.device, target.tokenizer, confidence, hf_methods
        )
        for note in setup.notes:
            print(f"note: {note}", file=sys.stderr)
        notes.extend(setup.notes)
        if setup.contenders and cfg.quantization:
            notes.append("transformers peers run the target's weights unquantized")
        contenders += setup.contenders
    llama_methods = (
        llamacpp.LLAMA_METHODS
        if llamacpp.PEER in cfg.peers
        else tuple(m for m in llamacpp.LLAMA_METHODS if m in cfg.peers)
    )
    if llama_methods:
        ngram = int(options.get("ngram", {}).get("ngram_max", 3))  # look up as long a suffix as forerun's ngram
        setup = llama_peer.llamacpp_contenders(
            cfg.model,
            cfg.speculative_model,
            cfg.ks,
            target.tokenizer,
            torch.get_num_threads(),
            context + LLAMA_CONTEXT_SLACK,
            llama_methods,
            ngram,
        )
        for note in setup.notes:
            print(f"note: {note}", file=sys.stderr)
        notes.extend(setup.notes)
        if setup.contenders:
            notes.append(llama_peer.describe(setup.contenders))
        contenders += setup.contenders
    return contenders


def _close(contenders: list[Contender]) -> None:
    for c in contenders:
        close = getattr(c, "close", None)
        if close is not None:
            close()


def _warm_up(contenders: list[Contender], ids: list[int], sampling: SamplingParams) -> None:
    """One short run of each contender on the first prompt; what a contender remembers of it is
    forgotten again (the first prompt's measured run would draft from its own warm-up answer)."""
    params = replace(sampling, max_tokens=min(WARMUP_TOKENS, sampling.max_tokens))
    for c in contenders:
        before = c.remembered() if _remembers(c) else None
        c.run(ids, params)
        if before is not None:
            c.recall(before)


def _params_for(prompt: Prompt, sampling: SamplingParams) -> SamplingParams:
    if prompt.prediction is not None:  # forerun's contenders draft from it; the peers take none
        sampling = replace(sampling, prediction=prompt.prediction)
    # Sampled runs: one seed per prompt, the same for every method, stable across resumed runs.
    if sampling.greedy:
        return sampling
    return replace(sampling, seed=(sampling.seed or 0) + zlib.crc32(prompt.prompt_id.encode()))


def _measure(case: Case, c: Contender, params: SamplingParams, store: ResultStore, round_: int = 0) -> dict:
    m: Measurement = c.run(case.ids, params)
    plain = store.get(case.prompt.prompt_id, PLAIN, 0, round_)
    decode = m.decode_tokens_per_s
    is_plain = c.method == PLAIN
    speedup = 1.0 if is_plain else (m.tokens_per_s / plain["tokens_per_s"] if plain and plain["tokens_per_s"] else None)
    identical = True if is_plain else (m.token_ids == plain["output_token_ids"] if plain else None)
    return {
        "prompt_id": case.prompt.prompt_id,
        "category": case.prompt.category,
        "task": case.prompt.task,
        "method": c.method,
        "engine": c.engine,
        "k": c.k,
        "round": round_,
        "options": c.options,
        "num_prompt_tokens": len(case.ids),
        "num_generated_tokens": len(m.token_ids),
        "elapsed_s": round(m.elapsed_s, 6),
        "first_token_s": round(m.first_token_s, 6),
        "tokens_per_s": round(m.tokens_per_s, 4),
        "decode_tokens_per_s": round(decode, 4) if decode is not None else None,
        "finish_reason": m.finish_reason,
        "speedup_vs_plain": round(speedup, 4) if speedup is not None else None,
        "identical_to_plain": identical,
        "spec": m.spec,
        "engine_timings": m.engine_timings,
        "output_token_ids": m.token_ids,
        "text": m.text,
        "settings": store.settings,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def write_outputs(
    cfg: BenchConfig, store: ResultStore, cases: list[Case], contenders: list[Contender], notes: list[str]
) -> list[dict]:
    """report.md, the plots and run.json, from this command's records only."""
    wanted_prompts = {case.prompt.prompt_id for case in cases}
    wanted = {(c.method, c.k) for c in contenders}
    records = [
        r
        for r in store.records
        if r["prompt_id"] in wanted_prompts and (r["method"], r["k"]) in wanted and r.get("round", 0) < cfg.rounds
    ]
    tasks = task_order([case.prompt for case in cases])
    plots = draw_all(cfg.out, by_task(records, tasks)) if records else {}
    with_transformers = any(p == "transformers" or p in HF_METHODS for p in cfg.peers)
    ctx = ReportContext(
        cfg.command,
        machine.describe(cfg.dtype, cfg.device, cfg.quantization, with_transformers),
        _settings_lines(cfg, cases, contenders),
        tasks,
        plots,
        notes,
    )
    write_report(cfg.out / "report.md", records, ctx)
    run = {"command": cfg.command, "machine": ctx.machine, "settings": store.settings, "notes": notes}
    files.write_json(cfg.out / "run.json", run, indent=1)
    return records


def _settings_lines(cfg: BenchConfig, cases: list[Case], contenders: list[Contender]) -> list[tuple[str, str]]:
    """The report's list of settings; the KV cache's dtype as forerun's contenders resolved it."""
    counts: dict[str, int] = {}
    for case in cases:
        counts[case.prompt.task] = counts.get(case.prompt.task, 0) + 1
    s = cfg.sampling
    sampling = (
        "greedy (temperature 0)" if s.greedy else f"temperature {s.temperature}, top-p {s.top_p}, top-k {s.top_k}"
    )
    adjustments = [
        f"{name} {value}"
        for name, value, off in (
            ("min-p", s.min_p, 0),
            ("min-tokens", s.min_tokens, 0),
            ("presence penalty", s.presence_penalty, 0),
            ("frequency penalty", s.frequency_penalty, 0),
            ("repetition penalty", s.repetition_penalty, 1),
            ("logit bias", dict(s.logit_bias), {}),
        )
        if value != off
    ]
    sampling = ", ".join([sampling, *adjustments])
    rounds = [("rounds", f"{cfg.rounds}: every run on a prompt repeated back to back; per-prompt medians")]
    llms = [c.llm for c in contenders if getattr(c, "llm", None) is not None]
    kv_cache = [("KV cache", str(llms[0].target.decoder.cache_dtype).removeprefix("torch."))] if llms else []
    return [
        ("model", cfg.model),
        ("draft model", cfg.speculative_model or "none"),
        ("dataset", f"{cfg.dataset}: {len(cases)} prompts (" + ", ".join(f"{t} {n}" for t, n in counts.items()) + ")"),
        ("sampling", f"{sampling}, max tokens {s.max_tokens}" + (", EOS ignored" if s.ignore_eos else "")),
        ("K", ", ".join(map(str, cfg.ks))),
        *kv_cache,
        *(rounds if cfg.rounds > 1 else []),
        ("chat template", ("yes" if cfg.chat else "no") + _infill_note(cases)),
        *([("tools", _tools_line(cfg.tools))] if cfg.tools is not None else []),
        *_prediction_line(cases),
    ]


def _infill_note(cases: list[Case]) -> str:
    infills = sum(case.prompt.suffix is not None for case in cases)
    return f" (the {infills} prompts with a suffix: the model's fill-in-the-middle prompt)" if infills else ""


def _prediction_line(cases: list[Case]) -> list[tuple[str, str]]:
    predicted = sum(case.prompt.prediction is not None for case in cases)
    if not predicted:
        return []
    return [("prediction", f"{predicted} prompts give one; forerun's drafters copy from it, the peers take none")]


def _tools_line(tools: ToolChoice) -> str:
    """The report's line on the tools: their names and the choice."""
    names = ", ".join(t["function"]["name"] for t in tools.tools)
    one = ", one call" if tools.choice == "required" and not tools.parallel else ""
    return f"{names}; tool_choice {tools.described}{one}" + (" (a structured output)" if tools.forced else "")
