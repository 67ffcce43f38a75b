"""From results.jsonl records to the numbers a report shows: one row per method x K, per task kind.

Speedup is the median over prompts of each prompt's ratio tokens/s(method) / tokens/s(plain), both
measured back to back on that prompt; "× llama.cpp plain" is the same for decode rates, with
llama.cpp's plain run as the base. A prompt run in several rounds (`forerun bench --rounds`) counts
once: the median of its rounds' ratios, each round's to that round's base. Acceptance counters are
pooled over prompts (sums, then ratios), so long outputs weigh more than short ones, as in Spec-Bench.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from forerun.bench.contenders import decode_rate
from forerun.bench.llamacpp import LLAMA_PLAIN

OVERALL = "overall"


@dataclass
class Row:
    method: str
    engine: str  # "forerun", "transformers" or "llama.cpp"
    k: int  # 0 for plain decoding
    prompts: int  # distinct prompts (a prompt run in several rounds counts once)
    speedup: float | None  # median per-prompt ratio to forerun plain
    tokens_per_s: float  # all generated tokens / all generation time
    decode_tokens_per_s: float | None  # tokens after the first / time after the first, pooled
    ttft_ms: float  # median time to first token
    mean_accepted_length: float | None  # tokens per target forward, pooled; None without speculation counters
    predicted_length: float | None  # (1 - a^(K+1)) / (1 - a) from the pooled a and K
    acceptance_rate: float | None  # accepted / drafted, pooled
    per_position: list[float] = field(default_factory=list)  # [K] share of drafts whose i-th token was kept
    identical: float | None = None  # share of prompts whose output equals plain's
    vs_llama_plain: float | None = None  # median per-prompt ratio of decode rates to llama.cpp plain
    adaptive: bool = False  # K is the most a step drafted; the cost model chose each step's
    draft_ms: float | None = None  # the drafter's time per drafted token, pooled (ms)

    @property
    def label(self) -> str:
        if self.k == 0:
            return self.method
        return f"{self.method} K≤{self.k}" if self.adaptive else f"{self.method} K={self.k}"


def contender_order(records: list[dict]) -> list[tuple[str, int]]:
    """(method, K) in a stable reading order: forerun plain, forerun methods, then each peer's."""
    seen = list(dict.fromkeys((r["method"], r["k"], r.get("engine", "forerun")) for r in records))
    seen.sort(key=lambda m: (m[2] != "forerun", m[2], m[1] != 0, m[0], m[1]))  # each engine's plain first
    return [(method, k) for method, k, _ in seen]


def summarize(records: list[dict]) -> list[Row]:
    """One row per (method, K) present in `records`, in contender order."""
    base = {_run_of(r): _decode(r) for r in records if r["method"] == LLAMA_PLAIN and r["k"] == 0}
    rows = []
    for method, k in contender_order(records):
        group = [r for r in records if r["method"] == method and r["k"] == k]
        rows.append(_row(method, k, group, base))
    return rows


def by_task(records: list[dict], tasks: list[str]) -> dict[str, list[Row]]:
    """Rows per task kind (in the order given), then the overall rows under OVERALL."""
    table = {task: summarize([r for r in records if r["task"] == task]) for task in tasks}
    table[OVERALL] = summarize(records)
    return {task: rows for task, rows in table.items() if rows}


