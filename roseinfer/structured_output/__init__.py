"""Structured outputs: text that must follow a JSON schema, a regex, a list of choices or a grammar (vLLM V1's
StructuredOutputManager, with xgrammar as the backend).

A grammar cannot change the model; it can change which tokens the sampler may pick. Each step, for every
constrained row the core writes one row of a bitmask, bit t = "token t may come next", and the model runner sets
the logits of every other token to -inf before the sampler sees them (roseinfer/sample/grammar_bitmask.py):

    add_request    grammar_init: compile the constraint in a thread (cached by its text); the request waits
                   in the scheduler until it is ready, and the others go ahead meanwhile
    each step      schedule ─► grammar_bitmask: rows for the constrained requests of the step  ─► the runner:
                                 [rows, ceil(V/32)] int32 in SchedulerOutput.grammar_bitmask      logits[~mask] = -inf,
                                 (1 + k rows for a request that verifies k drafts)                then sample
                   update ─► accept_outputs: each sampled token moves its request's matcher on; a grammar
                             that has reached its end finishes the request ("stop")

Everything here runs in the core, between the steps, on ids and bits: the runner receives the bitmask as data,
as it receives the token ids. Unconstrained requests pay nothing: a step with no constrained row has no bitmask.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait

from roseinfer.config import EngineConfig
from roseinfer.core.request import Request
from roseinfer.core.sched.output import EngineCoreOutput, SchedulerOutput
from roseinfer.structured_output.backend_xgrammar import XgrammarBackend, grammar_spec
from roseinfer.structured_output.request import StructuredOutputRequest


class StructuredOutputManager:
    def __init__(self, config: EngineConfig):
        self.config = config
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.backend: XgrammarBackend | None = None  # made at the first constrained request (reads the vocabulary)
        self.compiling: dict[str, Request] = {}  # requests whose grammar is not ready yet
        self.constrained: dict[str, Request] = {}  # the live constrained sequences: a step without any costs nothing
        self._bitmask = None  # [max rows, ceil(V/32)] int32, reused every step

    def grammar_init(self, request: Request) -> None:
        """Start compiling a constrained request's grammar (or find it compiled); nothing for the others."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self.backend is None:
            self.backend = self._make_backend()
        key = grammar_spec(params)
        stop = sorted(request.eos_token_ids | request.stop_token_ids)
        sor = StructuredOutputRequest(key, self.backend.compile_async(key), stop, self.num_speculative_tokens)
        request.structured_output_request = sor
        self.constrained[request.request_id] = request
        if not sor.is_ready:
            self.compiling[request.request_id] = request

    def _make_backend(self) -> XgrammarBackend:
        """xgrammar's view of the vocabulary: every token's bytes (special tokens none), the model's EOS ids."""
        from roseinfer.tokenizer import Tokenizer

        mc = self.config.model_config
        tokenizer = Tokenizer.from_model_dir(mc.model_dir, mc.vocab_size)
        table = list(tokenizer.token_bytes_table)
        for i in getattr(tokenizer, "special_ids", ()):
            table[i] = b""  # never inside the text: a special token can only stop the grammar
        return XgrammarBackend(table, mc.vocab_size, list(mc.eos_token_ids))

    def failed_requests(self) -> dict[str, str]:
        """Requests whose grammar failed to compile (request id -> why); the ones now ready stop being watched."""
        failed = {}
        for rid, req in list(self.compiling.items()):
            sor = req.structured_output_request
            if sor.is_ready or sor.error is not None or req.finished:
                del self.compiling[rid]
                if sor.error is not None and not req.finished:
                    failed[rid] = sor.error
        return failed

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until one compiling grammar is done (or `timeout` seconds): what the core does when nothing
        else can run, instead of stepping empty steps that take the CPU from the compile thread."""
        wait([r.structured_output_request.compiled for r in self.compiling.values()], timeout, FIRST_COMPLETED)

    def grammar_bitmask(self, requests: dict[str, Request], scheduler_output: SchedulerOutput) -> None:
        """Fill `scheduler_output.grammar_bitmask` with the rows of the step's constrained requests, and
        `structured_output_request_ids` with each one's first row. A request verifying k drafts gets k + 1 rows;
        a sequence forked to sample now (n > 1) gets its own row."""
        if not self.constrained:
            return
        live = self.constrained
        for rid in [rid for rid, req in live.items() if req.finished]:
            del live[rid]
        sampling_children = set()
        for f in scheduler_output.forks:  # n > 1: the sequences forked from a constrained one have their matcher
            if f.sample_now and f.parent_id in live and (child := requests.get(f.child_id)) is not None:
                live[f.child_id] = child
                sampling_children.add(f.child_id)
        scheduled = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        now = [req for rid, req in live.items() if rid in scheduled or rid in sampling_children]  # in this step
        constrained = [
            (r.request_id, r.structured_output_request.grammar) for r in now if r.structured_output_request.is_ready
        ]
        if not constrained:
            return
        rows = len(constrained) + sum(len(drafts.get(rid, ())) for rid, _ in constrained)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = self.backend.allocate_token_bitmask(max(rows, self.config.scheduler_config.max_num_seqs))
        bitmask, row, first = self._bitmask, 0, {}
        for rid, grammar in constrained:
            first[rid] = row
            d = drafts.get(rid)
            if d:
                grammar.advance_through(d, bitmask, row)
                row += len(d) + 1
            else:
                grammar.fill_bitmask(bitmask, row)
                row += 1
        scheduler_output.structured_output_request_ids = first
        scheduler_output.grammar_bitmask = bitmask[:row].numpy().copy()  # data: the runner (or a TP rank) reads it

    def accept_outputs(self, requests: dict[str, Request], outputs: list[EngineCoreOutput]) -> tuple[list, dict]:
        """Move each constrained sequence's matcher on by its new tokens. Returns (sequences whose grammar has just
        ended while they had not: they finish "stop"; request id -> error for a token the grammar refused)."""
        ended, refused = [], {}
        if not self.constrained:
            return ended, refused
        for o in outputs:
            if o.request_id not in self.constrained:
                continue
            req = requests.get(o.request_id)
            if req is None or not o.new_token_ids:  # (gone: it finished in this step)
                continue
            grammar = req.structured_output_request.grammar
            if grammar is None:
                continue
            if not grammar.accept_tokens(o.new_token_ids):
                refused[o.request_id] = f"the grammar refused token(s) {o.new_token_ids} (structured_outputs)"
            elif grammar.is_terminated() and o.finish_reason is None:
                o.finish_reason = "stop"
                ended.append(o.request_id)
        return ended, refused

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]
