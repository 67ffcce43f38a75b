"""What /v1/models and /props say of the model beside its name, as llama.cpp's server says it: the
file type's name, parameter count and bytes of a GGUF file and of a safetensors folder (against
gguf-py's and safetensors' own readings), the vocabulary's kind, and what a chat template can show
(`chat_template_caps`) on templates that can and cannot. The embedded pair's figures are the ones
llama-server gave for the same files."""

from __future__ import annotations

import json

import gguf
import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import safe_open
from test_load import write_gguf

from forerun.models.card import ftype_name, model_card
from forerun.models.hf_folder import weight_files
from forerun.models.source import ModelSource
from forerun.models.template_caps import template_caps
from forerun.models.testing import save_hf_folder, tiny_model, tiny_tokenizer


def _quant(name: str) -> str:
    return "Q8_0" if name.endswith("ffn_down.weight") else "Q4_0"  # every matrix; vectors stay F32


def test_a_gguf_files_card_counts_its_tensors_as_gguf_py_reads_them(tmp_path) -> None:
    model = tiny_model(0, hidden_size=64, intermediate_size=128, head_dim=16)
    extra = {"tokenizer.ggml.model": "gpt2"}
    path = write_gguf(model, tmp_path / "m.gguf", quant=_quant, extra=extra)
    reader = gguf.GGUFReader(str(path))
    card = model_card(ModelSource("gguf", path, "m"), model.decoder.cfg)
    assert card.n_params == sum(int(t.n_elements) for t in reader.tensors)
    assert card.size == sum(int(t.n_bytes) for t in reader.tensors)
    assert card.vocab_type == 2 and card.file_format == "gguf"
    # No general.file_type: guessed from the most common type, as llama.cpp guesses (Q4_0 here).
    assert card.ftype == "(guessed) Q4_0"
    cfg = model.decoder.cfg
    assert card.meta(77) == {
        "vocab_type": 2,
        "n_vocab": cfg.vocab_size,
        "n_ctx": 77,
        "n_ctx_train": cfg.max_position,
        "n_embd": cfg.hidden_size,
        "n_params": card.n_params,
        "size": card.size,
        "ftype": "(guessed) Q4_0",
    }


