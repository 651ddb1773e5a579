"""The simulated engine (``--engine sim --sim-profile FILE``, or ``--model sim:FILE``).

Runs in a worker process (or the caller's thread, in ``LLM``) in place of the model runner:
everything else -- scheduler, block manager, KV pool and its accounting, kvtransfer, sessions,
metrics, liveness -- is the real engine's. A step sleeps for the time a latency model fitted to a
profile predicts (``latency.py``), writes a tiny KV pool as a function of the tokens and emits
tokens that are a function of (original prompt, position) read back from that pool
(``runner.py``, ``sampler.py``), so a failed-over or resumed stream equals an undisturbed one and
a KV transfer that moved the wrong bytes changes the output. Profiles are the JSON that
``benchmarks/engine.py --json`` prints; two ship in ``profiles/``. See docs/architecture.md.
"""
