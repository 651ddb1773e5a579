"""Prometheus metrics of the router process, vLLM-style names with the tandem_ prefix.

Each Router owns its own CollectorRegistry (no module-level state), served on GET /metrics.
The dashboard (deploy/grafana/tandem.json) reads these by name, so renaming one breaks a panel.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A per-token mean sits between ~2 ms (a large GPU batch) and ~1 s (a crowded CPU): finer steps there.
TPOT_BUCKETS_S = (0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                  0.75, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, num_waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tandem_num_requests_running", "Requests streaming at the router", registry=r)
        waiting = Gauge("tandem_num_requests_waiting", "Requests waiting for their first token", registry=r)
        waiting.set_function(num_waiting)
        self.requests = Counter("tandem_request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.errors = Counter("tandem_request_errors", "Requests ended by an error, by HTTP status",
                              ["status"], registry=r)
        # Statuses a stream can end with, at 0 from the start, so a dashboard shows "no errors"
        # rather than "no data" (others, e.g. 404 or 409 from a worker, appear when they happen).
        for status in ("400", "429", "500", "503"):
            self.errors.labels(status)
        # Requests refused at admission (429, also in tandem_request_errors), by the limit that refused them.
        self.refused = Counter("tandem_request_refused", "Requests refused at admission, by limit", ["limit"],
                               registry=r)
        for limit in ("max_waiting", "max_predicted_wait_s", "max_tpot_s"):
            self.refused.labels(limit)
        self.failovers = Counter("tandem_request_failovers", "Requests re-dispatched to a new worker pair",
                                 registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        # Counted when a request is dispatched, so a planner sees the load arrive, not only what finished.
        self.prompt_tokens_arrived = Counter("tandem_prompt_tokens_arrived", "Prompt tokens of dispatched requests",
                                             registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Generated tokens streamed", registry=r)
        # The output a request may ask for, at dispatch, and the same for finished requests beside
        # tandem_generation_tokens: a planner predicts decode load from what arrives (arrivals x
        # max_tokens x the share of max_tokens finished requests used), not from streams already running.
        self.max_tokens_arrived = Counter("tandem_max_tokens_arrived", "max_tokens of dispatched requests",
                                          registry=r)
        self.max_tokens_finished = Counter("tandem_max_tokens_finished", "max_tokens of finished requests",
                                           registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS_S)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between streamed chunks", registry=r,
                             buckets=LATENCY_BUCKETS_S)
        # TPOT as benchmarks report it: per request, (last token - first token) / (tokens - 1).
        self.tpot = Histogram("tandem_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", registry=r,
                              buckets=TPOT_BUCKETS_S)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Request latency", registry=r,
                             buckets=LATENCY_BUCKETS_S)

    def render(self) -> bytes:
        return generate_latest(self.registry)
