"""Tokenizer and chat template (from transformers), every token id that ends generation, a code
model's fill-in-the-middle prompt, and an output's text a token at a time."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from forerun.base.errors import ForerunError
from forerun.base.prompts import valid_unicode
from forerun.base.tools import CALL_OPEN
from forerun.models.template_caps import template_caps

# Special tokens that end a turn or a document in the common families (and a code model's padding
# and file separators, which end a filled-in middle); llama.cpp stops on the same.
_STOP_TEXTS = {
    *("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>", "<|EOT|>"),
    *("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<fim_pad>", "<file_sep>"),
}
# Fill-in-the-middle markers of the code-model families, in the order the prompt writes them: before
# the text ahead of the gap, before the text after it, and where the model writes what goes between.
INFILL_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),  # SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
# Repository-level markers that come with some families' fill-in-the-middle ones: before a
# repository's name, and before each file's name (llama.cpp's /infill writes other files this way).
REPO_MARKERS = (("<|repo_name|>", "<|file_sep|>"), ("<reponame>", "<file_sep>"))
NO_INFILL = (
    "this model's vocabulary has no fill-in-the-middle tokens (such as <|fim_prefix|>), so it cannot fill "
    "in text before a suffix; leave out the suffix, or use a code model trained to fill in (Qwen2.5-Coder, "
    "StarCoder, DeepSeek-Coder)"
)
NO_TOOLS = "this model's chat template does not show the model tools, so it cannot call them; leave out tools"
# What `apply_chat` hands the template itself (and transformers' own arguments): not a template kwarg.
TEMPLATE_SETS = frozenset(
    ("messages", "conversation", "tools", "documents", "tokenize", "add_generation_prompt", "continue_final_message")
    + ("chat_template", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs")
)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece vocabulary's byte fallback
METASPACE = "\u2581"  # SentencePiece's space


class Tokenizer:
    def __init__(self, hf_tokenizer, extra_stop_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        stops = {int(i) for i in extra_stop_ids}
        if hf_tokenizer.eos_token_id is not None:
            stops.add(int(hf_tokenizer.eos_token_id))
        # Only special (added) tokens count: "</s>" can be an ordinary piece of text in a BPE vocabulary.
        for token_id, token in getattr(hf_tokenizer, "added_tokens_decoder", {}).items():
            if str(token) in _STOP_TEXTS:
                stops.add(int(token_id))
        self.stop_ids: frozenset[int] = frozenset(stops)
        self._pieces: dict[int, str] = {}
        self.streams = True  # outputs are decoded a token at a time where the tokenizer can (`stream`)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(valid_unicode(text, "the prompt"), add_special_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = True) -> TextStream | None:
        """An incremental decoder for one output (None where this tokenizer has none: a generation
        then decodes its whole output after every token, O(n) a token). `decode`'s text, grown a
        token at a time by the tokenizers library's DecodeStream; not where transformers cleans up
        spaces after decoding, which the stream does not."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if not self.streams or backend is None or getattr(self.hf, "clean_up_tokenization_spaces", False):
            return None
        return TextStream(backend, skip_special_tokens)

    def piece(self, token_id: int) -> str:
        """One token's own text, special tokens included (logprobs name tokens by it)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.hf.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: part of a character where it holds only part of one (`piece` shows
        that as U+FFFD), so a client joins a character split over tokens (OpenAI's `bytes`). From
        the vocabulary's byte-level alphabet or byte fallback, or a SentencePiece piece with its ▁
        as a space; else the piece's UTF-8."""
        raw = self.hf.convert_ids_to_tokens(int(token_id))
        if isinstance(raw, str):
            table = _byte_of_char() if self._byte_level else {}
            if table and all(c in table for c in raw):
                return bytes(table[c] for c in raw)
            if match := _BYTE_TOKEN.fullmatch(raw):
                return bytes([int(match.group(1), 16)])
            if self._metaspace and int(token_id) not in self._special_ids:
                return raw.replace(METASPACE, " ").encode("utf-8")  # decoding one token alone strips its space
        return self.piece(token_id).encode("utf-8")

    def encode_as_text(self, text: str) -> list[int]:
        """`text`'s ids without BOS, special tokens' text read as plain text (a file's contents). A
        copy of the backend made once does it: the shared one's `split_special_tokens` switch, set
        per call, would change other threads' encodings meanwhile."""
        backend = self._text_backend
        if backend is None:
            return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        return backend.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _text_backend(self):
        """The backend tokenizer's copy that never reads special tokens (None: no fast backend)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return None
        from tokenizers import Tokenizer as Backend

        copy = Backend.from_str(backend.to_str())
        copy.encode_special_tokens = True
        return copy

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.hf.all_special_ids)  # transformers builds the list anew on every read

    @functools.cached_property
    def _metaspace(self) -> bool:
        """Whether the vocabulary spells a space as SentencePiece's ▁ (its decoder turns ▁ back)."""
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        return decoder is not None and METASPACE.encode() in decoder.__getstate__()

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the vocabulary spells bytes in the byte-level alphabet (asked once)."""
        from tokenizers import decoders

        backend = getattr(self.hf, "backend_tokenizer", None)
        return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)

    @functools.cached_property
    def infill_markers(self) -> tuple[int, int, int] | None:
        """The ids of the vocabulary's fill-in-the-middle markers (prefix, suffix, middle), None where
        it has none: each must be one added token."""
        return self._added_set(INFILL_MARKERS)

    @functools.cached_property
    def repo_markers(self) -> tuple[int, int] | None:
        """The ids of the vocabulary's repository-name and file-separator tokens, None where it has none."""
        return self._added_set(REPO_MARKERS)

    def _added_set(self, families: tuple[tuple[str, ...], ...]) -> tuple[int, ...] | None:
        """The ids of the first of `families` (token texts) whose every token is an added token."""
        added = {str(token): int(i) for i, token in getattr(self.hf, "added_tokens_decoder", {}).items()}
        for names in families:
            if all(name in added for name in names):
                return tuple(added[name] for name in names)
        return None

    def infill(self, prefix: str | Sequence[int], suffix: str) -> list[int]:
        """A fill-in-the-middle prompt: the model writes what goes between `prefix` (text, or its
        token ids) and `suffix`, as llama.cpp's /infill asks it, prefix first. Each side is tokenized
        alone, so no token spans a marker; a tokenizer that opens a text with BOS opens this one."""
        if self.infill_markers is None:
            raise ForerunError(NO_INFILL)
        before_gap, after_gap, middle = self.infill_markers
        if isinstance(prefix, str):
            prefix = self.hf.encode(valid_unicode(prefix, "the prompt"), add_special_tokens=False)
        after = self.hf.encode(valid_unicode(suffix, "the suffix"), add_special_tokens=False)
        return [*self.opening, before_gap, *prefix, after_gap, *after, middle]

    @functools.cached_property
    def opening(self) -> list[int]:
        """What `encode` puts before a text's own tokens (BOS, for the tokenizers that add one)."""
        bos = self.hf.bos_token_id
        opens = bos is not None and self.hf.encode("a", add_special_tokens=True)[:1] == [bos]
        return [int(bos)] if opens else []

    def apply_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final: bool = False,
        tools: Sequence[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """The chat template's tokens for `messages`: `chat_text`'s text, encoded."""
        text = self.chat_text(messages, add_generation_prompt, continue_final, tools, template_kwargs)
        return list(self.hf.encode(text, add_special_tokens=False))

    def chat_text(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final: bool = False,
        tools: Sequence[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The chat template's text for `messages`, opening the assistant's turn (`add_generation_prompt`)
        or, with `continue_final`, leaving the last (assistant) message open for the answer to continue;
        with `tools` ({"type": "function", "function": ...} each), the template shows the model them;
        `template_kwargs` are more of the template's variables (vLLM's chat_template_kwargs, such as
        Qwen3's enable_thinking)."""
        if not getattr(self.hf, "chat_template", None):
            raise ForerunError(
                "this model has no chat template: pass a plain prompt instead of messages "
                "(on the command line, leave out --chat)"
            )
        if tools and not self.shows_tools:
            raise ForerunError(NO_TOOLS)
        text = self.hf.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            **check_template_kwargs(template_kwargs),
        )
        return valid_unicode(text, "the chat prompt (the messages in the chat template)")

    @property
    def shows_tools(self) -> bool:
        """Whether the chat template shows the model the functions it is offered (it reads `tools`)."""
        return "tools" in self._template_text

    @property
    def tool_tags_special(self) -> bool:
        """Whether the vocabulary marks the tool-call tags special (their text then needs
        `skip_special_tokens` off to be read)."""
        added = getattr(self.hf, "added_tokens_decoder", {}).values()
        return any(token.content == CALL_OPEN and token.special for token in added)

    @property
    def writes_tool_calls(self) -> bool:
        """Whether the chat template teaches the model to write calls as `base.tools` reads them
        (<tool_call> blocks, as Qwen's and Hermes' templates do)."""
        return CALL_OPEN in self._template_text

    @functools.cached_property
    def template_caps(self) -> dict[str, bool]:
        """What the chat template can show the model, as llama.cpp's /props reports it
        (`models.template_caps`); {} without a template."""
        if not getattr(self.hf, "chat_template", None):
            return {}

        def render(messages: list[dict], tools: list[dict] | None, variables: dict) -> str:
            return self.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=False, **variables
            )

        return template_caps(render)

    @property
    def template_text(self) -> str:
        """The chat template's source: the default one where the tokenizer names several; "" without one."""
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        return template if isinstance(template, str) else ""

    @property
    def _template_text(self) -> str:
        """The chat template's source ("" without one; several named ones as their mapping)."""
        return str(getattr(self.hf, "chat_template", None) or "")

    def vocabulary(self) -> dict[int, str]:
        """id -> token string, for comparing two tokenizers."""
        return {i: t for t, i in self.hf.get_vocab().items()}


def check_template_kwargs(kwargs: dict | None) -> dict:
    """Variables for a chat template beside the ones `apply_chat` sets: names as strings, none of
    those it sets itself; a clear error otherwise."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(name, str) and name.isidentifier() for name in kwargs):
        raise ForerunError(
            'chat_template_kwargs is an object of the template\'s variables, such as {"enable_thinking": false}, '
            f"got {kwargs!r:.80}"
        )
    taken = sorted(set(kwargs) & TEMPLATE_SETS)
    if taken:
        raise ForerunError(
            f"chat_template_kwargs sets {taken[0]}, which forerun sets itself (where a request may, as its own "
            "field) or does not take: leave it out"
        )
    return kwargs


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """A byte-level BPE vocabulary's alphabet (GPT-2's) reversed: every byte is one printable
    character there, the printable Latin-1 bytes as themselves, the others from U+0100 on in order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char = {b: chr(b) for b in kept}
    for i, b in enumerate(b for b in range(256) if b not in char):
        char[b] = chr(0x100 + i)
    return {c: b for b, c in char.items()}


class TextStream:
    """The text of a growing list of token ids, a token at a time: what arrives with each token
    (empty while it ends in part of a character), special tokens skipped (or not) as `Tokenizer.decode`
    skips them. A token costs microseconds, where decoding the whole output again costs O(n)."""

    def __init__(self, backend, skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self.decoder.step(self.backend, int(token_id)) or ""
