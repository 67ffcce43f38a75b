"""Shared fixtures: tiny fp32 random models and the character-level tokenizer, built once per session."""
from __future__ import annotations

import copy

import pytest
import torch

from forerun.models.load import LoadedModel
from forerun.models.tokenizer import Tokenizer
from forerun.testing import tiny_model, tiny_tokenizer

# The test machine is shared: one intra-op thread is faster than fighting for cores with tiny tensors.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _private_cost_cache(tmp_path_factory: pytest.TempPathFactory):
    """Pass costs measured in tests (tiny models in temporary folders, real ones on one thread) stay
    out of the user's cache. Session-wide, so module fixtures that build engines are covered too."""
    from forerun import cost_model

    folder = tmp_path_factory.getbasetemp() / "costs"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cost_model, "costs_dir", lambda: folder)
        yield


def perturbed(model: LoadedModel, noise: float, seed: int = 5, name: str = "perturbed") -> LoadedModel:
    """A copy of `model` with Gaussian noise of `noise` x each tensor's std added: a draft that agrees
    with the target often but not always (an independent random model almost never agrees)."""
    decoder = copy.deepcopy(model.decoder)
    gen = torch.Generator().manual_seed(seed)
    for p in decoder.parameters():
        p.data += torch.randn(p.shape, generator=gen) * p.data.std() * noise
    decoder.tie_weights()
    return LoadedModel(name, decoder, model.tokenizer, model.source)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def target() -> LoadedModel:
    """Target without a tokenizer: token ids in, token ids out."""
    return tiny_model(0, name="target")


@pytest.fixture(scope="session")
def target_tok(tokenizer: Tokenizer) -> LoadedModel:
    """The same target weights with the character-level tokenizer (stop strings, text, EOS)."""
    return tiny_model(0, tokenizer, name="target")
