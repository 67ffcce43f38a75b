"""A token's own bytes (`Tokenizer.token_bytes`, chat logprobs' `bytes`): where a character is split
over tokens each holds part of it, and their bytes joined are the character's UTF-8, as OpenAI's
`bytes` field promises, where the token's text alone shows only U+FFFD."""

from __future__ import annotations

import pytest

from forerun.models.tokenizer import Tokenizer, _byte_of_char

TEXT = "a 🐍 ü 日本"


def _byte_level() -> Tokenizer:
    """A byte-level BPE tokenizer without merges: every byte of the text is a token of its own."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(_byte_of_char()))}
    tok = HFTok(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok))


def _byte_fallback() -> Tokenizer:
    """A SentencePiece-style vocabulary: whole pieces where it has them, else <0xNN> byte tokens."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "a", "▁", *(f"<0x{b:02X}>" for b in range(256))]
    tok = HFTok(models.BPE({p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok))


def test_the_byte_level_alphabet_is_every_byte_once() -> None:
    table = _byte_of_char()
    assert sorted(table.values()) == list(range(256))
    assert table["a"] == ord("a") and table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n")


@pytest.mark.parametrize("make", [_byte_level, _byte_fallback])
def test_the_bytes_of_a_text_s_tokens_joined_are_its_utf8(make) -> None:
    tok = make()
    ids = tok.hf.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    assert "\ufffd" in [tok.piece(i) for i in ids]  # a character split over tokens: its pieces show U+FFFD
    assert b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode()
    assert tok.token_bytes(tok.hf.convert_tokens_to_ids("a")) == b"a"


def test_a_sentencepiece_pieces_space_is_kept_where_decoding_it_alone_strips_it() -> None:
    """Llama 2's and Mistral's decoders strip a text's first space: a token's own bytes must not."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTok
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "a", "▁", "▁a", *(f"<0x{b:02X}>" for b in range(256))]
    tok = HFTok(models.BPE({p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    spm = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>"))
    assert spm.hf.decode([3]) == "a"  # decoding alone strips the space
    assert spm.token_bytes(3) == b" a" and spm.token_bytes(2) == b" " and spm.token_bytes(1) == b"a"
    assert spm.token_bytes(spm.hf.convert_tokens_to_ids("<s>")) == b"<s>"
