"""Which I/O path grpc uses in Tandem's processes; each process chooses it before grpc is imported.

grpcio (1.85) moves a message between a socket and the Python event loop through its
EventEngine by default: a poller thread, then a thread of the engine's pool, then the aio
poller thread, then the loop -- a thread wake-up at each step. With the EventEngine's client
and listener endpoints switched off, the aio poller thread reads and writes the sockets itself.
On 2 vCPUs a streamed message's round trip took ~45% less time and ~30% less CPU that way
(benchmarks/grpc_hop.py runs both paths; benchmarks/router_overhead.py prints the one it ran
with). Both paths are grpc's own, chosen with its documented
``GRPC_EXPERIMENTS`` variable, which grpc reads once, when it is first imported: an operator
who sets it keeps their choice (``GRPC_EXPERIMENTS=""`` is grpc's default path).

Called where a Tandem process starts: the router's entry point (router/__main__.py), the worker
packages (prefill_worker/, decode_worker/: their processes and TP ranks), the ``tandem`` CLI
(deploy/), the test session (tests/conftest.py). Never by the client SDK (tandem_client/), which
runs in the user's process: the I/O path there is the user's (tests/test_sdk_import.py).
"""
from __future__ import annotations

import os

EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def use_polling_io() -> None:
    """Choose the poller-thread I/O path unless GRPC_EXPERIMENTS is set (before grpc is imported)."""
    os.environ.setdefault("GRPC_EXPERIMENTS", EXPERIMENTS)


def describe() -> str:
    return f"GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS', '')!r}"
