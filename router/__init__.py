"""Router: public gRPC API, OpenAI-compatible HTTP API, routing policies, client SDK.

Placeholder until the router issue lands.
"""
