"""The router's admin service tandem.v1.Admin (router process): membership for the controller.

RegisterWorker / DeregisterWorker (remove, or drain with ``drain=true``) change which workers
take requests, so they are not on the public tandem.v1.Tandem service that tenants call: this
service shares the router's gRPC port but every call needs the deployment's cluster secret
(``protos.auth.SecretInterceptor``, installed by router/server.py); a tenant's API key is not
enough.
"""
from __future__ import annotations

import grpc

from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.registry import WorkerRegistry

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    async def RegisterWorker(self, request: admin_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext):
        try:
            self.registry.add(request.role, request.address)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return admin_pb2.RegisterWorkerResponse()

    async def DeregisterWorker(self, request: admin_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext):
        if request.drain:
            return admin_pb2.DeregisterWorkerResponse(found=self.registry.drain(request.address))
        found = await self.registry.remove(request.address, "deregistered by the admin service")
        return admin_pb2.DeregisterWorkerResponse(found=found)
