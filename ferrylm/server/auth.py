"""ASGI middleware in front of the app: the API key check, the request body size limit, and JSON bodies
whatever their Content-Type says.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware) so a streamed response passes straight through
and costs nothing per chunk. Neither knows the OpenAI routes beyond which paths need the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from ferrylm.server.protocol import error_body

# /health, /metrics, /version and /ping stay open (probes and scrapers carry no key).
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


async def send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()  # ensure_ascii (the default): always encodable
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on the protected paths, compared in constant time (401 otherwise)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def _allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = b""
        for k, v in headers:
            if k == b"authorization":
                given = v
                break
        scheme, _, token = given.partition(b" ")
        ok_scheme = scheme.lower() == b"bearer"
        # hash both sides so the comparison takes the same time whatever the lengths
        ok_key = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)
        return ok_scheme and ok_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" \
                and scope["path"].startswith(PROTECTED_PREFIXES) and not self._allowed(scope["headers"]):
            await send_json(send, 401, error_body("Invalid or missing API key: send `Authorization: Bearer <key>`",
                                                  "invalid_request_error", None, "invalid_api_key"),
                            [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class ReceiveRefused(Exception):
    """Raised by a guarded `receive` to refuse the request; `run_guarded` answers it."""


async def run_guarded(app, scope, receive, send, reject) -> None:
    """Run `app` with a `receive` that may raise `ReceiveRefused`: whatever response the app makes of that
    error is replaced by `reject(send)`, sent once, and nothing after it goes out."""
    started = refused = False

    async def guarded_receive():
        nonlocal refused
        try:
            return await receive()
        except ReceiveRefused:
            refused = True
            raise

    async def guarded_send(message):
        nonlocal started
        if message["type"] == "http.response.start":
            if started:
                return
            started = True
            if refused:
                return await reject(send)
        elif refused:
            return
        await send(message)

    try:
        await app(scope, guarded_receive, guarded_send)
    except ReceiveRefused:
        if not started:
            started = True
            await reject(send)


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: by Content-Length before reading, or counted as a chunked body arrives."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _reject(self, send):
        return send_json(send, 413, error_body(f"request body exceeds the server's limit of {self.max_bytes} bytes",
                                               "invalid_request_error", None, "request_too_large"),
                         [(b"connection", b"close")])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    too_big = int(v) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    return await self._reject(send)
                break
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise ReceiveRefused
            return message

        await run_guarded(self.app, scope, counting_receive, send, self._reject)


class JsonContentTypeMiddleware:
    """Every POST body is JSON: `curl -d` sends form-urlencoded and some clients send none, so the header is
    set to application/json before FastAPI reads the typed body (a body that is not JSON is still a 400)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
