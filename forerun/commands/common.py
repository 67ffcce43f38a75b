"""Flags shared by the commands that load models and generate: model, speculation, sampling, prompts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forerun import drafters
from forerun.base.config import SamplingParams, StructuredOutputsParams
from forerun.base.errors import FieldError, ForerunError
from forerun.base.tools import ToolChoice, tool_choice
from forerun.models.decoder import KV_CACHE_DTYPES
from forerun.models.load import QUANTIZATIONS
from forerun.models.prefix_cache import PREFIX_CACHE_MB
from forerun.verification.grammar import grammar_text


def add_model_args(p: argparse.ArgumentParser, quantization: str | None = None) -> None:
    """`quantization`: the --quantization default ("auto" for the commands that answer requests;
    then "none" asks for the weights in --dtype)."""
    p.add_argument("--model", required=True, help="embedded name, .gguf file, model folder or hub id")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    choices = list(QUANTIZATIONS) + (["none"] if quantization is not None else [])
    p.add_argument(
        "--quantization",
        default=quantization,
        choices=choices,
        help="the target's numeric format, plain and speculative runs alike: gguf (a GGUF file's own "
        "blocks through forerun's native kernels), w8a8 (int8 weights and activations), int8 "
        "(weights) or auto (the fastest exact one for this model and CPU, said on stderr); gguf "
        "and w8a8 keep a row's result bit-identical alone or batched"
        + (f"; none: the weights in --dtype (default: {quantization})" if quantization else ""),
    )
    add_kv_cache_arg(p)
    if quantization is not None:  # the commands that answer requests
        p.add_argument(
            "--prefix-cache-mb",
            type=float,
            default=PREFIX_CACHE_MB,
            metavar="MB",
            help="prompt rows kept for later prompts that start the same (a chat template's system turn, "
            f"earlier turns): a prompt's prefill starts after the longest such prefix (default {PREFIX_CACHE_MB}; "
            "0: none; used with gguf, where a row comes out the same in any chunks)",
        )


def add_kv_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *KV_CACHE_DTYPES],
        help="what the target's and the draft model's KV caches store: auto (float16 where forerun's native "
        "layers run, as llama.cpp's cache: half the bytes attention reads at long contexts; else the "
        "activations' dtype), float32 or float16 (default: auto)",
    )


def quantization_arg(value: str | None) -> str | None:
    """--quantization as the loaders take it: "none" is the weights' own dtype."""
    return None if value == "none" else value


def add_spec_args(p: argparse.ArgumentParser, quantization: str | None = None) -> None:
    """`quantization`: the --speculative-quantization default (as in add_model_args)."""
    g = p.add_argument_group("speculation")
    *others, last = drafters.available()  # every registered drafter, so the list never falls behind
    g.add_argument(
        "--speculative-method",
        default=None,
        help=f"the drafter: {', '.join(others)} or {last} (auto: the suffix draft on long matches, else the "
        "draft model; auto-head: the same with --speculative-head's head in the draft model's place); "
        "default: auto with --speculative-model, else none (plain decoding)",
    )
    g.add_argument(
        "--speculative-model",
        default=None,
        help="draft model (implies --speculative-method auto unless another method is named)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=5,
        help="K: the most tokens a step drafts (with --speculative-k-policy fixed, every step's count)",
    )
    g.add_argument(
        "--speculative-k-policy",
        default="adaptive",
        choices=["adaptive", "fixed"],
        help="adaptive: each step drafts the length that pays best from this machine's measured "
        "pass costs and the acceptance so far (0 when drafts keep failing); fixed: always K",
    )
    _add_draft_model_args(g, quantization)
    _add_suffix_args(g)
    _add_method_args(g)


