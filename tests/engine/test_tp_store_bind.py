"""Rank 0's TCPStore listens on the address it is given, not on every interface (issue #13)."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from engine.config import ParallelConfig
from engine.tp.group import TPGroup, free_local_port

LISTEN = "0A"   # TCP_LISTEN in /proc/net/tcp*


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} print them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == LISTEN and int(hex_port, 16) == port:
                found.append(address)
    return found


def test_tp_store_listens_on_the_given_address_only():
    port = free_local_port()
    address = f"127.0.0.1:{port}"
    joined = threading.Event()

    def follower() -> None:
        group = TPGroup(ParallelConfig(2, 1, address), torch.device("cpu"))
        group.all_min([1])
        joined.set()
        group.all_min([2])   # stays in the group until rank 0 looked
        group.close()

    thread = threading.Thread(target=follower)
    thread.start()
    group = TPGroup(ParallelConfig(2, 0, address), torch.device("cpu"))
    try:
        assert group.all_min([3]) == [1]
        assert joined.wait(30)
        # 0100007F is 127.0.0.1; a wildcard bind would show 00000000 (tcp) or all zeros (tcp6).
        assert listening_addresses(port) == ["0100007F"]
        assert group.all_min([4]) == [2]
    finally:
        thread.join(30)
        group.close()
