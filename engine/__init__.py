"""Tandem's shared runtime: models, paged KV cache, attention, sampler, tokenizer, runner.

Kept light on purpose: importing ``engine`` must not import torch, so the router can use
``engine.tokenizer`` alone (docs/architecture.md#packages-and-import-direction).
"""
import os

# Worker processes share a few cores with each other, the router and whatever else runs on the
# node, so an OpenMP thread that finished its share spins only a while (20000 iterations) before
# it sleeps: long enough to bridge the Python between two parallel regions of a step (waking a
# sleeping thread costs more than the region), short enough to give the core back between steps.
# Measured on 2 cores (AMX machine), SmolLM2 bf16, 2-thread decode steps alone, batch 1 / 16:
# 2000 spins 33 / 48 ms, 20000 spins 21-24 / 34 ms, libgomp's default (300000) 24 / 37 ms,
# passive waits 37 / 49 ms; beside one busy thread 2000 spins is best (64 ms at batch 16 vs 124),
# but `tandem serve` on that machine (benchmarks/vs_vllm.py, 256/128) served 30 -> 37 tok/s at
# concurrency 1 and 251 -> 297 at 16 with 20000 instead of 2000. libgomp reads this when torch
# loads it, so it is set before torch is imported; a wait policy or spin count the user set wins.
SPIN_COUNT = "20000"
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
