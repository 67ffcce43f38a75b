"""Shared fixtures: tiny fp32 random models and the character-level tokenizer, built once per session."""

from __future__ import annotations

import copy

import pytest
import torch

from forerun.base.paths import forerun_home
from forerun.models.load import LoadedModel
from forerun.models.testing import tiny_model, tiny_tokenizer
from forerun.models.tokenizer import Tokenizer

# The test machine is shared: one intra-op thread is faster than fighting for cores with tiny tensors.
torch.set_num_threads(1)


# Caches keyed by what they hold (downloads, conversions, compiled kernels, built peers), which the
# tests share with the user's FORERUN_HOME; everything else (measured pass costs above all) is private.
SHARED_CACHES = ("models", "converted", "kernels", "peers", "draft-vocab")


@pytest.fixture(scope="session", autouse=True)
def _private_home(tmp_path_factory: pytest.TempPathFactory):
    """FORERUN_HOME for the session: a temporary folder that links the user's content-keyed caches, so
    pass costs measured in tests (tiny models in temporary folders, real ones on one thread) stay out
    of the user's cache. Session-wide, so module fixtures that build engines are covered too."""
    real = forerun_home()
    home = tmp_path_factory.getbasetemp() / "home"
    home.mkdir()
    for name in SHARED_CACHES:
        (real / name).mkdir(exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_HOME", str(home))
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