def _add_draft_model_args(g: argparse._ArgumentGroup, quantization: str | None) -> None:
    g.add_argument(
        "--speculative-quantization",
        default=quantization,
        choices=list(QUANTIZATIONS) + (["none"] if quantization is not None else []),
        help="the draft model's numeric format (cheaper drafts; output stays exact): q4_0, gguf, w8a8, "
        "int8 or auto (q4_0 for a GGUF draft)"
        + (f"; none: the weights in --dtype (default: {quantization})" if quantization else ""),
    )
    g.add_argument(
        "--draft-min-confidence",
        type=fraction,
        default=0.0,
        help="end a draft early when the draft model's top probability falls below this",
    )
    g.add_argument(
        "--draft-second-choice",
        type=float,
        default=None,
        metavar="P",
        help="greedy: also verify the draft model's second choice at a depth where the draft's "
        "probability of its path is at least P and its row pays (default 0.05; above 1: never)",
    )
    g.add_argument(
        "--draft-branch",
        type=at_least(0),
        default=None,
        metavar="N",
        help="greedy: the draft model continues its first second-choice leaf by up to N tokens, in "
        "the chain's own forwards, where each one's row pays (default 0: leaves only)",
    )
    g.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=None,
        metavar="N",
        help="the draft model scores only the N tokens the target writes most (e.g. 32768): cheaper "
        "draft tokens, output unchanged",
    )


def _add_suffix_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--auto-long-match",
        type=int,
        default=None,
        metavar="N",
        help="auto: propose the suffix draft when it matches N tokens or more (default 8)",
    )
    g.add_argument("--suffix-max-match", type=int, default=None, help="suffix: longest context suffix looked up (12)")
    g.add_argument("--suffix-min-match", type=int, default=None, help="suffix: shortest context suffix looked up (2)")
    g.add_argument(
        "--suffix-min-prob",
        type=float,
        default=None,
        help="suffix: end the draft when its continuation's estimated probability falls below this (0.1)",
    )
    g.add_argument(
        "--suffix-branch-ratio",
        type=float,
        default=None,
        help="suffix: a runner-up continuation seen this share as often as the best gets its own branch (0.5)",
    )


def _add_method_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--ngram-max", type=int, default=3, help="prompt lookup: longest suffix to match")
    g.add_argument("--ngram-min", type=int, default=1, help="prompt lookup: shortest suffix to match")
    g.add_argument(
        "--early-exit-layer",
        type=int,
        default=None,
        help="early exit: draft with the first L layers (default: three quarters of them)",
    )
    g.add_argument("--skip-layers", type=int, nargs="+", default=None, help="early exit: layers the draft skips")
    g.add_argument("--lookahead-window", type=int, default=4, help="lookahead: Jacobi window W")
    g.add_argument("--lookahead-ngram", type=int, default=4, help="lookahead: n-gram size N")
    g.add_argument("--lookahead-guesses", type=int, default=4, help="lookahead: candidate n-grams G per step")
    g.add_argument(
        "--speculative-head",
        default=None,
        metavar="DIR",
        help="medusa, eagle: the trained head's folder (made by `forerun train`); bench takes one of each "
        "kind, comma-separated",
    )
    g.add_argument(
        "--medusa-choices",
        type=_choices,
        default=None,
        metavar="JSON",
        help="medusa: the tree as a list of rank paths, e.g. '[[0], [1], [0, 0]]'",
    )
    g.add_argument("--eagle-nodes", type=int, default=None, help="eagle: the most tree nodes a step verifies (16)")
    g.add_argument(
        "--eagle-branch",
        type=int,
        default=None,
        help="eagle: nodes expanded per depth and children per expanded node (4)",
    )


def _choices(text: str) -> list[list[int]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not (isinstance(value, list) and all(isinstance(c, list) and all(isinstance(r, int) for r in c) for c in value)):
        raise argparse.ArgumentTypeError(f"expected a list of lists of whole numbers, got {text!r}")
    return value


def at_least(least: int):
    """An argparse type: a flag's whole number of `least` or more."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return whole


positive_int = at_least(1)  # a flag's whole number of 1 or more


def fraction(text: str) -> float:
    """An argparse type: a flag's probability, a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0 <= value <= 1:  # NaN too, which no comparison passes
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}")
    return value


