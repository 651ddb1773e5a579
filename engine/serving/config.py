"""Worker process settings (both roles); CLI flags map 1:1 onto the fields but one.

``cluster_secret`` has no flag: a secret on a command line is visible to every user of the host
(ps, /proc/PID/cmdline), so it comes from the environment (protos/auth.py, engine/serving/process.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

KV_BACKENDS = ("auto", "shm", "tcp", "fake")
NOT_FLAGS = ("cluster_secret",)


@dataclass(frozen=True)
class WorkerConfig:
    host: str = "127.0.0.1"          # address the gRPC, metrics and kvtransfer sockets bind
    port: int = 0                    # gRPC port; 0 picks a free one (printed when ready)
    metrics_port: int = 0            # Prometheus /metrics port; 0 picks a free one, -1 disables
    kv_backend: str = "auto"         # kvtransfer backend: auto (shm on the same host, else tcp)
    kv_lease_s: float = 30.0         # a transfer with no sender activity this long fails
    log_interval_s: float = 5.0      # period of the "Prefill batch." / "Decode batch." lines
    num_threads: int = 0             # torch CPU threads; 0 keeps torch's default
    # Every internal gRPC call and kvtransfer connection proves it; never printed (repr=False).
    cluster_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"kv_backend={self.kv_backend!r}: use one of {KV_BACKENDS}")
        if not self.kv_lease_s > 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        if not self.log_interval_s > 0:
            raise ValueError(f"log_interval_s must be > 0, got {self.log_interval_s}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
