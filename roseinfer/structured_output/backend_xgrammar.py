"""xgrammar, the grammar library vLLM and SGLang use: a constraint becomes a compiled grammar, and each request
walks it with a matcher of its own (vLLM's XgrammarBackend and XgrammarGrammar).

    StructuredOutputsParams ──► (kind, spec): the cache key     {"type": "object", ...} -> ("json", '{"type": ...}')
            │ compile (once per key, in a thread)               choice ["yes", "no"]    -> root ::= "yes" | "no"
            ▼
    CompiledGrammar: the grammar + for every state, which of the V tokens' bytes can follow (precomputed)
            │ one GrammarMatcher per sequence (cheap)
            ▼
    fill_bitmask(row)   bit t of the row = token t may come next        [ceil(V / 32)] int32
    accept_tokens(ids)  the sampled tokens move the matcher on          (the stop token ends it: terminated)

The vocabulary xgrammar needs is every token's bytes (`VocabType.RAW`), read once from the model's tokenizer;
special tokens have no bytes (b""), so the grammar never allows them inside the text, and the stop tokens (EOS,
the request's stop_token_ids) are the only way out once the value is complete.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from roseinfer.sampling_params import StructuredOutputsParams


def grammar_spec(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, spec text) of a constraint: what is compiled, and the key compiled grammars are cached by."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
        if params.disable_additional_properties:
            schema = no_additional_properties(schema)
        spec = json.dumps(schema)
    elif kind == "json_object":
        spec = '{"type": "object"}'  # any JSON object: the schema with nothing else in it
    elif kind == "choice":
        spec = choice_as_grammar(params.choice)
    else:
        spec = getattr(params, kind)
    if kind in ("json", "json_object") and params.disable_any_whitespace:
        kind += "_compact"  # the same schema without free whitespace is another grammar
    return kind, spec


def choice_as_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices: root ::= "yes" | "no" (escaped as EBNF strings)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(s: str) -> str:
        return "".join(escapes.get(c, c if ord(c) >= 0x20 and ord(c) != 0x7F else f"\\u{ord(c):04x}") for c in s)

    return "root ::= " + " | ".join(f'"{literal(c)}"' for c in choices)


def no_additional_properties(schema):
    """A copy of a JSON schema where every object schema that does not say otherwise allows no keys beyond its
    "properties" (what xgrammar's strict mode already assumes; written out, the schema says so to anyone)."""
    schema = copy.deepcopy(schema)
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if node.get("type") == "object" and "additionalProperties" not in node:
                node["additionalProperties"] = False
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return schema


@functools.lru_cache(maxsize=256)
def _check_spec(kind: str, spec: str) -> str | None:
    """Why `spec` does not compile (None: it does). Needs no tokenizer: xgrammar parses it into a grammar."""
    import xgrammar as xgr

    try:
        if kind.startswith("json"):
            xgr.Grammar.from_json_schema(spec, any_whitespace=not kind.endswith("_compact"))
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        else:
            xgr.Grammar.from_ebnf(spec)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors with the reason
        return xgrammar_error(e)
    return None


def xgrammar_error(e: BaseException) -> str:
    """xgrammar's reason, without the time and C++ source line it starts with ("[10:01:09] /project/cpp/...:83: ")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem if the constraint cannot compile (checked when a request is added)."""
    kind, spec = grammar_spec(params)
    error = _check_spec(kind, spec)
    if error is not None:
        raise ValueError(f"structured_outputs.{params.kind} cannot be compiled by xgrammar: {error}")


class XgrammarBackend:
    """Compiles constraints for one model's vocabulary, off the step loop, and keeps the last `cache_size`."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int, stop_token_ids: list[int], cache_size: int = 128):
        import xgrammar as xgr

        self.vocab_size = vocab_size  # the model's (it may have more rows of logits than the tokenizer has tokens)
        self.tokenizer_info = xgr.TokenizerInfo(token_bytes, xgr.VocabType.RAW, vocab_size=vocab_size,
                                                stop_token_ids=stop_token_ids)  # fmt: skip
        # one compile at a time, on one thread: it shares the CPU with the steps (cache: ours, bounded, below)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # key -> its CompiledGrammar, LRU
        self.cache_size = cache_size

    def compile_async(self, key: tuple[str, str]) -> Future:
        """The compiled grammar of `key`, as a Future: done at once when cached, else compiled in the thread."""
        future = self.cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self.cache[key] = self.executor.submit(self._compile, *key)
        self.cache.move_to_end(key)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return future

    def _compile(self, kind: str, spec: str):
        c = self.compiler
        if kind.startswith("json"):
            compact = kind.endswith("_compact")
            return c.compile_json_schema(spec, any_whitespace=not compact, separators=(",", ":") if compact else None)
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_grammar(spec)  # an EBNF grammar (a choice is one)

    def allocate_token_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(V / 32)] int32, all bits set (every token allowed)."""
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class XgrammarGrammar:
    """One sequence's place in its grammar (an xgrammar GrammarMatcher)."""

    __slots__ = ("matcher", "compiled", "_terminated")

    def __init__(self, compiled, stop_token_ids: list[int] | None, max_rollback_tokens: int):
        import xgrammar as xgr

        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None,
                                          max_rollback_tokens=max_rollback_tokens)  # fmt: skip
        self._terminated = False

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Move on by the sampled tokens; False if one is not allowed (tokens after the end are ignored)."""
        for t in tokens:
            if self._terminated:
                break
            if not self.matcher.accept_token(t):
                return False
            self._terminated = self.matcher.is_terminated()
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask`: the tokens allowed next (all of them once the grammar has ended)."""
        if self._terminated:
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def advance_through(self, drafts: list[int], bitmask: torch.Tensor, row: int) -> None:
        """Speculation: the rows of a request that verifies `drafts`, one per position. Row i is filled in the
        state after drafts[:i]; the matcher is moved through the drafts and back. After a draft the grammar does
        not allow, the rows are left all-ones: that draft is rejected (its masked probability is 0), so the
        positions after it are never used."""
        moved, ok = 0, True
        for i, token in enumerate([*drafts, None]):
            if ok:
                self.fill_bitmask(bitmask, row + i)
            else:
                bitmask[row + i].fill_(-1)
            if token is not None and ok and not self.matcher.is_terminated():
                ok = self.matcher.accept_token(token)
                moved += ok
        if moved:
            self.matcher.rollback(moved)

    def fork(self) -> XgrammarGrammar:
        """A copy in the same state (a sequence forked from this one continues from here)."""
        child = object.__new__(XgrammarGrammar)
        child.compiled, child.matcher, child._terminated = self.compiled, self.matcher.fork(), self._terminated
        return child

    def is_terminated(self) -> bool:
        return self._terminated
