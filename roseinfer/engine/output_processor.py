"""The output processor: token ids from the core in, text and RequestOutputs out (vLLM V1's OutputProcessor).

The core reports, per sequence that got tokens, its new token ids and whether a stop without text ended it
(EOS, a stop token id, max_tokens). Everything that needs text happens here, in front of the core:

    detokenize     each new token through the request's streaming detokenizer (engine/detokenizer.py)
    stop strings   a stop string found in the text ends the sequence: its later tokens are dropped, and
                   the engine tells the core to free it (`process_outputs` returns its id)
    n > 1          the n sequences of a request ("r", "r#1", ...) report separately; one RequestOutput
                   per request carries all n completions (vLLM's ParentRequest)
    output kinds   CUMULATIVE: all text and tokens so far (lazy snapshots: joined only when read) and
                   the step's `delta`; DELTA: only what is new; FINAL_ONLY: one output at the end
    logprobs       each new token's LogprobsLists row becomes a dict {token id: Logprob} (with the token's
                   own text), kept beside its token; the prompt's come once, with the first token
    errors         a sequence the core failed ("error") ends its request with that finish reason and why

A request that wants only its final output and has no stop strings is not detokenized step by step at
all: its text is decoded once, when it finishes (that is what `LLM.generate` asks for).
"""

from __future__ import annotations

import codecs

from roseinfer.core.request import as_token_ids
from roseinfer.core.sched.output import EngineCoreOutput, LogprobsLists
from roseinfer.engine.detokenizer import Detokenizer
from roseinfer.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from roseinfer.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from roseinfer.tokenizer import Tokenizer

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


class Completion:
    """One sequence's tokens and text so far (and one logprobs dict per token, if asked for)."""

    __slots__ = ("index", "token_ids", "detokenizer", "finish_reason", "cumulative_logprob", "reported", "logprobs")

    def __init__(self, index: int, detokenizer: Detokenizer | None, logprobs: bool = False):
        self.index, self.token_ids, self.detokenizer = index, [], detokenizer
        self.finish_reason: str | None = None
        self.cumulative_logprob: float | None = None
        self.reported = False  # its finish went out in a DELTA output already
        self.logprobs: list[dict[int, Logprob]] | None = [] if logprobs else None


