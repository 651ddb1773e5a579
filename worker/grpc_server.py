"""A worker's grpc.aio server: its services behind the cluster secret, plus health and reflection.

Runs in the worker processes. Every call to the role's services must carry the deployment's
cluster secret (protos/auth.py); health and reflection stay open, so load balancers and
`grpcurl` work against it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.auth import SecretInterceptor
from protos.limits import MAX_MESSAGE_BYTES


async def start_server(host: str, port: int, register: Sequence[Callable[[grpc.aio.Server], None]],
                       service_names: Sequence[str], secret: str) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Serve ``register``'s services on ``host:port`` (0 picks one), each call checked for ``secret``."""
    # Clients (the router) send HTTP/2 keepalive pings every 10 s to tell a frozen or vanished
    # worker from a busy one; answer them instead of closing the connection for "too many pings".
    server = grpc.aio.server(interceptors=[SecretInterceptor(secret, service_names)],
                             options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.keepalive_permit_without_calls", 1),
                                      ("grpc.http2.min_ping_interval_without_data_ms", 5_000)])
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}: the port is taken or the address is not local")
    await server.start()
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer
