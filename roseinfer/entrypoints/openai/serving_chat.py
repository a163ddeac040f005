"""POST /v1/chat/completions: messages in, the assistant's next message out (vLLM's OpenAIServingChat).

The messages become one prompt through the model's chat template (chat_utils.py: the checkpoint's own, as
transformers finds it, or the server's `--chat-template FILE`), tokenized in a thread, then run as a
completion of that prompt. The answers, in OpenAI's shapes:

    not streaming   {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Good morrow."}}], "usage": {…}}
    streaming       data: {"object": "chat.completion.chunk", "choices": [{"index": 0,
                           "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}   (first: the role)
                    data: {… "delta": {"content": "Good"} …}
                    data: {… "delta": {"content": " morrow."}, "finish_reason": "stop"}
                    data: {… "choices": [], "usage": {…}}              (with stream_options.include_usage)
                    data: [DONE]

Content may be a string or OpenAI's list of text parts ([{"type": "text", "text": ...}], joined with newlines,
as vLLM does). Without `max_tokens`, the answer may fill the rest of the context. With `tools`, the template shows
them to the model and the answer may carry `tool_calls` instead of content (tool_calls.py); `response_format` and
friends constrain the text (structured_outputs.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from roseinfer.entrypoints.chat_utils import chat_prompt_token_ids, resolve_chat_template
from roseinfer.entrypoints.openai.errors import APIError
from roseinfer.entrypoints.openai.logprobs import chat_logprobs
from roseinfer.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTemplateFields
from roseinfer.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    OpenAIServing,
    chain,
    sse,
    until_disconnect,
    with_max_tokens,
)
from roseinfer.entrypoints.openai.structured_outputs import structured_outputs_params
from roseinfer.entrypoints.openai.tool_calls import ToolCallReader, tool_call_arguments, tool_choice
from roseinfer.entrypoints.openai.tool_parsers import ToolParser

RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template", "tools",
                            "documents"}  # fmt: skip


def message_dict(m: ChatMessage, i: int) -> dict:
    """A message as the template reads it: content parts joined into one string, an assistant's tool calls with
    their arguments as objects (it may have no content then)."""
    d = m.model_dump(exclude_none=True)
    if "tool_calls" in d:
        tool_call_arguments(d, i)
    if isinstance(m.content, list):
        parts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                    f"are supported, got type {part.type!r}", "messages")  # fmt: skip
            parts.append(part.text)
        d["content"] = "\n".join(parts)
    elif m.content is None and "tool_calls" not in d:
        raise APIError(400, f"messages[{i}] has no content: give a string or a list of text parts", "messages")
    return d


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, chat_template: str | None = None, tool_parser: type[ToolParser] | None = None,
                 **kwargs):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template  # the server's --chat-template, over the model's own
        self.tool_parser = tool_parser  # --tool-call-parser with --enable-auto-tool-choice: "auto" tool choice

    def check_template_renders_tools(self) -> None:
        """tools with a template that never reads `tools` would be dropped without a word: a 400 instead."""
        try:
            template = resolve_chat_template(getattr(self.tokenizer, "chat_template", None), self.chat_template)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e
        if "tools" not in template:
            raise APIError(400, "tools: the chat template does not render tools (it never mentions `tools`), so the "
                                "model would never see them; start the server with a --chat-template that does",
                           "tools")  # fmt: skip

    async def render(self, request: ChatTemplateFields, add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """The prompt the messages make, and its token ids (rendered and tokenized in a thread)."""
        if self.chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "the model has no chat template (none in its tokenizer_config.json or "
                                "chat_template.jinja): start the server with --chat-template FILE to chat with it, "
                                "or use /v1/completions")  # fmt: skip
        messages = [message_dict(m, i) for i, m in enumerate(request.messages)]
        tools = None
        if request.tools:
            self.check_template_renders_tools()
            tools = [t.model_dump(exclude_none=True) for t in request.tools]
        kwargs = request.chat_template_kwargs or {}
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs)):
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: they are request fields",
                           "chat_template_kwargs")  # fmt: skip
        try:
            text, ids = await asyncio.to_thread(
                chat_prompt_token_ids, self.tokenizer, messages, request.add_generation_prompt, self.chat_template,
                request.continue_final_message, tools=tools, **kwargs)  # fmt: skip
            if add_special_tokens:
                ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=True)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), "messages") from e
        except Exception as e:  # the template's own code failed on these messages (it runs what they contain)
            message = f"the chat template failed on these messages: {type(e).__name__}: {e}"
            raise APIError(400, message, "messages") from e
        return text, ids

    async def create_chat_completion(self, request: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_model(request.model)
        self.check_unsupported(request)
        kwargs = request.sampling_kwargs()
        if request.max_completion_tokens is not None:
            kwargs["max_tokens"] = request.max_completion_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if request.logprobs:
            kwargs["logprobs"] = request.top_logprobs or 0
        tools = tool_choice(request, self.tool_parser)
        structured, constraint = structured_outputs_params(request, tools.schema(request.parallel_tool_calls))
        if structured is not None:
            kwargs["structured_outputs"] = structured
        params = self.make_sampling_params({"max_tokens": 1} | kwargs)  # checked before the (slower) rendering
        _, ids = await self.render(request)
        if "max_tokens" not in kwargs:  # the rest of the context (the prompt alone too long: the check says so)
            params = with_max_tokens(params, max(1, self.max_model_len - len(ids)))
        ids = await self.tokenize(ids, params, constraint=constraint)
        self.admit(1)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        role = "assistant" if request.add_generation_prompt else request.messages[-1].role
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        try:
            first, merged = await self.start_streams(raw, rid, [ids], params, arrival)
            logprobs = None
            if params.logprobs is not None:
                logprobs = functools.partial(chat_logprobs, n=params.logprobs, token_bytes=self.token_bytes)
            readers = None
            if tools.kind != "none":
                readers = [ToolCallReader(tools, self.tokenizer) for _ in range(params.n)]
            chunks = chat_chunks(first, merged, rid, self.model_name, params.n, role,
                                 include_usage or not request.stream, logprobs, readers)  # fmt: skip
            if request.stream:
                return StreamingResponse(sse(chunks), media_type="text/event-stream")
            return JSONResponse(await until_disconnect(raw, collect_chat(chunks, role)))
        except ClientDisconnected:
            return Response(status_code=499)


async def chat_chunks(first, merged, rid: str, model: str, n: int, role: str, usage: bool,
                      logprobs: Callable | None = None, readers: list[ToolCallReader] | None = None,
                      ) -> AsyncIterator[dict]:  # fmt: skip
    """RequestOutputs -> chat.completion.chunk objects: first the role of every choice, then one chunk per choice
    with new text (or tokens, when it asks for `logprobs`) or that just finished; with `usage`, a last chunk with
    the token counts. With tools, each choice's text goes through its `readers[i]` (text and tool calls out)."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    null_usage = {"usage": None} if usage else {}
    tokens, prompt_tokens, done = [0] * n, 0, set()

    def chunk(index: int, delta: dict, finish_reason: str | None = None, lp: dict | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        return head | {"choices": [choice]} | null_usage

    try:
        for i in range(n):
            yield chunk(i, {"role": role, "content": ""})
        async for _, out in chain(first, merged):
            prompt_tokens = len(out.prompt_token_ids)
            for c in out.outputs:
                tokens[c.index] += len(c.token_ids)
                finished = c.finish_reason is not None and c.index not in done
                if finished:
                    done.add(c.index)
                lp = logprobs(c.token_ids, c.logprobs or []) if logprobs is not None and c.token_ids else None
                delta, reason = ({"content": c.text} if c.text else {}), c.finish_reason
                if readers is not None:
                    read = readers[c.index].feed(c.text, finished)
                    delta = readers[c.index].delta(read) if read is not None else {}
                    reason = readers[c.index].finish_reason(c.finish_reason) if finished else None
                if delta or finished or lp is not None:
                    yield chunk(c.index, delta, reason if finished else None, lp)
    finally:
        await merged.aclose()
    if usage:
        total = sum(tokens)
        yield head | {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": total,
                                                "total_tokens": prompt_tokens + total}}  # fmt: skip


