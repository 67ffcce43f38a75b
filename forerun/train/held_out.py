"""Per-depth acceptance of a draft head on held-out answers, measured while it trains.

The target answers a few prompts that training never sees (greedy, through the batching engine),
then reads prompt + answer in one prefill: its final hidden state and its greedy next token at every
position are kept (`held-out.safetensors` in the run's folder, so a resumed run measures on the same
answers). On that text the head drafts as it would in `forerun generate` with a chain of greedy
drafts: from every position of the answer, the chain's token j is kept when it and every token
before it equal the target's greedy choice, which is what the verifier keeps on this text. Per
chain start t (the target has read up to x_{t+1}, its features up to f_t):

- EAGLE: `forward_unrolled`, depth j scores x_{t+j+1} from its own features after the first step;
- Medusa: head j at t scores x_{t+j+1} from f_t.

`kept[j-1]` is the share of chains whose first j tokens are all kept (the bench's "kept at position
j"); a chain of D tokens then gives 1 + Σ kept tokens per target pass. Drafting with a tree usually
keeps more than the chain measured here; the trend is what training watches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from forerun.base import files
from forerun.models.load import LoadedModel
from forerun.train.soft_losses import draft_columns

FILE = "held-out.safetensors"
DEPTH = 5  # EAGLE: chain tokens measured (forerun bench's --num-speculative-tokens default)


@dataclass
class HeldOutSequence:
    tokens: torch.Tensor  # int64 [T]: prompt + the target's greedy answer
    hidden: torch.Tensor  # float32 [T, hidden]: the target's final hidden state at each position
    greedy: torch.Tensor  # int64 [T]: the target's greedy next token at each position
    answer: int  # index of the answer's first token


@dataclass
class Acceptance:
    kept: list[float]  # per depth: the share of chains whose first j tokens are kept
    chains: int


def make_held_out(
    target: LoadedModel, prompts: list[list[int]], max_tokens: int, folder: Path
) -> list[HeldOutSequence]:
    """The target's answers to `prompts` with its features and greedy labels, stored in `folder`
    (and read back from there when it holds the same prompts' answers)."""
    from forerun.train.data import answer_prompts, prompts_digest
    from forerun.train.soft_labels import label_chunk

    path = folder / FILE
    digest = prompts_digest(prompts)  # the prompts themselves, not their count
    key = {"target": target.name, "prompts": len(prompts), "prompts_sha256": digest, "max_tokens": max_tokens}
    stored = _stored(folder, key)
    if stored is not None:
        return stored
    sequences = []
    for seq in answer_prompts(target, prompts, max_tokens):
        labels = label_chunk(target, seq.tokens, 1)
        sequences.append(
            HeldOutSequence(torch.tensor(seq.tokens), labels.hidden.float(), labels.top_ids[:, 0].long(), seq.answer)
        )
    folder.mkdir(parents=True, exist_ok=True)
    starts = [0]
    for s in sequences:
        starts.append(starts[-1] + len(s.tokens))
    files.save_tensors(
        path,
        {
            "tokens": torch.cat([s.tokens for s in sequences]).to(torch.int32),
            "hidden": torch.cat([s.hidden for s in sequences]).to(torch.bfloat16),
            "greedy": torch.cat([s.greedy for s in sequences]).to(torch.int32),
            "starts": torch.tensor(starts),
            "answers": torch.tensor([s.answer for s in sequences]),
        },
    )
    files.write_json(folder / (FILE + ".json"), key)
    return sequences


def _stored(folder: Path, key: dict) -> list[HeldOutSequence] | None:
    """The answers kept in `folder` when they were made as `key` says; None where there are none, or
    they are another run's or damaged (they are made again)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if json.loads((folder / (FILE + ".json")).read_text(encoding="utf-8")) == key:
            return _unpack(load_file(str(folder / FILE)))
    except (OSError, ValueError, KeyError, SafetensorError):
        pass
    return None


def _unpack(stored: dict[str, torch.Tensor]) -> list[HeldOutSequence]:
    starts, answers = stored["starts"].tolist(), stored["answers"].tolist()
    return [
        HeldOutSequence(
            stored["tokens"][a:b].long(), stored["hidden"][a:b].float(), stored["greedy"][a:b].long(), answer
        )
        for a, b, answer in zip(starts, starts[1:], answers)
    ]


@torch.no_grad()
def chain_acceptance(
    head: nn.Module, method: str, sequences: list[HeldOutSequence], column: torch.Tensor, embed: nn.Module | None
) -> Acceptance:
    """How deep the head's greedy chains are kept on the held-out answers. `column`: token id ->
    draft-vocabulary column (-100 outside: a token the head cannot draft is never kept)."""
    was_training = head.training
    head.eval()
    device = next(head.parameters()).device
    hits, chains = None, 0
    for s in sequences:
        s = HeldOutSequence(s.tokens.to(device), s.hidden.to(device), s.greedy.to(device), s.answer)
        ok = _kept_per_start(head, method, s, column, embed)  # [D, chains] bool
        if ok is None:
            continue
        deep = ok.cumprod(dim=0).sum(dim=1)  # [D]: chains kept through depth j
        hits = deep if hits is None else hits + deep
        chains += ok.shape[1]
    head.train(was_training)
    if hits is None:
        return Acceptance([], 0)
    return Acceptance([float(h) / chains for h in hits], chains)


def _kept_per_start(
    head: nn.Module, method: str, s: HeldOutSequence, column: torch.Tensor, embed: nn.Module | None
) -> torch.Tensor | None:
    """ok [D, C]: whether depth j's draft equals the target's greedy token, for the C chain starts
    t = answer - 1 ... T - 1 - D (the first draft follows the target's first answer token)."""
    t_len = len(s.tokens)
    if method == "eagle":
        depth = DEPTH
        outs = head.forward_unrolled(embed(s.tokens[1:]).float(), s.hidden[:-1], depth)  # row r: scores x_{r+2}
        guesses = torch.stack([head.logits(o).argmax(-1) for o in outs])  # [D, T-1]
        step = 1  # depth j of the chain from t sits in row t + j - 1
    else:
        depth = head.num_heads
        guesses = head(s.hidden).argmax(-1)  # [H, T]: head j at t scores x_{t+j+1}
        step = 0  # every depth in row t
    starts = torch.arange(max(s.answer - 1, 0), t_len - depth, device=s.tokens.device)  # [C]
    if len(starts) == 0:
        return None
    want = draft_columns(column, s.greedy)  # [T]: the greedy token after position p, as a column
    rows = []
    for j in range(1, depth + 1):
        # x_{t+j+1} is the greedy token after position t + j
        rows.append(guesses[j - 1, starts + step * (j - 1)] == want[starts + j])
    return torch.stack(rows)
