"""Sequence: how a request ends (stop token, max_tokens, stop string) and what text may be streamed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.engine.sequence import Sequence

EOS = 2


class ByteTokenizer:
    """Token i is byte i (0-255), decoded as UTF-8 with replacement: a multi-byte character shows as
    U+FFFD until its last byte arrives, as with real byte-level BPE tokenizers."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")

    def stream(self, skip_special_tokens: bool = True) -> None:
        return None  # no incremental decoder: the output is decoded whole after every token


class StreamingByteTokenizer(ByteTokenizer):
    """ByteTokenizer with an incremental decoder, as a fast tokenizer's DecodeStream: a character's
    bytes wait in it until its last arrives."""

    def __init__(self) -> None:
        self.streams = True
        self.streamed = 0  # decoders handed out

    def stream(self, skip_special_tokens: bool = True):
        import codecs

        if not self.streams:
            return None
        self.streamed += 1
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        class Stream:
            def step(self, token_id: int) -> str:
                return "" if token_id == EOS else decoder.decode(bytes([token_id]))

        return Stream()


def feed(seq: Sequence, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Append `ids` in steps of `chunks` tokens (as the engine does), taking text after each step."""
    pieces, i, sizes = [], 0, list(chunks or [])
    while i < len(ids) and not seq.finished:
        size = max(1, sizes.pop(0)) if sizes else 1
        for token in ids[i : i + size]:
            if seq.append(token):
                break
        i += size
        pieces.append(seq.take_text())
    return pieces


def make(params: SamplingParams, tokenizer=None) -> Sequence:
    return Sequence([65, 66], params, tokenizer if tokenizer is not None else ByteTokenizer(), frozenset({EOS}))


def test_stop_token_ends_with_reason_stop_and_is_kept_out_of_the_text():
    seq = make(SamplingParams(max_tokens=10))
    pieces = feed(seq, list(b"hi") + [EOS] + list(b"more"))
    assert seq.finished and seq.finish_reason == "stop"
    assert seq.output_ids == [104, 105, EOS]
    assert seq.text == "hi" and "".join(pieces) == "hi"
    assert seq.context == [65, 66, 104, 105, EOS]


def test_max_tokens_ends_with_reason_length():
    seq = make(SamplingParams(max_tokens=3))
    assert not seq.append(ord("a")) and not seq.append(ord("b"))
    assert seq.append(ord("c"))
    assert seq.finish_reason == "length" and seq.text == "abc"


def test_stop_token_at_the_last_allowed_position_reports_stop():
    seq = make(SamplingParams(max_tokens=2))
    seq.append(ord("a"))
    assert seq.append(EOS) and seq.finish_reason == "stop"


def test_ignore_eos_keeps_going_past_stop_tokens():
    seq = make(SamplingParams(max_tokens=3, ignore_eos=True))
    feed(seq, [ord("a"), EOS, ord("b"), ord("c")])
    assert seq.finish_reason == "length" and seq.output_ids == [ord("a"), EOS, ord("b")]


def test_stop_string_truncates_the_text_and_finishes():
    seq = make(SamplingParams(max_tokens=50, stop=("END",)))
    pieces = feed(seq, list(b"hello ENDworld"))
    assert seq.finish_reason == "stop"
    assert seq.text == "hello " and "".join(pieces) == "hello "
    assert bytes(seq.output_ids) == b"hello END"  # tokens stop at the one completing the match


def test_the_earliest_stop_string_wins():
    seq = make(SamplingParams(max_tokens=50, stop=("xyz", "y")))
    feed(seq, list(b"abxyz"))
    assert seq.text == "abx" and seq.finish_reason == "stop"
    seq = make(SamplingParams(max_tokens=50, stop=("c", "abcd")))
    feed(seq, list(b"xxabcd"), chunks=[6])  # both complete within one step: cut at the earlier start
    assert seq.text == "xxab"


def test_stop_string_inside_one_multi_character_token(tokenizer):
    ids = tokenizer.encode("say STOP now")
    seq = Sequence([1], SamplingParams(max_tokens=50, stop=("TOP",)), tokenizer, tokenizer.stop_ids)
    feed(seq, ids, chunks=[4, 8])
    assert seq.text == "say S" and seq.finish_reason == "stop"


def test_a_stop_string_prefix_is_held_back_until_it_is_decided():
    seq = make(SamplingParams(max_tokens=50, stop=("<end>",)))
    assert feed(seq, list(b"ab<en")) == ["a", "b", "", "", ""]
    seq.append(ord("x"))  # "<enx": no longer a prefix, released
    assert seq.take_text() == "<enx"
    seq2 = make(SamplingParams(max_tokens=5, stop=("<end>",)))
    pieces = feed(seq2, list(b"ab<en"))  # ends by length: the held text is final
    assert seq2.finish_reason == "length" and pieces == ["a", "b", "", "", "<en"]


def test_an_unfinished_utf8_character_is_held_back():
    seq = make(SamplingParams(max_tokens=50))
    euro = list("€".encode())  # three bytes
    assert feed(seq, [ord("a")] + euro[:2]) == ["a", "", ""]
    seq.append(euro[2])
    assert seq.take_text() == "€"


def test_stop_strings_without_a_tokenizer_are_a_user_error():
    with pytest.raises(ForerunError, match="stop strings"):
        Sequence([1], SamplingParams(stop=("x",)), None, frozenset())


def test_without_a_tokenizer_only_tokens_and_lengths_end_a_sequence():
    seq = Sequence([1], SamplingParams(max_tokens=3), None, frozenset({9}))
    feed(seq, [4, 9, 5])
    assert seq.finish_reason == "stop" and seq.text == "" and seq.output_ids == [4, 9]


def reference(ids: list[int], stop: tuple[str, ...], max_tokens: int) -> tuple[str, str, int]:
    """What a request must end as: text, finish reason, number of tokens kept; found by brute force."""
    tok = ByteTokenizer()
    for n in range(1, len(ids) + 1):
        if ids[n - 1] == EOS:
            return tok.decode(ids[:n]), "stop", n
        text = tok.decode(ids[:n])
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return text[: min(hits)], "stop", n
        if n == max_tokens:
            return text, "length", n
    raise AssertionError("the generated ids must end the sequence")


ALPHABET = "ab€"


@pytest.mark.parametrize("tokenizer", [ByteTokenizer, StreamingByteTokenizer])
@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=24),
    stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=3),
    chunks=st.lists(st.integers(1, 6), max_size=30),
    max_tokens=st.integers(1, 80),
    eos_at=st.one_of(st.none(), st.integers(0, 60)),
)
def test_streamed_pieces_are_final_and_join_to_the_final_text(tokenizer, text, stop, chunks, max_tokens, eos_at):
    # The same whether the output is decoded whole after every token or a token at a time.
    ids = list(text.encode())
    if eos_at is not None:
        ids.insert(min(eos_at, len(ids)), EOS)
    ids += list(b"a" * 80)  # enough tokens to always reach max_tokens
    seq = make(SamplingParams(max_tokens=max_tokens, stop=tuple(stop)), tokenizer())
    streamed = ""
    final_text, reason, kept = reference(ids, tuple(stop), max_tokens)
    pieces = feed(seq, ids, chunks)
    for piece in pieces:
        streamed += piece
        # Nothing streamed is ever taken back: every moment's stream is a prefix of the final text,
        # so it never holds a stop string nor a prefix of one that later completed.
        assert final_text.startswith(streamed)
    # Half a character is never streamed while more may come (at the very end it is the text).
    assert "\ufffd" not in "".join(pieces[:-1])
    assert seq.finished
    assert (seq.text, seq.finish_reason, len(seq.output_ids)) == (final_text, reason, kept)
    assert streamed == final_text
    assert not any(s in final_text for s in stop)


def test_a_token_at_a_time_a_part_of_a_character_waits_and_the_end_shows_it_as_a_whole_decode():
    tok = StreamingByteTokenizer()
    seq = make(SamplingParams(max_tokens=4), tok)
    euro = list("€".encode())  # three bytes
    assert not seq.append(ord("a")) and not seq.append(euro[0]) and not seq.append(euro[1])
    assert seq.text == "a" and seq.take_text() == "a"  # the character's first bytes wait
    assert seq.append(euro[0])  # max_tokens: a character that never completed
    assert seq.text == ByteTokenizer().decode([ord("a"), *euro[:2], euro[0]])  # as a whole decode renders it
    assert tok.streamed == 1


class StrayingTokenizer(StreamingByteTokenizer):
    """A stream whose text is not the whole decode's (a tokenizer the stream does not fit)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" + super().decode(ids)


def test_a_stream_that_strays_from_the_whole_decode_is_not_used_again():
    tok = StrayingTokenizer()
    seq = make(SamplingParams(max_tokens=2), tok)
    seq.append(ord("a"))
    assert seq.take_text() == "a"
    with pytest.warns(UserWarning, match="decoding whole"):
        seq.append(ord("b"))
    assert seq.text == "xab" and tok.streams is False
    later = make(SamplingParams(max_tokens=2), tok)
    later.append(ord("c"))
    assert later.text == "xc" and tok.streamed == 1  # decoded whole: no stream asked for


def test_the_stop_reason_names_the_stop_string_or_the_requests_own_stop_token():
    seq = make(SamplingParams(max_tokens=50, stop=("xyz", "y")))
    feed(seq, list(b"abxyz"))
    assert seq.stop_reason == "y"  # the one that cut the text
    seq = make(SamplingParams(max_tokens=50, stop_token_ids=(ord("!"),)))
    feed(seq, list(b"hi!more"))
    assert (seq.text, seq.stop_reason) == ("hi!", ord("!"))
    for ids, max_tokens in ((list(b"hi") + [EOS], 50), (list(b"hello"), 3)):  # the model's end, and length
        seq = make(SamplingParams(max_tokens=max_tokens, stop=("zz",)))
        feed(seq, ids)
        assert seq.finished and seq.stop_reason is None


def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_the_text():
    seq = make(SamplingParams(max_tokens=50, stop=("END",), include_stop_str_in_output=True))
    pieces = feed(seq, list(b"hello ENDworld"))
    assert seq.text == "hello END" == "".join(pieces) and seq.stop_reason == "END"
    seq = make(SamplingParams(max_tokens=50, stop=("c", "abcd"), include_stop_str_in_output=True))
    feed(seq, list(b"xxabcd"), chunks=[6])  # "c" completes first, inside the step that completes "abcd"
    assert seq.text == "xxabc" and seq.stop_reason == "c"
    seq = make(SamplingParams(max_tokens=50, stop=("ab", "b"), include_stop_str_in_output=True))
    feed(seq, list(b"xab"))  # one token completes both: the first to start wins
    assert seq.text == "xab" and seq.stop_reason == "ab"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=24),
    stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 6), max_size=30),
)
def test_with_the_stop_string_kept_streamed_pieces_still_join_to_the_final_text(text, stop, chunks):
    ids = list(text.encode()) + list(b"a" * 80)
    seq = make(SamplingParams(max_tokens=60, stop=tuple(stop), include_stop_str_in_output=True))
    cut, reason, kept = reference(ids, tuple(stop), 60)
    whole = ByteTokenizer().decode(ids[:kept])
    hits = sorted((whole.find(s), len(s), s) for s in stop if s in whole)
    want = whole[: hits[0][0] + hits[0][1]] if reason == "stop" else cut
    streamed = "".join(feed(seq, ids, chunks))
    assert (seq.text, seq.finish_reason, len(seq.output_ids)) == (want, reason, kept)
    assert streamed == want and seq.stop_reason == (hits[0][2] if reason == "stop" else None)
