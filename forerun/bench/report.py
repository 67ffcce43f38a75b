"""report.md: the command that made it, the machine, then speedup, decode-rate and acceptance tables per task kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from forerun.base import files
from forerun.bench.summary import OVERALL, Row, by_task

DETAIL_HEADER = (
    "| method | K | speedup | tokens/s | decode tok/s | TTFT ms | mean accepted length "
    "| predicted from α, K | α | draft ms per token | identical to plain | prompts |"
)


@dataclass
class ReportContext:
    command: str  # the exact command line, shown first
    machine: dict[str, str]  # CPU, threads, torch version, dtype, ...
    settings: list[tuple[str, str]]  # (what, value) lines under the machine table
    tasks: list[str]  # task kinds in reading order
    plots: dict[str, str] = field(default_factory=dict)  # file name -> caption, for plots that were drawn
    notes: list[str] = field(default_factory=list)  # skipped prompts, missing peers, interruptions


def write_report(path: Path, records: list[dict], ctx: ReportContext) -> None:
    files.write_text(path, render(records, ctx))


def render(records: list[dict], ctx: ReportContext) -> str:
    table = by_task(records, ctx.tasks)
    out = ["# forerun bench", "", "Made with:", "", "```sh", ctx.command, "```", ""]
    out += ["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in ctx.machine.items()] + [""]
    out += [f"- {what}: {value}" for what, value in ctx.settings] + [""]
    if not records:
        return "\n".join(out + ["No results yet.", ""])
    out += ["## Speedup over plain decoding, by task kind", ""] + _matrix(table, "speedup") + [""]
    if any(row.vs_llama_plain is not None for row in table[OVERALL]):
        out += [
            "## Decode rate × llama.cpp plain, by task kind",
            "",
            "Median over prompts of decode tok/s(method) / decode tok/s(llama-plain) on the same prompt.",
            "",
        ]
        out += _matrix(table, "vs_llama_plain") + [""]
    out += ["## Overall", ""] + _detail(table[OVERALL]) + [""]
    out += ["## By task kind", ""]
    for task in ctx.tasks:
        if task in table:
            out += [f"### {task}", ""] + _detail(table[task]) + [""]
    out += _positions(table[OVERALL])
    if ctx.plots:
        out += ["## Plots", ""] + [f"![{caption}]({name})\n" for name, caption in ctx.plots.items()]
    out += ["## How to read this", ""] + [f"- {line}" for line in _explanations(records) + ctx.notes] + [""]
    return "\n".join(out)


def _matrix(table: dict[str, list[Row]], field: str) -> list[str]:
    """One row per method, one column per task kind and overall, cells the ratio `field` of each Row."""
    columns = list(table)  # task kinds, then overall
    rows: dict[str, dict[str, Row]] = {}
    for task, task_rows in table.items():
        for row in task_rows:
            rows.setdefault(row.label, {})[task] = row
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for label, cells in rows.items():
        values = [_speedup(getattr(cells[c], field)) if c in cells else "–" for c in columns]
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    return lines


def _detail(rows: list[Row]) -> list[str]:
    lines = [DETAIL_HEADER, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [
            f"{r.method} ({r.engine})" if r.engine != "forerun" else r.method,
            str(r.k) if r.k else "–",
            _speedup(r.speedup),
            _rate(r.tokens_per_s),
            _rate(r.decode_tokens_per_s) if r.decode_tokens_per_s is not None else "–",
            f"{r.ttft_ms:.0f}",
            _num(r.mean_accepted_length),
            _num(r.predicted_length),
            _num(r.acceptance_rate),
            _num(r.draft_ms),
            f"{100 * r.identical:.0f}%" if r.identical is not None else "–",
            str(r.prompts),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _positions(rows: list[Row]) -> list[str]:
    rows = [r for r in rows if r.per_position]
    if not rows:
        return []
    width = max(len(r.per_position) for r in rows)
    lines = [
        "## Acceptance by draft position",
        "",
        "Share of drafts whose i-th token was kept (all task kinds).",
        "",
        "| method | " + " | ".join(str(i + 1) for i in range(width)) + " |",
        "|---|" + "---:|" * width,
    ]
    for r in rows:
        cells = [f"{p:.2f}" for p in r.per_position] + ["–"] * (width - len(r.per_position))
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    return lines + [""]


def _explanations(records: list[dict]) -> list[str]:
    lines = [
        "speedup: median over prompts of tokens/s(method) / tokens/s(forerun plain), each prompt's runs "
        "made back to back after a warm-up; models loaded once, loading never timed. tokens/s counts the "
        "whole request, prompt processing included.",
        "decode tok/s: (generated tokens − 1) / (elapsed − time to first token), pooled over prompts: the "
        "rate once the prompt is processed. × llama.cpp plain: median over prompts of its ratio to "
        "llama-plain's decode rate on the same prompt.",
        "mean accepted length: tokens emitted per target forward (prefill included), pooled over prompts; "
        "predicted from α, K: (1 − α^(K+1)) / (1 − α), what it would be if every draft token were kept "
        "independently with rate α.",
        "draft ms per token: the drafter's time proposing (shadow proposals included) over the tokens it "
        "drafted, pooled over prompts.",
        "α: accepted draft tokens / drafted tokens. identical to plain: share of prompts whose output "
        "tokens equal forerun plain's, in every round (expected 100% for greedy decoding; sampled runs agree only in "
        "distribution).",
    ]
    if any(r.get("engine") == "transformers" for r in records):
        lines.append(
            "transformers peers (hf-*) get the same token ids, stop tokens and max tokens; hf-assisted "
            "uses the same draft model with a constant K; hf-prompt-lookup uses transformers' own n-gram "
            "sizes. Their mean accepted length counts the target's forwards with a hook; their drafts "
            "are not visible from outside, so α stays blank."
        )
    return lines


def _speedup(value: float | None) -> str:
    return f"{value:.2f}×" if value is not None else "–"


def _rate(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _num(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "–"
