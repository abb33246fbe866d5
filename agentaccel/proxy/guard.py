"""Connection limits uvicorn does not enforce itself: a cap on open connections and a deadline
for a request's headers.

Why: uvicorn waits forever for the rest of a request that a client sends slowly (one header
byte at a time, or nothing after connecting), and counts such connections against nothing, so a
few thousand of them hold the server's sockets and memory. Here a connection beyond the cap is
answered 503 at once and closed, and one whose request headers are not complete within
`header_timeout` seconds (after it opened, or after its previous response) gets a 408 and is
closed. Bodies have their own deadline in the proxy (no gap between body bytes longer than the
read timeout), where the answer can be an ordinary OpenAI-style error.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def guarded_protocol(max_connections: int, header_timeout: float, base: type = AutoHTTPProtocol) -> type:
    """uvicorn's HTTP protocol class (`uvicorn.Config(http=...)`) with both limits."""
    too_many = _refusal(503, "Service Unavailable", f"this server is at its limit of {max_connections} open "
                        "connections; try again shortly", "too_many_connections")
    too_slow = _refusal(408, "Request Timeout", f"the request headers did not arrive within {header_timeout:g} s",
                        "header_timeout")

    class GuardedProtocol(base):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(too_many)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are complete: its body is the proxy's to time
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request on a kept-alive connection has the same deadline

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request it cannot parse (a malformed header line, a bad request
            line) is plain text: here it is the OpenAI error shape every other refusal has."""
            self._disarm()
            self.transport.write(_refusal(400, "Bad Request", f"malformed HTTP request: {msg}",
                                          "invalid_http_request"))
            self.transport.close()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.write(too_slow)
                self.transport.close()

    return GuardedProtocol
