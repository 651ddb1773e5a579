"""What one holder of the cluster secret can make a decode worker do is bounded: it dials only
TCP host:port prefill addresses (never a unix socket or another gRPC scheme), and keeps at most
MAX_PREFILL_CHANNELS channels open, closing the least recently used (decode_worker/servicer.py).
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_worker.servicer import PrefillClients
from protos.tandem.v1 import worker_pb2
from tests.workers.harness import greedy, open_generate, pool_flags, prompts_for

PROMPT = prompts_for([20], seed=9600)[0]
BAD_ADDRESSES = ["unix:/tmp/tandem-not-a-prefill.sock", "unix-abstract:x", "dns:///127.0.0.1:5000",
                 "127.0.0.1:5000,127.0.0.1:5001", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000",
                 "host with spaces:80", "a" * 300 + ":80"]


def test_prefill_channels_are_lru_bounded_and_evicted_ones_closed():
    async def run() -> None:
        clients = PrefillClients(max_channels=4)
        first = clients.stub("127.0.0.1:1")
        for port in range(2, 200):
            clients.stub(f"127.0.0.1:{port}")
        assert len(clients) == 4
        await asyncio.sleep(0.1)   # eviction closes the channel in a task
        with pytest.raises(grpc.aio.UsageError, match="Channel is closed"):
            await first.Stats(worker_pb2.StatsRequest(), timeout=2)
        # A used address stays: LRU, not FIFO.
        kept = clients.stub("127.0.0.1:196")
        clients.stub("127.0.0.1:500")
        assert clients.stub("127.0.0.1:196") is kept
        await clients.close()

    asyncio.run(run())


@pytest.mark.parametrize("address", BAD_ADDRESSES)
def test_prefill_clients_refuse_what_is_not_host_port(address):
    with pytest.raises(ValueError, match="is not a host:port"):
        PrefillClients().stub(address)


@pytest.fixture(scope="module")
def decode(spawn_module, tiny_dir):
    return spawn_module("decode", tiny_dir, *pool_flags())


@pytest.mark.parametrize("address", BAD_ADDRESSES[:3])
def test_decode_worker_refuses_to_dial_a_non_tcp_prefill_address(decode, address):
    call = open_generate(decode, address, "dial-me", PROMPT, greedy(4), timeout_s=30)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a host:port" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        decode.decode_stub.SetPrefill(worker_pb2.SetPrefillRequest(request_id="dial-me", prefill_address=address),
                                      timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a host:port" in err.value.details()
    assert decode.stats().kv_blocks_used == 0
