"""The fault-injection hook (kvtransfer/faults.py): off by default, a failed write when asked,
and the request then fails at the receiver (cancelled by the sender side's failure path) with
its destination blocks untouched."""
from __future__ import annotations

import pytest
import torch

from kvtransfer import NotifyPayload, TransferStatus, create_receiver, create_sender
from kvtransfer.faults import FAULT_RATE_ENV, FAULT_SEED_ENV, MAX_FAULT_WRITE, FaultPlan, InjectedFault
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


def test_seeded_draws_repeat_and_fail_that_fraction_of_transfers():
    def failed_at(plan: FaultPlan) -> list[int | None]:
        """Per request of 8 writes: the write that failed (the transfer stops there), or None."""
        out = []
        for i in range(2000):
            for write in range(8):
                try:
                    plan.check(f"r{i}")
                except InjectedFault:
                    out.append(write)
                    break
            else:
                out.append(None)
        return out
    env = {FAULT_RATE_ENV: "0.25", FAULT_SEED_ENV: "7"}
    first, second = failed_at(FaultPlan.from_env(env)), failed_at(FaultPlan.from_env(env))
    assert first == second
    assert 400 < sum(w is not None for w in first) < 600
    assert {w for w in first if w is not None} == set(range(MAX_FAULT_WRITE + 1))   # mid-transfer too


@pytest.mark.parametrize("rate", [None, "1"])
def test_a_faulted_write_fails_its_future_and_writes_nothing(layout, monkeypatch, rate):
    monkeypatch.delenv(FAULT_SEED_ENV, raising=False)
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
        if rate is not None:   # rate 1: every transfer fails, at one of its first writes
            for _ in range(MAX_FAULT_WRITE):
                if write.exception(timeout=10) is not None:
                    break
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
        assert receiver.wait("r", timeout_s=10).status is TransferStatus.CANCELLED
    finally:
        sender.close()
        receiver.close()


def test_a_doomed_transfer_of_one_write_fails_at_its_notify(layout, monkeypatch):
    """A transfer shorter than its drawn fault index still fails: at the notify."""
    monkeypatch.setenv(FAULT_RATE_ENV, "1")
    monkeypatch.delenv(FAULT_SEED_ENV, raising=False)
    pool = torch.zeros(layout.pool_shape(4), dtype=torch.bfloat16)
    receiver = create_receiver(pool, layout, "tcp")
    sender = create_sender(receiver.descriptor, random_pool(layout, 4, 0), layout, "tcp")
    try:
        plan = sender._faults
        request_id = next(f"r{i}" for i in range(1000) if plan.doomed(f"r{i}") > 0)   # fails at write >= 1
        receiver.expect(request_id, [0])
        sender.write(request_id, range(layout.num_layers), [1], [0]).result(timeout=10)
        with pytest.raises(InjectedFault):
            sender.notify(request_id, NotifyPayload(1)).result(timeout=10)
        sender.cancel(request_id, "KV write failed")
        assert receiver.wait(request_id, timeout_s=10).status is TransferStatus.CANCELLED
    finally:
        sender.close()
        receiver.close()
