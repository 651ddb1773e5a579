"""Given the cluster secret (as every worker gives it), kvtransfer runs CurveZMQ with the
deployment's keys: a receiver admits only senders that hold the secret, and a sender refuses a
receiver that is plaintext or of another deployment -- its KV never leaves in the clear."""
from __future__ import annotations

import pytest
import torch
import zmq

from kvtransfer import (
    CurveKeys,
    NotifyPayload,
    TransferStatus,
    create_receiver,
    create_sender,
    create_shm_pool,
    remove_shm_pool,
)
from protos.auth import new_secret
from tests.kvtransfer.conftest import random_pool

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")]
SECRET = new_secret()


def test_keys_derive_from_the_secret_alone():
    keys = CurveKeys.from_secret(SECRET)
    assert keys == CurveKeys.from_secret(SECRET) and len(keys.public) == len(keys.secret) == 40
    assert keys.public == zmq.curve_public(keys.secret)
    assert CurveKeys.from_secret(new_secret()).public != keys.public
    assert SECRET not in repr(keys) and keys.secret.decode() not in repr(keys)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_receiver_given_the_secret_admits_only_senders_that_hold_it(layout, backend):
    if backend == "shm":
        pool, path = create_shm_pool(layout, 4)
    else:
        pool, path = torch.zeros(layout.pool_shape(4), dtype=torch.bfloat16), None
    receiver = create_receiver(pool, layout, backend, shm_path=path, secret=SECRET)
    src = random_pool(layout, 4, 5)
    good = create_sender(receiver.descriptor.to_bytes(), src, layout, backend, secret=SECRET)
    plain = create_sender(receiver.descriptor.to_bytes(), src, layout, backend)        # knows no key at all
    stranger = create_sender(receiver.descriptor.to_bytes(), src, layout, backend, curve=CurveKeys.generate())
    try:
        assert receiver.descriptor.curve_public_key == CurveKeys.from_secret(SECRET).public
        receiver.expect("ok", [0])
        receiver.expect("plain", [1], lease_s=0.5)
        receiver.expect("stranger", [2], lease_s=0.5)
        for sender, request_id, dst in ((plain, "plain", 1), (stranger, "stranger", 2)):
            sender.write(request_id, range(layout.num_layers), [3], [dst])
            sender.notify(request_id, NotifyPayload(1))
        good.write("ok", range(layout.num_layers), [1], [0])
        good.notify("ok", NotifyPayload(2))
        assert receiver.wait("ok", timeout_s=10).status is TransferStatus.DONE
        assert receiver.wait("plain", timeout_s=5).status is TransferStatus.FAILED
        assert receiver.wait("stranger", timeout_s=5).status is TransferStatus.FAILED
        raw = pool.view(torch.uint8)
        assert torch.equal(raw[:, :, 0], src.view(torch.uint8)[:, :, 1])
        if backend == "tcp":   # shm bytes are guarded by the pool file's mode (0600), not by Curve
            assert torch.count_nonzero(raw[:, :, 1]) == 0 and torch.count_nonzero(raw[:, :, 2]) == 0
    finally:
        for s in (good, plain, stranger):
            s.close()
        receiver.close()
        if path:
            remove_shm_pool(path)


@pytest.mark.parametrize("receiver_secret", [None, "another-deployment-secret-0123456789"])
def test_a_sender_given_the_secret_refuses_a_receiver_without_this_deployments_key(layout, receiver_secret):
    pool = torch.zeros(layout.pool_shape(4), dtype=torch.bfloat16)
    receiver = create_receiver(pool, layout, "tcp", secret=receiver_secret)
    try:
        with pytest.raises(ValueError, match="does not use this deployment's CurveZMQ key"):
            create_sender(receiver.descriptor.to_bytes(), random_pool(layout, 4, 6), layout, "tcp", secret=SECRET)
    finally:
        receiver.close()
