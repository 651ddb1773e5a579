"""Tandem's shared runtime: models, paged KV cache, attention, sampler, tokenizer, runner.

Kept light on purpose: importing ``engine`` must not import torch, so the router can use
``engine.tokenizer`` alone (docs/architecture.md#packages-and-import-direction).
"""
import os

# Worker processes share a few cores with each other and the router. With OpenMP's default
# spin-waiting, a step whose threads find a busy core stalls for hundreds of milliseconds
# (measured: batch-1 SmolLM2 decode 728 ms/step vs 68 ms with passive waits on 2 loaded cores).
# libgomp reads this when torch loads it, so it must be set before torch is imported; a
# value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
