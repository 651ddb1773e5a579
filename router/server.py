"""The router process's servers: grpc.aio (Tandem + Admin + health + reflection) and uvicorn on ONE loop.

The public Tandem service takes the tenants' API key; the Admin service (membership) and every
call the router makes to its workers take the deployment's cluster secret (protos/auth.py),
given to ``Router`` or read from the environment -- a router without one does not start.
``Router(config)`` builds tokenizer, registry, policies, dispatcher and both APIs; ``start()``
binds (ports may be 0), starts heartbeats and both servers; ``stop()`` stops everything it
started and is safe to call twice. Tests run it in-process; ``python -m router`` runs it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.tokenizer import Tokenizer
from protos.auth import SecretInterceptor, require_secret
from protos.limits import MAX_MESSAGE_BYTES
from protos.tandem.v1 import admin_pb2_grpc, tandem_pb2_grpc
from router.admin_api import SERVICE_NAME as ADMIN_SERVICE_NAME
from router.admin_api import AdminServicer
from router.body_check import ChildCheck
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.frontend import Frontend
from router.grpc_api import SERVICE_NAME, ApiKeyInterceptor, DecodeErrorInterceptor, TandemServicer
from router.http_api import create_app
from router.http_server import http_config
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.registry import WorkerRegistry

logger = logging.getLogger(__name__)


class _UvicornServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the router process owns SIGINT/SIGTERM (router.__main__)


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None,
                 cluster_secret: str | None = None) -> None:
        """``cluster_secret``: the deployment's (default: from the environment, see protos/auth.py)."""
        self.config = config
        self._secret = cluster_secret or require_secret("the router")
        self.tokenizer = tokenizer or Tokenizer.from_model(config.model)
        self.http_address = ""
        self.grpc_address = ""
        self._grpc: grpc.aio.Server | None = None
        self._http: _UvicornServer | None = None
        self._http_task: asyncio.Task | None = None
        self._started = False

    async def start(self) -> Router:
        c = self.config
        self.registry = WorkerRegistry(c.heartbeat_interval_s, c.heartbeat_timeout_s, c.max_missed_heartbeats,
                                       secret=self._secret, model=c.model, dummy_weights=c.load_format == "dummy")
        self.dispatcher = Dispatcher(self.registry, make_policy(c.prefill_policy), make_policy(c.decode_policy),
                                     c.max_attempts, c.rpc_timeout_s,
                                     on_failover=lambda _: self.metrics.failovers.inc(),
                                     failover_wait_s=c.failover_wait_s,
                                     local_prefill_max_tokens=c.local_prefill_max_tokens,
                                     drain_move_after_s=c.drain_move_after_s)
        self.metrics = RouterMetrics(lambda: self.dispatcher.num_waiting)
        self.frontend = Frontend(self.tokenizer, self.registry, self.dispatcher, self.metrics, c)
        logger.info("%s", self.frontend.tool_format.describe())
        for role, addresses in (("prefill", c.prefill), ("decode", c.decode)):
            for address in addresses:
                self.registry.add(role, address)
        # The workers it starts with answer (or miss) one heartbeat before the ports open: a
        # router restarted over running workers serves its first request instead of a 503.
        await asyncio.gather(*(self.registry.poll(w) for w in self.registry.all()))
        self.registry.start()
        self._started = True
        await self._start_grpc()
        if c.http_port >= 0:
            await self._start_http()
        return self

    async def _start_grpc(self) -> None:
        c = self.config
        interceptors = [SecretInterceptor(self._secret, [ADMIN_SERVICE_NAME],
                                          missing=grpc.StatusCode.PERMISSION_DENIED)]
        if c.api_key:
            interceptors.append(ApiKeyInterceptor(c.api_key))
        interceptors.append(DecodeErrorInterceptor())
        # The public port takes what the HTTP API takes (its calls to the workers, on channels of
        # their own, keep MAX_MESSAGE_BYTES); a call past the cap is refused, not queued.
        server = self._grpc = grpc.aio.server(
            interceptors=interceptors, maximum_concurrent_rpcs=c.grpc_max_concurrent_rpcs,
            options=[("grpc.max_receive_message_length", c.max_request_body_bytes),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_concurrent_streams", c.grpc_max_concurrent_streams)])
        tandem_pb2_grpc.add_TandemServicer_to_server(TandemServicer(self.frontend, self._secret), server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self.registry), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        # Reflection lists the public services only: the admin service is the controller's.
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        port = server.add_insecure_port(f"{c.host}:{c.grpc_port}")
        if port == 0:
            raise OSError(f"cannot bind gRPC to {c.host}:{c.grpc_port}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.grpc_address = f"{c.host}:{port}"

    async def _start_http(self) -> None:
        c = self.config
        sock = socket.socket(socket.AF_INET6 if ":" in c.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((c.host, c.http_port))
        sock.set_inheritable(True)
        self._http = _UvicornServer(http_config(create_app(self.frontend, c), c))
        self._http_task = asyncio.get_running_loop().create_task(self._http.serve(sockets=[sock]), name="router-http")
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()
                raise OSError("the HTTP server exited at startup")
            await asyncio.sleep(0.01)
        self.http_address = f"{c.host}:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._http is not None:
            self._http.should_exit = True
            assert self._http_task is not None   # started with the server
            await asyncio.gather(self._http_task, return_exceptions=True)
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self.registry.stop()
        await self.dispatcher.close()
        ChildCheck.shutdown()

    async def __aenter__(self) -> Router:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
