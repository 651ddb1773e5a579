"""Prometheus metrics of one worker (vLLM-style names, ``tandem_`` prefix), own registry.

Runs in a prefill or decode worker process; every series carries ``role``. The dashboard
(deploy/grafana/tandem.json) reads these by name, so renaming one breaks a panel.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from worker.metrics_server import HEAD_TIMEOUT_S, MAX_CONNECTIONS, MetricsServer


class _ReceiverCounters:
    """A decode worker's receiver counters as Prometheus counters (a custom collector)."""

    SERIES = (("tandem_kv_received_bytes", "payload_bytes",
               "decode: KV payload bytes that arrived over the network (tcp backend; shm and cuda-ipc writes "
               "land in the pool without passing the receiver)"),
              ("tandem_kv_messages_rejected", "rejected",
               "decode: kvtransfer messages the receiver refused (bad header, size, blocks or sender)"))

    def __init__(self, stats: Callable[[], dict[str, int]], role: str) -> None:
        self._stats, self._role = stats, role

    def collect(self) -> Iterator[CounterMetricFamily]:
        counters = self._stats()
        for name, key, doc in self.SERIES:
            family = CounterMetricFamily(name, doc, labels=["role"])
            family.add_metric([self._role], counters.get(key, 0))
            yield family


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["role"], registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["role"], registry=self.registry).labels(**labels)

        self.running = gauge("tandem_num_requests_running", "requests in the running batch")
        self.waiting = gauge("tandem_num_requests_waiting", "requests queued for compute")
        self.preallocated = gauge("tandem_num_requests_preallocated", "decode: requests waiting for KV blocks")
        self.transferring = gauge("tandem_num_requests_transferring", "requests whose KV is in flight")
        self.kv_usage = gauge("tandem_kv_cache_usage_ratio", "fraction of KV blocks in use")
        self.kv_blocks_total = gauge("tandem_kv_cache_blocks_total", "KV blocks in the pool")
        self.prompt_tokens = counter("tandem_prompt_tokens", "prompt tokens computed")
        self.generation_tokens = counter("tandem_generation_tokens", "tokens generated")
        self.prefix_queries = counter("tandem_prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("tandem_prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.local_prefills = counter("tandem_local_prefills", "decode: requests whose prompt this worker computed "
                                      "itself (no prefill worker: conditional disaggregation)")
        self.retractions = counter("tandem_num_retractions", "decode requests retracted for lack of blocks")
        self.kv_transfer_bytes = counter("tandem_kv_transfer_bytes",
                                         "prefill: KV bytes shipped to decode workers (any backend)")
        self.kv_transfer_failures = counter("tandem_kv_transfer_failures",
                                            "KV transfers that failed (lease expired, peer gone, rejected)")
        self.kv_transfer_seconds = Histogram(
            "tandem_kv_transfer_seconds",
            "prefill: destination known to every write done; decode: blocks reserved to the KV landed (both "
            "include the prefill compute they overlap)", ["role"],
            registry=self.registry, buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        ).labels(**labels)
        self.ttft = Histogram("tandem_time_to_first_token_seconds",
                              "request arrival to first token (prefill: sampled; decode: streamed)", ["role"],
                              registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)).labels(**labels)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "time between streamed tokens", ["role"],
                             registry=self.registry,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)).labels(**labels)
        self._step_seconds = Histogram(
            "tandem_engine_step_seconds",
            "one engine step (schedule, forward, sampling) on the engine thread, by what it computed: prefill "
            "(prompt chunks only), decode (decodes only) or mixed", ["role", "kind"], registry=self.registry,
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5))
        self._server: MetricsServer | None = None
        self._role = role

    def observe_step(self, kind: str, seconds: float) -> None:
        """One engine step that ran and its wall time (``LLMEngine.last_step``)."""
        self._step_seconds.labels(role=self._role, kind=kind).observe(seconds)

    def read_receiver(self, stats: Callable[[], dict[str, int]]) -> None:
        """decode: export the kvtransfer receiver's counters (``Receiver.stats``), read when
        /metrics is scraped, not on the engine step."""
        self.registry.register(_ReceiverCounters(stats, self._role))

    def serve(self, host: str, port: int, head_timeout_s: float = HEAD_TIMEOUT_S,
              max_connections: int = MAX_CONNECTIONS) -> int:
        """Start the /metrics HTTP server (worker/metrics_server.py); returns the bound port."""
        self._server = MetricsServer(self.registry, head_timeout_s, max_connections)
        return self._server.start(host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
