"""Tandem's client SDK: the router's gRPC API from the user's own process (grpcio + protos only).

    from tandem_client import TandemClient
    with TandemClient("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=16, temperature=0.0).text)

Importing it changes nothing in the caller's process: no environment variable (grpc's I/O path
is the caller's choice; Tandem's own processes pick theirs in their entry points, see
protos/grpc_io.py), no logging set-up, no threads. The clients and their keywords are described
in client.py and docs/api.md.
"""
from tandem_client.client import (
    AsyncTandemClient,
    Chunk,
    Completion,
    InvalidArgument,
    ModelNotFound,
    Overloaded,
    TandemClient,
    TandemError,
    ToolCall,
    Unauthenticated,
    Unavailable,
    Usage,
)

__all__ = ["AsyncTandemClient", "Chunk", "Completion", "InvalidArgument", "ModelNotFound", "Overloaded",
           "TandemClient", "TandemError", "ToolCall", "Unauthenticated", "Unavailable", "Usage"]
