"""The drafter protocol (drafters/base.py): every registered drafter is a Drafter, a drafter with the
three required methods alone runs through the engine and the batch exactly, and each registry entry
says what its callers need to know."""

from __future__ import annotations

import inspect

import pytest

from forerun import drafters
from forerun.base.config import SamplingParams
from forerun.drafters.base import Drafter
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine
from forerun.models.load import LoadedModel
from forerun.models.testing import tiny_model
from forerun.policy.draft_length import DraftLengthPolicy
from forerun.policy.pass_costs import PassCosts
from forerun.verification.tree import DraftTree

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
FLAT = PassCosts([0.1] * 8 + [0.2] * 8)  # rows free to eight: drafting pays where drafts are kept


class Repeater(Drafter):
    """Only what the protocol requires: proposes the context's last k tokens again."""

    def start(self, prompt_ids, target_cache, max_len) -> None:
        self.proposals = 0

    def propose(self, context, k, params, generator) -> DraftTree | None:
        self.proposals += 1
        return DraftTree.chain(context[-k:]) if len(context) >= k else None

    def observe(self, num_accepted, aux_logits=None) -> None:
        pass


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_model(3, name="protocol-target", num_layers=2)


def test_every_registered_drafter_is_a_drafter() -> None:
    entries = drafters.entries()
    assert set(entries) == set(drafters.available()) and len(entries) >= 8
    for name, entry in entries.items():
        assert isinstance(entry.factory, type) and issubclass(entry.factory, Drafter), name


def test_the_protocol_requires_start_propose_and_observe() -> None:
    class Silent(Drafter):
        def start(self, prompt_ids, target_cache, max_len) -> None:
            pass

        def propose(self, context, k, params, generator):
            return None

    with pytest.raises(TypeError, match="observe"):
        Silent()


@pytest.mark.parametrize("policy", [False, True], ids=["fixed", "adaptive"])
def test_a_drafter_without_optional_hooks_gives_the_plain_greedy_output(target, policy) -> None:
    plain = Engine(target).generate(PROMPT, GREEDY).token_ids
    drafter = Repeater()
    engine = Engine(target, drafter, 3, DraftLengthPolicy(FLAT, 3) if policy else None)
    out = engine.generate(PROMPT, GREEDY)
    assert out.token_ids == plain
    assert drafter.proposals > 0 and out.metrics.num_drafts > 0


def test_drafters_without_optional_hooks_batch_as_they_run_alone(target) -> None:
    def new_engine() -> Engine:
        return Engine(target, Repeater(), 3, DraftLengthPolicy(FLAT, 3))

    prompts = [PROMPT, [9, 10, 9, 10, 9], [11, 12, 13]]
    alone = [new_engine().generate(p, GREEDY).token_ids for p in prompts]
    batch = BatchEngine(new_engine, len(prompts))
    for key, prompt in enumerate(prompts):
        batch.add(key, prompt, GREEDY)
    while not all(lane.run.seq.finished for lane in batch.lanes.values()):
        batch.step()
    assert [batch.remove(key).token_ids for key in range(len(prompts))] == alone


def test_the_optional_hooks_default_to_a_drafter_that_needs_none() -> None:
    drafter = Repeater()
    drafter.start(PROMPT, None, 64)
    assert drafter.max_rows(4) == 4 and drafter.cost_per_token() is None
    assert not drafter.stateless and not drafter.reads_features and drafter.memory is None
    assert drafter.next_source(PROMPT, GREEDY) is None and drafter.costless_source(PROMPT, GREEDY) is None
    assert drafter.batch_pass_seconds(4) is None and drafter.source is None
    steps = drafter.propose_steps(PROMPT, 2, GREEDY, None)
    with pytest.raises(StopIteration) as stop:
        next(steps)  # no model forward to share: the proposal comes back at once
    assert stop.value.value.tokens == PROMPT[-2:]


def test_the_registry_says_which_methods_run_a_draft_model() -> None:
    assert drafters.draft_model_methods() == ("draft", "auto")
    assert drafters.needs_draft_model("auto") and not drafters.needs_draft_model("ngram")
    assert not drafters.needs_draft_model("no-such-method") and not drafters.needs_draft_model(None)


def test_every_cli_option_names_a_keyword_of_its_drafter() -> None:
    for name, entry in drafters.entries().items():
        keywords = inspect.signature(entry.factory).parameters
        assert set(entry.cli_options.values()) <= set(keywords), name
    assert drafters.cli_options("suffix")["suffix_min_prob"] == "min_prob"
    assert drafters.cli_options("no-such-method") == {}


def test_a_gate_hears_the_tokens_the_request_may_still_emit(target) -> None:
    # The draft model asks its catch-up gate with what is left of max_tokens at that context, and
    # with the tokens emitted so far.
    drafter = drafters.create("draft", target, {"model": target})
    asked = []
    drafter.set_gate(lambda seconds, token_cost, alpha, remaining, emitted: asked.append((remaining, emitted)) or False)
    prompt = list(range(30, 50))  # with two tokens out, a 21-token catch-up: the gate is asked
    drafter.start(prompt, None, 64)
    assert drafter.propose(prompt + [3, 4], 2, SamplingParams(max_tokens=10), None) is None
    assert asked == [(8, 2)]