async def collect_chat(chunks: AsyncIterator[dict], role: str) -> dict:
    """The non-streaming answer: each choice's whole message (its tool calls put together), and the usage."""
    texts, reasons, logprobs, calls, last = {}, {}, {}, {}, None
    async for chunk in chunks:
        last = chunk
        for c in chunk["choices"]:
            texts.setdefault(c["index"], []).append(c["delta"].get("content", ""))
            for call in c["delta"].get("tool_calls", []):
                mine = calls.setdefault(c["index"], {})
                if "id" in call:
                    mine[call["index"]] = {k: v for k, v in call.items() if k != "index"}
                else:  # more arguments for a call already opened
                    mine[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
            if c["logprobs"] is not None:
                logprobs.setdefault(c["index"], []).extend(c["logprobs"]["content"])
    choices = [{"index": k, "message": message(role, "".join(texts[k]), calls.get(k)),
                "logprobs": {"content": logprobs[k]} if k in logprobs else None,
                "finish_reason": reasons[k]} for k in sorted(texts)]  # fmt: skip
    return {"id": last["id"], "object": "chat.completion", "created": last["created"], "model": last["model"],
            "choices": choices, "usage": last["usage"]}  # fmt: skip


def message(role: str, content: str, calls: dict[int, dict] | None) -> dict:
    """A choice's message; with tool calls, `content` is null unless the model wrote text besides them."""
    if not calls:
        return {"role": role, "content": content}
    return {"role": role, "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
