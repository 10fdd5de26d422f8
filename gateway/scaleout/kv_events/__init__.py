"""KV-cache events in vLLM's ZMQ format, for external routers (llm-d, Dynamo, Ray Serve):
``config`` (``--kv-events-config``), ``wire`` (the message format), ``publisher`` (the
thread that sends them)."""
