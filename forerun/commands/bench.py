"""`forerun bench`: acceptance and speedup per task kind for each method, beside the peers."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from forerun import drafters
from forerun.base.errors import ForerunError
from forerun.commands.common import (
    add_model_args,
    add_sampling_args,
    add_spec_args,
    add_tool_args,
    sampling_from_args,
    spec_from_args,
    tools_from_args,
)
from forerun.drafters import needs_draft_model

HEAD_METHODS = ("medusa", "eagle")  # methods that read a trained head of their kind (--speculative-head)
ANY_HEAD = "auto-head"  # reads the EAGLE head given, else the Medusa one


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _name_list(text: str) -> list[str]:
    """A flag's comma-separated names, at least one (`,` alone is a mistake, not "the default")."""
    names = _names(text)
    if not names:
        raise argparse.ArgumentTypeError(f"names nothing ({text!r}): give one or more names separated by commas")
    return names


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"names no number ({text!r}): give one or more separated by commas")
    return values


def _add_run_args(g) -> None:
    """How the runs are made and where they go."""
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every contender on a prompt this many times over, back to back, before the next prompt; "
        "the report takes each prompt's median (llama-bench's -r; a larger --rounds resumes a run's folder)",
    )
    g.add_argument("--out", default="bench-out", help="folder for results.jsonl, report.md and plots")
    g.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="give prompts as plain text, not wrapped in the chat template",
    )
    g.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up runs")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure acceptance and speedup per task kind, beside the peers",
        description="Run each method back to back on every prompt and write results.jsonl, "
        "report.md and PNG plots to --out. An interrupted run resumes where it stopped.",
    )
    add_model_args(p)
    g = p.add_argument_group("bench")
    g.add_argument(
        "--methods",
        type=_name_list,
        default=None,
        help=f"comma-separated: plain and the registered drafters ({', '.join(drafters.available())}); "
        "METHOD:FORMAT runs a draft-model method with its draft in FORMAT beside the same method in "
        "--speculative-quantization (e.g. auto,auto:gguf), METHOD:OPTION=VALUE with one of its drafter's "
        "options set (e.g. auto,auto:branch=0); default: all that can run",
    )
    g.add_argument(
        "--dataset",
        default="spec-bench",
        help="spec-bench (bundled) or a JSONL file: 'prompt' or 'turns' per line, optional 'category', "
        "'suffix' for a gap the answer fills in (the model's fill-in-the-middle prompt, not a chat turn) and "
        "'prediction' (text the answer is expected to be, which forerun's drafters copy from)",
    )
    g.add_argument(
        "--categories",
        type=_name_list,
        default=None,
        help="comma-separated categories (or task kinds, e.g. mt_bench) to keep; a category named here is "
        "reported as its own task kind (coding, not mt_bench)",
    )
    g.add_argument("--limit-per-category", type=int, default=None, help="first N prompts of each category")
    g.add_argument(
        "--sweep-k",
        type=_ints,
        default=None,
        help="comma-separated K values, each method run at every one (instead of --num-speculative-tokens)",
    )
    g.add_argument(
        "--peers",
        type=_name_list,
        default=[],
        help="other engines to run beside forerun: transformers (all of its contenders) or some of "
        "hf-plain, hf-assisted, hf-prompt-lookup; llama.cpp (built on first use, ~10 minutes, "
        "or ahead with `make peers`) or some of llama-plain, llama-draft, llama-ngram",
    )
    _add_run_args(g)
    add_sampling_args(p)
    add_tool_args(p)
    add_spec_args(p)
    p.set_defaults(func=run, bench_parser=p)


def _method_options(args: argparse.Namespace, method: str) -> dict:
    """A method's options from the flags; `METHOD:FORMAT` with its draft model in FORMAT,
    `METHOD:OPTION=VALUE` with that option of its drafter set."""
    from forerun.bench.contenders import draft_format_of, drafter_of, option_of

    options = spec_from_args(args, drafter_of(method))[1]
    fmt, option = draft_format_of(method), option_of(method)
    if option is not None:
        options = {**options, option[0]: _option_value(args.bench_parser, method, option[0])}
    return options if fmt is None else {**options, "quantize": fmt}


_EXPECTED = {int: "a whole number", float: "a number"}


