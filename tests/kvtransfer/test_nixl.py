"""What the nixl backend adds to the contract (tests/kvtransfer/test_contract.py runs that over
nixl too): UCX kept to the bound interface, no spinning progress thread, a deadline on every
transfer, a killed receiver noticed at once, the descriptor's NIXL region on the wire, the
extra named when NIXL is missing, and the workers' refusal of nixl on a public address."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from kvtransfer import NotifyPayload, RegionDescriptor, TransferStatus, create_receiver, create_sender
from kvtransfer.descriptor import NixlRegion
from kvtransfer.messages import MessageError
from tests.kvtransfer.conftest import REPO_ROOT, make_pair, random_pool
from worker.config import WorkerConfig

pytestmark = pytest.mark.timeout(60)


def _listening(pid: int) -> set[str]:
    """Local addresses of the TCP sockets process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:   # 0A: LISTEN
                    raw = bytes.fromhex(fields[1].split(":")[0])
                    # /proc prints each 32-bit word in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add(socket.inet_ntop(family, raw))
    return found


def _other_address() -> str | None:
    """An IPv4 address of this host that is not loopback, if it has one."""
    from kvtransfer.nixl import route_source
    try:
        addr = route_source("192.0.2.123")    # TEST-NET: routing it only picks a source address
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_ucx_listens_only_on_the_interface_of_the_bound_address(layout, monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    pair = make_pair("nixl", layout)
    try:
        pair.sender()
        assert pair.receiver._transport.agent.net_devices == "lo"
        assert pair.senders[0]._writer._agent.net_devices == "lo"
        assert "UCX_NET_DEVICES" not in os.environ      # set only while a UCX context is made
        assert _listening(os.getpid()) == {"127.0.0.1"}
        if _other_address() is None:
            pytest.skip("this host has no interface but loopback: no other interface UCX could have used")
    finally:
        pair.close()


def test_an_operators_ucx_net_devices_wins(layout, monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    pool = torch.empty(layout.pool_shape(4), dtype=layout.torch_dtype)
    receiver = create_receiver(pool, layout, "nixl", host="127.0.0.1")
    try:
        assert receiver._transport.agent.net_devices == "lo"
        assert os.environ["UCX_NET_DEVICES"] == "lo"
    finally:
        receiver.close()
    with pytest.raises(ValueError, match="no network interface has the address 0.0.0.0"):
        monkeypatch.delenv("UCX_NET_DEVICES")
        create_receiver(pool, layout, "nixl", host="0.0.0.0")


def test_idle_agents_do_not_spin(layout):
    """NIXL's Python API polls its progress thread with a 0 delay: a core at 100 % per agent."""
    pair = make_pair("nixl", layout)
    try:
        sender = pair.sender(heartbeat_s=1.0)
        pair.receiver.expect("r", [1, 2])
        sender.write("r", range(3), [0, 1], [1, 2]).result(timeout=10)
        sender.notify("r", NotifyPayload(first_token_id=3)).result(timeout=10)
        assert pair.receiver.wait("r", timeout_s=10).status is TransferStatus.DONE
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(2.0)
        busy = (time.process_time() - cpu0) / (time.monotonic() - t0)
        assert busy < 0.1, f"an idle receiver and sender use {busy:.0%} of a core"
        pair.land(range(3), [0, 1], [1, 2])
        pair.assert_pool()
    finally:
        pair.close()


class _Child:
    """tests/kvtransfer/receiver_child.py: a nixl receiver in its own process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.kvtransfer.receiver_child"], cwd=REPO_ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.descriptor = bytes.fromhex(self.proc.stdout.readline().strip())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


def _sender(child: _Child, layout, timeout_s: float):
    return create_sender(child.descriptor, random_pool(layout, 12, seed=5), layout, "nixl", heartbeat_s=0.2,
                         transfer_timeout_s=timeout_s)


def test_a_killed_receiver_fails_the_next_write_at_once_and_every_later_one(layout):
    child = _Child()
    sender = None
    try:
        sender = _sender(child, layout, timeout_s=30.0)
        sender.write("a", range(3), [0, 1], [2, 3]).result(timeout=10)    # connected and working
        child.proc.kill()
        child.proc.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="NIXL write to .* failed"):
            sender.write("b", [0], [4], [5]).result(timeout=20)
        assert time.monotonic() - t0 < 5     # the disconnect, not the 30 s deadline
        t1 = time.monotonic()
        with pytest.raises(Exception, match="the NIXL path to this receiver is broken"):
            sender.write("c", [0], [4], [6]).result(timeout=20)
        assert time.monotonic() - t1 < 1
    finally:
        if sender is not None:
            t_close = time.monotonic()
            sender.close()
            assert time.monotonic() - t_close < 10
        child.close()


def test_a_stopped_receiver_fails_the_write_at_its_deadline(layout):
    """A transfer to a SIGSTOPped peer never completes by itself: the deadline ends it."""
    child = _Child()
    sender = None
    try:
        sender = _sender(child, layout, timeout_s=1.5)
        sender.write("a", [0], [0], [1]).result(timeout=10)
        child.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="not done by its deadline"):
            sender.write("b", range(3), list(range(12)), list(range(12))).result(timeout=20)
        assert 1.4 <= time.monotonic() - t0 < 6
        with pytest.raises(Exception, match="broken"):
            sender.write("c", [0], [4], [6]).result(timeout=5)
    finally:
        if sender is not None:
            sender.close()
        child.close()


def test_descriptor_carries_the_nixl_region(layout):
    region = NixlRegion(b"\x00metadata\xff", 140000000000, 0, "DRAM")
    d = RegionDescriptor(layout, 16, ("nixl",), "tcp://127.0.0.1:1", "h", "r", nixl=region)
    assert RegionDescriptor.from_bytes(d.to_bytes()) == d
    for bad in (NixlRegion(b"", 1, 0, "DRAM"), NixlRegion(b"md", 1, 0, "DISK")):
        with pytest.raises(MessageError, match="bad_field: nixl"):
            RegionDescriptor.from_bytes(RegionDescriptor(layout, 16, ("nixl",), "tcp://x:1", "h", "r",
                                                         nixl=bad).to_bytes())


def test_without_nixl_the_error_names_the_extra(layout, monkeypatch):
    for name in ("nixl", "nixl._bindings", "nixl_cu12", "nixl_cu12._bindings", "nixl_cu13", "nixl_cu13._bindings"):
        monkeypatch.setitem(sys.modules, name, None)   # import of it raises ImportError
    pool = torch.empty(layout.pool_shape(4), dtype=layout.torch_dtype)
    with pytest.raises(ImportError, match=r"scripts/setup.sh --nixl.*\.\[nixl\]"):
        create_receiver(pool, layout, "nixl")


def test_workers_refuse_nixl_on_a_public_address_unless_accepted():
    with pytest.raises(ValueError, match="not a private address.*--kv-nixl-allow-public"):
        WorkerConfig(host="8.8.8.8", kv_backend="nixl")   # a global address (never contacted)
    with pytest.raises(ValueError, match="not a private address"):
        WorkerConfig(host="0.0.0.0", kv_backend="nixl")
    assert WorkerConfig(host="8.8.8.8", kv_backend="nixl", kv_nixl_allow_public=True).kv_nixl_allow_public
    assert WorkerConfig(host="10.1.2.3", kv_backend="nixl").kv_backend == "nixl"
    assert WorkerConfig(host="8.8.8.8", kv_backend="tcp").host == "8.8.8.8"
