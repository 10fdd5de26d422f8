"""The OpenAI chat/completions surface: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/tokenize``, ``/detokenize`` (request and response models in schemas/,
routes in routes.py, chunks and whole responses written from the shared turn in writer.py)."""
