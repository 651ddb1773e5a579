"""The cluster view both APIs return: every registered worker's role, address, load and KV usage."""
from __future__ import annotations

from router.registry import WorkerRegistry


def cluster_view(registry: WorkerRegistry) -> list[dict]:
    out = []
    for w in sorted(registry.all(), key=lambda w: (w.role, w.address)):
        s = w.stats
        out.append({"role": w.role, "address": w.address, "model": s.model if s else "", "healthy": w.healthy,
                    "num_inflight": w.num_inflight, "num_running": s.num_running if s else 0,
                    "num_waiting": s.num_waiting if s else 0, "kv_blocks_used": s.kv_blocks_used if s else 0,
                    "kv_blocks_total": s.kv_blocks_total if s else 0, "kv_usage": w.kv_usage,
                    "max_model_len": s.max_model_len if s else 0, "draining": w.draining,
                    "num_requests": w.num_requests})
    return out
