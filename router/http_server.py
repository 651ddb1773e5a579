"""The router's HTTP/1.1 connections: uvicorn's httptools protocol with limits (router process, its loop).

uvicorn by itself bounds neither the request head (httptools has no size or count limit) nor how
long a peer may take to send it or its body: a connection that sends half a head, or a body one
byte at a time, is held for ever. ``LimitedHttpProtocol`` refuses, before the application sees
the request, and closes the connection:

- a head larger than MAX_HEAD_BYTES or with more than MAX_HEADERS header lines: 431;
- a request target longer than MAX_URL_BYTES: 414;
- a head not complete ``header_timeout_s`` after the connection opened (or, on a kept-alive
  connection, after its first byte): 408;
- a body that sent fewer than ``min_body_rate`` bytes/s over a window of ``body_timeout_s``
  (at least one byte per window when the rate is 0): 408 if no response started, else closed.

Refusals are written straight to the transport in OpenAI's error shape. Idle kept-alive
connections close after ``keep_alive_timeout_s`` and connections past ``max_connections`` get
uvicorn's 503 (``limit_concurrency``). ``http_config`` builds the uvicorn config with all of it.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.config import RouterConfig

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10   # request line + headers (Node's and nginx's defaults are 16 and 32 KiB)
MAX_HEADERS = 100           # header lines of one request (Apache's LimitRequestFields)
MAX_URL_BYTES = 8 << 10     # the request target, query string included
LINGER_S = 2.0             # a refused connection is read (and discarded) this long before it is closed
_REASONS = {400: "Bad Request", 408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large"}


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float
    body_timeout_s: float
    min_body_rate: int            # bytes/s
    max_head_bytes: int = MAX_HEAD_BYTES
    max_headers: int = MAX_HEADERS
    max_url_bytes: int = MAX_URL_BYTES

    @classmethod
    def from_config(cls, c: RouterConfig) -> HttpLimits:
        return cls(c.http_header_timeout_s, c.http_body_timeout_s, c.http_min_body_rate)


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def refusal_bytes(status: int, message: str) -> bytes:
    """A whole ``Connection: close`` response with OpenAI's error body."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class _Config(uvicorn.Config):
    """uvicorn's config carrying the limits to each connection's protocol."""

    def __init__(self, app, limits: HttpLimits, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits


class LimitedHttpProtocol(HttpToolsProtocol):
    def __init__(self, config: _Config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = config.limits
        self._in_head = True          # bytes arriving now belong to a request head
        self._head_bytes = 0
        self._num_headers = 0
        self._timer: asyncio.TimerHandle | None = None   # the head's deadline, or the body's next rate check
        self._body_bytes = 0          # body bytes since the last rate check
        self._refused = False

    # -- timers ------------------------------------------------------------------------------

    def _arm(self, delay_s: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        self._refuse(_Refusal(408, f"the request head did not arrive within {self.limits.header_timeout_s:g} s"))

    def _check_body_rate(self) -> None:
        self._timer = None
        window_s = self.limits.body_timeout_s
        if self.flow.read_paused:     # the application is not reading: the peer cannot send
            self._body_bytes = 0
            self._arm(window_s, self._check_body_rate)
            return
        needed = max(1, int(self.limits.min_body_rate * window_s))
        if self._body_bytes < needed:
            self._refuse(_Refusal(408, f"the request body sent {self._body_bytes} bytes in {window_s:g} s, fewer "
                                       f"than {needed} (--http-min-body-rate, --http-body-timeout-s)"))
            return
        self._body_bytes = 0
        self._arm(window_s, self._check_body_rate)

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            room = self.limits.max_head_bytes - self._head_bytes
            if len(data) > room:
                # Feed what fits: the head may end inside it, and the rest is body or the next request.
                if not self._feed(data[:room]):
                    return
                if self._in_head:
                    self._refuse(_Refusal(431, f"the request head is larger than {self.limits.max_head_bytes} bytes"))
                    return
                data = data[room:]
            else:
                self._head_bytes += len(data)
        self._feed(data)

    def _feed(self, data: bytes) -> bool:
        """uvicorn's data_received, with a limit's refusal (raised in a parser callback) answered."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            refusal = exc.__context__ if isinstance(exc.__context__, _Refusal) else None
            if refusal is None:
                logger.debug("an HTTP request that does not parse: %s", exc)
                refusal = _Refusal(400, "the HTTP request does not parse")
            self._refuse(refusal)
            return False
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()
        return not self._refused

    def _refuse(self, refusal: _Refusal) -> None:
        """Answer ``refusal`` unless a response already started, and close the connection. A
        request the application is reading reads a disconnect from now on."""
        if self._refused:
            return
        self._refused = True
        self._disarm()
        self._unset_keepalive_if_required()
        cycle = self.cycle
        started = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True     # the application's sends go nowhere, its receive gets a disconnect
            cycle.message_event.set()
        # DEBUG: a flood of hostile connections must not become a flood of log lines.
        logger.debug("HTTP connection from %s closed: %d %s", self.client[0] if self.client else "?",
                     refusal.status, refusal.message)
        if self.transport.is_closing():
            return
        if started or not self.transport.can_write_eof():
            self.transport.close()
            return
        # Half-close and read on, discarding, for a moment: closing with the peer's bytes unread
        # would reset the connection, and a reset can destroy the answer before the peer reads it.
        self.transport.write(refusal_bytes(refusal.status, refusal.message))
        self.transport.write_eof()
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    # -- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._num_headers = 0
        if self._timer is None:       # a kept-alive connection's next request: its head starts now
            self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            raise _Refusal(414, f"the request target is longer than {self.limits.max_url_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_headers:
            raise _Refusal(431, f"more than {self.limits.max_headers} header lines")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._disarm()
        super().on_headers_complete()
        if any(name in (b"content-length", b"transfer-encoding") for name, _ in self.headers):
            self._body_bytes = 0
            self._arm(self.limits.body_timeout_s, self._check_body_rate)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True
        super().on_message_complete()


def http_config(app, config: RouterConfig) -> uvicorn.Config:
    """uvicorn's config for the router's app: the limits above, no access log, no lifespan."""
    return _Config(app, HttpLimits.from_config(config), http=LimitedHttpProtocol, ws="none", log_level="warning",
                   access_log=False, lifespan="off", timeout_graceful_shutdown=2, backlog=2048,
                   timeout_keep_alive=config.http_keep_alive_timeout_s,
                   limit_concurrency=config.http_max_connections)
