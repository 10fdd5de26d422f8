"""The HTTP front of a prefixgate application on Ray Serve (``serve.ingress``).

Every request Ray's HTTP proxy hands it (OpenAI chat and completions, Responses, Anthropic
Messages, models, cache stats, ...) is forwarded whole to one replica through a deployment
handle; the replica's response streams back chunk by chunk (SSE included). For the four
completion routes the ingress first tokenises and hashes the prompt exactly as a replica will
(``gateway.router.prompt.PromptHasher``, the hasher ``prefixgate route`` uses) and attaches
the block hashes, which the handle's request router scores replicas by. Auth is the replicas'
(the ingress passes headers through); this recipe runs them without API keys, as the hasher
here is built without them (a keyed fleet would need the same key table here).
"""


import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from prefixgate.gateway.http.auth import KeyTable
from prefixgate.gateway.router.prompt import PROMPT_PATHS, PromptHasher
from prefixgate.gateway.scaleout.kv_events.wire import u64
from prefixgate.gateway.scaleout.ray_serve.forwarded import (
    ForwardedRequest,
    ResponseHead,
    message_texts,
)

REPLICA_HEADER = "x-prefixgate-replica"  # which Ray replica served the request

api = FastAPI(title="prefixgate on Ray Serve")


@dataclass(frozen=True, slots=True)
class IngressOptions:
    """What the ingress hashes with: it must match the replicas (model, page size, seed)."""

    model: str | None = None  # None = the default model
    page_size: int = 16
    hash_seed: int = 0


@serve.ingress(api)
class PrefixgateIngress:
    """The ingress deployment class (see the module docstring)."""

    def __init__(self, replicas: DeploymentHandle, options: IngressOptions):
        from prefixgate.engine.loader.tokenizer_only import load_tokenizer_only

        loaded = load_tokenizer_only(options.model)
        self.hasher = PromptHasher(loaded.tokenizer, loaded.model_id, options.page_size,
                                   options.hash_seed, KeyTable({}, None))
        self.replicas = replicas.options(stream=True)

    @api.get("/ray/router")
    async def router_state(self) -> JSONResponse:
        """The prefix-aware routers of this process: blocks known per replica, reasons."""
        # NOTE: imported here, not at the top: Ray pickles this class by value, and a module
        # global would travel as a copy, not the set the routers of this process add to
        from prefixgate.gateway.scaleout.ray_serve import request_router

        routers = list(request_router.LIVE_ROUTERS)
        return JSONResponse({"routers": [router.snapshot() for router in routers]})

    @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, path: str, request: Request) -> StreamingResponse:
        body = await request.body()
        forwarded = await asyncio.to_thread(
            self._forwarded, request.method, request.url.path, request.url.query,
            tuple(request.headers.items()), body)
        stream: DeploymentResponseGenerator = self.replicas.forward.remote(forwarded)
        try:
            head: ResponseHead = await stream.__anext__()
        except BaseException:
            stream.cancel()
            raise
        headers = dict(head.headers)
        headers[REPLICA_HEADER] = head.replica
        return StreamingResponse(self._body(stream), status_code=head.status, headers=headers)

    @staticmethod
    async def _body(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()  # the client left early: stop the replica's stream too

    def _forwarded(self, method: str, path: str, query: str,
                   headers: tuple[tuple[str, str], ...], body: bytes) -> ForwardedRequest:
        """The request with its block hashes (CPU work: the chat template; on a thread)."""
        hashes: tuple[int, ...] = ()
        num_tokens = 0
        if method == "POST" and path in PROMPT_PATHS:
            key = self.hasher.key(path, body, dict(headers))
            if key is not None:
                hashes = tuple(u64(block_hash) for block_hash in key.chain)
                num_tokens = key.num_tokens
        messages = message_texts(method, path, body)
        return ForwardedRequest(method, path, query, headers, body, hashes, num_tokens, messages)
