"""Knock on every door of a Tandem cluster as an outsider: a machine on the same network holding
no Ray token and no cluster secret (run inside tests/cluster/netns.py's outsider namespace by
tests/cluster/test_cluster.py).

    python outsider.py '{"ray_gcs": "HOST:PORT", "ray_client": ..., "ray_dashboard": ...,
                         "prefill_grpc": ..., "decode_grpc": ..., "router_admin": ...,
                         "kvtransfer": ["HOST:PORT", ...]}'

Prints one JSON object: for each door, [refused, what happened].
"""
from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import zmq
from zmq.utils.monitor import recv_monitor_message

from protos.tandem.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc

RAY_INIT = """
import ray, sys
try:
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
except Exception as exc:
    print("refused:", type(exc).__name__, str(exc).splitlines()[0][:200])
    sys.exit(0)
print("CONNECTED: nodes", len(ray.nodes()))
"""


def ray_init(address: str, env: dict[str, str]) -> subprocess.Popen:
    """A ``ray.init`` from this machine, started (``ray_refused`` takes its answer): the three Ray
    knocks run side by side, a refused one taking 20-30 s."""
    return subprocess.Popen([sys.executable, "-c", RAY_INIT, address], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def ray_refused(proc: subprocess.Popen, deadline: float) -> tuple[bool, str]:
    try:
        stdout, stderr = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        return True, "no answer within 90 s"
    out = (stdout.strip().splitlines() or [stderr.strip()[-300:]])[-1]
    return not out.startswith("CONNECTED"), out


def dashboard(address: str) -> tuple[bool, str]:
    try:
        response = httpx.get(f"http://{address}/api/version", timeout=10)
    except httpx.TransportError as exc:
        return True, f"{type(exc).__name__}: {exc}"
    return response.status_code in (401, 403), f"HTTP {response.status_code}: {response.text[:200]}"


def grpc_call(address: str, stub: type, method: str, request: object) -> tuple[bool, str]:
    """A unary call with no cluster secret; refused means UNAUTHENTICATED / PERMISSION_DENIED or
    no connection at all."""
    with grpc.insecure_channel(address) as channel:
        try:
            getattr(stub(channel), method)(request, timeout=10)
        except grpc.RpcError as exc:
            code = exc.code()
            refused = code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                               grpc.StatusCode.UNAVAILABLE)
            return refused, f"{code.name}: {exc.details()}"
    return False, "answered"


def kvtransfer_plain(address: str) -> tuple[bool, str]:
    """A plaintext ZeroMQ peer: the CurveZMQ server must never complete a handshake with it."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket()
    sock.connect(f"tcp://{address}")
    events = []
    deadline = time.monotonic() + 5
    try:
        while time.monotonic() < deadline:
            if monitor.poll(200):
                event = recv_monitor_message(monitor)["event"]
                events.append(zmq.Event(event).name)
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return False, f"handshake succeeded: {events}"
        try:
            # Without a blocking send: a DEALER with no peer pipe (the failed handshake tore it
            # down and the reconnect has not made a new one) blocks in send forever, which hung
            # this knock in one CI run.
            sock.send_multipart([b"\x93\x01\x02\x03"], flags=zmq.NOBLOCK, copy=True)   # and nothing comes back
        except zmq.Again:
            events.append("send refused: no peer")
        if sock.poll(1000, zmq.POLLIN):
            return False, f"answered: {sock.recv_multipart()!r}"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    return True, f"no handshake ({', '.join(events) or 'no events'})"


def main() -> None:
    doors = json.loads(sys.argv[1])
    # A knock that hangs shows where, and ends this process before the test's own timeout (300 s).
    faulthandler.dump_traceback_later(240, exit=True)
    rays = {"ray_gcs": ray_init(doors["ray_gcs"], {"RAY_AUTH_MODE": "disabled"}),
            "ray_gcs_wrong_token": ray_init(doors["ray_gcs"], {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}),
            "ray_client": ray_init(f"ray://{doors['ray_client']}", {"RAY_AUTH_MODE": "disabled"})}
    ray_deadline = time.monotonic() + 90
    results = {
        "ray_dashboard": dashboard(doors["ray_dashboard"]),
        "prefill_grpc": grpc_call(doors["prefill_grpc"], worker_pb2_grpc.PrefillWorkerStub, "Stats",
                                  worker_pb2.StatsRequest()),
        "decode_grpc": grpc_call(doors["decode_grpc"], worker_pb2_grpc.DecodeWorkerStub, "Stats",
                                 worker_pb2.StatsRequest()),
        # An outsider posing as a worker.
        "router_admin": grpc_call(doors["router_admin"], admin_pb2_grpc.AdminStub, "RegisterWorker",
                                  admin_pb2.RegisterWorkerRequest(role="decode", address="10.0.0.1:1")),
    }
    kv = [kvtransfer_plain(address) for address in doors["kvtransfer"]]
    results["kvtransfer_plain"] = (all(refused for refused, _ in kv), "; ".join(why for _, why in kv))
    results.update({name: ray_refused(proc, ray_deadline) for name, proc in rays.items()})
    print(json.dumps(results), flush=True)
    # Out without the interpreter's shutdown (pyzmq's and gRPC's exit hooks).
    os._exit(0)


if __name__ == "__main__":
    main()
