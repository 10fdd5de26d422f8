"""HTTP pieces the server and the router share: API keys and who is calling, the error
envelope, request ids, limits on slow and greedy clients, metrics helpers. Nothing here knows an
API surface or the engine."""
