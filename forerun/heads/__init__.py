"""Draft heads: small networks that read the target's own hidden state and guess what comes next.

A head lives in a folder: `config.json` (what kind, its sizes, the draft vocabulary it scores, and
the checksum of the target it was trained on) and `head.safetensors` (its weights). A head reads
one target's features and means nothing beside another, so loading checks the checksum first.

- `medusa.py`: Medusa heads (Cai et al., 2024), one residual block per future position.
- `eagle.py`: an EAGLE head (Li et al., 2024), one decoder layer that drafts at the feature level.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from forerun.base.errors import ForerunError
from forerun.base.files import load_tensors, save_tensors, write_json
from forerun.models.gguf_format import GGUFLinear
from forerun.models.linear import Int8Linear, Linear
from forerun.models.load import LoadedModel, model_identity
from forerun.models.w8a8 import W8A8Linear

CONFIG = "config.json"
WEIGHTS = "head.safetensors"
FORMAT_VERSION = 1


@dataclass
class HeadConfig:
    method: str  # "medusa" or "eagle"
    target_checksum: str  # target_checksum() of the model whose features it read
    target_name: str  # for messages
    hidden_size: int  # the target's hidden size
    vocab_size: int  # the target's vocabulary (the draft vocabulary's token ids index it)
    draft_vocab: int  # tokens the head scores (its projection's rows)
    num_heads: int = 0  # medusa: future positions guessed
    intermediate_size: int = 0  # eagle: its layer's MLP width
    training: dict = field(default_factory=dict)  # what it was trained on, for people to read
    version: int = FORMAT_VERSION


def target_checksum(model: LoadedModel) -> str:
    """What names the target's weights: its GGUF file's sha256 or model folder's identity, else (a
    model built in memory) a digest of its configuration and embedding matrix."""
    identity = model_identity(model)
    if identity is not None:
        return identity
    decoder = model.decoder
    digest = hashlib.sha256(repr(decoder.cfg).encode())
    digest.update(decoder.embed_tokens.weight.detach().float().cpu().numpy().tobytes())
    return "memory-" + digest.hexdigest()[:32]


def float_weight(module: nn.Module) -> torch.Tensor:
    """The float32 weight [out, in] of a product in any of forerun's formats."""
    if isinstance(module, W8A8Linear):
        return module.qweight().float() * module.scale[:, None]
    if isinstance(module, GGUFLinear):
        return module.dequantized()
    if isinstance(module, Int8Linear):
        return module.qweight.float() * module.scale.float()[:, None]
    if isinstance(module, (Linear, nn.Linear)):
        return module.weight.detach().float()
    raise TypeError(f"cannot read the weight of a {type(module).__name__}")


def save_head(folder: Path, config: HeadConfig, head: nn.Module) -> None:
    """Write the head's folder, each file whole: weights first, the config that names them last."""
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_tensors(folder / WEIGHTS, state)
    write_json(folder / CONFIG, asdict(config), indent=1)


def read_config(folder: str | Path) -> HeadConfig:
    folder = Path(folder).expanduser()
    path = folder / CONFIG
    if not path.is_file():
        raise ForerunError(f"{folder} is not a draft head: it has no {CONFIG}; make one with `forerun train`")
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "method" not in data and ("model_type" in data or "architectures" in data):
            raise ForerunError(
                f"{folder} is a model folder, not a draft head: pass the folder `forerun train` wrote the head to"
            )
        config = HeadConfig(**data)
    except (ValueError, TypeError) as exc:
        raise ForerunError(f"{path} is not a forerun head config ({exc}); train the head again") from None
    if config.version != FORMAT_VERSION:
        raise ForerunError(f"{folder} holds a head of format {config.version}; this forerun reads {FORMAT_VERSION}")
    return config


def load_head(folder: str | Path, target: LoadedModel, method: str) -> tuple[HeadConfig, nn.Module]:
    """The head in `folder`, built for `target`; a clear error when it is another kind of head or
    was trained on another target."""
    folder = Path(folder).expanduser()
    config = read_config(folder)
    if config.method != method:
        raise ForerunError(
            f"{folder} holds a {config.method} head, not a {method} head; use --speculative-method {config.method}"
        )
    checksum = target_checksum(target)
    if config.target_checksum != checksum:
        raise ForerunError(
            f"the head in {folder} was trained on {config.target_name} (checksum "
            f"{config.target_checksum[:16]}), not on this target {target.name} ({checksum[:16]}); "
            "a head reads one target's features only: train one for this target with `forerun train`"
        )
    cfg = target.decoder.cfg
    if (config.hidden_size, config.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise ForerunError(
            f"the head in {folder} is sized for hidden {config.hidden_size} and vocabulary "
            f"{config.vocab_size}, the target has {cfg.hidden_size} and {cfg.vocab_size}"
        )
    head = build_head(config, target)
    path = folder / WEIGHTS
    if not path.is_file():
        raise ForerunError(f"{folder} has {CONFIG} but no {WEIGHTS}; train the head again")
    state = load_tensors(path, "train the head again")
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ForerunError(f"{path} does not fit a {config.method} head of this config: {exc}") from None
    return config, head.eval()


def build_head(config: HeadConfig, target: LoadedModel) -> nn.Module:
    """An untrained head of `config`'s shape (weights to be loaded or trained)."""
    from forerun.heads.eagle import EagleHead
    from forerun.heads.medusa import MedusaHeads

    vocab = torch.zeros(config.draft_vocab, dtype=torch.long)
    if config.method == "medusa":
        return MedusaHeads(config.hidden_size, config.num_heads, vocab)
    if config.method == "eagle":
        return EagleHead(target.decoder.cfg, config.intermediate_size, vocab)
    raise ForerunError(f"unknown head kind {config.method!r}; forerun makes medusa and eagle heads")


def fast_products_(head: nn.Module) -> nn.Module:
    """Every nn.Linear of a trained head as an 8-bit product (a drafting head's weights are read
    once per draft token, so bytes are its cost), in place: Q8_0 blocks on the native kernels where
    they run (the kernels the model's own products use), else w8a8 where fbgemm runs."""
    from forerun import native
    from forerun.models import w8a8
    from forerun.models.gguf_format import GGUFLinear

    device = next(head.parameters()).device
    blocks = device.type == "cpu" and native.available()
    if not blocks and not w8a8.available(device):
        return head
    for module in list(head.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                weight, bias = child.weight.detach(), child.bias.detach() if child.bias is not None else None
                fast = (
                    GGUFLinear.from_float(weight, bias)
                    if blocks and weight.shape[1] % 32 == 0
                    else W8A8Linear.from_float(weight, bias)
                )
                setattr(module, name, fast)
    return head


# Per target decoder: the heads loaded for it, by (kind, folder). A server has a drafter per running
# sequence; they read one head, never write it, so they share one copy.
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_head(folder: str | Path, target: LoadedModel, method: str) -> tuple[HeadConfig, nn.Module]:
    """`load_head`, on the target's device with its products made fast, once per target and folder."""
    key = (method, str(Path(folder).expanduser().resolve()))
    loaded = _LOADED.setdefault(target.decoder, {})
    if key not in loaded:
        config, head = load_head(folder, target, method)
        loaded[key] = (config, fast_products_(head.to(target.decoder.device)))
    return loaded[key]
