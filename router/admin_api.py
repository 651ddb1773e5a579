"""The router's admin service tandem.v1.Admin (router process): membership for the controller.

RegisterWorker / DeregisterWorker (remove) / DrainWorkers (scale-down) change which workers take
requests, so they are not on the public tandem.v1.Tandem service that tenants call: this
service shares the router's gRPC port but every call needs the deployment's cluster secret
(``protos.auth.SecretInterceptor``, installed by router/server.py); a tenant's API key is not
enough.

RegisterWorker asks the new worker for its Stats once: a worker that answers with another model
(see router/registry.py) is not registered and the caller gets FAILED_PRECONDITION saying why;
one that does not answer yet is registered and joins once it does.
"""
from __future__ import annotations

import grpc

from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.errors import WORKER_DETAIL_CHARS, clip
from router.registry import WorkerRegistry

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    async def RegisterWorker(self, request: admin_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext):
        try:
            self.registry.add(request.role, request.address)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, clip(str(exc), 256))
        refused = await self.registry.check_new(request.address)
        if refused:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{request.role} worker {clip(request.address)} is not registered: "
                                f"{clip(refused, WORKER_DETAIL_CHARS)}")   # both fingerprints, whole
        return admin_pb2.RegisterWorkerResponse()

    async def DeregisterWorker(self, request: admin_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext):
        found = await self.registry.remove(request.address, "deregistered by the admin service")
        return admin_pb2.DeregisterWorkerResponse(found=found)

    async def DrainWorkers(self, request: admin_pb2.DrainWorkersRequest, context: grpc.aio.ServicerContext):
        return admin_pb2.DrainWorkersResponse(found=self.registry.drain(list(request.addresses)))
