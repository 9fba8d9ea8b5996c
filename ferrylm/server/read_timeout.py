"""Slow clients: a deadline on reading a request's headers and on each wait for its body.

uvicorn has a keep-alive timeout for idle connections but none while a request is being read, so a client
that sends half its headers (slowloris) or stops mid-body holds a connection and a task forever. Two parts:
- `TimedH11Protocol`, uvicorn's h11 protocol with a timer from the first byte of a request (or from the
  connection's opening) until its headers are complete; when it fires the client gets a 408 and the
  connection is closed.
- `BodyTimeoutMiddleware`, plain ASGI: each wait for the next piece of the body is bounded; past it the
  client gets the 408 JSON envelope and the connection is closed.
Does not know routes or the engine.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from ferrylm.server.auth import ReceiveRefused, run_guarded, send_json
from ferrylm.server.protocol import error_body

_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s")


def _timeout_body(what: str, seconds: float) -> dict:
    return error_body(f"the client took longer than {seconds:g} s to send the request {what}",
                      "invalid_request_error", None, "request_timeout")


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a header deadline; `header_timeout` is set by `protocol_class`."""

    header_timeout: float = 30.0

    def connection_made(self, transport) -> None:
        self._header_timer = None
        super().connection_made(transport)
        self._arm()

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        # between requests uvicorn's keep-alive timer covers the idle time; this one starts at the first byte
        if self._waiting_for_headers():
            self._arm()
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if not self._waiting_for_headers():
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            body = json.dumps(_timeout_body("headers", self.header_timeout)).encode()
            self.transport.write(_408 % (len(body), body))
            self.transport.close()


def protocol_class(header_timeout: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout})


class BodyTimeoutMiddleware:
    """408 when the client pauses longer than `timeout` seconds while sending a request body."""

    def __init__(self, app, timeout: float):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_done = False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()  # after the body: only the disconnect, which may take as long as it takes
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                raise ReceiveRefused from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await run_guarded(self.app, scope, timed_receive, send, self._reject)

    def _reject(self, send):
        return send_json(send, 408, _timeout_body("body", self.timeout), [(b"connection", b"close")])
