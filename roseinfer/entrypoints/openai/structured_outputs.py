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
fields. A `structured_outputs` with only options and no constraint, `{"disable_any_whitespace": true}`, sets them
on the constraint given another way (as vLLM merges them): JSON in its compact form, for a small model that would
otherwise fill the free whitespace between JSON tokens with newlines until max_tokens.

Whether a schema, regex or grammar compiles is the engine's to say (the input processor raises a ValueError that
names it when the prompt is checked); the server answers that with a 400 naming the request's field too
(serving_engine.py), before anything is queued.
"""

from __future__ import annotations

from typing import Any

from roseinfer.entrypoints.openai.errors import APIError
from roseinfer.entrypoints.openai.protocol import SamplingRequest
from roseinfer.sampling_params import CONSTRAINTS, StructuredOutputsParams

OPTIONS = {"disable_any_whitespace", "disable_additional_properties"}  # how a constraint applies, not one itself
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
    so = request.structured_outputs
    if so is not None and any(kind in so.model_dump(by_alias=True, exclude_none=True) for kind in CONSTRAINTS):
        found["structured_outputs"] = so.model_dump(by_alias=True, exclude_none=True, exclude=OPTIONS)
    for field, kind in GUIDED.items():
        if getattr(request, field) is not None:
            found[field] = {kind: getattr(request, field)}
    return found


def structured_outputs_params(request: SamplingRequest, tool_schema: dict | None = None,
                              ) -> tuple[StructuredOutputsParams | None, str | None]:  # fmt: skip
    """The request's one constraint (with `tool_schema`: the one that forces its tool calls), checked by
    StructuredOutputsParams itself (its message names the field at fault), and the field that gave it; (None,
    None) if there is none. Two at once: a 400 that names both."""
    constraints = requested_constraints(request)
    if tool_schema is not None:
        constraints["tool_choice"] = {"json": tool_schema}
    options = {}
    if request.structured_outputs is not None:
        options = request.structured_outputs.model_dump(include=OPTIONS)
    if len(constraints) > 1:
        names = sorted(constraints)
        raise APIError(400, f"{' and '.join(names)} both constrain the output: give only one of them", names[0])
    if not constraints:
        if request.structured_outputs is not None:
            raise APIError(400, f"structured_outputs needs one kind of constraint ({', '.join(CONSTRAINTS)}), or "
                                "a response_format or guided_* field for its options to apply to",
                           "structured_outputs")  # fmt: skip
        return None, None
    (field, kwargs), = constraints.items()  # fmt: skip
    try:
        return StructuredOutputsParams(**kwargs, **options), field
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{field}: {e}", field) from e
