"""The worker /metrics server (worker/metrics_server.py) bounds what idle and slow
clients hold: a connection that sends no full request head within the timeout is closed, a
flood of idle connections does not keep a real scrape out, and the server stops cleanly."""
from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from worker.metrics import WorkerMetrics

HEAD_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16


@pytest.fixture
def metrics():
    m = WorkerMetrics("decode")
    m.running.set(3)
    port = m.serve("127.0.0.1", 0, head_timeout_s=HEAD_TIMEOUT_S, max_connections=MAX_CONNECTIONS)
    yield m, port
    m.close()


def _scrape(port: int, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method=method)
    with urllib.request.urlopen(request, timeout=20) as response:
        return response.status, response.read()


def _closed_within(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (recv returns b""), or None if it did not."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_scrape_answers_with_the_registry(metrics):
    _, port = metrics
    status, body = _scrape(port)
    assert status == 200
    assert b'tandem_num_requests_running{role="decode"} 3.0' in body
    assert _scrape(port, "HEAD") == (200, b"")


def test_an_idle_connection_is_closed_within_the_head_timeout(metrics):
    _, port = metrics
    with socket.create_connection(("127.0.0.1", port)) as idle, \
            socket.create_connection(("127.0.0.1", port)) as half:
        half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")   # half a head, never finished
        assert (_closed_within(idle, HEAD_TIMEOUT_S + 10)) is not None
        assert (_closed_within(half, HEAD_TIMEOUT_S + 10)) is not None


def test_a_head_over_the_size_limit_is_closed(metrics):
    _, port = metrics
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n")
        assert _closed_within(sock, 10) is not None


def test_idle_connections_do_not_keep_a_scrape_out(metrics, caplog):
    _, port = metrics
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4 * MAX_CONNECTIONS)]
    try:
        status, body = _scrape(port)
        assert status == 200 and b"tandem_num_requests_running" in body
        # The oldest idle connections made room: no more than the cap stay open.
        time.sleep(0.2)
        closed = sum(_closed_within(sock, 0.05) is not None for sock in idle)
        assert closed >= len(idle) - MAX_CONNECTIONS
        # Making room closed the oldest connections, without an error in the server's handler.
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    finally:
        for sock in idle:
            sock.close()
