"""POST /v1/completions: text in, text out (vLLM's OpenAIServingCompletion).

    {"model": "roseinfer", "prompt": ["Romeo.\\n", "KING."], "n": 2, "max_tokens": 16, "stream": true}

One engine request per prompt; choice index = prompt index * n + completion index. Streaming, each chunk
carries the new text of one choice (the engine hands over only each step's tokens, RequestOutputKind.DELTA,
so a long stream costs no more per step than a short one):

    data: {"id": "cmpl-…", "object": "text_completion", "choices": [{"index": 2, "text": " the", …}]}
    …
    data: {"id": "cmpl-…", "choices": [], "usage": {…}}        with stream_options.include_usage
    data: [DONE]

Not streaming, the same chunks are joined into one answer. `response_format`, `structured_outputs` or a
`guided_*` field constrains every choice's text (structured_outputs.py).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from roseinfer.entrypoints.openai.errors import APIError
from roseinfer.entrypoints.openai.logprobs import CompletionLogprobs, merge_completion_logprobs
from roseinfer.entrypoints.openai.protocol import CompletionRequest
from roseinfer.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    OpenAIServing,
    chain,
    sse,
    until_disconnect,
)
from roseinfer.entrypoints.openai.structured_outputs import structured_outputs_params


def prompt_list(prompt) -> list:
    """One prompt (a string or a list of token ids) or a list of them -> a list of prompts."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: give a string, a list of token ids, or a non-empty list of those",
                       "prompt")  # fmt: skip
    return list(prompt)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_model(request.model)
        self.check_unsupported(request)
        prompts = prompt_list(request.prompt)
        kwargs = request.sampling_kwargs()
        kwargs.setdefault("max_tokens", 16)  # OpenAI's default for completions
        kwargs["logprobs"] = request.logprobs
        kwargs["prompt_logprobs"] = request.logprobs if request.echo and request.prompt_logprobs is None else None
        if request.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = request.prompt_logprobs
        structured, constraint = structured_outputs_params(request)
        if structured is not None:
            kwargs["structured_outputs"] = structured
        params = self.make_sampling_params(kwargs)
        self.check_num_prompts(len(prompts))
        many = len(prompts) > 1
        ids = [
            await self.tokenize(p, params, f"prompt {i}: " if many else "", constraint) for i, p in enumerate(prompts)
        ]
        self.admit(len(prompts))
        rid = f"cmpl-{uuid.uuid4().hex}"
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if request.echo else None
        try:
            first, merged = await self.start_streams(raw, rid, ids, params, arrival)
            usage = include_usage or not request.stream
            form = ChoiceFormat(params.n, params.logprobs, echo, self.token_text, request.prompt_logprobs is not None)
            chunks = completion_chunks(first, merged, rid, self.model_name, form, usage)
            if request.stream:
                return StreamingResponse(sse(chunks), media_type="text/event-stream")
            return JSONResponse(await until_disconnect(raw, collect(chunks)))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the requests are already aborted


@dataclass
class ChoiceFormat:
    """How a request wants its choices: n per prompt, logprobs (None: none, else the top N), the prompts' texts
    to echo (None: no echo), and each token's text (for the logprobs of echoed prompt tokens)."""

    n: int
    logprobs: int | None
    echo: list[str] | None
    token_text: Callable[[int], str]
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs`: each choice's first chunk carries them


async def completion_chunks(first, merged, rid: str, model: str, form: ChoiceFormat, usage: bool,
                            ) -> AsyncIterator[dict]:  # fmt: skip
    """(prompt index, RequestOutput) items -> OpenAI chunks, one per choice that has new text or tokens, or has just
    finished; with `usage`, a last chunk with the token counts (and every other chunk says "usage": null, as
    OpenAI's). With echo, a choice's first chunk starts with its prompt (and the prompt's logprobs)."""
    created, tokens, prompt_tokens, done = int(time.time()), {}, {}, set()
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    null_usage = {"usage": None} if usage else {}
    logprobs: dict[tuple[int, int], CompletionLogprobs] = {}  # each choice's, with its running text offset
    prompt_logprobs: dict[int, list] = {}  # per prompt: its logprobs (in its first output only)
    try:
        async for i, out in chain(first, merged):
            prompt_tokens[i] = len(out.prompt_token_ids)
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            for c in out.outputs:
                key = (i, c.index)
                tokens[key] = tokens.get(key, 0) + len(c.token_ids)
                finished = c.finish_reason is not None and key not in done
                first_chunk = key not in logprobs
                if first_chunk:
                    logprobs[key] = CompletionLogprobs(form.logprobs or 0, form.token_text)
                echo = form.echo is not None and first_chunk
                wants_prompt = form.prompt_logprobs and first_chunk
                if not (c.text or finished or echo or wants_prompt or (form.logprobs is not None and c.token_ids)):
                    continue
                if finished:
                    done.add(key)
                text, parts = c.text, []
                if echo:
                    text = form.echo[i] + text
                    if form.logprobs is not None:  # the prompt's tokens first, the first one without a logprob
                        parts.append(logprobs[key].add(out.prompt_token_ids, prompt_logprobs[i]))
                if form.logprobs is not None:
                    parts.append(logprobs[key].add(c.token_ids, c.logprobs or []))
                lp = merge_completion_logprobs(parts) if parts else None
                choice = {"index": i * form.n + c.index, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason if finished else None}  # fmt: skip
                if wants_prompt:  # vLLM's extra field, in its own shape
                    choice["prompt_logprobs"] = [
                        None if p is None else {t: dataclasses.asdict(x) for t, x in p.items()}
                        for p in prompt_logprobs[i]
                    ]
                yield head | {"choices": [choice]} | null_usage
    finally:
        await merged.aclose()  # a consumer that stops early (a disconnect) aborts the requests now
    if usage:
        p, c = sum(prompt_tokens.values()), sum(tokens.values())
        yield head | {"choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}


async def collect(chunks: AsyncIterator[dict]) -> dict:
    """The non-streaming answer: every choice's whole text (and logprobs), in index order, and the usage."""
    texts, reasons, logprobs, prompts, last = {}, {}, {}, {}, None
    async for chunk in chunks:
        last = chunk
        for c in chunk["choices"]:
            texts.setdefault(c["index"], []).append(c["text"])
            reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
            if c["logprobs"] is not None:
                logprobs.setdefault(c["index"], []).append(c["logprobs"])
            if "prompt_logprobs" in c:
                prompts[c["index"]] = c["prompt_logprobs"]
    choices = [{"index": k, "text": "".join(texts[k]),
                "logprobs": merge_completion_logprobs(logprobs[k]) if k in logprobs else None,
                "finish_reason": reasons[k]} | ({"prompt_logprobs": prompts[k]} if k in prompts else {})
               for k in sorted(texts)]  # fmt: skip
    head = {k: v for k, v in last.items() if k not in ("choices", "usage")}
    return head | {"choices": choices, "usage": last["usage"]}
