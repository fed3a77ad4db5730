"""Serving: an OpenAI-compatible HTTP server on the same scheduler, policies and engine.

    live       a scheduler over an open workload, stepped by a background thread on the
               wall clock (requests submitted, cancelled and stopped as they come)
    tokenizer  text to token ids: a checkpoint's tokenizer.json, or the byte tokenizer
    metrics    the server's Prometheus metrics
    app        the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models,
               /health, /metrics
    server     the port bound before the engine compiles; uvicorn's server with a stop
               that answers 503 while the requests held finish

`app`, `metrics` and `server` need the `serve` extra (fastapi, uvicorn, prometheus-client,
tokenizers); `live` needs nothing more than the core.

May import: every other part of `orca_jax` (it sits beside the runner, at the top);
never `experiments`.
"""
