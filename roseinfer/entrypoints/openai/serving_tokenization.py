"""POST /tokenize and POST /detokenize, in vLLM's shapes: the server's own tokenizer, over HTTP.

    POST /tokenize    {"prompt": "Romeo.\\n"}          -> {"tokens": [49, 1093, 13], "count": 3, "max_model_len": 512}
                      {"prompt": ..., "add_special_tokens": false}    without the BOS a prompt gets
                      {"messages": [...]}               the ids /v1/chat/completions would run
    POST /detokenize  {"tokens": [49, 1093, 13]}        -> {"prompt": "Romeo.\\n"}

A client counts tokens with these before it sends a request (will it fit the context?), or checks what a
chat template made. Both run in a thread: a long text does not stall the streams being served.
"""

from __future__ import annotations

import asyncio

from roseinfer.entrypoints.openai.errors import APIError
from roseinfer.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from roseinfer.entrypoints.openai.serving_chat import OpenAIServingChat
from roseinfer.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """Messages are rendered by the chat route's `render`: the same template, the same ids."""

    def __init__(self, *args, chat: OpenAIServingChat, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat = chat

    async def create_tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            _, ids = await self.chat.render(request, request.add_special_tokens)
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, request.prompt,
                                          add_special_tokens=request.add_special_tokens)  # fmt: skip
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = min(self.engine.engine.config.model_config.vocab_size, self.tokenizer.vocab_size)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        try:
            text = await asyncio.to_thread(self.tokenizer.decode, request.tokens)
        except (KeyError, ValueError) as e:  # an id inside the range that the tokenizer has no token for
            raise APIError(400, f"cannot decode these token ids: {type(e).__name__}: {e}", "tokens") from e
        return DetokenizeResponse(prompt=text)
