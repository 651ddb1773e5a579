"""One contract, every backend: what any kvtransfer backend must do (docs/architecture.md#kv-transfer)."""
from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvtransfer import KVLayout, LayoutMismatchError, NotifyPayload, TransferCancelled, TransferStatus, create_sender
from tests.kvtransfer.conftest import CONTRACT_BACKENDS, REPO_ROOT, SRC_BLOCKS, make_pair, random_pool, u8

pytestmark = pytest.mark.timeout(60)

PAYLOAD = NotifyPayload(first_token_id=17, first_logprob=-0.5, top_logprobs=((17, -0.5), (3, -2.0)),
                        num_prompt_tokens=9, num_cached_tokens=4)


def test_write_lands_bit_exact_in_named_blocks_only(pair):
    sender = pair.sender()
    src_ids, dst_ids = [7, 2, 3, 11], [9, 4, 5, 0]   # scattered, partly consecutive
    pair.receiver.expect("req-1", dst_ids)
    assert pair.receiver.status("req-1") is TransferStatus.WAITING
    sender.write("req-1", range(3), src_ids, dst_ids).result(timeout=10)
    sender.notify("req-1", PAYLOAD).result(timeout=10)
    result = pair.receiver.wait("req-1", timeout_s=10)
    assert result.status is TransferStatus.DONE
    assert result.payload == PAYLOAD
    assert result.landed_layers == (0, 1, 2)
    assert result.blocks_freeable
    pair.land(range(3), src_ids, dst_ids)
    pair.assert_pool()
    assert pair.receiver.finished() == ["req-1"]
    assert pair.receiver.release("req-1") == (9, 4, 5, 0)
    assert pair.receiver.finished() == []
    assert pair.receiver.stats().get("rejected", 0) == 0


def test_not_done_until_every_layer_and_notify(pair):
    sender = pair.sender()
    pair.receiver.expect("r", [1, 2], num_layers=3)
    sender.write("r", [0, 1], [0, 1], [1, 2])
    sender.notify("r", PAYLOAD)
    sender.flush(timeout_s=10)
    deadline = time.monotonic() + 10
    while pair.receiver.result("r").payload is None and time.monotonic() < deadline:
        time.sleep(0.01)
    result = pair.receiver.result("r")
    assert result.status is TransferStatus.TRANSFERRING
    assert result.landed_layers == (0, 1)
    sender.write("r", [2], [0, 1], [1, 2])
    assert pair.receiver.wait("r", timeout_s=10).status is TransferStatus.DONE
    pair.land(range(3), [0, 1], [1, 2])
    pair.assert_pool()


def test_per_layer_writes_out_of_order_and_in_chunks(pair):
    sender = pair.sender()
    pair.receiver.expect("r", [3, 4, 5, 6])
    # Layer 2 first, then layer 0 in two chunks of blocks, then layer 1.
    sender.write("r", [2], [0, 1, 2, 3], [3, 4, 5, 6])
    sender.write("r", [0], [2, 3], [5, 6])
    sender.notify("r", PAYLOAD)
    sender.write("r", [0], [0, 1], [3, 4])
    sender.write("r", [1], [8, 9, 10, 11], [3, 4, 5, 6])
    assert pair.receiver.wait("r", timeout_s=10).status is TransferStatus.DONE
    pair.land([2, 0], [0, 1, 2, 3], [3, 4, 5, 6])
    pair.land([1], [8, 9, 10, 11], [3, 4, 5, 6])
    pair.assert_pool()


def test_many_requests_interleaved_from_concurrent_senders(pair):
    rng = random.Random(7)
    free = list(range(16))
    rng.shuffle(free)
    plans = []  # (sender index, request_id, src ids, dst ids)
    for i in range(6):
        dst = [free.pop() for _ in range(2)]
        src = rng.sample(range(SRC_BLOCKS), 2)
        plans.append((i % 2, f"req-{i}", src, dst))
        pair.receiver.expect(f"req-{i}", dst)
    senders = [pair.sender(), pair.sender()]

    def run(index: int) -> None:
        ops = [(rid, layer, src, dst) for s, rid, src, dst in plans if s == index
               for layer in range(3)]
        rng_local = random.Random(index)
        rng_local.shuffle(ops)
        for rid, layer, src, dst in ops:
            senders[index].write(rid, [layer], src, dst)
        for s, rid, _, _ in plans:
            if s == index:
                senders[index].notify(rid, NotifyPayload(first_token_id=int(rid[-1])))
        senders[index].flush(timeout_s=10)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for _, rid, src, dst in plans:
        result = pair.receiver.wait(rid, timeout_s=10)
        assert result.status is TransferStatus.DONE, result
        assert result.payload.first_token_id == int(rid[-1])
        pair.land(range(3), src, dst)
    pair.assert_pool()
    assert sorted(pair.receiver.finished()) == sorted(p[1] for p in plans)


