"""Prefill worker role: scheduler + engine + gRPC servicer + kvtransfer sender.

Placeholder until the worker issue lands.
"""
