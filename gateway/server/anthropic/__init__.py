"""The Anthropic Messages API surface: ``POST /v1/messages`` (streaming and not) and
``POST /v1/messages/count_tokens``, a thin translation over gateway/server/turn.py."""
