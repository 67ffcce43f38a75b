"""A Decoder from its weights: built on the meta device and handed a state dict, or over a GGUF file's own blocks."""

from __future__ import annotations

from pathlib import Path

import torch

from forerun.base.errors import ForerunError
from forerun.models import formats
from forerun.models.decoder import Decoder, DecoderConfig


def build_decoder(
    cfg: DecoderConfig, state: dict[str, torch.Tensor], device: torch.device, quantization: str | None = None
) -> Decoder:
    """Build on the meta device and adopt `state` without copying; `quantization`: state holds that
    format's cached weights."""
    with torch.device("meta"):
        decoder = Decoder(cfg)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if quantization is not None:
        try:
            return formats.get(quantization).load(decoder, state).to(device).eval()
        except (KeyError, RuntimeError) as exc:
            raise ForerunError(
                f"the cached {quantization} weights do not fit the model ({str(exc)[-300:]}); "
                "delete them and load again"
            ) from None
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing = set(decoder.state_dict()) - set(state)
    if missing:
        raise ForerunError(f"the weights lack {len(missing)} tensors the model needs, e.g. {sorted(missing)[:3]}")
    _check_all_used(cfg, state, set(decoder.state_dict()))
    try:
        decoder.load_state_dict({k: state[k] for k in decoder.state_dict()}, assign=True, strict=True)
    except RuntimeError as exc:  # shapes that contradict the config
        raise ForerunError(f"the weights do not match the model's configuration: {str(exc).strip()[-300:]}") from None
    decoder.tie_weights()
    return decoder.to(device).eval()


def _check_all_used(cfg: DecoderConfig, state: dict[str, torch.Tensor], needed: set[str]) -> None:
    """Weights the configuration leaves unused mean it describes another model (fewer layers, no
    biases): dropping them would run a wrong model, so they are refused."""
    # A rotary table some checkpoints saved is recomputed from rope_theta, not a weight.
    unused = sorted(k for k in set(state) - needed if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ForerunError(
            f"the weights hold {len(unused)} tensors a {cfg.architecture} model of {cfg.num_layers} layers "
            f"as config.json describes it does not use, e.g. {unused[:3]}: config.json does not describe "
            "these weights (check num_hidden_layers, attention_bias, tie_word_embeddings); use the model's own"
        )


def build_gguf_decoder(path: Path, cfg: DecoderConfig, device: torch.device, reblock: Path | None = None) -> Decoder:
    """The `gguf` format: products over the file's own blocks (no conversion, nothing cached); with
    `reblock` (a file to keep them in), `q4_0`: the wider products' tensors re-blocked into Q4_0."""
    from forerun.models import gguf_decoder, gguf_format, gguf_loader

    reader = gguf_loader.open_reader(path)
    gguf_loader.check_tensors(reader, cfg, path)
    try:
        reblocked = None if reblock is None else gguf_format.Reblocked(reblock)
        return gguf_decoder.load_decoder(reader, cfg, reblocked).to(device)
    except (KeyError, ValueError) as exc:
        raise ForerunError(f"{path}: its tensors do not fit the model ({exc}); the file may be corrupt") from None
