"""`forerun generate`: plain or speculative generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.base.prompts import read_prompts_file, unread_fields, valid_unicode
from forerun.base.tools import CallReader, ToolChoice
from forerun.commands.common import (
    add_model_args,
    add_prompt_args,
    add_sampling_args,
    add_spec_args,
    add_tool_args,
    quantization_arg,
    read_text_flag,
    sampling_from_args,
    spec_from_args,
    tools_from_args,
)
from forerun.verification.grammar import tool_sampling


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text, with or without speculation")
    add_model_args(p, quantization="auto")
    add_prompt_args(p)
    p.add_argument(
        "--suffix",
        default=None,
        metavar="TEXT",
        help="the text after a gap: each --prompt is the text before it and the answer fills it in (a code "
        "model's fill-in-the-middle; a --prompts-file line gives its own as 'suffix')",
    )
    p.add_argument(
        "--prediction-file",
        default=None,
        metavar="FILE",
        help="text much of the answer is expected to be (OpenAI's predicted output: the file an edit rewrites); "
        "the drafters that copy text (suffix, auto) draft from it too, so only the speed changes",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    add_sampling_args(p)
    add_tool_args(p)
    add_spec_args(p, quantization="auto")
    p.set_defaults(func=run)


def build_llm(args: argparse.Namespace, method: str | None = None) -> LLM:
    method, options = spec_from_args(args, method)
    return LLM(
        model=args.model,
        speculative_method=method,
        speculative_options=options,
        num_speculative_tokens=args.num_speculative_tokens,
        dtype=args.dtype,
        device=args.device,
        quantization=quantization_arg(args.quantization),
        speculative_k_policy=args.speculative_k_policy,
        prefix_cache_mb=args.prefix_cache_mb,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def run(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    params = sampling_from_args(args)
    if args.prediction_file is not None:
        params = replace(params, prediction=read_text_flag(Path(args.prediction_file), "--prediction-file"))
    tools = tools_from_args(args)
    llm = build_llm(args)
    speculative = llm.spec.method is not None
    if tools is not None:
        prompts, params = _with_tools(llm, prompts, params, tools)
    for index, ids in enumerate(checked_prompts(llm, prompts, params)):
        if args.json:
            result = llm.generate([ids], params)[0]
            record = {
                "prompt_index": index,
                "text": result.text,
                "token_ids": result.token_ids,
                "num_prompt_tokens": len(result.prompt_token_ids),
                "num_generated_tokens": len(result.token_ids),
                "finish_reason": result.finish_reason,
                "elapsed_s": round(result.elapsed_s, 4),
                "tokens_per_s": round(result.tokens_per_s, 3),
                "first_token_s": round(result.first_token_s, 4),
                "decode_tokens_per_s": round(result.decode_tokens_per_s, 3),
            }
            if speculative:
                record["spec"] = result.metrics.to_dict()
            if result.prediction_tokens is not None:
                record["accepted_prediction_tokens"], record["rejected_prediction_tokens"] = result.prediction_tokens
            if tools is not None and tools.choice != "none":
                record["tool_calls"] = _calls(result.text, tools)
            print(json.dumps(record), flush=True)
            continue
        for piece in llm.stream(ids, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        result = llm.last_result
        print()
        print(summary_line(result, speculative), file=sys.stderr)
    return 0


def _prompts(args: argparse.Namespace) -> list[str | dict | list[dict]]:
    """The prompts of --prompt and --prompts-file, as `LLM.generate` takes them: a chat turn each
    with --chat, a {"prompt", "suffix"} dict where a suffix makes a gap to fill in."""
    given = [(valid_unicode(text, "--prompt"), args.suffix) for text in args.prompt]
    if args.suffix is not None:
        valid_unicode(args.suffix, "--suffix")
    if args.prompts_file:
        records = read_prompts_file(args.prompts_file)
        unread_fields(records, "forerun generate (whose --prediction-file is every prompt's)", reads=("suffix",))
        given += [(r["prompt"], r.get("suffix")) for r in records]
    if not given:
        raise ForerunError("no prompt given: use --prompt TEXT or --prompts-file F.jsonl")
    if args.chat and any(suffix is not None for _, suffix in given):
        raise ForerunError("a prompt with a suffix fills in a gap, it is no chat turn: leave out --chat or the suffix")
    if args.chat:
        return [[{"role": "user", "content": text}] for text, _ in given]
    return [text if suffix is None else {"prompt": text, "suffix": suffix} for text, suffix in given]


def _with_tools(
    llm: LLM, chats: list[list[dict]], params: SamplingParams, tools: ToolChoice
) -> tuple[list[list[int]], SamplingParams]:
    """Each chat's tokens with the tools shown to the model, and the sampling they ask for (a forced
    call's structured output; the call tags' text kept where the vocabulary marks them special)."""
    params = tool_sampling(params, tools, llm.tokenizer)
    return [llm.tokenizer.apply_chat(chat, tools=tools.tools) for chat in chats], params


def _calls(text: str, tools: ToolChoice) -> list[dict]:
    """The calls an answer's text makes, as OpenAI's tool_calls give them (without ids)."""
    reader = CallReader([function["name"] for function in tools.functions])
    calls = reader.feed(text)[1] + reader.finish()[1]
    return [{"name": call.name, "arguments": call.arguments} for call in calls]


def checked_prompts(llm: LLM, prompts: list, params: SamplingParams) -> list[list[int]]:
    """Each prompt's token ids, every one checked before the first is generated (a bad later prompt
    must not stop the command halfway through its output)."""
    ids = []
    for index, prompt in enumerate(prompts):
        try:
            ids.append(llm.check_prompt(prompt, params))
        except ForerunError as exc:
            raise ForerunError(
                f"prompt {index + 1} of {len(prompts)}: {exc}" if len(prompts) > 1 else str(exc)
            ) from None
    return ids


def summary_line(result, speculative: bool) -> str:
    line = (
        f"[{len(result.token_ids)} tokens in {result.elapsed_s:.2f} s, {result.tokens_per_s:.2f} tok/s "
        f"(first token {result.first_token_s:.2f} s, then {result.decode_tokens_per_s:.2f} tok/s), "
        f"finish: {result.finish_reason}"
    )
    if speculative:
        m = result.metrics
        line += (
            f"; K={m.num_speculative_tokens}, {m.num_draft_tokens} drafted in {m.num_drafts} steps, "
            f"acceptance {m.acceptance_rate:.2f}, "
            f"mean accepted length {m.mean_accepted_length:.2f} "
            f"(predicted {m.predicted_mean_accepted_length:.2f})"
        )
    return line + "]"
