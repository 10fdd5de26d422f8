"""API keys and the tenants they belong to: ``--api-key KEY[:TENANT]`` and ``--api-keys-file``.

Pages are shared only within a tenant, because the engine salts every block hash with it; a bare
key belongs to the ``default`` tenant. The server and the router read keys the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

DEFAULT_TENANT = "default"

# Tenants and keys travel in headers, logs and metric labels: keep them printable and short.
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=@-]{1,256}$")


def check_token(value: str, what: str, source: str) -> str:
    """``value`` if it is a well-formed key or tenant, else ValueError naming ``source``."""
    if not _TOKEN_RE.match(value):
        raise ValueError(
            f"{source}: invalid {what} {value!r} (1-256 characters from A-Z a-z 0-9 . _ ~ + / = @ -)"
        )
    return value


def parse_api_key(spec: str, source: str = "--api-key") -> tuple[str, str]:
    """Parse ``KEY`` or ``KEY:TENANT``; a bare key belongs to the ``default`` tenant.

    The key ends at the first ``:`` (a key containing ``:`` must come from a keys file).
    """
    key, sep, tenant = spec.strip().partition(":")
    if sep and not tenant:
        raise ValueError(f"{source}: empty tenant in {spec!r} (use KEY or KEY:TENANT)")
    return check_token(key, "API key", source), check_token(
        tenant or DEFAULT_TENANT, "tenant", source
    )


def load_api_keys_file(path: str | Path) -> dict[str, str]:
    """Read an API-keys file into ``{key: tenant}``.

    Accepted formats (chosen by the first non-blank character):

    * JSON object ``{"KEY": "TENANT", ...}``;
    * JSON list of ``{"key": "KEY", "tenant": "TENANT"}`` objects or ``"KEY[:TENANT]"`` strings;
    * text, one ``KEY [TENANT]`` per line (whitespace-separated; ``#`` starts a comment).

    Raises:
        ValueError: naming the file (and line) on any malformed entry or duplicate key.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--api-keys-file: cannot read {path}: {exc.strerror or exc}") from exc
    keys = _KeysFile(path)
    if text.lstrip().startswith(("{", "[")):
        keys.read_json(text)
    else:
        keys.read_lines(text)
    return keys.keys


class _KeysFile:
    """The ``{key: tenant}`` map of one API-keys file as it is read; errors name the file."""

    def __init__(self, path: Path):
        self.path = path
        self.keys: dict[str, str] = {}

    def add(self, key: str, tenant: str, where: str) -> None:
        source = f"{self.path}{where}"
        key = check_token(key, "API key", source)
        tenant = check_token(tenant, "tenant", source)
        if key in self.keys:
            raise ValueError(f"{source}: duplicate API key")
        self.keys[key] = tenant

    def read_json(self, text: str) -> None:
        path = self.path
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
        if isinstance(data, dict):
            for key, tenant in data.items():
                if not isinstance(tenant, str):
                    raise ValueError(f"{path}: tenant of key {key!r} must be a string")
                self.add(key, tenant, "")
            return
        for i, item in enumerate(data):
            self.read_entry(item, f" [entry {i}]")

    def read_entry(self, item: object, where: str) -> None:
        """One entry of a JSON list: ``"KEY[:TENANT]"`` or ``{"key": ..., "tenant": ...}``."""
        if isinstance(item, str):
            self.add(*parse_api_key(item, f"{self.path}{where}"), where)
        elif isinstance(item, dict) and isinstance(item.get("key"), str):
            tenant = item.get("tenant", DEFAULT_TENANT)
            if not isinstance(tenant, str):
                raise ValueError(f"{self.path}{where}: 'tenant' must be a string")
            self.add(item["key"], tenant, where)
        else:
            raise ValueError(
                f'{self.path}{where}: expected "KEY[:TENANT]" or {{"key": ..., "tenant": ...}}'
            )

    def read_lines(self, text: str) -> None:
        """One ``KEY [TENANT]`` per line; ``#`` starts a comment."""
        for lineno, line in enumerate(text.splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise ValueError(
                    f"{self.path}:{lineno}: expected 'KEY [TENANT]', got {len(fields)} fields"
                )
            self.add(fields[0], fields[1] if len(fields) == 2 else DEFAULT_TENANT, f":{lineno}")


def merge_api_keys(specs: Iterable[str], keys_file: str | Path | None) -> dict[str, str]:
    """Combine ``--api-key`` specs and an ``--api-keys-file`` into one ``{key: tenant}`` map."""
    keys = load_api_keys_file(keys_file) if keys_file else {}
    for spec in specs:
        key, tenant = parse_api_key(spec)
        if keys.get(key, tenant) != tenant:
            raise ValueError(
                f"--api-key: key given twice with different tenants ({keys[key]!r}, {tenant!r})"
            )
        keys[key] = tenant
    return keys


def with_keys_file(keys: Mapping[str, str], keys_file: str | Path | None) -> dict[str, str]:
    """``keys`` plus those of ``keys_file``; a key in both must name the same tenant."""
    merged = load_api_keys_file(keys_file) if keys_file else {}
    for key, tenant in keys.items():
        if merged.get(key, tenant) != tenant:
            raise ValueError(
                f"--api-key: key given twice with different tenants ({merged[key]!r}, {tenant!r})"
            )
        merged[key] = tenant
    return merged
