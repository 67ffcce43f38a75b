"""`forerun bench-serve`'s load: requests at each concurrency, what they measure, and the report.

For each server set-up (forerun serve with speculation off, at a fixed K, or auto; llama-server
with as many slots as the highest concurrency) the load generator sends, at each concurrency c,
`requests_per_level` x c streamed completions with at most c in flight (the `openai` client on
asyncio, loopback), and measures: total output tokens per second over the level's wall time, time
to the first token and time per output token after it (per request; median and 90th percentile).
Every request is greedy with the same prompt token ids and max tokens on every server.

Requests differ in length (`request_lengths`), as real traffic does. With every request the same
length, a server that emits one token per step runs in lockstep: each wave of c requests starts
together, finishes together and hands every lane to the next wave at once, while one whose steps
emit varying numbers of tokens drifts out of step and ends the level on a thinning batch. The
level's total rate would then measure that finish, not the servers' steady rates.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from forerun.base import files
from forerun.base.errors import ForerunError


@dataclass
class RequestTiming:
    ttft_s: float  # request sent to its first text
    e2e_s: float  # request sent to its last chunk
    tokens: int  # completion tokens (usage, else one per chunk with text)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None for one token)."""
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class LevelResult:
    setup: str
    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    failures: int = 0
    timings: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # what the failed requests raised, each kind once
    draft_tokens: int | None = None  # the server's counters over the level (forerun's /metrics; None: not read)
    accepted_tokens: int | None = None
    prompt_tokens: int = 0  # the level's prompts, token ids sent: its traffic beside the other levels'
    # What shaped its numbers (`run_settings`): a later run into the same folder keeps it only beside its like.
    settings: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _one(client, model: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    start = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            chunks += 1
            if first is None:
                first = time.perf_counter() - start
    end = time.perf_counter() - start
    return RequestTiming(first if first is not None else end, end, usage if usage else chunks)


def shortest(max_tokens: int, spread: float) -> int:
    """The fewest max tokens `request_lengths` draws."""
    if not 0 <= spread < 1:
        raise ForerunError(f"the length spread (--length-spread) must be at least 0 and below 1, got {spread}")
    return max(1, math.ceil((1 - spread) * max_tokens))


def request_lengths(count: int, max_tokens: int, spread: float, seed: int = 0) -> list[int]:
    """Max tokens for `count` requests: spread evenly over [(1 - spread) * max_tokens, max_tokens]
    (at least 1) and shuffled with `seed`, the same list for the same arguments (every server gets
    the same requests). Evenly, not drawn at random: every level then asks for as many tokens a
    request on average, whatever its size (random draws gave a level of 16 requests 46 a request
    and one of 64 requests 49, at 32-64)."""
    low = shortest(max_tokens, spread)
    span = max_tokens - low + 1
    lengths = [low + (2 * i + 1) * span // (2 * count) for i in range(count)]
    random.Random(seed).shuffle(lengths)
    return lengths


def level_prompts(prompts: list, counts: list[int], distinct: bool = False, seed: int = 0) -> list[list]:
    """The prompts each level sends (`counts[i]` for level i): the list over and over from its start
    at every level; with `distinct`, no prompt twice in the whole run, so a drafter that remembers
    earlier answers finds none of them asked again, each level's prompts in an order shuffled with
    `seed`, and every level dealt prompts as long on average as it can be (`_even_deal`), so that
    levels differ in how many requests are in flight rather than in how long their prompts are."""
    if not distinct:
        return [list(itertools.islice(itertools.cycle(prompts), n)) for n in counts]
    if sum(counts) > len(prompts):
        raise ForerunError(
            f"--distinct sends {sum(counts)} different prompts ({' + '.join(map(str, counts))}), "
            f"but the dataset has {len(prompts)}; use fewer levels or requests per level, "
            "or more categories"
        )
    draw = random.Random(seed)
    levels = _even_deal([len(p) for p in prompts], counts, draw)
    for level in levels:
        draw.shuffle(level)
    return [[prompts[i] for i in level] for level in levels]


def _even_deal(lengths: list[int], counts: list[int], draw: random.Random) -> list[list[int]]:
    """Indices into `lengths` (prompt lengths), `counts[i]` for level i: a sample spread evenly over
    the prompts' lengths (and so, roughly, over task kinds, whose lengths differ), dealt shortest
    first each to the level furthest behind its share of the places; then prompts swapped between
    levels while a swap lowers the sum over levels of (tokens - count x the sample's mean length)^2.
    Spreading alone leaves a level of a few requests short: a few prompts (summaries, retrieval
    contexts) are several times the median, and only one level can have each. Levels of a handful
    of requests may still differ (one long prompt can be more than a level's whole share): the
    report gives each level's prompt tokens a request."""
    taken = sum(counts)
    if taken == 0:
        return [[] for _ in counts]
    order = sorted(draw.sample(range(len(lengths)), len(lengths)), key=lambda i: lengths[i])  # ties drawn
    sample = [order[(2 * t + 1) * len(order) // (2 * taken)] for t in range(taken)]
    levels: list[list[int]] = [[] for _ in counts]
    for t, i in enumerate(sample):
        open_ = [lv for lv, n in enumerate(counts) if len(levels[lv]) < n]
        levels[max(open_, key=lambda lv: counts[lv] * (t + 1) / taken - len(levels[lv]))].append(i)
    mean = sum(lengths[i] for i in sample) / taken
    excess = [sum(lengths[i] for i in level) - n * mean for level, n in zip(levels, counts)]  # tokens over
    for _ in range(taken * taken):  # each swap lowers the sum of squares: it ends well before
        best = _best_swap(levels, excess, lengths)
        if best is None:
            break
        p, a, q, b = best
        levels[p][a], levels[q][b] = levels[q][b], levels[p][a]
        moved = lengths[levels[q][b]] - lengths[levels[p][a]]
        excess[p], excess[q] = excess[p] - moved, excess[q] + moved
    return levels


def _best_swap(levels: list[list[int]], excess: list[float], lengths: list[int]) -> tuple[int, int, int, int] | None:
    """(level p, place a, level q, place b): the swap of two prompts that most lowers the sum of
    the levels' squared `excess` (tokens over their share); None when none lowers it."""
    best, gain = None, 1e-9
    for p, q in itertools.combinations(range(len(levels)), 2):
        for a, i in enumerate(levels[p]):
            for b, j in enumerate(levels[q]):
                moved = lengths[i] - lengths[j]  # p gives i, takes j
                change = (excess[p] - moved) ** 2 + (excess[q] + moved) ** 2 - excess[p] ** 2 - excess[q] ** 2
                if -change > gain:
                    best, gain = (p, a, q, b), -change
    return best


def running_order(setups: list, level: int) -> list:
    """The set-ups in the order level number `level` (0, 1, ...) runs them: as given on even
    levels, reversed on odd ones, so no set-up always runs first (a drift of the machine's speed
    within a run would otherwise favour it at every level)."""
    return list(setups) if level % 2 == 0 else list(reversed(setups))


async def run_level(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int | list[int],
    api_key: str = "none",
    setup: str = "",
) -> LevelResult:
    """Every prompt once, at most `concurrency` in flight; `max_tokens` for all, or per prompt."""
    import openai

    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    if len(lengths) != len(prompts):
        raise ValueError(f"{len(lengths)} max_tokens for {len(prompts)} prompts")
    gate = asyncio.Semaphore(concurrency)

    async def limited(client, prompt, length):
        async with gate:
            return await _one(client, model, prompt, length)

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600) as client:
        start = time.perf_counter()
        outcomes = await asyncio.gather(
            *(limited(client, p, n) for p, n in zip(prompts, lengths)), return_exceptions=True
        )
        wall = time.perf_counter() - start
    timings = [o for o in outcomes if isinstance(o, RequestTiming)]
    failures = len(outcomes) - len(timings)
    errors = list(dict.fromkeys(f"{type(o).__name__}: {o}" for o in outcomes if not isinstance(o, RequestTiming)))
    if not timings:
        raise ForerunError(f"every request to {base_url} failed, e.g. {errors[0]}")
    tpots = [t.tpot_s for t in timings if t.tpot_s is not None]
    ttfts = [t.ttft_s for t in timings]
    return LevelResult(
        setup,
        concurrency,
        len(prompts),
        wall,
        sum(t.tokens for t in timings),
        statistics.median(ttfts),
        percentile(ttfts, 0.9),
        statistics.median(tpots) if tpots else None,
        percentile(tpots, 0.9) if tpots else None,
        failures,
        [asdict(t) for t in timings],
        errors,
        prompt_tokens=sum(len(p) for p in prompts),
    )


def write_report(out: Path, levels: list[LevelResult], header: str) -> None:
    files.write_json(out / "results.json", [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in levels], indent=1)
    # A level may run more than once: each row is set beside off's run of the same round.
    rounds, keys = collections.Counter(), []
    for r in levels:
        keys.append((r.concurrency, rounds[r.setup, r.concurrency]))
        rounds[r.setup, r.concurrency] += 1
    off = {key: r.tokens_per_s for r, key in zip(levels, keys) if r.setup == "off"}
    lines = [
        header,
        "",
        "| set-up | concurrency | requests | prompt tokens a request | output tok/s | × off | TTFT p50 / p90 ms | "
        "time per output token p50 / p90 ms | drafted / kept tokens | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ms(value: float | None) -> str:
        return "–" if value is None else f"{value * 1000:.0f}"

    for r, key in zip(levels, keys):
        ratio = f"{r.tokens_per_s / off[key]:.2f}×" if off.get(key) else "–"
        drafted = "–" if r.draft_tokens is None else f"{r.draft_tokens} / {r.accepted_tokens}"
        lines.append(
            f"| {r.setup} | {r.concurrency} | {r.requests} | {r.prompt_tokens / r.requests:.0f} | "
            f"{r.tokens_per_s:.1f} | {ratio} | "
            f"{ms(r.ttft_p50_s)} / {ms(r.ttft_p90_s)} | {ms(r.tpot_p50_s)} / {ms(r.tpot_p90_s)} | "
            f"{drafted} | {r.failures} |"
        )
    failed = [f"- {r.setup} at {r.concurrency}: {error}" for r in levels for error in r.errors]
    if failed:
        lines += ["", "What failed requests raised:", "", *failed]
    files.write_text(out / "report.md", "\n".join(lines) + "\n")


RESULTS, REPORT = "results.json", "report.md"


def run_settings(common: dict, draft: dict | None) -> dict:
    """A level's settings as results.json holds them: `common` to every set-up (model, prompts,
    lengths, levels) and `draft`, the draft model's, for a set-up that speculates (None for one that
    does not: its numbers owe nothing to them)."""
    return json.loads(json.dumps({"run": common, "draft": draft}))


def earlier_levels(out: Path, settings: dict) -> list[LevelResult]:
    """The levels an earlier bench-serve left in `out`, read back so that a later run into the same
    folder adds its set-ups beside them (a set-up run again replaces its own); a clear error where
    they were made with other settings than `settings` (this run's `run_settings`, its draft part
    None where no set-up speculates) or the file is not one bench-serve wrote."""
    path = out / RESULTS
    if not path.exists():
        return []
    levels = []
    for row in _read_rows(path):
        differ = _differences(row.get("settings"), settings)
        if differ:
            raise ForerunError(
                f"{path} holds {row['setup']} results made with other settings ({'; '.join(differ)}); "
                f"use another --out, or remove {RESULTS} to start over"
            )
        levels.append(LevelResult(**{f.name: row[f.name] for f in fields(LevelResult) if f.name in row}))
    return levels


_REQUIRED = [f.name for f in fields(LevelResult) if f.default is MISSING and f.default_factory is MISSING]


def _read_rows(path: Path) -> list[dict]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else f"not valid JSON ({exc.msg})"
        raise ForerunError(f"{path} is {problem}; remove it to start over, or use another --out") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in _REQUIRED) for r in rows):
        raise ForerunError(f"{path} is not a list of bench-serve levels; remove it to start over, or use another --out")
    return rows


def _differences(theirs: object, now: dict) -> list[str]:
    """What differs between a stored level's settings and this run's, each as `name: there, now`."""
    if not isinstance(theirs, dict):
        return ["none recorded there: made by an earlier forerun"]
    pairs = [(theirs.get("run") or {}, now["run"])]
    if theirs.get("draft") is not None and now["draft"] is not None:
        pairs.append((theirs["draft"], now["draft"]))
    return [
        f"{key}: {there.get(key)!r} there, {here.get(key)!r} now"
        for there, here in pairs
        for key in sorted(set(there) | set(here))
        if there.get(key) != here.get(key)
    ]