def test_a_gguf_files_own_file_type_names_it(tmp_path) -> None:
    model = tiny_model(0)
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen2")
    writer.add_file_type(17)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_tensor("token_embd.weight", model.decoder.state_dict()["embed_tokens.weight"].float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    card = model_card(ModelSource("gguf", tmp_path / "q.gguf", "q"), model.decoder.cfg)
    assert (card.ftype, card.vocab_type) == ("Q5_K - Medium", 1)


@pytest.mark.parametrize(
    "file_type, kinds, name",
    [
        (15, [], "Q4_K - Medium"),
        (0, [("a", "Q4_K")], "all F32"),  # the file's word over its tensors
        (15 | 1024, [], "(guessed) Q4_K - Medium"),
        (99, [], "unknown, may not work"),
        (None, [("a", "F32"), ("b", "Q6_K"), ("c", "Q6_K")], "(guessed) Q6_K"),
        (None, [("b", "Q4_K"), ("a", "Q6_K")], "(guessed) Q6_K"),  # a tie: the first in name order
        (None, [("a", "BF16"), ("b", "BF16"), ("c", "F32")], "(guessed) BF16"),
        (None, [("a", "IQ4_XS")], "(guessed) IQ4_XS - 4.25 bpw"),
        (None, [("a", "I32")], "(guessed) unknown, may not work"),
        (None, [], "(guessed) all F32"),
    ],
)
def test_a_file_types_name_is_llamacpps(file_type, kinds, name) -> None:
    assert ftype_name(file_type, kinds) == name


def test_a_safetensors_folders_card_counts_its_tensors_as_safetensors_reads_them(tmp_path) -> None:
    tok = tiny_tokenizer(tmp_path / "tok")
    folder = save_hf_folder(tiny_model(0, tok), tmp_path / "hf")
    model = tiny_model(0, tok)
    card = model_card(ModelSource("hf", folder, "hf"), model.decoder.cfg)
    n_params = size = 0
    for file in weight_files(folder):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                n_params, size = n_params + tensor.numel(), size + tensor.numel() * tensor.element_size()
    assert (card.n_params, card.size, card.file_format) == (n_params, size, "safetensors")
    assert card.ftype == "(guessed) all F32"
    assert card.vocab_type == 0  # a word-level tokenizer: none of llama.cpp's kinds
    tokenizer_json = folder / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    for model_kind, fallback, kind in (("BPE", False, 2), ("BPE", True, 1), ("Unigram", None, 4)):
        data["model"] = {"type": model_kind, "byte_fallback": fallback}
        tokenizer_json.write_text(json.dumps(data), encoding="utf-8")
        assert model_card(ModelSource("hf", folder, "hf"), model.decoder.cfg).vocab_type == kind


def test_a_model_built_in_memory_has_no_file_facts() -> None:
    model = tiny_model(0)
    card = model_card(model.source, model.decoder.cfg)
    assert (card.file_format, card.ftype, card.n_params, card.size) == ("", "", 0, 0)
    assert card.n_embd == model.decoder.cfg.hidden_size


# --- chat_template_caps ---------------------------------------------------------------------------


def renderer(source: str):
    """A template rendered as transformers renders one (a sandbox, `raise_exception`, `tojson`)."""

    def refuse(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = refuse
    env.filters["tojson"] = lambda value: json.dumps(value)
    template = env.from_string(source)
    return lambda messages, tools, variables: template.render(messages=messages, tools=tools, **variables)


EVERY = {
    "supports_object_arguments",
    "supports_parallel_tool_calls",
    "supports_preserve_reasoning",
    "supports_reasoning_effort",
    "supports_string_content",
    "supports_system_role",
    "supports_tool_calls",
    "supports_tools",
    "supports_typed_content",
}
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
TYPED = (
    "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}"
    "{% else %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endif %}\n{% endfor %}"
)
NO_SYSTEM = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + PLAIN
FIRST_CALL_ONLY = (
    "{% for m in messages %}{{ m.content }}{% if m.tool_calls %}"
    "{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments }}){% endif %}{% endfor %}"
    "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
)
STRING_ARGUMENTS = (
    "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.name }}:"
    "{% if c.function.arguments is string %}{{ c.function.arguments }}"
    "{% else %}{{ raise_exception('arguments must be a string') }}{% endif %}{% endfor %}{% endfor %}"
    "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
)
EFFORT = "Reasoning: {{ reasoning_effort | default('medium') }}\n" + PLAIN
LAST_THOUGHT = (
    "{% for m in messages %}{% if loop.last and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content }}{% endfor %}"
)


def caps_of(source: str) -> set[str]:
    caps = template_caps(renderer(source))
    assert set(caps) == EVERY
    return {name for name, has in caps.items() if has}


def test_the_tiny_models_template_shows_all_but_typed_content_and_effort(tmp_path) -> None:
    tok = tiny_tokenizer(tmp_path / "tok")
    assert caps_of(tok.template_text) == EVERY - {"supports_typed_content", "supports_reasoning_effort"}
    # The tokenizer's own (transformers renders it) agrees with the sandbox here.
    assert tok.template_caps == template_caps(renderer(tok.template_text))


@pytest.mark.parametrize(
    "source, has",
    [
        (PLAIN, {"supports_string_content", "supports_system_role"}),  # prints a list as it is: not typed
        (TYPED, {"supports_string_content", "supports_typed_content", "supports_system_role"}),
        (NO_SYSTEM, {"supports_string_content"}),
        (FIRST_CALL_ONLY, {"supports_string_content", "supports_system_role", "supports_tools", "supports_tool_calls"}),
        (
            STRING_ARGUMENTS,
            {"supports_string_content", "supports_system_role", "supports_tools", "supports_tool_calls"}
            | {"supports_parallel_tool_calls"},
        ),
        (EFFORT, {"supports_string_content", "supports_system_role", "supports_reasoning_effort"}),
        (LAST_THOUGHT, {"supports_string_content", "supports_system_role"}),  # an earlier turn's thought dropped
    ],
)
def test_each_capability_is_there_only_where_the_template_shows_it(source, has) -> None:
    assert caps_of(source) == has


def test_a_template_that_refuses_everything_has_no_capability() -> None:
    caps = template_caps(renderer("{{ raise_exception('no') }}"))
    assert not any(caps.values())


@pytest.mark.real
def test_the_embedded_targets_card_and_caps_are_what_llama_server_reports() -> None:
    from forerun.models.gguf_loader import open_reader, read_config
    from forerun.models.load import load_tokenizer_of
    from forerun.models.source import resolve

    source = resolve("qwen2.5-coder-1.5b-instruct")
    card = model_card(source, read_config(open_reader(source.path)))
    # llama-server (llama.cpp 0.3.36's build, -c 4096) on the same file: GET /v1/models' meta.
    assert card.meta(4096) == {
        "vocab_type": 2,
        "n_vocab": 151936,
        "n_ctx": 4096,
        "n_ctx_train": 32768,
        "n_embd": 1536,
        "n_params": 1777088000,
        "size": 1111370240,
        "ftype": "Q4_K - Medium",
    }
    # Its GET /props' chat_template_caps.
    assert load_tokenizer_of("qwen2.5-coder-1.5b-instruct").template_caps == {
        "supports_object_arguments": True,
        "supports_parallel_tool_calls": True,
        "supports_preserve_reasoning": False,
        "supports_reasoning_effort": False,
        "supports_string_content": True,
        "supports_system_role": True,
        "supports_tool_calls": True,
        "supports_tools": True,
        "supports_typed_content": False,
    }
