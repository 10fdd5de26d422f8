"""API keys → tenants. Used as FastAPI dependencies by the routes.

With no keys configured every caller is the ``default`` tenant (and may use the admin
endpoints). With keys, ``Authorization: Bearer <key>`` is required; the key's tenant is passed
to the engine, which salts block hashes with it so tenants never share pages.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request

from prefixgate.gateway.http.api_keys import DEFAULT_TENANT
from prefixgate.gateway.http.errors import AuthenticationError, PermissionDeniedError


class KeySettings(Protocol):
    """What the key table reads from ServerSettings and RouterSettings alike."""

    @property
    def api_keys(self) -> Mapping[str, str]: ...

    @property
    def admin_key(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant their requests run as, and whether they may administer."""

    tenant: str
    is_admin: bool


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyTable:
    """Looks keys up by SHA-256 digest, so lookup time does not depend on how much of a key matched."""

    def __init__(self, api_keys: Mapping[str, str], admin_key: str | None):
        self._tenants = {_digest(key): tenant for key, tenant in api_keys.items()}
        self._admin = _digest(admin_key) if admin_key is not None else None
        self.enabled = bool(api_keys) or admin_key is not None

    @property
    def has_admin(self) -> bool:
        return self._admin is not None

    @classmethod
    def from_settings(cls, settings: KeySettings) -> KeyTable:
        """The table of a server's or a router's settings (both carry api_keys and admin_key)."""
        return cls(settings.api_keys, settings.admin_key)

    def principal(self, key: str) -> Principal | None:
        digest = _digest(key)
        if self._admin is not None and digest == self._admin:
            return Principal(DEFAULT_TENANT, is_admin=True)
        tenant = self._tenants.get(digest)
        return Principal(tenant, is_admin=False) if tenant is not None else None


_OPEN = Principal(DEFAULT_TENANT, is_admin=True)


def bearer_key(request: Request) -> str | None:
    """The API key: ``Authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>``."""
    header = request.headers.get("authorization")
    if not header:
        return request.headers.get("x-api-key", "").strip() or None
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthenticationError(
            "Malformed Authorization header; expected 'Bearer <API key>'.", code="invalid_api_key"
        )
    return key.strip()


async def authenticate(request: Request) -> Principal:
    """FastAPI dependency: the caller's :class:`Principal` (401 on a missing or unknown key)."""
    table: KeyTable = request.app.state.keys
    if not table.enabled:
        return _OPEN
    key = bearer_key(request)
    if key is None:
        raise AuthenticationError(
            "Missing API key: send 'Authorization: Bearer <API key>'.", code="missing_api_key"
        )
    principal = table.principal(key)
    if principal is None:
        raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
    request.state.tenant = principal.tenant
    return principal


async def require_admin(request: Request) -> Principal:
    """FastAPI dependency for cache administration: the admin key when auth is on (403 otherwise)."""
    principal = await authenticate(request)
    if not principal.is_admin:
        table: KeyTable = request.app.state.keys
        hint = "" if table.has_admin else " (no --admin-key is configured)"
        raise PermissionDeniedError(
            f"This endpoint needs the admin key{hint}.", code="admin_required"
        )
    return principal
