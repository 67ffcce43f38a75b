"""Speculation counters per request and summed over a run, with the textbook prediction beside them."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    num_speculative_tokens: int = 0  # K
    num_drafts: int = 0  # steps in which a draft was proposed
    num_draft_tokens: int = 0  # draft tokens proposed
    num_accepted_tokens: int = 0  # draft tokens kept (and emitted)
    num_emitted_tokens: int = 0  # every token emitted, first token and bonus/recovered included
    num_target_forwards: int = 0  # target passes, prefill included
    num_emitted_in_drafts: int = 0  # tokens emitted by the steps that verified a draft
    accepted_per_position: list[int] = field(default_factory=list)  # [K] kept counts by draft position
    draft_seconds: float = 0.0  # wall time the drafter spent proposing (shadow proposals too)
    acceptance_histogram: list[int] = field(default_factory=list)  # [j]: drafting steps that kept j tokens
    steps: list[tuple[int, int]] = field(default_factory=list)  # (drafted, kept) of each drafting step

    def record_step(self, drafted: int, accepted: int, emitted: int) -> None:
        """One target forward that verified `drafted` tokens, kept `accepted`, emitted `emitted`."""
        self.num_target_forwards += 1
        self.num_emitted_tokens += emitted
        counted = min(accepted, emitted)  # a stop inside the run: what was not emitted does not count
        if drafted:
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_emitted_in_drafts += emitted
            if len(self.acceptance_histogram) <= counted:
                self.acceptance_histogram += [0] * (counted + 1 - len(self.acceptance_histogram))
            self.acceptance_histogram[counted] += 1
            self.steps.append((drafted, counted))
        self.num_accepted_tokens += counted
        if len(self.accepted_per_position) < self.num_speculative_tokens:
            self.accepted_per_position += [0] * (self.num_speculative_tokens - len(self.accepted_per_position))
        for i in range(min(counted, len(self.accepted_per_position))):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecMetrics) -> None:
        self.num_speculative_tokens = max(self.num_speculative_tokens, other.num_speculative_tokens)
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.num_target_forwards += other.num_target_forwards
        self.num_emitted_in_drafts += other.num_emitted_in_drafts
        self.draft_seconds += other.draft_seconds
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (width - len(other.accepted_per_position))
        self.accepted_per_position = [a + b for a, b in zip(mine, theirs)]
        # Totals only: the per-step record stays with each request (a server merges without end).
        hist = self.acceptance_histogram
        hist += [0] * (len(other.acceptance_histogram) - len(hist))
        for j, count in enumerate(other.acceptance_histogram):
            hist[j] += count

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_emitted_tokens / self.num_target_forwards if self.num_target_forwards else 0.0

    @property
    def efficiency(self) -> float:
        """Emitted over the most a drafting step could emit (vLLM's system efficiency), in [0, 1].
        Only drafting steps count: the prefill token and undrafted steps have no slots."""
        slots = self.num_drafts * (self.num_speculative_tokens + 1)
        return self.num_emitted_in_drafts / slots if slots else 0.0

    @property
    def predicted_mean_accepted_length(self) -> float:
        """(1 - a^(K+1)) / (1 - a): tokens per step if each draft were kept independently with rate a."""
        a, k = self.acceptance_rate, self.num_speculative_tokens
        if a >= 1.0:
            return float(k + 1)
        return (1 - a ** (k + 1)) / (1 - a)

    def to_dict(self) -> dict:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "efficiency": round(self.efficiency, 4),
            "predicted_mean_accepted_length": round(self.predicted_mean_accepted_length, 4),
            "draft_seconds": round(self.draft_seconds, 6),
        }


def prediction_used(prediction: list[int], output: list[int]) -> tuple[int, int]:
    """(accepted, rejected): the prediction's tokens the output holds in the same order, and the
    rest; OpenAI's accepted / rejected prediction tokens, whatever drafter drafted from it.

    A walk down the output: a token that continues the prediction where the walk stands is kept;
    any other moves the walk to the nearest place ahead where the prediction holds the output's next
    two tokens (its last one, at the end), keeping it and skipping the prediction's tokens between;
    where there is none, it is new text. Linear in the two lengths (an index of the prediction's
    pairs), where an exact longest common subsequence is quadratic: a client sets both lengths, and
    this runs on the engine's thread."""
    index: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(prediction)):
        index.setdefault(tuple(prediction[i : i + 2]), []).append(i)  # the last one alone, too
    at = accepted = 0
    for j, token in enumerate(output):
        if at < len(prediction) and prediction[at] == token:
            at, accepted = at + 1, accepted + 1
            continue
        starts = index.get(tuple(output[j : j + 2]), [])
        k = bisect_left(starts, at)
        if k < len(starts):
            at, accepted = starts[k] + 1, accepted + 1
    return accepted, len(prediction) - accepted
