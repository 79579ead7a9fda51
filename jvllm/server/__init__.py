"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over one LLMEngine.

`build_app(engine, served_model_name, api_key=None, ...)` in app.py; `jvllm serve` in cli.py.
Modules: protocol (request models, error shape), fields (known-but-unimplemented and unknown
fields, lone surrogates), chat (chat templates, tools), render (requests -> prompts +
SamplingParams, server-side limits), async_engine (the engine thread, admission queue, drain),
serving (JSON and SSE answers, disconnect handling), metrics (Prometheus, one registry per app,
jvllm: and vllm: names), middleware (API key, size caps, CORS)."""