def spec_from_args(args: argparse.Namespace, method: str | None = None) -> tuple[str | None, dict]:
    """(method, that method's options) from parsed flags; `method` overrides --speculative-method."""
    named = method is None  # the method is the flags' own, not the caller's
    method = method or args.speculative_method or ("auto" if args.speculative_model else None)
    if named:
        _check_flags_used(args, method)
    if method is None:
        return None, {}
    drafters.lookup(method)  # an unknown name is refused before any model loads
    if drafters.needs_draft_model(method) and not args.speculative_model:
        raise ForerunError(f"--speculative-method {method} needs --speculative-model")
    if named and args.speculative_model and not drafters.needs_draft_model(method):
        raise ForerunError(
            f"--speculative-model is a draft model, but --speculative-method {method} runs none; "
            f"use --speculative-method {' or '.join(drafters.draft_model_methods())}, or leave one of the two out"
        )
    names = drafters.cli_options(method)  # each method's own flags: a drafter receives only its own
    # "none" (a format flag's own dtype) is no option at all.
    options = {kw: getattr(args, dest) for dest, kw in names.items() if getattr(args, dest, None) not in (None, "none")}
    if drafters.needs_draft_model(method):
        options.update(dtype=args.dtype, device=args.device)
    return method, options


def _check_flags_used(args: argparse.Namespace, method: str | None) -> None:
    """A drafter's flag set away from its default where the method in use takes none of it is an
    error, not silently dropped."""
    if getattr(args, "speculative_model", None) == "":
        raise ForerunError("--speculative-model is empty: name a draft model, or leave the flag out")
    used = drafters.cli_options(method) if method is not None else {}
    defaults = _spec_defaults()
    owners: dict[str, list[str]] = {}
    for name in drafters.available():
        for dest in drafters.cli_options(name):
            if dest != "speculative_model":  # it names the method itself, or spec_from_args says why not
                owners.setdefault(dest, []).append(name)
    for dest, methods in owners.items():
        if dest in used or getattr(args, dest, None) == defaults.get(dest):
            continue
        flag = "--" + dest.replace("_", "-")
        which = f"--speculative-method {method} does not use it" if method else "no speculative method is given"
        raise ForerunError(
            f"{flag} is a flag of --speculative-method {' or '.join(methods)}, and {which}: "
            f"add --speculative-method {methods[0]}, or leave {flag} out"
        )


def _spec_defaults() -> dict:
    """The speculation flags' defaults in `forerun generate` and `forerun serve`."""
    parser = argparse.ArgumentParser(add_help=False)
    add_spec_args(parser, quantization="auto")
    return vars(parser.parse_args([]))


def add_prompt_args(p: argparse.ArgumentParser, prompt_help: str = "one or more prompts") -> None:
    p.add_argument("--prompt", nargs="+", default=[], help=prompt_help)
    p.add_argument("--prompts-file", default=None, help="JSONL with 'prompt' or 'turns' per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", nargs="+", default=[], help="stop strings")
    g.add_argument(
        "--stop-token-ids", nargs="+", type=int, default=[], metavar="ID", help="token ids that end generation (kept)"
    )
    g.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens regardless of stop tokens")
    g.add_argument("--min-tokens", type=int, default=0, help="no stop token or stop string before this many tokens")
    g.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest's probability"
    )
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]: less of every token generated")
    g.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="in [-2, 2]: less per time a token was generated"
    )
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0: a seen token's logit divided by it")
    g.add_argument(
        "--logit-bias", nargs="+", default=[], type=_bias, metavar="ID=BIAS", help="add BIAS in [-100, 100] to token ID"
    )
    s = p.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    s.add_argument("--json-schema", metavar="SCHEMA", help="the text is JSON following this schema (JSON, or a file)")
    s.add_argument("--regex", help="the whole text matches this regular expression")
    s.add_argument("--choice", nargs="+", metavar="TEXT", help="the text is one of these")
    s.add_argument("--grammar-file", metavar="FILE", help="the text follows this Lark grammar (its rule `start`)")


