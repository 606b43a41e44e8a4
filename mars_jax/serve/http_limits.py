"""uvicorn's httptools protocol with the limits a public server needs and uvicorn lacks:
a deadline for a request's headers, and a cap on open connections.

  config = uvicorn.Config(app, http=limited_protocol(header_timeout=20, max_connections=1024))

A connection that has not sent a whole request line and headers `header_timeout`
seconds after it opened (or, kept alive, after the first byte of its next request) is
answered 408 and closed: a client sending one byte at a time holds no connection for
long; so is one that sends only blank lines after a response. A response sent before the
request's body was read (401, 413, 408, which the app marks `connection: close`) closes
the connection, so a body trickled in after it holds nothing either. A connection past `max_connections` open ones is answered 503 with
Retry-After and closed at once. The body's own deadline is the app's (`--body-timeout`),
and idle keep-alive connections close after uvicorn's `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _response(status: str, message: str, extra: str = "") -> bytes:
  body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                               "param": None, "code": None}}).encode()
  return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
          f"{extra}content-length: {len(body)}\r\n\r\n").encode() + body


def limited_protocol(*, header_timeout: float, max_connections: int) -> type:
  """The protocol class for `uvicorn.Config(http=...)` (module doc)."""

  class Limited(HttpToolsProtocol):
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
      super().connection_made(transport)
      if len(self.connections) > max_connections:
        transport.write(_response(
            "503 Service Unavailable", f"the server holds {max_connections} connections "
            "at most (--max-connections); retry shortly.", "retry-after: 1\r\n"))
        transport.close()
        return
      self._arm()

    def on_message_begin(self) -> None:
      super().on_message_begin()
      if self._header_timer is None:   # a kept-alive connection's next request
        self._arm()

    def on_response_complete(self) -> None:
      if (not self.pipeline and self.cycle is not None and self.cycle.more_body
          and not self.transport.is_closing()):
        self.transport.close()   # answered before its body came: nothing more to read
        return
      super().on_response_complete()
      if not self.transport.is_closing():   # kept alive: its next request's headers are
        self._arm()                         # due in time too (CRLFs between don't count)

    def on_headers_complete(self) -> None:
      self._disarm()
      super().on_headers_complete()

    def connection_lost(self, exc) -> None:
      self._disarm()
      super().connection_lost(exc)

    def _arm(self) -> None:
      self._disarm()
      self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

    def _disarm(self) -> None:
      if self._header_timer is not None:
        self._header_timer.cancel()
        self._header_timer = None

    def _headers_late(self) -> None:
      self._header_timer = None
      if self.transport.is_closing():
        return
      if self.cycle is not None and not self.cycle.response_complete:
        self._arm()   # a request is being answered: time the next one's headers after it
        return
      self.transport.write(_response(
          "408 Request Timeout", f"the request's headers did not arrive within "
          f"{header_timeout:g} s (--header-timeout)."))
      self.transport.close()

  return Limited