def _option_value(parser: argparse.ArgumentParser, method: str, option: str) -> object:
    """The VALUE of `METHOD:OPTION=VALUE` as the option's own flag reads it (--draft-branch for auto's
    branch): a clear error naming the option and the value where that flag would refuse it, before
    any model loads. (check_methods has made sure the drafter takes `option`.)"""
    from forerun import drafters
    from forerun.bench.contenders import drafter_of

    text = method.split("=", 1)[1]
    dest = next(d for d, kw in drafters.cli_options(drafter_of(method)).items() if kw == option)
    action = next(a for a in parser._actions if a.dest == dest)
    flag, convert = max(action.option_strings, key=len), action.type or str
    many = action.nargs in ("+", "*")  # e.g. early-exit:skip_layers='3 5 7'
    try:
        values = [convert(part) for part in (text.split() if many else [text])]
        if not values:
            raise ValueError(text)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        why = (
            str(exc) if isinstance(exc, argparse.ArgumentTypeError) else f"expected {_EXPECTED.get(convert, 'a value')}"
        )
        raise ForerunError(f"method {method!r}: {option}={text!r} is not a value {flag} takes ({why})") from None
    if action.choices is not None and any(v not in action.choices for v in values):
        choices = ", ".join(map(str, action.choices))
        raise ForerunError(f"method {method!r}: {option}={text!r} is not one of {flag}'s choices ({choices})")
    return values if many else values[0]


def run(args: argparse.Namespace) -> int:
    from forerun.bench.runner import (
        BenchConfig,
        check_methods,
        run_bench,
        valid_methods,
    )

    if args.speculative_method:
        raise ForerunError("forerun bench takes --methods (comma-separated), not --speculative-method")
    sampling = sampling_from_args(args)
    if args.peers and (sampling.adjusts or sampling.min_p or args.tools):
        raise ForerunError(
            "the peers are sent temperature, top-k and top-p only: leave out --logit-bias, the penalties, "
            "--min-p, --min-tokens, a structured output and --tools, or --peers"
        )
    heads = heads_by_kind(args.speculative_head)
    methods = list(dict.fromkeys(args.methods or default_methods(valid_methods(), args.speculative_model, heads)))
    if "plain" not in methods:
        methods = ["plain"] + methods  # every speedup is a ratio to plain decoding
    check_methods(methods, args.speculative_model)  # before spec_from_args, for the clearer message
    options = {m: _method_options(args, m) for m in methods if m != "plain"}
    for m in set(methods) & {*HEAD_METHODS, ANY_HEAD}:
        head = head_for(m, heads)
        if head is None:
            kind = "EAGLE or Medusa" if m == ANY_HEAD else m
            raise ForerunError(
                f"--methods names {m}, which needs a trained {kind} head: pass its folder with "
                f"--speculative-head (made by `forerun train --method {'eagle' if m == ANY_HEAD else m}`)"
            )
        options[m]["head"] = head
    cfg = BenchConfig(
        model=args.model,
        out=Path(args.out),
        methods=methods,
        method_options=options,
        speculative_model=args.speculative_model,
        dataset=args.dataset,
        categories=args.categories,
        limit_per_category=args.limit_per_category,
        sampling=sampling,
        ks=args.sweep_k or [args.num_speculative_tokens],
        k_policy=args.speculative_k_policy,
        peers=args.peers,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        chat=args.chat,
        tools=tools_from_args(args, "leave out --no-chat"),
        warmup=args.warmup,
        progress=args.progress,
        rounds=args.rounds,
        command=command_line(args),
    )
    result = run_bench(cfg)
    print(
        f"{result.ran} runs made, {len(result.records)} in the report; see {result.out / 'report.md'}", file=sys.stderr
    )
    return 0


def heads_by_kind(folders: str | None) -> dict[str, str]:
    """--speculative-head's comma-separated folders by the kind of head each holds (at most one each)."""
    from forerun.heads import read_config

    heads: dict[str, str] = {}
    for folder in _names(folders or ""):
        kind = read_config(folder).method
        if kind in heads:
            raise ForerunError(
                f"--speculative-head names two {kind} heads ({heads[kind]} and {folder}); bench one {kind} head per run"
            )
        heads[kind] = folder
    return heads


def head_for(method: str, heads: dict[str, str]) -> str | None:
    """The head folder `method` reads: its own kind's, or for auto-head the EAGLE head, else the Medusa one."""
    if method == ANY_HEAD:
        return heads.get("eagle", heads.get("medusa"))
    return heads.get(method)


def default_methods(
    available: list[str], speculative_model: str | None, heads: dict[str, str] | None = None
) -> list[str]:
    """plain and every registered drafter that can run with the flags given (draft and auto need a
    draft model; medusa and eagle a trained head of their kind, auto-head one of either)."""
    return ["plain"] + [
        m
        for m in available
        if m != "plain"
        and (not needs_draft_model(m) or speculative_model)
        and (m not in (*HEAD_METHODS, ANY_HEAD) or head_for(m, heads or {}) is not None)
    ]


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, rebuilt from the parsed flags that differ from their defaults."""
    words = ["forerun", "bench"]
    for action in args.bench_parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # store_true / store_false
            words.append(flag)
        elif isinstance(value, (list, tuple)) and action.type in (_name_list, _ints):
            words += [flag, ",".join(map(str, value))]
        elif isinstance(value, (list, tuple)):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)