def add_tool_args(p: argparse.ArgumentParser) -> None:
    """generate's and bench's tool flags: the tools shown to the model and how it may call them."""
    t = p.add_argument_group("tool calls (with --chat)")
    t.add_argument(
        "--tools",
        metavar="FILE",
        help='a JSON file of OpenAI tools ([{"type": "function", "function": {"name", "parameters", ...}}]) '
        "the chat template shows the model",
    )
    t.add_argument(
        "--tool-choice",
        default="auto",
        metavar="auto|required|none|NAME",
        help="required, or a function's NAME: the answer is a call in the template's own format (default auto)",
    )
    t.add_argument(
        "--no-parallel-tool-calls",
        dest="parallel_tool_calls",
        action="store_false",
        help="--tool-choice required writes one call (OpenAI's parallel_tool_calls: false)",
    )


def tools_from_args(args: argparse.Namespace, chat_hint: str = "add --chat") -> ToolChoice | None:
    """--tools (a file of OpenAI's tools) and --tool-choice, checked as the server checks them,
    before any model loads; `chat_hint`: how the command's user turns the chat template on."""
    if args.tools is None:
        if args.tool_choice != "auto":
            raise ForerunError("--tool-choice chooses among --tools: give the file of tools too")
        return None
    if not args.chat:
        raise ForerunError(f"--tools go to the chat template: {chat_hint}")
    try:
        tools = json.loads(read_text_flag(Path(args.tools), "--tools"))
    except ValueError as exc:
        raise ForerunError(f"--tools: {args.tools} is not JSON: {exc}") from None
    word = args.tool_choice in ("none", "auto", "required")
    choice = args.tool_choice if word else {"type": "function", "function": {"name": args.tool_choice}}
    try:
        offered = tool_choice(tools, choice, args.parallel_tool_calls)
    except FieldError as exc:
        raise ForerunError(f"--{exc.field.replace('_', '-')}: {exc}") from None
    if offered is not None and offered.forced and _structured_from_args(args) is not None:
        raise ForerunError(f"--tool-choice {args.tool_choice} makes the answer a call: leave out the structured output")
    return offered


def _bias(text: str) -> tuple[int, float]:
    """--logit-bias's ID=BIAS."""
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ID=BIAS (a token id and a number, e.g. 15043=-5)") from None


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    tokens = [token for token, _ in args.logit_bias]
    twice = next((token for token in tokens if tokens.count(token) > 1), None)
    if twice is not None:  # a dict would keep the last silently
        raise ForerunError(f"--logit-bias names token {twice} twice: give each token one bias")
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_ids),
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=dict(args.logit_bias),
        structured_outputs=_structured_from_args(args),
    )


def _structured_from_args(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """--json-schema (its text, or a file holding it), --regex, --choice or --grammar-file."""
    if args.json_schema is not None:
        schema = args.json_schema
        if not schema.lstrip().startswith(("{", "true")):
            if not Path(schema).is_file():
                raise ForerunError(f"--json-schema takes a schema's JSON or a file holding it; {schema!r} is neither")
            schema = read_text_flag(Path(schema), "--json-schema")
        spec = StructuredOutputsParams(json=schema)
    elif args.regex is not None:
        spec = StructuredOutputsParams(regex=args.regex)
    elif args.choice is not None:
        spec = StructuredOutputsParams(choice=args.choice)
    elif args.grammar_file is not None:
        spec = StructuredOutputsParams(grammar=read_text_flag(Path(args.grammar_file), "--grammar-file"))
    else:
        return None
    grammar_text(spec)  # a grammar that cannot be followed is told before the model loads
    return spec


def read_text_flag(path: Path, flag: str) -> str:
    """A text file a flag names; a clear error when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ForerunError(f"{flag}: cannot read {path} as UTF-8 text: {exc}") from None
