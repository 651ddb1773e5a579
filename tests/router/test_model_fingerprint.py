"""The router refuses to register, or route to, a worker whose model fingerprint shows another
model than its own; it compares only the model identity, the part it can know (issue #13)."""
from __future__ import annotations

import grpc
import pytest

from engine.fingerprint import Fingerprint, ModelIdentity, model_identity
from protos.auth import SecretStub, require_secret
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from tests.router.clusters import MODEL, start_fake_cluster, stop_fake_cluster
from tests.router.fake_workers import FakeWorker


def fingerprint(identity: ModelIdentity, dtype: str = "float32", kv: str = "30x3x64/16", tp: str = "0/1") -> str:
    return str(Fingerprint(identity, dtype, kv, tp))


@pytest.fixture(scope="module")
def own() -> ModelIdentity:
    return model_identity(MODEL)


def other_model(identity: ModelIdentity) -> ModelIdentity:
    return ModelIdentity(identity.protocol, identity.architecture, identity.config, "0123456789abcdef",
                         "other-weights.gguf")


def register(loop_thread, tokenizer, workers: list[FakeWorker], model: str = MODEL) -> tuple[list, dict]:
    """RegisterWorker each of ``workers`` (started here) on a fresh router whose registry checks
    against ``model``; the calls' errors (None where accepted) and, per address, whether the
    worker is registered and whether it is routable."""
    async def main():
        cluster = await start_fake_cluster(tokenizer)
        cluster.router.registry.model = model   # its own fake workers report no fingerprint
        for worker in workers:
            await worker.start()
        try:
            errors = []
            async with grpc.aio.insecure_channel(cluster.router.grpc_address) as channel:
                admin = SecretStub(admin_pb2_grpc.AdminStub(channel), require_secret("the test"))
                for worker in workers:
                    try:
                        await admin.RegisterWorker(admin_pb2.RegisterWorkerRequest(role=worker.role,
                                                                                   address=worker.address))
                        errors.append(None)
                    except grpc.aio.AioRpcError as exc:
                        errors.append(exc)
            registry = cluster.router.registry
            return errors, {w.address: (registry.get(w.address) is not None,
                                        w.address in {h.address for h in registry.healthy(w.role)})
                            for w in workers}
        finally:
            for worker in workers:
                await worker.stop()
            await stop_fake_cluster(cluster)
    return loop_thread.run(main(), 60)


def test_router_refuses_to_register_a_worker_of_another_model(loop_thread, tokenizer, own):
    theirs = fingerprint(other_model(own))
    stranger = FakeWorker("decode", model=MODEL, fingerprint=theirs)
    errors, seen = register(loop_thread, tokenizer, [stranger])
    assert errors[0].code() == grpc.StatusCode.FAILED_PRECONDITION
    details = errors[0].details()
    assert theirs in details and str(own) in details, details   # both sides, named in full
    assert seen[stranger.address] == (False, False)              # not registered, never routed to


def test_router_registers_workers_of_its_model_whatever_their_layout(loop_thread, tokenizer, own):
    """Same weights under another file name, another dtype, KV layout or TP size: the router cannot
    know those (the prefill/decode handshake checks them), so it does not compare them."""
    renamed = ModelIdentity(own.protocol, own.architecture, own.config, own.weights, "copy-of-it.gguf")
    workers = [FakeWorker("decode", fingerprint=fingerprint(own)),
               FakeWorker("prefill", fingerprint=fingerprint(renamed, dtype="bfloat16", kv="30x1x64/32", tp="0/2"))]
    errors, seen = register(loop_thread, tokenizer, workers)
    assert errors == [None, None]
    assert all(seen[w.address] == (True, True) for w in workers), seen


@pytest.mark.parametrize("field", ["protocol", "architecture", "config"])
def test_router_refuses_another_protocol_architecture_or_config(loop_thread, tokenizer, own, field):
    changed = {"protocol": own.protocol + 1, "architecture": "Qwen3ForCausalLM", "config": "fedcba9876543210"}
    identity = ModelIdentity(**{**own.__dict__, field: changed[field]})
    errors, seen = register(loop_thread, tokenizer, [FakeWorker("prefill", fingerprint=fingerprint(identity))])
    assert errors[0].code() == grpc.StatusCode.FAILED_PRECONDITION, field
    assert list(seen.values()) == [(False, False)]


def test_router_does_not_route_to_a_configured_worker_of_another_model(loop_thread, tokenizer, own):
    """Workers given on the command line (--decode) are not registered through the admin
    service; one of another model stays out of routing."""
    theirs = fingerprint(other_model(own))

    async def main():
        stranger = await FakeWorker("decode", fingerprint=theirs).start()
        cluster = await start_fake_cluster(tokenizer)   # one good prefill + decode, already healthy
        try:
            registry = cluster.router.registry
            state = registry.add("decode", stranger.address)
            await registry.poll(state)
            return state.healthy, state.refused, [w.address for w in registry.healthy("decode")]
        finally:
            await stranger.stop()
            await stop_fake_cluster(cluster)
    healthy, refused, routable = loop_thread.run(main(), 60)
    assert not healthy and theirs in refused and str(own) in refused
    assert len(routable) == 1   # the fake cluster's own decode worker only


def test_a_router_that_cannot_read_its_model_holds_workers_to_the_first_one(loop_thread, tokenizer, own):
    """A Hugging Face id is never resolved by the router (no revision, no download): the first
    worker to answer sets the model the others must serve."""
    first = FakeWorker("prefill", fingerprint=fingerprint(own))
    same = FakeWorker("decode", fingerprint=fingerprint(own, tp="0/2"))
    other = FakeWorker("decode", fingerprint=fingerprint(other_model(own)))
    errors, seen = register(loop_thread, tokenizer, [first, same, other], model="some-org/some-model")
    assert errors[:2] == [None, None]
    assert errors[2].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"prefill worker {first.address}, the first to answer" in errors[2].details()
    assert [seen[w.address] for w in (first, same, other)] == [(True, True), (True, True), (False, False)]
