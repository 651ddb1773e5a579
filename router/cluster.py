"""The cluster view both APIs return: every registered worker's role, load and KV usage (router process).

Tenants (``GET /v1/cluster``, ``Tandem.GetCluster``) see no worker addresses: where the workers
run is not theirs to know, and a worker's address is where a peer holding the cluster secret
would aim. A caller that sends the cluster secret on ``GetCluster`` (the controller, for
``tandem status``) gets the addresses too.
"""
from __future__ import annotations

from router.registry import WorkerRegistry


def cluster_view(registry: WorkerRegistry, addresses: bool = False) -> list[dict]:
    """One dict per worker, by role (and address); ``address`` is empty unless ``addresses``."""
    out = []
    for w in sorted(registry.all(), key=lambda w: (w.role, w.address)):
        s = w.stats
        out.append({"role": w.role, "address": w.address if addresses else "", "model": s.model if s else "",
                    "healthy": w.healthy, "num_inflight": w.num_inflight, "num_running": s.num_running if s else 0,
                    "num_waiting": s.num_waiting if s else 0, "kv_blocks_used": s.kv_blocks_used if s else 0,
                    "kv_blocks_total": s.kv_blocks_total if s else 0, "kv_usage": w.kv_usage,
                    "max_model_len": s.max_model_len if s else 0, "draining": w.draining,
                    "num_requests": w.num_requests,
                    "prefix_cache_queries": s.prefix_cache_queries if s else 0,
                    "prefix_cache_hits": s.prefix_cache_hits if s else 0})
    return out
