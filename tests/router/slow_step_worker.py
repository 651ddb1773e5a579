"""A real prefill or decode worker process whose engine holds one step for a long time.

Runs as ``python -m tests.router.slow_step_worker ROLE HOLD_AT_STEP HOLD_S [worker flags]``: the
``HOLD_AT_STEP``-th engine step that has work (counted from 1) spins the engine thread for
``HOLD_S`` seconds, half in Python (holding the GIL the gRPC thread also needs) and half in torch
kernels, the way a long prefill does. Everything else is the unmodified worker.
"""
from __future__ import annotations

import sys
import time

import torch

from engine.llm_engine import LLMEngine


def hold(seconds: float) -> None:
    a = torch.randn(256, 256)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(20_000))    # pure Python: the GIL is held throughout
        torch.mm(a, a)


def main() -> int:
    role, hold_at, hold_s, *flags = sys.argv[1:]
    hold_at, hold_s = int(hold_at), float(hold_s)
    real_step = LLMEngine.step
    count = 0

    def step(self, *args, **kwargs):
        nonlocal count
        if self.has_unfinished():
            count += 1
            if count == hold_at:
                print(f"slow_step_worker: holding step {count} for {hold_s} s", file=sys.stderr, flush=True)
                hold(hold_s)
        return real_step(self, *args, **kwargs)

    LLMEngine.step = step
    if role == "prefill":
        from prefill_worker.__main__ import build, follow
    else:
        from decode_worker.__main__ import build, follow
    from worker.process import run
    return run(role, build, flags, follow=follow)


if __name__ == "__main__":
    sys.exit(main())