def test_receiver_cancel_mid_transfer_stops_later_writes(pair):
    sender = pair.sender()
    pair.receiver.expect("c", [8, 9])
    sender.write("c", [0], [0, 1], [8, 9]).result(timeout=10)
    deadline = time.monotonic() + 10
    while pair.receiver.result("c").landed_layers != (0,) and time.monotonic() < deadline:
        time.sleep(0.01)
    pair.receiver.cancel("c", "client went away")
    assert pair.receiver.status("c") is TransferStatus.CANCELLED
    result = pair.receiver.wait("c", timeout_s=10, freeable=True)
    assert result.blocks_freeable and result.reason == "client went away"
    deadline = time.monotonic() + 10
    while not sender.is_cancelled("c") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.is_cancelled("c")
    with pytest.raises(TransferCancelled, match="request_id=c was cancelled"):
        sender.write("c", [1, 2], [0, 1], [8, 9]).result(timeout=10)
    pair.land([0], [0, 1], [8, 9])
    pair.assert_pool()  # layers 1 and 2 of blocks 8, 9 are still poison
    assert pair.receiver.release("c") == (8, 9)


def test_sender_cancel_frees_blocks_at_once(pair):
    sender = pair.sender()
    pair.receiver.expect("c", [1])
    pair.receiver.expect("other", [2])
    sender.write("c", [0], [0], [1]).result(timeout=10)
    sender.cancel("c", "prefill aborted")
    sender.write("other", range(3), [5], [2])
    sender.notify("other", PAYLOAD)
    result = pair.receiver.wait("c", timeout_s=10)
    assert result.status is TransferStatus.CANCELLED
    assert result.blocks_freeable
    assert "prefill aborted" in result.reason
    assert pair.receiver.wait("other", timeout_s=10).status is TransferStatus.DONE
    pair.land([0], [0], [1])
    pair.land(range(3), [5], [2])
    pair.assert_pool()


def test_silent_sender_fails_after_lease_and_others_continue(pair):
    sender = pair.sender()
    pair.receiver.expect("quiet", [0, 1], lease_s=0.4)
    pair.receiver.expect("busy", [2], lease_s=5.0)
    sender.write("quiet", [0], [0, 1], [0, 1])
    sender.notify("quiet", PAYLOAD)    # notify ends the sender's heartbeats for it
    t0 = time.monotonic()
    result = pair.receiver.wait("quiet", timeout_s=5)
    assert result.status is TransferStatus.FAILED
    assert 0.3 <= time.monotonic() - t0 < 3
    assert "lease expired" in result.reason and result.blocks_freeable
    sender.write("busy", range(3), [4], [2])
    sender.notify("busy", PAYLOAD)
    assert pair.receiver.wait("busy", timeout_s=10).status is TransferStatus.DONE
    assert pair.receiver.release("quiet") == (0, 1)
    pair.land([0], [0, 1], [0, 1])
    pair.land(range(3), [4], [2])
    pair.assert_pool()


