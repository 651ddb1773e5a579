"""Decode worker role: reserves KV blocks, receives prompt KV, decodes in a continuous batch.

``python -m decode_worker`` starts one: engine thread (DecodeLoop), gRPC servicer
(DecodeWorker service), a kvtransfer receiver over its KV pool and a Prometheus /metrics port.
"""
from protos.grpc_io import use_polling_io

use_polling_io()   # before anything imports grpc (protos/grpc_io.py)
