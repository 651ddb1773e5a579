"""A prefill worker played by the test (pytest process): it takes a real decode worker's
SetDestination and then writes and notifies whatever the test tells it to, so a faulty or
hostile prefill side can be reproduced against a real decode worker process.

``RoguePrefill`` is a PrefillWorker gRPC server on port 0 that records each SetDestination;
``writer(request_id)`` opens a kvtransfer sender on that destination with a zero-filled source
pool of the receiver's own layout.
"""
from __future__ import annotations

import inspect
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

import kvtransfer
from protos.auth import load_secret
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc


@dataclass
class Destination:
    block_ids: list[int]
    descriptor: bytes


class _Servicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, owner: RoguePrefill) -> None:
        self.owner = owner

    def SetDestination(self, request, context):
        with self.owner.cond:
            self.owner.destinations[request.request_id] = Destination(list(request.block_ids),
                                                                      bytes(request.region_descriptor))
            self.owner.cond.notify_all()
        # Plays the decode worker's model unless the test gave it another fingerprint to answer.
        answer = request.fingerprint if self.owner.fingerprint is None else self.owner.fingerprint
        return worker_pb2.SetDestinationResponse(fingerprint=answer)

    def Abort(self, request, context):
        self.owner.aborted.append(request.request_id)
        return worker_pb2.AbortResponse()


class RoguePrefill:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.destinations: dict[str, Destination] = {}
        self.aborted: list[str] = []
        self.fingerprint: str | None = None   # what SetDestination answers; None: the caller's own
        self._senders: list[kvtransfer.Sender] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_Servicer(self), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def destination(self, request_id: str, timeout_s: float = 30.0) -> Destination:
        with self.cond:
            if not self.cond.wait_for(lambda: request_id in self.destinations, timeout_s):
                raise AssertionError(f"no SetDestination for request_id={request_id!r} within {timeout_s} s")
            return self.destinations[request_id]

    def writer(self, request_id: str, backend: str = "shm") -> tuple[kvtransfer.Sender, Destination]:
        """A sender onto ``request_id``'s destination, from a zero-filled pool of its layout."""
        dest = self.destination(request_id)
        layout = kvtransfer.RegionDescriptor.from_bytes(dest.descriptor).layout
        pool = torch.zeros(layout.pool_shape(max(dest.block_ids) + 1), dtype=layout.torch_dtype)
        # The session's cluster secret (tests/conftest.py), so the sender speaks CurveZMQ where the
        # workers do; kvtransfer takes it once CurveZMQ is on by default.
        takes_secret = "secret" in inspect.signature(kvtransfer.create_sender).parameters
        options = {"secret": load_secret()} if takes_secret else {}
        sender = kvtransfer.create_sender(dest.descriptor, pool, layout, backend, heartbeat_s=0.2, **options)
        self._senders.append(sender)
        return sender, dest

    def close(self) -> None:
        for sender in self._senders:
            sender.close()
        self.server.stop(None)
