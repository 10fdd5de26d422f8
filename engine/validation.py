"""What a request is checked against before it is queued: once, at the edge (the async
front's ``generate``, or ``LLMEngine.add_request`` for a caller that drives the core itself)."""

from __future__ import annotations

from prefixgate.engine.api import (
    ContextLengthError,
    GenerationRequest,
    InvalidRequestError,
    OverloadedError,
)


def validate_request(request: GenerationRequest, *, vocab_size: int, max_model_len: int,
                     num_pages: int, page_size: int) -> None:
    """Raise the error ``request`` would hit (bad token ids, top_k, context length, more
    pages than the whole pool), before it is queued."""
    prompt = request.prompt_token_ids
    sp = request.sampling
    if not prompt:
        raise InvalidRequestError("the prompt is empty", param="messages")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                                  param="prompt")
    if sp.top_k > vocab_size:
        raise InvalidRequestError(f"top_k must be <= the vocabulary size {vocab_size}, got {sp.top_k}",
                                  param="top_k")
    bad = next((t for t in sp.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"stop token id {bad} is outside the vocabulary [0, {vocab_size})",
                                  param="stop_token_ids")
    if len(prompt) + sp.max_tokens > max_model_len:
        raise ContextLengthError(len(prompt), sp.max_tokens, max_model_len)
    pages = -(-(len(prompt) + sp.max_tokens) // page_size) + (sp.n - 1) * (
        -(-sp.max_tokens // page_size) + 1
    )
    if pages > num_pages:
        raise ContextLengthError(len(prompt), sp.max_tokens, num_pages * page_size // max(1, sp.n),
                                 what="KV cache capacity (all pages)")


def check_queue(num_waiting: int, max_waiting: int) -> None:
    """OverloadedError (HTTP 429) when ``num_waiting`` requests fill the waiting queue."""
    if num_waiting >= max_waiting:
        raise OverloadedError(f"the waiting queue is full ({max_waiting} requests); retry shortly",
                              retry_after=1.0)
