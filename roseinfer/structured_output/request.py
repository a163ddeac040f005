"""A request's constraint as the core holds it (vLLM's StructuredOutputRequest): the compiled grammar on its way
(a Future, while the compile thread works), then the request's own matcher.

The scheduler asks one thing of it, `is_ready`: a request whose grammar is still compiling stays in `waiting`
(vLLM's WAITING_FOR_FSM) while the requests behind it are admitted; it runs from the first step after its grammar
is ready. A grammar that failed to compile is not ready either: the engine core fails that request alone.
"""

from __future__ import annotations

from concurrent.futures import Future

from roseinfer.structured_output.backend_xgrammar import XgrammarGrammar, xgrammar_error


class StructuredOutputRequest:
    __slots__ = ("key", "compiled", "grammar", "stop_token_ids", "max_rollback_tokens")

    def __init__(self, key: tuple[str, str], compiled: Future, stop_token_ids: list[int], max_rollback_tokens: int):
        self.key = key  # (kind, spec): what was compiled
        self.compiled = compiled  # a Future of the CompiledGrammar (done at once when it was cached)
        self.grammar: XgrammarGrammar | None = None  # the matcher, made once the compile is done
        self.stop_token_ids = stop_token_ids  # the tokens that end the grammar: EOS and the request's stop ids
        self.max_rollback_tokens = max_rollback_tokens  # speculation moves through k drafts and back

    @property
    def is_ready(self) -> bool:
        """The grammar is compiled (and the matcher made); False while compiling, or if the compile failed."""
        if self.grammar is None and self.compiled.done() and self.compiled.exception() is None:
            self.grammar = XgrammarGrammar(self.compiled.result(), self.stop_token_ids, self.max_rollback_tokens)
        return self.grammar is not None

    @property
    def error(self) -> str | None:
        """Why the compile failed (None while it runs or if it succeeded)."""
        if not self.compiled.done() or self.compiled.exception() is None:
            return None
        return f"structured_outputs.{self.key[0]} failed to compile: {xgrammar_error(self.compiled.exception())}"

    def fork(self) -> StructuredOutputRequest:
        """The constraint of a sequence forked from this one (n > 1): the same grammar, a matcher in the same state."""
        child = StructuredOutputRequest(self.key, self.compiled, self.stop_token_ids, self.max_rollback_tokens)
        if self.is_ready:
            child.grammar = self.grammar.fork()
        return child
