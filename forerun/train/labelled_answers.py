"""The target's greedy answers with their soft labels, from the passes that write them.

`forerun train --answers N` needs, at every position of prompt + answer, the target's final state
and its top-k next-token distribution (soft_labels.py's labels). Writing the answer computes them
already: a prompt's prefill states every prompt position and scores the next token, and each step
of several prompts' rows (one segment each, on its own cache) states and scores the position it
feeds. Where the native layers run, a row is exact alone or beside others and in any chunks, so
these are the labels `label_chunk` gives prompt + answer in one prefill, without reading the answer
again. Elsewhere (a GPU) the answers are written as padded rows (`data.answer_prompts`) and labelled
in a prefill each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from forerun import native
from forerun.base.errors import ForerunError
from forerun.models.attention import RowLayout, Segment
from forerun.models.decoder import Decoder
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.train.data import check_answerable
from forerun.train.soft_labels import Labels, check_top_k, every_row_labels, top_labels


@dataclass
class _Answer:
    """One prompt being answered and labelled: its tokens so far, its cache, and the labels of
    the positions fed so far (per row: state, top ids, top probabilities)."""

    tokens: list[int]
    cache: KVCache
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    written: int = 0  # answer tokens chosen
    done: bool = False  # the last chosen token ended the answer (still to be fed, for its own label)


@torch.inference_mode()
def labelled_answers(
    target: LoadedModel, prompts: list[list[int]], max_tokens: int, batch_size: int, top_k: int
) -> Iterator[tuple[list[int], Labels]]:
    """The target's greedy answers to `prompts` (`batch_size` stepped together, as the engine's
    lanes: each the answer its prompt gets alone), each with the labels of prompt + answer: a
    prompt's prefill labels its positions, every step the position it feeds, and one more step
    feeds the answer's last token for its own label. The same states, ids and probabilities as
    `label_chunk` of prompt + answer (bit for bit on tiny models of every kernel family and on the
    default target, benchmark-log run 114). Yielded in prompt order."""
    decoder = target.decoder
    if not decoder.chain_prefill:
        raise ForerunError(
            "answers are labelled as they are written only where the native layers run (a GGUF model on a "
            "CPU with the kernels); elsewhere write them with data.answer_prompts and label each with label_chunk"
        )
    check_answerable(target, prompts, max_tokens)
    check_top_k(decoder.cfg.vocab_size, top_k)
    stop_ids = target.tokenizer.stop_ids if target.tokenizer is not None else frozenset()
    for first in range(0, len(prompts), batch_size):
        group = [
            _Answer(list(ids), decoder.new_cache(len(ids) + max_tokens)) for ids in prompts[first : first + batch_size]
        ]
        for answer in group:
            out = decoder.forward_ids(answer.tokens, answer.cache, last_only=True, output_hidden=True, all_hidden=True)
            labels = every_row_labels(decoder, out.hidden[0], top_k)
            answer.rows.append((labels.hidden, labels.top_ids, labels.top_probs))
            _choose(answer, out.logits[0, -1:], max_tokens, stop_ids)
        while live := [a for a in group if a.cache.length < len(a.tokens)]:
            logits, hidden = _step(decoder, live)
            for i, answer in enumerate(live):
                ids, probs = top_labels(logits[i : i + 1], top_k)
                answer.rows.append((hidden[i : i + 1].to(torch.bfloat16).cpu(), ids, probs))
                if not answer.done:
                    _choose(answer, logits[i : i + 1], max_tokens, stop_ids)
        for answer in group:
            yield answer.tokens, Labels(*(torch.cat(column) for column in zip(*answer.rows)))


def _choose(answer: _Answer, logits: torch.Tensor, max_tokens: int, stop_ids: frozenset[int]) -> None:
    """The greedy next token from one row's logits [1, vocab], as the engine picks it."""
    token = int(native.argmax(logits)[0])
    answer.tokens.append(token)
    answer.written += 1
    answer.done = token in stop_ids or answer.written >= max_tokens


def _step(decoder: Decoder, live: list[_Answer]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every live answer's next unfed token after its cache, one row each in one forward: (logits
    [n, vocab] float32, final states [n, hidden])."""
    device = decoder.device
    segments = [Segment(i, i + 1, a.cache, RowLayout.chain(a.cache.length, 1)) for i, a in enumerate(live)]
    tokens = torch.tensor([a.tokens[a.cache.length] for a in live], device=device)
    positions = torch.tensor([a.cache.length for a in live], device=device)
    out = decoder(tokens, positions, None, segments=segments, output_hidden=True)
    return out.logits[0].float(), out.hidden[0]
