"""Prefill worker role: computes prompts and pushes their KV into decode workers' pools.

``python -m prefill_worker`` starts one: engine thread (PrefillLoop), gRPC servicer
(PrefillWorker service), kvtransfer senders and a Prometheus /metrics port.
"""
