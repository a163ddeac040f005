"""The request bodies of the OpenAI-compatible API, as pydantic models (vLLM's entrypoints/openai/protocol.py).

The models do two jobs. They are the server's OpenAPI schema (`GET /openapi.json`, the docs at `/docs`), which
clients and fuzzers read; and they check the *shape* of a body before a route runs:

    {"prompt": "Hi", "max_tokens": "8"}     400  max_tokens: Input should be a valid integer
    {"prompt": "Hi", "stream": "yes"}       400  stream: Input should be a valid boolean
    {"prompt": "Hi", "frobnicate": 1}       400  frobnicate: Extra inputs are not permitted

Types are strict (no "8" -> 8, no "yes" -> True) and unknown fields are refused, as OpenAI's API does. The
*values* are checked once, where they are used: `SamplingParams` refuses a negative temperature with its own
message, the input processor an out-of-vocabulary token id. Fields this server does not implement are in the
schema but accepted only with the value that means "off" (`UNSUPPORTED`), so that a client that sends the
default of every field keeps working.

    request field                           SamplingParams argument
    max_tokens (chat: max_completion_tokens) max_tokens
    temperature, top_p, top_k, seed, n,      the same names
    stop, stop_token_ids, ignore_eos,
    presence_penalty, frequency_penalty,
    repetition_penalty, logit_bias,
    min_tokens, min_p,
    include_stop_str_in_output
    logprobs (completions: N)               logprobs = N
    logprobs + top_logprobs (chat: bool, N) logprobs = N (0 without top_logprobs)
    echo with logprobs, prompt_logprobs     prompt_logprobs
    response_format, structured_outputs,    structured_outputs (structured_outputs.py: one constraint at most)
    guided_json/regex/choice/grammar
    tools + tool_choice (chat)              the template's `tools`; "required" or a named function: a JSON
                                            schema in structured_outputs (tool_calls.py)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64 = {"ge": -(2**63), "le": 2**63 - 1}  # the seed range vLLM's API accepts (a torch.long)

# request field -> SamplingParams argument: what `sampling_kwargs` copies when the field is set
SAMPLING_FIELDS = {name: name for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                                          "stop_token_ids", "n", "ignore_eos", "presence_penalty",
                                          "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                                          "min_p", "include_stop_str_in_output")}  # fmt: skip


class OpenAIBaseModel(BaseModel):
    """Strict types, unknown fields refused, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = Field(False, description="end the stream with a chunk that holds the token usage")


class JsonSchemaResponseFormat(OpenAIBaseModel):
    """response_format's json_schema: OpenAI names the schema and says whether it is `strict`; here every schema
    is enforced token by token, strict or not."""

    name: str = Field(description="the schema's name (a-z, A-Z, 0-9, _ and -)")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema itself")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = Field(None, description='with type "json_schema"')


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` field: the fields of roseinfer.sampling_params.StructuredOutputsParams."""

    json_: str | dict[str, Any] | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="an EBNF grammar, the start rule named root")
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class SamplingRequest(OpenAIBaseModel):
    """The fields every generating request shares (OpenAI's, and vLLM's extras top_k, ignore_eos, stop_token_ids)."""

    model: str | None = Field(None, description="the served model name (GET /v1/models); optional")
    max_tokens: int | None = Field(None, description="new tokens at most")
    temperature: float | None = Field(None, description="0 is greedy")
    top_p: float | None = None
    top_k: int | None = Field(None, description="-1: all tokens")
    seed: int | None = Field(None, **INT64)
    n: int | None = Field(None, description="completions per prompt")
    stop: str | list[str] | None = Field(None, description="stop strings, left out of the text")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, description="subtracted once from every token already generated")
    frequency_penalty: float | None = Field(None, description="subtracted per time a token was generated")
    repetition_penalty: float | None = Field(None, description="Hugging Face's: > 1 discourages prompt and output")
    logit_bias: dict[str, float] | None = Field(None, description='token id -> added to its logit, {"50256": -100}')
    min_tokens: int | None = Field(None, description="no EOS, stop token or stop string before this many tokens")
    min_p: float | None = Field(None, description="drop tokens less likely than min_p x the most likely")
    include_stop_str_in_output: bool | None = Field(None, description="keep the stop string in the text")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = Field(None, description="vLLM's: one constraint")
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM's older name of structured_outputs.json")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams arguments this request sets (the fields left out keep SamplingParams' defaults)."""
        return {arg: getattr(self, field) for field, arg in SAMPLING_FIELDS.items() if getattr(self, field) is not None}


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, a list of token ids, or a list of either (one completion per prompt)"
    )
    logprobs: int | None = Field(None, description="per token: its logprob and the N most likely (0 .. 20)")
    echo: bool | None = Field(None, description="the prompt first in the text (and its logprobs, with logprobs)")
    prompt_logprobs: int | None = Field(None, description="the prompt's logprobs, N most likely per token")
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    """A content part; parts of other types (image_url ...) are refused by name when the messages are read."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str = Field(description='"text" (the only kind of content part this server reads)')
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; fields past role and content (name, tool_call_id ...) reach the chat template unchanged. An
    assistant message's `tool_calls` are checked and their arguments parsed into objects (tool_calls.py)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: str
    content: str | list[TextPart] | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(description="what the model calls it by")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """One tool: OpenAI's function tools (the only kind)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: the answer is a call of that function."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateFields(OpenAIBaseModel):
    """How the messages become a prompt: through the model's chat template (entrypoints/chat_utils.py)."""

    messages: list[ChatMessage]
    tools: list[ChatCompletionToolsParam] | None = Field(None, description="functions the model may call")
    add_generation_prompt: bool = Field(True, description="end with the header of the assistant's turn")
    continue_final_message: bool = Field(False, description="continue the last message instead of starting one")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the template")


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    """POST /v1/chat/completions."""

    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name of max_tokens (wins if both)")
    logprobs: bool | None = Field(None, description="return each generated token's logprob")
    top_logprobs: int | None = Field(None, description="and the N most likely at each position (needs logprobs)")
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = Field(
        None, description='"auto" when tools are given (needs --enable-auto-tool-choice), else "none"'
    )
    parallel_tool_calls: bool | None = Field(None, description="false: one tool call at most")


# fields the server does not implement -> the values that mean "off", the only ones accepted (compared with their
# types: `best_of: 1.0` is refused though 1.0 == 1)
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None,), "guided_whitespace_pattern": (None,)}


class TokenizeCompletionRequest(OpenAIBaseModel):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the BOS (or what the tokenizer adds) as a prompt gets")


class TokenizeChatRequest(ChatTemplateFields):
    """POST /tokenize with messages: the ids of the prompt /v1/chat/completions would run."""

    model: str | None = None
    add_special_tokens: bool = Field(False, description="the template writes the BOS itself")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "roseinfer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
