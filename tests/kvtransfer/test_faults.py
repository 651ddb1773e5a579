"""The fault-injection hook (kvtransfer/faults.py): off by default, a failed write when asked,
and the request then fails at the receiver (cancelled by the sender side's failure path) with
its destination blocks untouched."""
from __future__ import annotations

import pytest
import torch

from kvtransfer import NotifyPayload, TransferStatus, create_receiver, create_sender
from kvtransfer.faults import FAULT_RATE_ENV, FAULT_SEED_ENV, FaultPlan, InjectedFault
from tests.kvtransfer.conftest import random_pool

pytestmark = pytest.mark.timeout(60)


def test_off_unless_set():
    assert FaultPlan.from_env({}) is None
    assert FaultPlan.from_env({FAULT_RATE_ENV: "0"}) is None
    assert FaultPlan.from_env({FAULT_RATE_ENV: " "}) is None


@pytest.mark.parametrize("raw", ["1.5", "-0.1", "nan"])
def test_bad_rate_is_refused(raw):
    with pytest.raises(ValueError, match=FAULT_RATE_ENV):
        FaultPlan.from_env({FAULT_RATE_ENV: raw})


def test_seeded_draws_repeat_and_follow_the_rate():
    def fails(plan: FaultPlan) -> list[bool]:
        out = []
        for i in range(2000):
            try:
                plan.check(f"r{i}")
                out.append(False)
            except InjectedFault:
                out.append(True)
        return out
    env = {FAULT_RATE_ENV: "0.25", FAULT_SEED_ENV: "7"}
    first, second = fails(FaultPlan.from_env(env)), fails(FaultPlan.from_env(env))
    assert first == second
    assert 400 < sum(first) < 600


@pytest.mark.parametrize("rate", [None, "1"])
def test_a_faulted_write_fails_its_future_and_writes_nothing(layout, monkeypatch, rate):
    if rate is None:
        monkeypatch.delenv(FAULT_RATE_ENV, raising=False)
    else:
        monkeypatch.setenv(FAULT_RATE_ENV, rate)
    pool = torch.zeros(layout.pool_shape(4), dtype=torch.bfloat16)
    receiver = create_receiver(pool, layout, "tcp")
    sender = create_sender(receiver.descriptor, random_pool(layout, 4, 0), layout, "tcp")
    try:
        receiver.expect("r", [0])
        write = sender.write("r", range(layout.num_layers), [1], [0])
        if rate is None:
            write.result(timeout=10)
            sender.notify("r", NotifyPayload(1))
            assert receiver.wait("r", timeout_s=10).status is TransferStatus.DONE
            assert pool.any()
            return
        with pytest.raises(InjectedFault, match="request_id=r"):
            write.result(timeout=10)
        sender.cancel("r", "KV write failed")   # what prefill_worker/ranks.py does on a failed op
        assert receiver.wait("r", timeout_s=10).status is TransferStatus.CANCELLED
        assert not pool.any()
    finally:
        sender.close()
        receiver.close()
