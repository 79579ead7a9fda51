"""Pure-ASGI guard in front of the app (API key, header and body caps), the CORS settings, and the
rewriting of pydantic validation errors into one readable OpenAI-style 400 message."""
from __future__ import annotations

import dataclasses
import hmac
import json
import re

from fastapi.responses import JSONResponse

from jvllm.server.protocol import error_body

PROTECTED_PATHS = ("/v1/", "/tokenize", "/detokenize")  # API key needed here (prefix match); the rest is open


@dataclasses.dataclass(frozen=True)
class CorsConfig:
    """vLLM's CORS flags (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials)
    with vLLM's defaults. The CORS middleware sits outside the API-key guard: preflight requests
    (OPTIONS, never carrying a key) are answered by it, and errors (401, 413, ...) carry its headers."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self):
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
                raise ValueError(f"--{name.replace('_', '-')} must be a JSON list of non-empty strings, got {v!r}")
            object.__setattr__(self, name, tuple(v))
        if not isinstance(self.allow_credentials, bool):
            raise ValueError(f"--allow-credentials must be a boolean, got {self.allow_credentials!r}")

    def add_to(self, app):
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                           allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                           allow_credentials=self.allow_credentials)


def error_response(status: int, message: str, param=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


class GuardMiddleware:
    """Pure ASGI (keeps disconnect detection intact): header size cap (uvicorn's h11 limit, set to
    4x this cap by the CLI, only cuts headers far beyond it), API key check and body size cap. The body is
    read here (at most `max_body_bytes`) and replayed to the app; Content-Length over the cap is
    refused (the body is drained up to 8x the cap so the client reads the 413). Bodies are always parsed as JSON, whatever their
    Content-Type says (curl -d sends form encoding)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, max_header_bytes: int):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes
        self.max_header = max_header_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        raw_headers = scope.get("headers") or []
        if sum(len(k) + len(v) + 4 for k, v in raw_headers) + len(scope.get("raw_path") or b"") \
                + len(scope.get("query_string") or b"") > self.max_header:
            return await error_response(431, f"the request line and headers are larger than this server's limit "
                                              f"of {self.max_header} bytes (--max-header-bytes)")(scope, receive, send)
        headers = dict(raw_headers)
        if self.key is not None and (path.startswith(PROTECTED_PATHS) or path == "/v1"):
            auth = headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                resp = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
                return await resp(scope, receive, send)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = error_response(413, f"the request body is larger than this server's limit of "
                                       f"{self.max_body} bytes (--max-body-bytes)")
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            return await error_response(400, "invalid Content-Length header")(scope, receive, send)
        if declared > self.max_body:
            await self._discard(receive, declared)
            return await too_big(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_body:
                if msg.get("more_body", False):
                    await self._discard(receive, 0)
                return await too_big(scope, receive, send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        if b"json" not in headers.get(b"content-type", b""):
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"] + [
                (b"content-type", b"application/json")]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        return await self.app(scope, replay_receive, send)

    async def _discard(self, receive, declared: int):
        """Read and drop the rest of an oversized body (up to 8x the limit), so the client, still
        sending, reads our 413 instead of a connection reset. Beyond that the connection is cut."""
        if declared > 8 * self.max_body:
            return
        left = 8 * self.max_body
        while left > 0:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            left -= len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return


_UNION_TAG = re.compile(r"[\[\]\-]|^(str|int|float|bool|list|dict)$")


def validation_message(errors) -> tuple[str, str | None]:
    """One readable sentence from pydantic's errors: the field path without union-member tags, what
    was wrong (with the limit, pydantic states it) and the offending value. For a union (e.g.
    `prompt`), the most specific member error wins over plain "wrong type" ones."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc0 = [x for x in e.get("loc", ()) if x != "body"]
    if not loc0:
        if e.get("type") == "missing":
            return "the request body must be a JSON object (got an empty body or null)", None
        if e.get("type") == "string_unicode":  # a key of the body object
            return "a field name in the request body is not valid Unicode text (a lone UTF-16 surrogate)", None
        return f"the request body must be a JSON object: {e.get('msg')}", None
    same = [x for x in errors if [y for y in x.get("loc", ()) if y != "body"][:1] == loc0[:1]]
    specific = [x for x in same if not x.get("type", "").endswith("_type")]
    e = (specific or same)[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _UNION_TAG.search(str(x))]
    inp = e.get("input")
    got = ""
    if e.get("type") != "missing":
        r = json.dumps(inp, default=str) if not isinstance(inp, (dict, list)) else type(inp).__name__
        got = f" (got {r[:80]})"
    fields = {str(x.get("loc", ("", ""))[1:2]) for x in errors}
    more = f" (and {len(fields) - 1} more field(s))" if len(fields) > 1 else ""
    return f"{'.'.join(loc)}: {e.get('msg')}{got}{more}", str(loc0[0])
