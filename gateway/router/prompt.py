"""Hash a request's prompt exactly as a replica will: same tokenizer and chat template, same
page size and seed, same extra keys (model id, tenant from the API key, cache_salt).

The request is parsed with the gateway's own pydantic models, so the messages and tools reach
the chat template in the same form as on the replica. Anything that does not parse simply has
no prompt key: the replica will answer it (with its 400), placed by load alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from prefixgate.cache.hashing import BlockHasher, make_extra_keys
from prefixgate.gateway.http.api_keys import DEFAULT_TENANT
from prefixgate.gateway.http.auth import KeyTable
from prefixgate.gateway.http.headers import AGENT_HEADER
from prefixgate.gateway.server.anthropic.schemas import MessagesRequest
from prefixgate.gateway.server.openai.schemas import ChatCompletionRequest, CompletionRequest
from prefixgate.gateway.server.responses.schemas import ResponsesRequest
from prefixgate.gateway.server.tokenization import template_inputs
from prefixgate.gateway.server.tools.dialect import choose_dialect

logger = logging.getLogger("prefixgate.router")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
PROMPT_PATHS = (CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, MESSAGES_PATH)


class PromptKey(NamedTuple):
    """What placement needs to know about one request."""

    chain: tuple[bytes, ...]  # block hashes of the prompt's full blocks (may be empty)
    num_tokens: int
    session: str | None  # X-Agent-Id, else the body's `user`
    tenant: str


class PromptHasher:
    """Tokenises and hashes request bodies (CPU work: call it on a worker thread).

    Args:
        tokenizer: the replicas' tokenizer (``apply_chat_template``, ``encode``).
        model_id: the replicas' ``LoadedModel.name`` (enters the first block's hash).
        page_size, hash_seed: as the replicas (``--page-size``, ``--hash-seed``).
        keys: the replicas' API keys → tenants.
        tool_call_format: as the replicas' ``--tool-call-format`` (tools/dialect.py).
    """

    def __init__(self, tokenizer: Any, model_id: str, page_size: int, hash_seed: int,
                 keys: KeyTable, tool_call_format: str | None = None):
        self.tokenizer = tokenizer
        self.dialect = choose_dialect(getattr(tokenizer, "chat_template", None),
                                      tool_call_format)
        self.model_id = model_id
        self.hasher = BlockHasher(page_size, hash_seed)
        self.keys = keys

    def tenant_of(self, headers: Mapping[str, str]) -> str | None:
        """The tenant a replica will run this request as; None when it will refuse the key."""
        if not self.keys.enabled:
            return DEFAULT_TENANT
        scheme, _, key = (headers.get("authorization") or "").partition(" ")
        if not scheme and headers.get("x-api-key"):  # Anthropic clients
            scheme, key = "bearer", headers.get("x-api-key", "")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        principal = self.keys.principal(key.strip())
        return None if principal is None else principal.tenant

    def _chat_ids(self, messages: list[dict[str, Any]], tools: Any, param: str,
                  template_kwargs: dict[str, Any] | None) -> list[int]:
        prepared, template_tools = template_inputs(self.tokenizer, messages, tools, param,
                                                   self.dialect)
        return list(self.tokenizer.apply_chat_template(prepared, template_tools, True,
                                                       **(template_kwargs or {})))

    def token_ids(self, path: str, data: dict[str, Any], history: list[dict[str, Any]] | None = None
                  ) -> tuple[list[int], str | None, str | None]:
        """(prompt token ids, `user`, cache_salt); raises ValueError / ValidationError.

        ``history``: for a Responses request continuing ``previous_response_id``, the stored
        conversation (the replica prepends the same one).
        """
        if path == CHAT_PATH:
            chat = ChatCompletionRequest.model_validate(data)
            ids = self._chat_ids(chat.template_messages(), chat.template_tools(), "messages",
                                 chat.template_kwargs())
            return ids, chat.user, chat.cache_salt
        if path in (RESPONSES_PATH, MESSAGES_PATH):
            if path == RESPONSES_PATH:
                request = ResponsesRequest.model_validate(data)
                turn, salt = request.turn(history or []), request.cache_salt
            else:
                turn, salt = MessagesRequest.model_validate(data).turn(), None
            ids = self._chat_ids(turn.messages, turn.visible_tools, turn.message_param,
                                 turn.template_kwargs)
            return ids, turn.user, salt
        if path == COMPLETIONS_PATH:
            completion = CompletionRequest.model_validate(data)
            first = completion.prompt[0]  # a multi-prompt request goes where its first fits
            ids = first if isinstance(first, list) else self.tokenizer.encode(first, True)
            return list(ids), completion.user, completion.cache_salt
        raise ValueError(f"no prompt in {path}")

    def key(self, path: str, body: bytes, headers: Mapping[str, str],
            history: list[dict[str, Any]] | None = None) -> PromptKey | None:
        """The prompt key of a request, or None when it has no (valid) prompt or tenant."""
        tenant = self.tenant_of(headers)
        if tenant is None:
            return None
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                return None
            ids, user, cache_salt = self.token_ids(path, data, history)
        except (ValueError, TypeError, KeyError, ValidationError) as exc:
            # The replica will reject it with a proper error; we only lose placement.
            logger.debug("no prompt key for %s: %s", path, exc)
            return None
        header = (headers.get(AGENT_HEADER.lower()) or "").strip()
        session = header or user
        extra = make_extra_keys(self.model_id, tenant, cache_salt)
        chain = tuple(b.block_hash for b in self.hasher.hash_blocks(ids, extra))
        return PromptKey(chain, len(ids), session, tenant)