class RequestState:
    """What the output processor keeps of a request until it finishes."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams | BeamSearchParams, processor: OutputProcessor):  # fmt: skip
        self.request_id, self.prompt, self.prompt_token_ids, self.params = request_id, prompt, prompt_token_ids, params
        self.kind = params.output_kind
        self.stream_text = self.kind is not FINAL_ONLY or bool(params.stop)  # detokenize token by token
        self.processor = processor
        self.completions: dict[int, Completion] = {}
        self.num_seqs = params.n
        self.num_finished = 0
        self.num_cached_tokens = 0
        self.delta = ""  # completion 0's new text in this step (n > 1)
        self.wants_logprobs = params.logprobs is not None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False  # (DELTA: in the first output only)
        self.error: str | None = None
        # tokens that make no text: EOS, and the stop token ids unless the stop string is kept
        self.skip = frozenset(processor.eos_token_ids) | (
            frozenset() if params.include_stop_str_in_output else frozenset(params.stop_token_ids)
        )
        self.completion(0)

    def completion(self, index: int) -> Completion:
        c = self.completions.get(index)
        if c is None:
            p = self.params
            detok = (Detokenizer(self.processor.token_bytes, p.stop, self.skip, p.include_stop_str_in_output,
                                 p.min_tokens) if self.stream_text else None)  # fmt: skip
            c = self.completions[index] = Completion(index, detok, self.wants_logprobs)
        return c

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt's log-probabilities for an output: every time, or only the first time (DELTA)."""
        if self.kind is DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = self.prompt_logprobs is not None
        return self.prompt_logprobs

    @property
    def finished(self) -> bool:
        return self.num_finished >= self.num_seqs


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: int | tuple[int, ...] | None):
        self.tokenizer, self.eos_token_ids = tokenizer, as_token_ids(eos_token_ids)  # EOS tokens make no text
        self.token_bytes = tokenizer.token_bytes_table
        self.requests: dict[str, RequestState] = {}
        self._token_text: dict[int, str] = {}  # decoded_token of each token id seen in log-probabilities

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | BeamSearchParams) -> None:  # fmt: skip
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, self)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request; its last output (finish_reason "abort") for whoever still waits on it."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for i in range(state.num_seqs):
            c = state.completion(i)
            c.finish_reason = c.finish_reason or "abort"
        state.num_finished = state.num_seqs
        return self._final_output(state)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Turn one step's core outputs into RequestOutputs; also return the sequences a stop string ended,
        which the core must free."""
        results, stopped, groups = [], [], {}
        requests = self.requests
        for o in outputs:
            rid = o.group_id or o.request_id
            state = requests.get(rid)
            if state is None:
                continue
            if o.completions is not None:
                self._finish_all(state, o)
            elif state.num_seqs == 1:  # one sequence: its output right away
                c = state.completions[0]
                state.num_cached_tokens = o.num_cached_tokens
                self._note(state, o)
                delta = self._append(c, o, stopped)
                done = c.finish_reason is not None
                if state.kind is CUMULATIVE:  # all so far, as lengths of the growing lists (see outputs.py)
                    snapshot = (c.detokenizer.pieces, c.token_ids, c.logprobs, c.cumulative_logprob)
                    results.append(RequestOutput(rid, state.prompt, state.prompt_token_ids, None, c.finish_reason,
                                                 delta, state.num_cached_tokens, snapshot, state.prompt_logprobs,
                                                 state.error))  # fmt: skip
                else:
                    state.num_finished = int(done)
                    out = self._output(state, delta)
                    if out is not None:
                        results.append(out)
                if done:
                    del requests[rid]
                continue
            else:  # one of n completions: the request's output once all of this step's are in
                c = state.completion(o.index)
                state.num_cached_tokens = o.num_cached_tokens
                self._note(state, o)
                was_done = c.finish_reason is not None
                delta = self._append(c, o, stopped)
                state.num_finished += c.finish_reason is not None and not was_done
                if o.error is not None:  # one failed sequence fails the request: the core freed them all
                    for i in range(state.num_seqs):
                        state.completion(i).finish_reason = state.completion(i).finish_reason or "error"
                    state.num_finished = state.num_seqs
                if o.index == 0:
                    state.delta = delta
            groups[rid] = state
        for rid, state in groups.items():
            out = self._output(state, state.delta)
            state.delta = ""
            if out is not None:
                results.append(out)
            if state.finished:
                del requests[rid]
        return results, stopped

    def _note(self, state: RequestState, o: EngineCoreOutput) -> None:
        """What an output says about the whole request: the prompt's log-probabilities, an error."""
        if o.new_prompt_logprobs is not None and state.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None, *self.logprob_dicts(o.new_prompt_logprobs)]
        if o.error is not None:
            state.error = o.error

    def _append(self, c: Completion, o: EngineCoreOutput, stopped: list[str]) -> str:
        """A sequence's new tokens (each with its logprobs dict, if asked for): through the detokenizer one by one,
        ending at a stop string."""
        detok = c.detokenizer
        if o.cumulative_logprob is not None:
            c.cumulative_logprob = o.cumulative_logprob
        lps = self.logprob_dicts(o.new_logprobs) if c.logprobs is not None and o.new_logprobs is not None else None
        if detok is None:
            c.token_ids += o.new_token_ids
            if lps:
                c.logprobs += lps
            c.finish_reason = o.finish_reason
            return ""
        tokens = o.new_token_ids
        if len(tokens) == 1 and not detok.stop:  # the usual step: one token, no stop string to look for
            c.token_ids.append(tokens[0])
            if lps:
                c.logprobs.append(lps[0])
            delta = detok.step(tokens[0])
        else:
            delta = ""
            for j, t in enumerate(tokens):
                c.token_ids.append(t)
                if lps:
                    c.logprobs.append(lps[j])
                delta += detok.step(t)
                if detok.stopped:  # a stop string: the text ends before it, the tokens after it are dropped
                    c.finish_reason = "stop"
                    if o.finish_reason is None:
                        stopped.append(o.request_id)
                    return delta
        if o.finish_reason is not None:
            c.finish_reason = o.finish_reason
            delta += detok.flush()
        return delta

    def _output(self, state: RequestState, delta: str) -> RequestOutput | None:
        if state.kind is FINAL_ONLY:
            return self._final_output(state) if state.finished else None
        if state.kind is DELTA:
            return self._delta_output(state, delta)
        outs = []
        for i in sorted(state.completions) if state.num_seqs > 1 else (0,):
            c = state.completions[i]
            outs.append(CompletionOutput.snapshot(i, c.detokenizer.pieces, c.token_ids, c.finish_reason,
                                                  c.cumulative_logprob, c.logprobs))  # fmt: skip
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, self._reason(state), delta,
                             state.num_cached_tokens, None, state.take_prompt_logprobs(), state.error)  # fmt: skip

    def _delta_output(self, state: RequestState, delta: str) -> RequestOutput:
        """Only what this step added: each completion's new text and tokens (kept since the last output)."""
        outs = []
        for i in sorted(state.completions) if state.num_seqs > 1 else (0,):
            c = state.completions[i]
            new_pieces = c.detokenizer.pieces
            new_tokens = c.token_ids
            if not new_tokens and not (c.finish_reason and not c.reported):
                continue
            lps = None if c.logprobs is None else list(c.logprobs)
            outs.append(CompletionOutput(i, "".join(new_pieces), list(new_tokens), c.finish_reason,
                                         c.cumulative_logprob, logprobs=lps))  # fmt: skip
            new_pieces.clear()
            new_tokens.clear()
            if lps is not None:
                c.logprobs.clear()
            c.reported = c.finish_reason is not None
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, self._reason(state), delta,
                             state.num_cached_tokens, None, state.take_prompt_logprobs(), state.error)  # fmt: skip

    def _final_output(self, state: RequestState) -> RequestOutput:
        outs = []
        for i in sorted(state.completions):
            c = state.completions[i]
            text = c.detokenizer.text if c.detokenizer is not None else self.decode(c.token_ids, state.skip)
            outs.append(CompletionOutput(i, text, c.token_ids, c.finish_reason, c.cumulative_logprob,
                                         logprobs=c.logprobs))  # fmt: skip
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs,
                             self._reason(state) or "abort", "", state.num_cached_tokens, None,
                             state.take_prompt_logprobs(), state.error)  # fmt: skip

    def _finish_all(self, state: RequestState, o: EngineCoreOutput) -> None:
        """A request that ends with all its completions at once (a beam search: its best sequences, best first)."""
        state.completions = {}
        for i, (tokens, cum, reason) in enumerate(o.completions):
            c = state.completions[i] = Completion(i, None)
            c.token_ids, c.finish_reason, c.cumulative_logprob = list(tokens), reason, cum
        state.num_seqs = state.num_finished = len(o.completions)

    def decode(self, token_ids: list[int], skip: frozenset[int] | None = None) -> str:
        """The whole text at once, as the streaming detokenizer would have made it (EOS, and the `skip` ids, make no
        text)."""
        table, skip = self.token_bytes, self.eos_token_ids if skip is None else skip
        data = b"".join(table[t] if t < len(table) else b"" for t in token_ids if t not in skip)
        return codecs.decode(data, "utf-8", errors="replace")

    def logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        """One dict per position: its own token first (with its true rank), then the top N (ranks 1 .. N)."""
        text, out = self.token_text, []
        for ids, lps, rank in zip(lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks, strict=True):
            d = {ids[0]: Logprob(lps[0], rank, text(ids[0]))}
            for j in range(1, len(ids)):
                if ids[j] not in d:
                    d[ids[j]] = Logprob(lps[j], j, text(ids[j]))
            out.append(d)
        return out

    def token_text(self, token_id: int) -> str:
        """A token's own text: its bytes decoded with errors="replace" (a piece of a character shows as U+FFFD)."""
        text = self._token_text.get(token_id)
        if text is None:
            table = self.token_bytes
            data = table[token_id] if token_id < len(table) else b""
            text = self._token_text[token_id] = data.decode("utf-8", errors="replace")
        return text

    @staticmethod
    def _reason(state: RequestState) -> str | None:
        """The request's finish reason (its first completion's), once every completion has finished."""
        return state.completions[0].finish_reason if state.finished else None
