"""Prefill worker role: computes prompts and pushes their KV into decode workers' pools.

``python -m prefill_worker`` starts one: engine thread (PrefillLoop), gRPC servicer
(PrefillWorker service), kvtransfer senders and a Prometheus /metrics port.
"""
from protos.grpc_io import use_polling_io

use_polling_io()   # before anything imports grpc (protos/grpc_io.py)
