"""Decode worker role: pre-allocation, continuous-batched decode, kvtransfer receiver.

Placeholder until the worker issue lands.
"""
