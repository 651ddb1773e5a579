"""Tandem's shared runtime: models, paged KV cache, attention, sampler, tokenizer, runner.

Kept light on purpose: importing ``engine`` must not import torch, so the router can use
``engine.tokenizer`` alone (DESIGN.md §2).
"""
