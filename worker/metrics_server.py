"""The worker's /metrics HTTP server: one asyncio loop on its own thread (worker process).

prometheus_client's ``start_http_server`` runs a thread per connection with no timeouts, so a
client that opens connections and sends nothing (slowloris) holds threads forever. Here a
connection costs a socket, not a thread: its request head must arrive within ``head_timeout_s``
and fit in ``MAX_HEAD_BYTES``, the answer must be taken within ``head_timeout_s``, and at most
``max_connections`` are open at once -- a new one closes the oldest connection still waiting
for its head, so idle connections cannot keep a real scrape (which sends its head at once) out.
Every answer is ``Connection: close``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

logger = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
MAX_HEAD_BYTES = 8192


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, head_timeout_s: float = HEAD_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self._registry = registry
        self._head_timeout_s = head_timeout_s
        self._max_connections = max_connections
        self._reading: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()   # still waiting for a head
        self._open = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="worker-metrics", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port (OSError if it cannot bind)."""
        self._thread.start()
        started: Future = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, host, port, limit=MAX_HEAD_BYTES), self._loop)
        try:
            server = self._server = started.result()
        except BaseException:
            self.close()
            raise
        return server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._reading):
                writer.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        if self._open > self._max_connections and self._reading:
            oldest = next(iter(self._reading))   # the longest-waiting idle connection makes room
            del self._reading[oldest]
            oldest.close()
        self._reading[writer] = None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._head_timeout_s)
            self._reading.pop(writer, None)
            method, _, _ = head.split(b"\r\n", 1)[0].partition(b" ")
            if method not in (b"GET", b"HEAD"):
                await self._answer(writer, b"405 Method Not Allowed", b"text/plain", b"GET /metrics\n")
                return
            encode, content_type = choose_encoder(_accept(head))   # text, or OpenMetrics if asked for
            body = encode(self._registry)
            await self._answer(writer, b"200 OK", content_type.encode(), b"" if method == b"HEAD" else body)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass   # too slow, too long or gone: just close it
        finally:
            self._reading.pop(writer, None)
            self._open -= 1
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, status: bytes, content_type: bytes, body: bytes) -> None:
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        await asyncio.wait_for(writer.drain(), self._head_timeout_s)


def _accept(head: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"accept":
            return value.strip().decode("latin-1")
    return ""
