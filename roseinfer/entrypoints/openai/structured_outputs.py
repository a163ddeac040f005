"""A request's constraint on its output: the API's several spellings -> one StructuredOutputsParams.

A client can ask for structured output in four ways, all read here:

    request field                                    StructuredOutputsParams
    response_format {"type": "text"}                 none (plain text)
    response_format {"type": "json_object"}          json_object=True: any JSON object
    response_format {"type": "json_schema",          json=<the schema>
                     "json_schema": {"name": ..., "schema": {...}, "strict": true}}
    structured_outputs {"regex": ...} (vLLM's)       the same fields: json, regex, choice, grammar, json_object,
                                                     disable_any_whitespace, disable_additional_properties
    guided_json / guided_regex / guided_choice /     json / regex / choice / grammar (vLLM's older names)
    guided_grammar
    tool_choice "required" or a named function       json=<a schema built from the tools> (tool_calls.py)

At most one of them may be set: two constraints cannot both hold, and picking one silently would hide the
client's mistake, so `{"response_format": {"type": "json_object"}, "guided_regex": "a+"}` is a 400 that names both
fields. Whether a schema, regex or grammar compiles is the engine's to say (`LLMEngine.add_request` raises a
ValueError that names it); the server answers that with a 400 too (serving_engine.py), before any stream starts.
"""

from __future__ import annotations

from typing import Any

from roseinfer.entrypoints.openai.errors import APIError
from roseinfer.entrypoints.openai.protocol import SamplingRequest
from roseinfer.sampling_params import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def requested_constraints(request: SamplingRequest) -> dict[str, dict[str, Any]]:
    """Each field of the request that constrains the output -> the StructuredOutputsParams arguments it means."""
    found: dict[str, dict[str, Any]] = {}
    rf = request.response_format
    if rf is not None and rf.type == "json_object":
        found["response_format"] = {"json_object": True}
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise APIError(400, 'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                                '"schema": {...}}', "response_format")  # fmt: skip
        found["response_format"] = {"json": rf.json_schema.json_schema}
    if request.structured_outputs is not None:
        found["structured_outputs"] = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    for field, kind in GUIDED.items():
        if getattr(request, field) is not None:
            found[field] = {kind: getattr(request, field)}
    return found


def structured_outputs_params(constraints: dict[str, dict[str, Any]]) -> StructuredOutputsParams | None:
    """The one constraint, checked by StructuredOutputsParams itself (its message names the field at fault);
    None if there is none. Two at once: a 400 that names both."""
    if len(constraints) > 1:
        names = sorted(constraints)
        raise APIError(400, f"{' and '.join(names)} both constrain the output: give only one of them", names[0])
    if not constraints:
        return None
    (field, kwargs), = constraints.items()  # fmt: skip
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{field}: {e}", field) from e
