"""The OpenAI Responses API surface: ``/v1/responses`` (stateful through ``previous_response_id``),
a thin translation over gateway/server/turn.py, with its store (responses/store.py)."""
