"""Stand-ins for the router's public Tandem gRPC service, for clients under test (the SDK, `tandem
bench`'s gRPC backend). Each runs in the test process on a thread pool, on port 0."""
from __future__ import annotations

import time


def generate_only_tandem_server(chunk_delay_s: float):
    """A Tandem gRPC service with Generate only (no Multiplex), on a free port: each request streams
    ``max_tokens`` chunks ``chunk_delay_s`` apart; returns (server, servicer, port)."""
    import grpc

    from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc

    class Stub(tandem_pb2_grpc.TandemServicer):
        def __init__(self) -> None:
            self.requests = []

        def Generate(self, request, context):
            self.requests.append(request)
            n = request.sampling.max_tokens
            for i in range(n):
                time.sleep(chunk_delay_s)
                yield tandem_pb2.CompletionChunk(request_id=request.request_id, text=" t", token_ids=[100 + i])
            yield tandem_pb2.CompletionChunk(request_id=request.request_id, finish_reason="length",
                                             usage=tandem_pb2.Usage(prompt_tokens=16, completion_tokens=n))

    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    stub = Stub()
    tandem_pb2_grpc.add_TandemServicer_to_server(stub, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, stub, port
