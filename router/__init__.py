"""Router: public gRPC API, OpenAI-compatible HTTP API, routing policies, worker registry.

Runs in the router process (``python -m router``); never imports torch, and of ``engine`` only
its torch-free modules ``engine.tokenizer``, ``engine.config`` and ``engine.fingerprint``
(docs/architecture.md#packages-and-import-direction; tests/test_architecture.py). Map: __main__.py
(flags) -> server.py (both servers on one loop) -> grpc_api.py / http_api.py
-> frontend.py (validate, tokenize, detokenize, stop strings) -> dispatch.py (P/D pair,
streaming, failover) -> session.py (one stream per worker; what arrives while a client is slow
comes as one batch) + registry.py (membership, heartbeats) + policies/. The client SDK is its own
package, tandem_client/; the workers' twins are tests/router/fake_workers.py.

Importing it has no side effects: ``python -m router`` picks grpc's I/O path in __main__.py.
"""
