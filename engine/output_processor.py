"""Sampled tokens into deltas: the engine core's update phase (vLLM v1's OutputProcessor).

Per token: grammar advance, detokenize, stop tokens and stop strings (the one that matched is
named in the final delta, ``Delta.matched_stop``: nobody decodes the output again to find it),
length, then the delta to the request's sink; per verify chunk: draft acceptance. It owns the
requests in flight (``RequestState``) and makes their sequences.
"""

from __future__ import annotations

import logging
from typing import Any

from prefixgate.engine.api import (
    Delta,
    EngineError,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from prefixgate.engine.drafter import DraftState
from prefixgate.engine.grammar import new_matcher
from prefixgate.engine.grammar.drafts import GrammarDrafts, jump_forward_allowed
from prefixgate.engine.isolation import grammar_dead_end, isolated_failure
from prefixgate.engine.request_state import DecodeState, RequestState
from prefixgate.engine.sampler import Verified, make_generator
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.sequence import SeqStatus, Sequence
from prefixgate.engine.step_counters import StepCounters
from prefixgate.engine.step_sampling import SampledToken, VerifiedDrafts
from prefixgate.engine.stop_strings import StopStringMatcher

logger = logging.getLogger("prefixgate.engine")


class OutputProcessor:
    """The requests in flight and their output: tokens in, deltas out.

    Args:
        tokenizer: ``decode`` + ``incremental_decoder()`` + ``eos_token_ids``.
        scheduler: the step's scheduler (tokens appended, drafts accepted, sequences finished).
        counters: the engine's running totals (constrained and accepted draft tokens).
        max_model_len: a sequence that reaches it finishes with "length".
    """

    def __init__(self, tokenizer: Any, scheduler: Scheduler, counters: StepCounters,
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.counters = counters
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self.requests: dict[str, RequestState] = {}

    # ------------------------------------------------------------------ sequences

    def new_sequence(self, state: RequestState, choice: int, token_ids: list[int]) -> Sequence:
        """Choice ``choice`` of ``state``'s request, with its decode state (detokenizer, stop
        strings, seeded generator, grammar matcher, drafts)."""
        req = state.request
        seq = Sequence(request_id=req.request_id, choice=choice, token_ids=token_ids,
                       num_prompt_tokens=len(req.prompt_token_ids), sampling=req.sampling,
                       extra_keys=state.extra_keys, tenant=req.tenant, agent=req.agent)
        seq.state = DecodeState(
            decoder=self.tokenizer.incremental_decoder(),
            stops=StopStringMatcher(req.sampling.stop),
            generator=make_generator(req.sampling.seed, choice),
            matcher=new_matcher(state.grammar) if state.grammar is not None else None,
        )
        # Greedy and sampled requests draft alike (sampler.verify: rejection sampling), with
        # penalties, logprobs and seeds (each emitted token consumes one draw of the request's
        # generator, as a plain decode does). Constrained rows draft too (grammar/drafts.py):
        # the tokens their grammar forces next, else the n-gram proposal up to the first
        # token the grammar rejects; each verify row is masked by the grammar's state after
        # the drafts before it, so the output is the same as one token a step.
        # NOTE: not with n > 1: the prompt's last token can be scheduled as a one-token
        # "decode" (after chunked prefill or a recompute), which would draft before the
        # choices fork, and the forks sample from that chunk's first row in the step's
        # sampling, which skips verified chunks.
        drafter = self.scheduler.drafter
        if drafter is not None and req.speculative and req.sampling.n == 1:
            matcher = seq.state.matcher
            seq.draft = DraftState(k=drafter.max_draft, grammar=GrammarDrafts(
                matcher, jump_forward=jump_forward_allowed(req.grammar))
                if matcher is not None and req.grammar is not None else None)
        state.seqs.append(seq)
        return seq

    def fork_choices(self, parent: Sequence) -> list[Sequence]:
        """n > 1: choices 1..n-1 of ``parent``'s request, sharing its computed prompt."""
        state = self.requests[parent.request_id]
        children = [self.new_sequence(state, choice, list(parent.token_ids))
                    for choice in range(1, parent.num_choices_to_fork + 1)]
        parent.num_choices_to_fork = 0
        return children

    # ------------------------------------------------------------------ tokens in

    def emit_sampled(self, sampled: list[tuple[Sequence, SampledToken | None]]) -> None:
        """Each sampled token into its choice's output (the step's commit came first)."""
        for seq, token in sampled:
            if seq.request_id not in self.requests:
                continue  # failed earlier in this loop (another choice of it)
            if token is None:
                self.fail(seq.request_id,
                          isolated_failure("sampling failed on this request's parameters"))
            elif token.dead_end:
                self.fail(seq.request_id, grammar_dead_end())
            else:
                try:
                    top = seq.sampling.top_logprobs
                    logprob = None
                    if token.logprob is not None and seq.sampling.logprobs:
                        logprob = self._logprob(token.token_id, token.logprob,
                                                token.top_ids[:top], token.top_logprobs[:top])
                    self._on_token(seq, token.token_id, logprob)
                except Exception:  # detokenizer, stop strings, grammar: this row's alone
                    self._fail_decoding(seq)

    def emit_verified(self, verified: dict[int, VerifiedDrafts]) -> None:
        """Each verify chunk's accepted drafts and the token after them."""
        for seq, result in verified.values():
            if seq.status is not SeqStatus.RUNNING or seq.request_id not in self.requests:
                continue
            try:
                self._on_drafts(seq, result)
            except Exception:
                self._fail_decoding(seq)

    def _fail_decoding(self, seq: Sequence) -> None:
        logger.exception("request %s failed after sampling; failing it alone", seq.request_id)
        self.fail(seq.request_id, isolated_failure("decoding this request's output failed"))

    def _on_drafts(self, seq: Sequence, result: Verified) -> None:
        """Emit ``seq``'s accepted draft tokens (as if decoded one by one), make their K/V the
        sequence's, then emit the token after them; stops early when one of them finishes it
        (EOS, stop, length)."""
        sp = seq.sampling
        for i, token_id in enumerate(result.token_ids):
            logprob = None
            if result.logprobs is not None and sp.logprobs:
                assert result.top_ids is not None and result.top_logprobs is not None
                logprob = self._logprob(token_id, result.logprobs[i], result.top_ids[i][: sp.top_logprobs],
                                        result.top_logprobs[i][: sp.top_logprobs])
            if i == result.num_accepted:  # the drafts are the sequence's tokens now
                self.scheduler.accept_drafts(seq, result.num_accepted)
                if result.dead_end:
                    self.fail(seq.request_id, grammar_dead_end())
                    return
            self._on_token(seq, token_id, logprob)
            self.counters.spec_tokens_accepted += i < result.num_accepted
            if seq.status is not SeqStatus.RUNNING:
                return

    def _logprob(self, token_id: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> TokenLogprob:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        top = tuple(TopLogprob(t, self.tokenizer.decode([t], skip_special_tokens=False), lp)
                    for t, lp in zip(top_ids, top_lps, strict=True))
        return TokenLogprob(token_id, text, logprob, top)

    def _on_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        sp = seq.sampling
        st: DecodeState = seq.state
        if st.matcher is not None:
            self.counters.constrained_tokens += 1
            if not st.matcher.accept_token(token_id):
                # the mask allowed it, so the grammar itself is inconsistent: this request only
                self.fail(seq.request_id, EngineError(
                    f"the output grammar rejected token {token_id} it had allowed; the request "
                    "was stopped", code="grammar_dead_end"))
                return
        self.scheduler.append_token(seq, token_id)
        finish = None
        if (token_id in sp.stop_token_ids or (not sp.ignore_eos and token_id in self.eos_token_ids)
                or (st.matcher is not None and st.matcher.is_terminated())):
            finish = "stop"  # the stop token itself is not shown (a finished grammar ends too)
            # NOTE: the text held back in case it started a stop string did not: it is output
            # (a tool call's closing tag, which a stop string must not cut off)
            text, matched = st.stops.feed(st.decoder.flush())
            if not matched:
                text += st.stops.flush()
        else:
            text, matched = st.stops.feed(st.decoder.feed(token_id))
            if matched:
                finish = "stop"
        # the surfaces that name the stop string (Anthropic's stop_sequence) read it here
        matched_stop = st.stops.matched if matched else None
        if finish is None and (seq.num_output_tokens >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len):
            finish = "length"
        if finish == "length":
            text += st.stops.feed(st.decoder.flush())[0] + st.stops.flush()
        self.emit(seq, (token_id,), text, finish, (logprob,) if logprob is not None else None,
                  matched_stop)

    # ------------------------------------------------------------------ deltas out

    def emit(self, seq: Sequence, token_ids: tuple[int, ...], text: str, finish: str | None,
             logprobs: tuple[TokenLogprob, ...] | None, matched_stop: str | None = None) -> None:
        """Hand one delta to ``seq``'s request; a finish releases the choice (and, with the
        request's last choice, reports its usage)."""
        state = self.requests.get(seq.request_id)
        if state is None:
            return
        usage = None
        if finish is not None:
            seq.finish_reason = finish  # type: ignore[assignment]
            if state.pin_when_done and seq.choice == 0:
                self.scheduler.pin_prompt(seq)
            self.scheduler.finish(seq)
            state.num_finished += 1
            if state.num_finished == state.request.sampling.n:
                usage = Usage(
                    prompt_tokens=len(state.request.prompt_token_ids),
                    completion_tokens=sum(s.num_output_tokens for s in state.seqs),
                    cached_tokens=state.seqs[0].num_cached_tokens or 0,
                )
                del self.requests[seq.request_id]
        state.sink(Delta(seq.choice, tuple(token_ids), text, finish, logprobs, usage,  # type: ignore[arg-type]
                         matched_stop))

    def fail(self, request_id: str, error: EngineError) -> None:
        """End ``request_id`` with ``error`` (its pages are released; unknown: nothing)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.scheduler.remove_request(request_id)
            state.sink(error)

    def fail_all(self, error: EngineError) -> None:
        for request_id in list(self.requests):
            self.fail(request_id, error)
