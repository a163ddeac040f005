"""What `LLM.generate` returns for each prompt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    """What a caller gets back (the names of vLLM's RequestOutput, flattened)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token, stop string) | "length" | "abort" | None while running
    delta: str = ""  # text that became final in the last engine step (streaming)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (stage 10)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
