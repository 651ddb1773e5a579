"""Limits of the internal control plane that the router and the workers both hold to.

One definition each, imported by the router (router/registry.py, router/frontend.py,
router/dispatch.py), the workers' gRPC side (worker/) and the controller (deploy/).
kvtransfer may not import this package; its ``MAX_REQUEST_ID_LEN`` is held equal to
``MAX_REQUEST_ID_CHARS`` by tests/test_one_fact.py.
"""
from __future__ import annotations

ROLES = ("prefill", "decode")
MAX_MESSAGE_BYTES = 64 << 20        # one gRPC message, either way, between router and workers
#                                     (the router's public port takes max_request_body_bytes)
MAX_REQUEST_ID_CHARS = 256          # a request id a worker accepts (kvtransfer's bound too)
# Of a client's own request id: the router's internal id appends ".<16 hex>" (64 random bits per
# request, router/dispatch.py) and retries ".retry<N>", which must stay within MAX_REQUEST_ID_CHARS.
MAX_CLIENT_REQUEST_ID_CHARS = 200
# Starts the SDK (tandem_client/) puts in one Multiplex message; a router takes at least this
# many in one message (max(max_waiting, this), router/grpc_api.py).
MULTIPLEX_STARTS_PER_MESSAGE = 64
# Initial metadata a router sends first on every Multiplex stream; the SDK writes nothing before it
# has seen it. A server that refuses the stream (no Multiplex: an older router; a bad API key)
# answers with its status alone, which the SDK then reads as sent: had it written first, grpc aio
# could report that status as INTERNAL "Internal error from Core" (grpc/grpc#36066).
MULTIPLEX_READY = ("tandem-multiplex", "1")
