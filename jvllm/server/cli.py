"""`jvllm serve [MODEL] [--host H] [--port P] [--api-key KEY] [--served-model-name NAME ...]` plus
every engine option of `LLM(...)` as a flag (shared with generate/chat through jvllm.cli).

Importing this module is cheap (argparse only): `jvllm.cli` imports it on every invocation.

Shutdown contract (SIGTERM or Ctrl-C): the server stops accepting connections and answers 503 to
any new request on an open connection; in-flight requests keep streaming until they finish or
`--drain-timeout` seconds pass; then each one still open ends cleanly (a non-streamed request gets
an OpenAI-style 503, a stream an SSE error event and `data: [DONE]`) and its engine requests are
aborted; uvicorn itself waits DRAIN_GRACE seconds more before it cancels anything. Then the engine
thread stops and the process exits with status 0. A second Ctrl-C forces exit.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys


DRAIN_GRACE = 5.0  # seconds uvicorn waits beyond --drain-timeout (jvllm ends the requests first)


def _json_list(flag: str):
    def parse(text: str) -> list[str]:
        try:
            v = json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of non-empty strings, got {text!r}")
        return v

    return parse


def register(sub):
    from jvllm.cli import add_engine_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", default="smollm2", help="built-in name or checkpoint folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize; "
                        "None: $JVLLM_API_KEY if set, else no key")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts and reports; None: MODEL")
    p.add_argument("--max-queue-len", type=int, default=512,
                   help="engine requests admitted beyond max_num_seqs; more get 503 + Retry-After")
    p.add_argument("--max-n", type=int, default=16, help="largest n (choices per prompt) per request")
    p.add_argument("--max-stop", type=int, default=16, help="most stop strings per request")
    p.add_argument("--max-prompts", type=int, default=32, help="most prompts in one /v1/completions batch")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    p.add_argument("--max-header-bytes", type=int, default=32 << 10,
                   help="request line + headers larger than this get 431 (beyond 4x this, h11 answers "
                        "400 and closes the connection)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer prompt texts are refused before tokenizing; None: 32 x max_model_len")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may keep running after SIGTERM (then: 503 / SSE error)")
    p.add_argument("--chat-template", default=None,
                   help="chat template: a file, or the Jinja template itself; None: the tokenizer's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template in chat requests (a template is code run on the server)")
    p.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=["*"],
                   help="CORS: allowed origins, a JSON list")
    p.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"],
                   help="CORS: allowed methods, a JSON list")
    p.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"],
                   help="CORS: allowed headers, a JSON list")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="uvicorn: max open connections+tasks before answering 503")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how tool calls are read from the output with tool_choice 'auto' (vLLM's names)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto' (needs --tool-call-parser)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--disable-access-log", action="store_true")
    # vLLM's readiness: /health answers once every program is compiled, so a load balancer or a
    # benchmark never meets a request that waits for a compile (--background-compile: a first
    # request sooner, the other batch sizes compiling beside it, jvllm:warmup_pending 1 meanwhile)
    add_engine_args(p, background_compile=False)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(a):
    try:
        import uvicorn

        from jvllm.server.app import build_app
        from jvllm.server.chat import load_chat_template
        from jvllm.server.middleware import CorsConfig
        from jvllm.server.render import Limits
    except ImportError as e:
        sys.exit(f"jvllm serve needs the server extra ({e}): pip install 'jvllm[server]'")
    from jvllm.cli import engine_kwargs
    from jvllm.engine.engine import EngineConfig, LLMEngine

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag, v, lo in (("--max-queue-len", a.max_queue_len, 0), ("--max-n", a.max_n, 1), ("--max-stop", a.max_stop, 0),
                        ("--max-prompts", a.max_prompts, 1), ("--max-body-bytes", a.max_body_bytes, 1)):
        if v < lo:
            sys.exit(f"{flag} must be >= {lo}, got {v}")
    if a.max_prompt_chars is not None and a.max_prompt_chars < 1:
        sys.exit(f"--max-prompt-chars must be >= 1, got {a.max_prompt_chars}")
    if not a.drain_timeout >= 0:
        sys.exit(f"--drain-timeout must be >= 0, got {a.drain_timeout}")
    try:  # before minutes of loading
        chat_template = load_chat_template(a.chat_template)
        cors = CorsConfig(tuple(a.allowed_origins), tuple(a.allowed_methods), tuple(a.allowed_headers),
                          a.allow_credentials)
    except (ValueError, OSError) as e:
        sys.exit(str(e))
    api_key = a.api_key if a.api_key is not None else os.environ.get("JVLLM_API_KEY") or None
    ekw = engine_kwargs(a)  # starts jax.distributed when asked to (flags, environment, jvllm launch)
    import jax

    if jax.process_count() > 1:  # before minutes of loading
        sys.exit(f"jvllm serve runs in one process (this run has {jax.process_count()} processes): requests reach "
                 f"one process's HTTP server only, and the others could not run the same steps in the same order. "
                 f"Serve a sharded model from a single process instead: jvllm serve --tensor-parallel-size N "
                 f"(without jvllm launch or --num-processes)")
    engine = LLMEngine(EngineConfig(model=a.model, use_tqdm_on_load=sys.stderr.isatty(), **ekw))
    names = a.served_model_name or [a.model]
    try:
        app = build_app(engine, names, api_key, max_queue_len=a.max_queue_len,
                        limits=Limits(max_n=a.max_n, max_stop=a.max_stop, max_prompts=a.max_prompts,
                                      max_prompt_chars=a.max_prompt_chars),
                        max_body_bytes=a.max_body_bytes, max_header_bytes=a.max_header_bytes, model_path=a.model,
                        chat_template=chat_template, trust_request_chat_template=a.trust_request_chat_template,
                        cors=cors, tool_call_parser=a.tool_call_parser,
                        enable_auto_tool_choice=a.enable_auto_tool_choice)
    except ValueError as e:
        sys.exit(str(e))
    print(f"jvllm: serving {names} on http://{a.host}:{a.port} (engine ready in {engine.init_seconds:.1f}s)",
          file=sys.stderr, flush=True)
    serve_app(app, a.host, a.port, drain_timeout=a.drain_timeout, max_header_bytes=a.max_header_bytes,
              limit_concurrency=a.limit_concurrency, log_level=a.log_level, access_log=not a.disable_access_log)


def serve_app(app, host: str, port: int, *, drain_timeout: float, max_header_bytes: int = 32 << 10,
              limit_concurrency: int | None = None, log_level: str = "info", access_log: bool = True):
    """Run `app` (from build_app) under uvicorn until SIGTERM/SIGINT, draining as the module
    docstring says."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, http="h11", lifespan="on",
                            # h11 reads headers up to 4x the cap whole, so GuardMiddleware answers 431
                            # instead of h11 closing mid-request (the client, still sending, then saw
                            # a connection reset instead of the error; CI caught it with 40 KB of headers)
                            h11_max_incomplete_event_size=4 * max_header_bytes,
                            timeout_graceful_shutdown=drain_timeout + DRAIN_GRACE,
                            limit_concurrency=limit_concurrency, log_level=log_level, access_log=access_log)
    server = _draining_server(config, app.state.aengine, drain_timeout)
    # uvicorn re-raises the captured signal after a graceful shutdown: make that a no-op so the
    # process exits 0 after draining instead of dying by the default SIGTERM action.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()


def _draining_server(config, aengine, drain_timeout: float):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn.Server that, on the first SIGTERM/SIGINT, flips the app into draining mode (new
        requests: 503) and has the open requests ended `drain_timeout` seconds later, before uvicorn
        would cancel their handlers (which answers a bare 500 and cuts streams)."""

        def handle_exit(self, sig, frame):
            if not aengine.draining:
                aengine.begin_drain(drain_timeout)
            super().handle_exit(sig, frame)

    return DrainingServer(config)
