"""Tandem's shared runtime: models, paged KV cache, attention, sampler, tokenizer, runner.

Kept light on purpose: importing ``engine`` must not import torch, so the router can use
``engine.tokenizer`` alone (docs/architecture.md#packages-and-import-direction).
"""
import os

# Worker processes share a few cores with each other, the router and whatever else runs on the
# node, so an OpenMP thread that finished its share spins only briefly (2000 iterations, tens of
# microseconds) before it sleeps. Measured on 2 cores, SmolLM2 bf16, a 2-thread batch-16 decode
# step alone / beside one busy thread: libgomp's default spin (300000) 23-28 / 53 ms, passive
# waits (no spin) 31-43 / 81 ms, 2000 spins 25-28 / 45 ms; a worker on passive waits left a
# third of a core idle under load. libgomp reads this when torch loads it, so it is set before
# torch is imported; a wait policy or spin count the user set wins.
SPIN_COUNT = "2000"
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
