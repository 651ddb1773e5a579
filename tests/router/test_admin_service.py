"""Membership (register, drain, remove) is on the router's admin service, behind the cluster
secret: tenants -- anonymous or with the API key -- get PERMISSION_DENIED and change nothing."""
from __future__ import annotations

import grpc
import pytest

from protos.auth import METADATA_KEY, SecretStub, require_secret
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc, tandem_pb2
from tests.router.clusters import start_fake_cluster, stop_fake_cluster
from tests.router.fake_workers import FakeWorker

API_KEY = "tenant-key"


def run(loop_thread, tokenizer, body, **router_options):
    async def main():
        cluster = await start_fake_cluster(tokenizer, **router_options)
        extra = await FakeWorker("decode").start()
        try:
            async with grpc.aio.insecure_channel(cluster.router.grpc_address) as channel:
                return await body(cluster, extra, channel)
        finally:
            await extra.stop()
            await stop_fake_cluster(cluster)
    return loop_thread.run(main(), 60)


def test_the_public_service_has_no_membership_rpcs(loop_thread, tokenizer):
    public = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"]
    assert sorted(m.name for m in public.methods) == ["Chat", "Generate", "GetCluster", "ListModels", "Multiplex"]
    assert not hasattr(tandem_pb2, "RegisterWorkerRequest")

    async def body(cluster, extra, channel):
        # A tenant who sends the old method by name finds nothing there.
        register = channel.unary_unary("/tandem.v1.Tandem/RegisterWorker",
                                       request_serializer=admin_pb2.RegisterWorkerRequest.SerializeToString,
                                       response_deserializer=admin_pb2.RegisterWorkerResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError, match="Method not found") as err:
            await register(admin_pb2.RegisterWorkerRequest(role="decode", address=extra.address),
                           metadata=(("authorization", f"Bearer {API_KEY}"),))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert cluster.router.registry.get(extra.address) is None
    run(loop_thread, tokenizer, body, api_key=API_KEY)


@pytest.mark.parametrize("who, metadata", [
    ("anonymous", ()),
    ("tenant", (("authorization", f"Bearer {API_KEY}"),)),
    ("wrong secret", (("authorization", f"Bearer {API_KEY}"), (METADATA_KEY, "x" * 43))),
])
def test_admin_calls_without_the_cluster_secret_are_permission_denied(loop_thread, tokenizer, who, metadata):
    async def body(cluster, extra, channel):
        admin = admin_pb2_grpc.AdminStub(channel)
        known = cluster.decodes[0].address
        calls = [admin.RegisterWorker(admin_pb2.RegisterWorkerRequest(role="decode", address=extra.address),
                                      metadata=metadata),
                 admin.DrainWorkers(admin_pb2.DrainWorkersRequest(addresses=[known]), metadata=metadata),
                 admin.DeregisterWorker(admin_pb2.DeregisterWorkerRequest(address=known), metadata=metadata)]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError, match="(missing|wrong) cluster secret") as err:
                await call
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, who
        registry = cluster.router.registry
        assert registry.get(extra.address) is None
        assert registry.get(known) is not None and not registry.get(known).draining
    run(loop_thread, tokenizer, body, api_key=API_KEY)


def test_admin_calls_with_the_cluster_secret_change_membership(loop_thread, tokenizer):
    async def body(cluster, extra, channel):
        admin = SecretStub(admin_pb2_grpc.AdminStub(channel), require_secret("the test"))
        await admin.RegisterWorker(admin_pb2.RegisterWorkerRequest(role="decode", address=extra.address))
        registry = cluster.router.registry
        assert registry.get(extra.address) is not None
        drained = await admin.DrainWorkers(admin_pb2.DrainWorkersRequest(addresses=[extra.address, "nope:1"]))
        assert list(drained.found) == [extra.address]
        assert registry.get(extra.address).draining
        assert (await admin.DeregisterWorker(admin_pb2.DeregisterWorkerRequest(address=extra.address))).found
        assert registry.get(extra.address) is None
    run(loop_thread, tokenizer, body, api_key=API_KEY)


def test_a_router_given_a_model_with_no_files_exits_2_with_the_reason(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "no-such-model"
    done = subprocess.run([sys.executable, "-m", "router", "--model", str(missing), "--http-port", "0",
                           "--grpc-port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("router: error:") and str(missing) in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