def _row(method: str, k: int, group: list[dict], llama_plain: dict[tuple[str, int], float | None]) -> Row:
    tokens = sum(r["num_generated_tokens"] for r in group)
    seconds = sum(r["elapsed_s"] for r in group)
    identical: dict[str, bool] = {}  # a prompt's output equals plain's in every round
    for r in group:
        if r.get("identical_to_plain") is not None:
            identical[r["prompt_id"]] = identical.get(r["prompt_id"], True) and bool(r["identical_to_plain"])
    ratios = [
        (r["prompt_id"], _decode(r) / llama_plain[_run_of(r)])
        for r in group
        if _decode(r) is not None and llama_plain.get(_run_of(r))
    ]
    row = Row(
        method=method,
        engine=group[0].get("engine", "forerun"),
        k=k,
        prompts=len({r["prompt_id"] for r in group}),
        speedup=_median_of_prompts([(r["prompt_id"], r.get("speedup_vs_plain")) for r in group]),
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        decode_tokens_per_s=_pooled_decode(group),
        ttft_ms=1000 * (_median_of_prompts([(r["prompt_id"], r["first_token_s"]) for r in group]) or 0.0),
        mean_accepted_length=None,
        predicted_length=None,
        acceptance_rate=None,
        identical=sum(identical.values()) / len(identical) if identical else None,
        vs_llama_plain=_median_of_prompts(ratios),
        adaptive=group[0].get("options", {}).get("k_policy") == "adaptive",
    )
    specs = [r["spec"] for r in group if r.get("spec")]
    if specs:
        _add_acceptance(row, specs)
    return row


def _run_of(record: dict) -> tuple[str, int]:
    """The prompt and round a record ran in: the runs whose figures are set side by side."""
    return record["prompt_id"], int(record.get("round", 0))


def _median_of_prompts(values: list[tuple[str, float | None]]) -> float | None:
    """The median over prompts of each prompt's median over its rounds (None values left out)."""
    by_prompt: dict[str, list[float]] = {}
    for prompt_id, value in values:
        if value is not None:
            by_prompt.setdefault(prompt_id, []).append(value)
    return statistics.median(statistics.median(v) for v in by_prompt.values()) if by_prompt else None


def _decode(record: dict) -> float | None:
    """A record's decode rate: its own field, or worked out for records written before it existed."""
    if "decode_tokens_per_s" in record:
        return record["decode_tokens_per_s"]
    return decode_rate(record["num_generated_tokens"], record["elapsed_s"], record["first_token_s"])


def _pooled_decode(group: list[dict]) -> float | None:
    """Tokens after the first over time after the first, summed over the prompts that have both."""
    timed = [r for r in group if _decode(r) is not None]
    tokens = sum(r["num_generated_tokens"] - 1 for r in timed)
    seconds = sum(r["elapsed_s"] - r["first_token_s"] for r in timed)
    return tokens / seconds if timed and seconds > 0 else None


def _add_acceptance(row: Row, specs: list[dict]) -> None:
    """What the counters of every record allow: tokens per target forward, α, per-position rates.

    transformers peers count only their target's forwards (their drafts are not visible from
    outside); llama.cpp counts its drafts but not its verification steps.
    """
    if all("num_target_forwards" in s for s in specs):
        forwards = sum(s["num_target_forwards"] for s in specs)
        row.mean_accepted_length = sum(s["num_emitted_tokens"] for s in specs) / forwards if forwards else 0.0
    if not all("num_draft_tokens" in s for s in specs):
        return
    drafted = sum(s["num_draft_tokens"] for s in specs)
    accepted = sum(s["num_accepted_tokens"] for s in specs)
    alpha = accepted / drafted if drafted else 0.0
    row.acceptance_rate = alpha
    row.predicted_length = predicted_length(alpha, row.k)
    if drafted and all("draft_seconds" in s for s in specs):
        row.draft_ms = 1000 * sum(s["draft_seconds"] for s in specs) / drafted
    if not all("num_drafts" in s and "accepted_per_position" in s for s in specs):
        return
    drafts = sum(s["num_drafts"] for s in specs)
    width = max(len(s["accepted_per_position"]) for s in specs)
    kept = [
        sum(s["accepted_per_position"][i] for s in specs if i < len(s["accepted_per_position"])) for i in range(width)
    ]
    row.per_position = [c / drafts if drafts else 0.0 for c in kept]


def predicted_length(alpha: float, k: int) -> float:
    """Textbook tokens per target step when each of K drafts is kept independently with rate alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)
