"""Structured output asked by a request: OpenAI's `response_format` (json_object, json_schema) and vLLM's own
`structured_outputs` (json, regex, choice, grammar), parsed into the keyword arguments of vLLM's
`StructuredOutputsParams`, kept as canonical JSON text so that SamplingParams stays a value.

The vLLM engine constrains its sampling with them (its xgrammar/guidance backends). The built-in engine has
no grammar-constrained sampler: a request asking for one is refused with a 400 naming the field and the
engine that implements it (sampling_params.unsupported_field), never answered unconstrained.
"""

from __future__ import annotations

import json

from baige_ray.serving.requests import bad_request

VLLM_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def parse_structured_output(payload: dict) -> str | None:
    """The request's structured output as StructuredOutputsParams keyword arguments in JSON, or None (none
    asked: absent, null, or `response_format` of type "text"); a 400 naming the field when malformed."""
    response_format, structured = payload.get("response_format"), payload.get("structured_outputs")
    if response_format is not None and structured is not None:
        raise bad_request("structured_outputs", "'response_format' and 'structured_outputs' are both set: send one")
    if structured is not None:
        return _canonical(_from_structured_outputs(structured))
    if response_format is None:
        return None
    asked = _from_response_format(response_format)
    return None if asked is None else _canonical(asked)


def _from_response_format(value) -> dict | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format", "'response_format' of type 'json_schema' needs "
                                                 "'json_schema': {'name': ..., 'schema': {...}}")
        return {"json": schema}
    raise bad_request("response_format", f"'response_format' must be an object whose 'type' is 'text', "
                                         f"'json_object' or 'json_schema', got {value!r}")


def _from_structured_outputs(value) -> dict:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs", f"'structured_outputs' must be an object, got {value!r}")
    chosen = {key: value[key] for key in VLLM_STRUCTURED_KEYS if value.get(key) not in (None, False)}
    if len(chosen) != 1:
        raise bad_request("structured_outputs", f"'structured_outputs' must set exactly one of "
                                                f"{list(VLLM_STRUCTURED_KEYS)}, got {sorted(chosen) or 'none'}")
    ((key, constraint),) = chosen.items()
    expected = {"json": (dict, str), "regex": str, "choice": list, "grammar": str, "json_object": bool}[key]
    if not isinstance(constraint, expected) or (key == "choice" and not all(isinstance(c, str) for c in constraint)):
        raise bad_request("structured_outputs", f"'structured_outputs.{key}' has the wrong type: {constraint!r}")
    return {key: constraint}


def canonical_structured_outputs(params) -> str:
    """A vLLM StructuredOutputsParams (one a tool-call parser set) as the JSON text SamplingParams keeps: the
    fields it sets away from their defaults."""
    import dataclasses

    arguments = {field.name: getattr(params, field.name) for field in dataclasses.fields(params)
                 if field.init and not field.name.startswith("_") and getattr(params, field.name) != field.default}
    return _canonical(arguments)


def _canonical(arguments: dict) -> str:
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"))
