"""The FastAPI app: `build_app(engine, served_model_name, api_key, ...)`.

Routes: GET /health /version /metrics /v1/models; POST /v1/completions /v1/chat/completions
/tokenize /detokenize. The engine runs in an AsyncEngine thread started by the app's lifespan.

Error contract: every error is `{"error": {"message", "type", "param", "code"}}`. Bad input is a
400 naming the field and the limit (FastAPI's 422 validation errors are rewritten to 400; bodies
that are not JSON objects too), an unknown model 404, a missing/wrong API key 401 (only on /v1/*,
/tokenize and /detokenize; compared in constant time; /health, /metrics and /version stay open),
bodies over `max_body_bytes` 413, and a full admission queue, a draining server or a dead engine
503 with Retry-After. No handler state survives a rejected request, so the next one is served.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import os
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jvllm.server.async_engine import AsyncEngine, DrainingError, EngineDeadError, QueueFullError
from jvllm.server.metrics import CONTENT_TYPE, ServerMetrics
from jvllm.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest, error_body)
from jvllm.server.render import Limits, Renderer
from jvllm.server.serving import CompletionServer, watch_disconnect

OPEN_PATHS = ("/health", "/metrics", "/version", "/openapi.json", "/docs", "/redoc", "/ping")
RETRY_AFTER = "1"


def _error_response(status: int, message: str, param=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


class GuardMiddleware:
    """Pure ASGI (keeps disconnect detection intact): API key check and body size cap. The body is
    read here (at most `max_body_bytes`) and replayed to the app; Content-Length over the cap is
    refused before reading anything."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if self.key is not None and not path.startswith(OPEN_PATHS):
            auth = headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                resp = _error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
                return await resp(scope, receive, send)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = _error_response(413, f"the request body is larger than this server's limit of "
                                       f"{self.max_body} bytes (--max-body-bytes)")
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            return await _error_response(400, "invalid Content-Length header")(scope, receive, send)
        if declared > self.max_body:
            return await too_big(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_body:
                return await too_big(scope, receive, send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        return await self.app(scope, replay_receive, send)


def _validation_message(errors) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    typ = e.get("type", "")
    if typ == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if not loc:
        if typ == "missing":
            return "the request body must be a JSON object (got an empty body or null)", None
        return f"the request body must be a JSON object: {e.get('msg')}", None
    param = loc[0]
    inp = e.get("input")
    got = ""
    if typ != "missing":
        r = json.dumps(inp, default=str) if not isinstance(inp, (dict, list)) else type(inp).__name__
        got = f" (got {r[:80]})"
    more = f" (+{len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return f"{'.'.join(loc)}: {e.get('msg')}{got}{more}", param


def _patch_openapi(app: FastAPI, names: list[str], limits: Limits, max_model_len: int):
    """Put the running server's limits into /openapi.json (n, stop count, max_tokens, model)."""

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
            for f in ("max_tokens", "max_completion_tokens"):
                if f in props:
                    first(props[f])["maximum"] = max_model_len - 1
            if "stop" in props:
                for alt in props["stop"].get("anyOf", []):
                    if alt.get("type") == "array":
                        alt["maxItems"] = limits.max_stop
            if name == "CompletionRequest":
                for alt in props["prompt"].get("anyOf", []):
                    if alt.get("type") == "array":
                        alt["maxItems"] = limits.max_prompts if alt["items"].get("type") != "integer" \
                            else max_model_len - 1
        app.openapi_schema = s
        return s

    app.openapi = custom


def build_app(engine, served_model_name: str | list[str], api_key: str | None = None, *,
              max_queue_len: int = 512, limits: Limits | None = None, max_body_bytes: int = 8 << 20,
              model_path: str | None = None) -> FastAPI:
    """An app serving `engine` (an LLMEngine, or anything with its interface). The engine thread
    starts with the app's lifespan and stops (aborting what is left) when it ends."""
    from jvllm import __version__

    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    limits = limits or Limits()
    metrics = ServerMetrics(names[0])
    aengine = AsyncEngine(engine, max_queue_len=max_queue_len, metrics=metrics)
    metrics.attach_engine(aengine)
    renderer = Renderer(engine, limits)
    L = renderer.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        try:
            yield
        finally:
            aengine.draining = True
            await aengine.shutdown()

    app = FastAPI(title="jvllm", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of jvllm (an LLM inference engine on JAX).")
    app.state.aengine = aengine
    app.state.metrics = metrics
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    _patch_openapi(app, names, limits, L)

    # ---------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        msg, param = _validation_message(e.errors())
        return _error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        status = e.status_code if e.status_code != 422 else 400
        return _error_response(status, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        return _error_response(500, f"internal error: {type(e).__name__}: {e}")

    def check_model(model: str | None):
        if model is not None and model not in names:
            raise APIError(f"The model `{model}` does not exist; this server serves {names}", status=404,
                           param="model", type="not_found_error")

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
            raise APIError(msg, param=msg.split(" ", 1)[0]) from None

    async def run(raw: Request, cs: CompletionServer, items, stream: bool):
        sub = await submit(items)
        if stream:
            return cs.streaming_response(sub)
        return await watch_disconnect(raw, cs.full(sub))

    # ---------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        if not aengine.alive:
            return _error_response(503, f"the engine is dead: {aengine.dead!r}")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

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
        check_model(req.model)
        renderer.check_common(req)
        prompts = renderer.completion_prompts(req)
        params = [renderer.completion_params(req, p) for p in prompts]
        base = "cmpl-" + os.urandom(8).hex()
        items = [(f"{base}-{i}", {"prompt_token_ids": p.token_ids, "prompt": p.text}, sp)
                 for i, (p, sp) in enumerate(zip(prompts, params))]
        cs = CompletionServer(False, req.model or names[0], req.n, len(prompts), prompts, req.stream,
                              bool(req.stream_options and req.stream_options.include_usage), req.logprobs,
                              echo=req.echo)
        return await run(raw, cs, items, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        renderer.check_common(req)
        prompt = renderer.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                      req.add_special_tokens)
        sp = renderer.chat_params(req, prompt)
        items = [("chatcmpl-" + os.urandom(8).hex(), {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text},
                  sp)]
        cs = CompletionServer(True, req.model or names[0], req.n, 1, [prompt], req.stream,
                              bool(req.stream_options and req.stream_options.include_usage),
                              sp.logprobs)
        return await run(raw, cs, items, req.stream)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError("messages is empty", param="messages")
            ids = renderer.chat_prompt(req.messages, req.add_generation_prompt, False,
                                       req.add_special_tokens and False).token_ids
        else:
            ids = renderer.encode(req.prompt, req.add_special_tokens) if req.prompt else []
        return {"tokens": ids, "count": len(ids), "max_model_len": L}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < renderer.vocab_size]
        if bad:
            raise APIError(f"tokens {bad[:16]} outside the vocabulary [0, {renderer.vocab_size})", param="tokens")
        if renderer.tokenizer is None:
            raise APIError("this model was loaded without a tokenizer", param="tokens")
        return {"prompt": renderer.tokenizer.decode(req.tokens)}

    return app
