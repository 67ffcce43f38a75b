"""A request's structured output, from the fields OpenAI and vLLM give it: OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` and its older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`. At most one of them; FieldError names the field when wrong."""

from __future__ import annotations

import json

from forerun.base.config import StructuredOutputsParams
from forerun.base.errors import FieldError

# vLLM's older fields, each one kind of structured output.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *GUIDED)
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")


def structured_output(body: dict) -> StructuredOutputsParams | None:
    """The request's structured output, None without one. Its grammar is compiled and checked
    against the model's tokens off the event loop, once the prompt is tokenized (`requests.tokenize`)."""
    given = [name for name in FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise FieldError(given[1], f"give one of {' and '.join(given)}: each says what the whole text must be")
    if not given:
        return None
    name = given[0]
    value = body[name]
    try:
        if name == "response_format":
            fields = _response_format(value)
        elif name == "structured_outputs":
            fields = _vllm_fields(value)
        else:
            fields = {GUIDED[name]: value}
        if fields is None:
            return None
        spec = StructuredOutputsParams(**fields)
    except FieldError as exc:
        raise FieldError(name, str(exc) if str(exc).startswith(name) else f"{name}: {exc}") from None
    return spec


def _vllm_fields(value) -> dict:
    """vLLM's structured_outputs object as StructuredOutputsParams' fields (a null field is absent)."""
    if not isinstance(value, dict):
        raise FieldError("structured_outputs", f"structured_outputs must be an object with one of {', '.join(_KINDS)}")
    fields = {key: given for key, given in value.items() if given is not None}
    if "structural_tag" in fields:
        raise FieldError("structured_outputs", "structural_tag is not supported here; use json or grammar")
    unknown = [key for key in fields if key not in _KINDS + _OPTIONS]
    if unknown:
        raise FieldError(
            "structured_outputs",
            f"structured_outputs has an unknown field {json.dumps(unknown[0])[:80]}: it takes one of "
            f"{', '.join(_KINDS)}, and {', '.join(_OPTIONS)}",
        )
    return fields


def _response_format(value) -> dict | None:
    """OpenAI's response_format as StructuredOutputsParams' fields (None: plain text)."""
    kinds = "text, json_object or json_schema"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FieldError("response_format", f'response_format must be an object with a "type": {kinds}')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise FieldError("response_format", f"response_format type must be {kinds}, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise FieldError(
            "response_format",
            'response_format json_schema needs "json_schema": {"name": ..., "schema": {a JSON schema}}',
        )
    # strict: as OpenAI promises it, no property the schema does not name
    return {"json": spec["schema"], "disable_additional_properties": spec.get("strict") is True}