def test_layout_mismatch_is_refused_before_any_write(pair, layout):
    other = KVLayout("bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=16)
    src = random_pool(other, SRC_BLOCKS, seed=1, device=pair.device)
    with pytest.raises(LayoutMismatchError, match=r"head_dim: ours=16 theirs=8"):
        create_sender(pair.receiver.descriptor.to_bytes(), src, other, pair.backend,
                      fabric=pair.fabric)
    fp32 = KVLayout("float32", 4, 3, 2, 8)
    with pytest.raises(LayoutMismatchError, match="dtype"):
        create_sender(pair.receiver.descriptor.to_bytes(),
                      random_pool(fp32, 2, 0, pair.device), fp32, pair.backend, fabric=pair.fabric)
    pair.assert_pool()


def test_sender_rejects_bad_arguments_without_writing(pair):
    sender = pair.sender()
    pair.receiver.expect("r", [1])
    for args, message in [(([3], [0], [1]), "layers must be unique ids"),
                          (([0], [0, 1], [1]), "need as many src as dst block ids"),
                          (([0], [SRC_BLOCKS], [1]), "src_block_ids out of range"),
                          (([0], [0], [16]), "dst_block_ids out of range"),
                          (([], [0], [1]), "layers must be unique ids"),
                          (([0], [0, 1], [1, 1]), "dst_block_ids must be unique")]:
        with pytest.raises(ValueError, match=message):
            sender.write("r", *args)
    with pytest.raises(ValueError, match="request_id must be a non-empty str"):
        sender.write("", [0], [0], [1])
    pair.assert_pool()


def test_writes_outside_the_request_are_rejected_by_the_receiver(pair):
    sender = pair.sender()
    pair.receiver.expect("r", [1, 2], num_layers=2)
    sender.write("r", [0], [0], [3])       # block 3 is not r's (shm copies, receiver rejects)
    sender.write("r", [2], [0, 1], [1, 2])  # r expects 2 layers
    sender.flush(timeout_s=10)
    deadline = time.monotonic() + 10
    while pair.receiver.stats().get("rejected", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = pair.receiver.stats()
    assert stats["rejected_block_not_in_request"] == 1
    assert stats["rejected_layer_out_of_range"] == 1
    assert pair.receiver.result("r").landed_layers == ()
    if pair.backend == "tcp":  # only tcp can refuse the bytes themselves
        pair.assert_pool()


@pytest.mark.parametrize("backend", ["shm", "tcp", "cuda-ipc", "nixl"])
def test_sender_killed_mid_request(backend, layout):
    """A real sender process is kill -9'd: its request fails after the lease, others go on."""
    pair = make_pair(backend, layout, lease_s=1.0)
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kvtransfer.sender_child", backend, "victim",
             "--layers", "0", "1", "--src", "5", "6", "--dst", "3", "4", "--seed", "99"],
            cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        watchdog = threading.Timer(60, proc.kill)
        watchdog.start()
        proc.stdin.write(pair.receiver.descriptor.to_bytes().hex() + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ready"
        pair.receiver.expect("victim", [3, 4], lease_s=1.0)
        pair.receiver.expect("survivor", [10, 11], lease_s=5.0)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "written"
        deadline = time.monotonic() + 10
        while pair.receiver.result("victim").landed_layers != (0, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.5)  # longer than the lease: the child's heartbeats keep it alive
        assert pair.receiver.status("victim") is TransferStatus.TRANSFERRING
        proc.kill()  # SIGKILL: no goodbye, no cancel
        proc.wait(timeout=10)
        watchdog.cancel()
        t_kill = time.monotonic()
        sender = pair.sender()
        sender.write("survivor", range(3), [0, 1], [10, 11])
        sender.notify("survivor", PAYLOAD)
        assert pair.receiver.wait("survivor", timeout_s=10).status is TransferStatus.DONE
        result = pair.receiver.wait("victim", timeout_s=5)
        assert result.status is TransferStatus.FAILED
        assert time.monotonic() - t_kill < 3.5
        assert result.blocks_freeable and result.landed_layers == (0, 1)
        assert pair.receiver.finished() == ["victim", "survivor"] or sorted(
            pair.receiver.finished()) == ["survivor", "victim"]
        assert pair.receiver.release("victim") == (3, 4)   # only its own blocks
        assert pair.receiver.status("survivor") is TransferStatus.DONE
        pair.receiver.expect("next", [3, 4])                  # keeps serving
        sender.write("next", range(3), [7, 8], [3, 4])
        sender.notify("next", PAYLOAD)
        assert pair.receiver.wait("next", timeout_s=10).status is TransferStatus.DONE
        child_src = random_pool(layout, SRC_BLOCKS, seed=99)
        pair.land(range(3), [0, 1], [10, 11])
        pair.land(range(3), [7, 8], [3, 4])
        pair.assert_pool()
        assert not torch.equal(u8(child_src)[0, :, [5, 6]], u8(pair.src)[0, :, [7, 8]])
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        pair.close()



@pytest.fixture(params=[b for b in CONTRACT_BACKENDS if b != "fake"])
def threaded_pair(request: pytest.FixtureRequest, layout: KVLayout):
    """Backends with a sender thread (the in-process fake has none: its leases are the caller's)."""
    p = make_pair(request.param, layout)
    yield p
    p.close()


def test_open_keeps_a_queued_request_alive_past_its_lease(threaded_pair):
    """A sender that opens a request heartbeats it before any write (prefill queues)."""
    pair = threaded_pair
    sender = pair.sender(heartbeat_s=0.1)
    pair.receiver.expect("queued", [0, 1], lease_s=0.6)
    sender.open("queued").result(timeout=5)
    time.sleep(1.5)  # well past the lease: only heartbeats keep it alive
    assert pair.receiver.status("queued") is TransferStatus.TRANSFERRING
    sender.write("queued", range(3), [4, 5], [0, 1])
    sender.notify("queued", PAYLOAD)
    assert pair.receiver.wait("queued", timeout_s=10).status is TransferStatus.DONE
    pair.land(range(3), [4, 5], [0, 1])
    pair.assert_pool()
