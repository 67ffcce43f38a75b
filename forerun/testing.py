"""Tiny random models for tests and examples: fp32, a few layers, a small vocabulary, no downloads."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from forerun.models.decoder import Decoder, DecoderConfig
from forerun.models.load import LoadedModel, ModelSource
from forerun.models.tokenizer import Tokenizer

# A character-level vocabulary: specials, then printable ASCII.
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def tiny_config(vocab_size: int = 128, num_layers: int = 2, architecture: str = "qwen2", **overrides) -> DecoderConfig:
    fields = dict(architecture=architecture, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                  rms_norm_eps=1e-6, max_position=1024, attention_bias=architecture == "qwen2",
                  tie_embeddings=False)
    fields.update(overrides)
    return DecoderConfig(**fields)


def tiny_decoder(cfg: DecoderConfig | None = None, seed: int = 0, scale: float = 1.0) -> Decoder:
    """A random float32 decoder. `scale` sharpens the logits (larger: more peaked distributions)."""
    cfg = cfg or tiny_config()
    gen = torch.Generator().manual_seed(seed)
    decoder = Decoder(cfg)
    for name, p in decoder.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            p.data.fill_(1.0)
        else:
            p.data = torch.randn(p.shape, generator=gen) * (0.5 / p.shape[-1] ** 0.5)
    decoder.lm_head.weight.data *= scale * 8
    decoder.tie_weights()
    return decoder.eval()


def tiny_tokenizer_folder(folder: Path) -> Path:
    """Write a character-level Hugging Face tokenizer (with a chat template) into `folder`."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_SPECIALS + _CHARS)}
    tok = HFTok(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=_SPECIALS)
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


def tiny_tokenizer(folder: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(str(tiny_tokenizer_folder(folder))))


TINY_VOCAB = len(_SPECIALS) + len(_CHARS)  # 99 tokens


def tiny_model(seed: int = 0, tokenizer: Tokenizer | None = None, name: str = "tiny", **cfg_overrides) -> LoadedModel:
    cfg = tiny_config(vocab_size=TINY_VOCAB, **cfg_overrides)
    return LoadedModel(name, tiny_decoder(cfg, seed), tokenizer, ModelSource("memory", Path("."), name))


def save_hf_folder(model: LoadedModel, folder: Path) -> Path:
    """Save a tiny model as a Hugging Face folder (config.json + model.safetensors + tokenizer)."""
    from safetensors.torch import save_file

    cfg = model.decoder.cfg
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": cfg.architecture, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
              "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tie_embeddings,
              "attention_bias": cfg.attention_bias, "architectures": ["Qwen2ForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    state = {f"model.{k}" if k != "lm_head.weight" else k: v.contiguous()
             for k, v in model.decoder.state_dict().items()
             if not (cfg.tie_embeddings and k == "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"))
    tiny_tokenizer_folder(folder)
    return folder
