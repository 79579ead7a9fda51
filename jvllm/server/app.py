"""The FastAPI app: `build_app(engine, served_model_name, api_key, ...)`.

Routes: GET /health /version /metrics /v1/models; POST /v1/completions /v1/chat/completions
/tokenize /detokenize. The engine runs in an AsyncEngine thread started by the app's lifespan.

Error contract: every error is `{"error": {"message", "type", "param", "code"}}`. Bad input is a
400 naming the field and the limit (FastAPI's 422 validation errors are rewritten to 400; bodies
that are not JSON objects too), an unknown model 404, a missing/wrong API key 401 (only on /v1/*,
/tokenize and /detokenize; compared in constant time; /health, /metrics and /version stay open),
bodies over `max_body_bytes` 413, headers over `max_header_bytes` 431, and a full admission queue,
a draining server or a dead engine 503 with Retry-After. No handler state survives a rejected
request, so the next one is served. Before anything else every POST body is checked for lone
surrogates and for fields jvllm knows but does not implement (fields.py). An unexpected exception
is logged with a request id and answered as a generic 500 naming only that id.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jvllm.server.async_engine import AsyncEngine, DrainingError, EngineDeadError, QueueFullError
from jvllm.server.chat import chat_options
from jvllm.server.fields import check_extra_fields, reject_surrogates
from jvllm.server.metrics import CONTENT_TYPE, ServerMetrics
from jvllm.server.middleware import CorsConfig, GuardMiddleware, error_response, validation_message
from jvllm.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest)
from jvllm.server.render import Limits, Renderer
from jvllm.server.serving import CompletionServer, watch_disconnect
from jvllm.server.tools import PARSERS, tool_mode

RETRY_AFTER = "1"
RENDER_THREADS = 4  # tokenizing / templating threads: a long prompt holds one, the others go on
log = logging.getLogger("jvllm.server")


def _patch_openapi(app: FastAPI, names: list[str], limits: Limits, max_model_len: int, vocab_size: int):
    """Put the running server's limits into /openapi.json: model names, n, stop count, batch size,
    max_tokens, token id ranges."""

    def first(schema):
        for alt in schema.get("anyOf", [schema]):
            if alt.get("type") not in (None, "null"):
                return alt
        return schema

    def custom():
        if app.openapi_schema:
            return app.openapi_schema
        s = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
        comps = s.get("components", {}).get("schemas", {})
        for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
            props = comps.get(name, {}).get("properties", {})
            if "model" in props:
                props["model"] = {"anyOf": [{"type": "string", "enum": list(names)}, {"type": "null"}],
                                  "title": "Model"}
            if "n" in props:
                props["n"]["maximum"] = limits.max_n
            if "best_of" in props:
                first(props["best_of"])["maximum"] = limits.max_n
            for f in ("max_tokens", "max_completion_tokens"):
                if f in props:
                    first(props[f])["maximum"] = max_model_len - 1
            if "stop" in props:
                for alt in props["stop"].get("anyOf", []):
                    if alt.get("type") == "array":
                        alt["maxItems"] = limits.max_stop
            for f in ("stop_token_ids", "allowed_token_ids"):
                if f in props:
                    first(props[f])["items"].update(minimum=0, maximum=vocab_size - 1)
            if name == "CompletionRequest":
                for alt in props["prompt"].get("anyOf", []):
                    if alt.get("type") != "array":
                        continue
                    items = alt["items"]
                    if items.get("type") == "integer":
                        alt["maxItems"] = max_model_len - 1
                        items.update(minimum=0, maximum=vocab_size - 1)
                    else:
                        alt["maxItems"] = limits.max_prompts
                        if items.get("type") == "array":
                            items["items"].update(minimum=0, maximum=vocab_size - 1)
            if name == "DetokenizeRequest":
                props["tokens"]["items"].update(minimum=0, maximum=vocab_size - 1)
        app.openapi_schema = s
        return s

    app.openapi = custom


def build_app(engine, served_model_name: str | list[str], api_key: str | None = None, *,
              max_queue_len: int = 512, limits: Limits | None = None, max_body_bytes: int = 8 << 20,
              max_header_bytes: int = 32 << 10, model_path: str | None = None, chat_template: str | None = None,
              trust_request_chat_template: bool = False, cors: CorsConfig | None = None,
              render_threads: int = RENDER_THREADS, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False) -> FastAPI:
    """An app serving `engine` (an LLMEngine, or anything with its interface). The engine thread
    starts with the app's lifespan and stops (aborting what is left) when it ends. `chat_template`
    is the template text (chat.load_chat_template reads --chat-template); `cors` None: vLLM's
    defaults (CorsConfig()). `tool_call_parser` (tools.PARSERS) reads tool calls of tool_choice 'auto',
    which needs `enable_auto_tool_choice` too (vLLM's flags)."""
    from jvllm import __version__

    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {list(PARSERS)}, got {tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    limits = limits or Limits()
    metrics = ServerMetrics(names[0])
    aengine = AsyncEngine(engine, max_queue_len=max_queue_len, metrics=metrics)
    metrics.attach_engine(aengine)
    renderer = Renderer(engine, limits, chat_template)
    L = renderer.max_model_len
    version_info = {"version": __version__}
    try:  # what the benchmarks record as "device"
        import jax

        version_info.update(jax=jax.__version__, backend=jax.default_backend(),
                            devices=[getattr(d, "device_kind", str(d)) for d in jax.devices()])
    except Exception:
        pass

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        try:
            yield
        finally:
            aengine.draining = True
            await aengine.shutdown()
            render_pool.shutdown(wait=False)

    app = FastAPI(title="jvllm", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of jvllm (an LLM inference engine on JAX).")
    app.state.aengine = aengine
    app.state.metrics = metrics
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes,
                       max_header_bytes=max_header_bytes)
    (cors or CorsConfig()).add_to(app)  # added last: outermost
    _patch_openapi(app, names, limits, L, renderer.vocab_size)

    # ---------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        msg, param = validation_message(e.errors())
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        status = e.status_code if e.status_code != 422 else 400
        return error_response(status, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        rid = "err-" + os.urandom(6).hex()
        log.error("internal error %s on %s %s", rid, request.method, request.url.path, exc_info=e)
        return error_response(500, f"internal server error (request id {rid}: the server log has the details)",
                              headers={"X-Request-Id": rid})

    def check_model(model: str | None):
        if model and model not in names:  # null or "" is the served model (vLLM)
            raise APIError(f"The model `{model}` does not exist; this server serves {names}", status=404,
                           param="model", type="not_found_error")

    if not isinstance(render_threads, int) or render_threads < 1:
        raise ValueError(f"render_threads must be an integer >= 1, got {render_threads!r}")
    render_pool = concurrent.futures.ThreadPoolExecutor(render_threads, thread_name_prefix="jvllm-render")

    async def render(fn, *args):
        """Tokenize / apply the chat template off the event loop (thread-safety: see render.py)."""
        return await asyncio.get_running_loop().run_in_executor(render_pool, fn, *args)

    async def submit(items):
        try:
            return await aengine.submit(items)
        except QueueFullError as e:
            metrics.reject("queue_full")
            raise APIError(str(e), status=503, headers={"Retry-After": RETRY_AFTER}) from None
        except DrainingError as e:
            metrics.reject("draining")
            raise APIError(str(e), status=503, headers={"Retry-After": RETRY_AFTER}) from None
        except EngineDeadError as e:
            metrics.reject("engine_dead")
            raise APIError(str(e), status=503, headers={"Retry-After": RETRY_AFTER}) from None
        except (ValueError, TypeError) as e:  # the engine's own validation (backstop)
            metrics.reject("invalid")
            msg = str(e)
            raise APIError(msg, param=msg.split(" ", 1)[0].rstrip(":")) from None

    async def run(raw: Request, cs: CompletionServer, items, stream: bool):
        sub = await submit(items)
        if stream:  # the response closes `sub` when it ends, however it ends
            return cs.streaming_response(sub)
        try:
            return await watch_disconnect(raw, cs.full(sub))
        finally:
            sub.close()  # idempotent; covers a cancel that lands before cs.full starts

    def continuous_usage(req) -> bool:
        return bool(req.stream_options and req.stream_options.continuous_usage_stats)

    # ---------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        if not aengine.alive:
            return error_response(503, aengine.dead_message())
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return version_info

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        data = [{"id": n, "object": "model", "created": int(time.time()), "owned_by": "jvllm",
                 "root": model_path or names[0], "parent": None, "max_model_len": L,
                 "vocab_size": renderer.vocab_size} for n in names]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        reject_surrogates(req)
        check_extra_fields(req, "completions", "/v1/completions")
        check_model(req.model)
        renderer.check_common(req)
        prompts = await render(renderer.completion_prompts, req)
        params = [renderer.completion_params(req, p) for p in prompts]
        base = "cmpl-" + os.urandom(8).hex()
        items = [(f"{base}-{i}", {"prompt_token_ids": p.token_ids, "prompt": p.text}, sp)
                 for i, (p, sp) in enumerate(zip(prompts, params))]
        cs = CompletionServer(False, req.model or names[0], req.n, len(prompts), prompts, req.stream,
                              bool(req.stream_options and req.stream_options.include_usage), req.logprobs,
                              echo=req.echo, decode=renderer.decode, continuous_usage=continuous_usage(req),
                              echo_only=req.echo and req.max_tokens == 0)
        return await run(raw, cs, items, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        reject_surrogates(req)
        check_extra_fields(req, "chat", "/v1/chat/completions")
        check_model(req.model)
        renderer.check_common(req)
        opts = chat_options(req, trust_request_chat_template, add_special_tokens=req.add_special_tokens)
        mode, tool_constraint = tool_mode(req, tool_call_parser, enable_auto_tool_choice)
        prompt = await render(renderer.chat_prompt, req.messages, opts, req.truncate_prompt_tokens)
        sp = renderer.chat_params(req, prompt, tool_constraint)
        items = [("chatcmpl-" + os.urandom(8).hex(), {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text},
                  sp)]
        cs = CompletionServer(True, req.model or names[0], req.n, 1, [prompt], req.stream,
                              bool(req.stream_options and req.stream_options.include_usage),
                              sp.logprobs, continuous_usage=continuous_usage(req), tool_mode=mode)
        return await run(raw, cs, items, req.stream)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        reject_surrogates(req)
        check_extra_fields(req, "tokenize", "/tokenize")
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError("messages is empty", param="messages")
            # vLLM's chat tokenize request defaults add_special_tokens to False (the template has them)
            opts = chat_options(req, trust_request_chat_template,
                                "add_special_tokens" in req.model_fields_set and req.add_special_tokens)
            ids = (await render(renderer.chat_prompt, req.messages, opts)).token_ids
        else:
            ids = await render(renderer.encode, req.prompt, req.add_special_tokens) if req.prompt else []
        return {"tokens": ids, "count": len(ids), "max_model_len": L}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        reject_surrogates(req)
        check_extra_fields(req, "detokenize", "/detokenize")
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < renderer.vocab_size]
        if bad:
            raise APIError(f"tokens {bad[:16]} outside the vocabulary [0, {renderer.vocab_size})", param="tokens")
        if renderer.tokenizer is None:
            raise APIError("this model was loaded without a tokenizer", param="tokens")
        return {"prompt": await render(renderer.tokenizer.decode, req.tokens)}

    return app
