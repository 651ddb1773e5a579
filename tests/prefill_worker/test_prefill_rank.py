"""A prefill rank's kvtransfer side in-process (pytest process): a failed write fails its
request alone and stops renewing its lease; senders to a dead or long-unused decode region are
evicted. A real shm receiver plays the decode worker's pool.
"""
from __future__ import annotations

import time

import pytest
import torch

import kvtransfer
from kvtransfer.messages import NotifyPayload
from prefill_worker.ops import Forget, Notify, Open, Poll, SendPoll, Write
from prefill_worker.ranks import PrefillRank

LAYOUT = kvtransfer.KVLayout.from_dtype(torch.float32, block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
NUM_BLOCKS = 8


@pytest.fixture
def decode_pool():
    pool, path = kvtransfer.create_shm_pool(LAYOUT, NUM_BLOCKS)
    receiver = kvtransfer.create_receiver(pool, LAYOUT, "shm", shm_path=path, lease_s=5.0)
    yield receiver
    receiver.close()
    kvtransfer.remove_shm_pool(path)


def rank_for(stall_s: float = 30.0) -> PrefillRank:
    return PrefillRank(torch.ones(LAYOUT.pool_shape(NUM_BLOCKS)), 0, 1, "shm", stall_s=stall_s)


def poll(rank: PrefillRank, request_id: str) -> list[int]:
    return rank.apply([Poll([request_id])])


def test_a_failed_write_fails_its_request_and_stops_renewing_its_lease(decode_pool):
    rank = rank_for()
    try:
        descriptor = decode_pool.descriptor.to_bytes()
        decode_pool.expect("r1", [2, 3])
        decode_pool.expect("r2", [4, 5])
        rank.apply([Open("r1", descriptor, [2, 3]), Open("r2", descriptor, [4, 5])])
        sender = rank.requests["r1"]
        real_write = sender._writer.write

        def failing_write(send, ctx, request_id, *args):
            if request_id == "r1":
                raise OSError(28, "No space left on device")
            return real_write(send, ctx, request_id, *args)

        sender._writer.write = failing_write
        rank.apply([Write("r1", [0, 1], [0, 1], [2, 3]), Write("r2", [0, 1], [0, 1], [4, 5]),
                    Notify("r2", NotifyPayload(first_token_id=7, num_prompt_tokens=8))])
        # The decode side hears at once (well inside the 5 s lease) that r1 will not be filled.
        result = decode_pool.wait("r1", timeout_s=3.0, freeable=True)
        assert result.status is kvtransfer.TransferStatus.CANCELLED, result
        assert "KV write failed: OSError" in result.reason and result.blocks_freeable
        assert decode_pool.wait("r2", timeout_s=3.0).status is kvtransfer.TransferStatus.DONE
        assert poll(rank, "r1") == [SendPoll.FAILED]
        deadline = time.monotonic() + 3   # r2's notify landed; its future completes on the sender's thread
        while poll(rank, "r2") != [SendPoll.DONE]:
            assert time.monotonic() < deadline, poll(rank, "r2")
            time.sleep(0.01)
        assert "r1" not in sender._open   # no heartbeat renews it any more
    finally:
        rank.close()


def test_a_sender_whose_decode_worker_died_is_evicted_and_its_requests_fail(decode_pool):
    rank = rank_for(stall_s=0.5)
    try:
        descriptor = decode_pool.descriptor.to_bytes()
        decode_pool.expect("r1", [0, 1])
        rank.apply([Open("r1", descriptor, [0, 1])])
        decode_pool.close()   # the decode worker is gone: nothing drains the sender's socket
        for _ in range(200):  # more than the socket queues hold: the ops stall
            rank.apply([Write("r1", [0], [0, 1], [0, 1])])
        deadline = time.monotonic() + 10
        while poll(rank, "r1") != [SendPoll.FAILED]:
            assert time.monotonic() < deadline, "the stalled sender was never evicted"
            time.sleep(0.1)
        assert rank.senders == {}
        # A new request to another (live) region opens a fresh sender.
    finally:
        rank.close()


def test_a_sender_unused_for_stall_s_is_evicted(decode_pool):
    rank = rank_for(stall_s=0.3)
    try:
        descriptor = decode_pool.descriptor.to_bytes()
        decode_pool.expect("r1", [0, 1])
        rank.apply([Open("r1", descriptor, [0, 1]), Write("r1", [0, 1], [0, 1], [0, 1]),
                    Notify("r1", NotifyPayload(first_token_id=1, num_prompt_tokens=8))])
        assert decode_pool.wait("r1", timeout_s=3.0).status is kvtransfer.TransferStatus.DONE
        rank.apply([Forget("r1")])
        assert len(rank.senders) == 1
        time.sleep(0.5)
        assert rank.apply([Poll([])]) == [] and rank.senders == {}
    finally:
        rank.close()
