"""A request's structured output, from the fields OpenAI and vLLM give it: OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` and its older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`. At most one of them; FieldError names the field when wrong."""

from __future__ import annotations

import json

from forerun.base.config import StructuredOutputsParams
from forerun.base.errors import FieldError
from forerun.verification.grammar import grammar_text

# vLLM's older fields, each one kind of structured output.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *GUIDED)
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output(body: dict) -> StructuredOutputsParams | None:
    """The request's structured output, None without one; its grammar checked (not yet against the
    model's tokens: `verification.grammar.check` does that once the prompt is tokenized)."""
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
            if not isinstance(value, dict) or any(key not in _KINDS for key in value):
                raise FieldError(name, f"structured_outputs must be an object with one of {', '.join(_KINDS)}")
            fields = value
        else:
            fields = {GUIDED[name]: value}
        if fields is None:
            return None
        spec = StructuredOutputsParams(**fields)
        grammar_text(spec)
    except FieldError as exc:
        raise FieldError(name, str(exc) if str(exc).startswith(name) else f"{name}: {exc}") from None
    except TypeError:
        raise FieldError(name, f"{name} is not one this server reads: got {json.dumps(value)[:80]}") from None
    return spec


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
    return {"json": spec["schema"]}
