"""Worker process settings (both roles); CLI flags map 1:1 onto the fields but one.

``cluster_secret`` has no flag: a secret on a command line is visible to every user of the host
(ps, /proc/PID/cmdline), so it comes from the environment (protos/auth.py, worker/process.py).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from engine.config import flag

# kvtransfer's backend names (kvtransfer.BACKENDS), written again: `import kvtransfer` loads torch
# (~1.5 s, ~190 MB) and this module is imported where torch is not, by `tandem serve` for its
# flags and by the controller, so tests/test_one_fact.py holds the two equal. "fake" is the
# in-process fabric of the twin tests: a worker process cannot use it, so its flag offers the others only.
KV_BACKENDS = ("auto", "shm", "tcp", "cuda-ipc", "nixl", "fake")
PROCESS_KV_BACKENDS = tuple(b for b in KV_BACKENDS if b != "fake")
NOT_FLAGS = ("cluster_secret",)


@dataclass(frozen=True)
class WorkerConfig:
    host: str = flag("127.0.0.1", "address the gRPC, metrics and kvtransfer sockets bind")
    port: int = flag(0, "gRPC port; 0 picks a free one (printed when ready)")
    metrics_port: int = flag(0, "Prometheus /metrics port; 0 picks a free one, -1 disables")
    kv_backend: str = flag(
        "auto", "kvtransfer backend: auto (shm or cuda-ipc on the same host, else tcp: CurveZMQ, encrypted and "
        "authenticated), or nixl (NIXL/UCX one-sided writes, RDMA where the network has it; needs the nixl extra, "
        "bash scripts/setup.sh --nixl). nixl's data plane is NOT authenticated or encrypted: whoever reaches "
        "the workers' network can read and write KV pools; keep it on a private network",
        choices=PROCESS_KV_BACKENDS)
    kv_nixl_allow_public: bool = flag(
        False, "accept --kv-backend nixl on a --host that is not a private address (its data plane is "
        "unauthenticated and unencrypted)")
    kv_lease_s: float = flag(30.0, "a transfer with no sender activity this long fails")
    log_interval_s: float = flag(5.0, 'period of the "Prefill batch." / "Decode batch." lines')
    num_threads: int = flag(0, "torch CPU threads; 0 keeps torch's default")
    bind_threads: bool = flag(True, "on CPU, when --num-threads equals the CPUs the worker may use (its affinity "
                              "mask), bind each of the engine thread's torch threads to one of them (as vLLM's "
                              "VLLM_CPU_OMP_THREADS_BIND does); --no-bind-threads leaves them to the scheduler")
    # Every internal gRPC call and kvtransfer connection proves it; never printed (repr=False).
    cluster_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"kv_backend={self.kv_backend!r}: use one of {KV_BACKENDS}")
        if self.kv_backend == "nixl" and not self.kv_nixl_allow_public and not _is_private(self.host):
            raise ValueError(f"--kv-backend nixl moves KV unauthenticated and unencrypted, and host={self.host!r} "
                             "is not a private address: bind a private (or loopback) address, use the tcp "
                             "backend, or accept it with --kv-nixl-allow-public")
        if not self.kv_lease_s > 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        if not self.log_interval_s > 0:
            raise ValueError(f"log_interval_s must be > 0, got {self.log_interval_s}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")


def _is_private(host: str) -> bool:
    """Loopback, RFC 1918 / unique-local and the other non-global ranges (a wildcard is not)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False   # a name: what it resolves to is not ours to trust
    return ip.is_private and not ip.is_unspecified
