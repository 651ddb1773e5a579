"""What every Tandem server process does as it starts, beside choosing grpc's I/O path
(protos/grpc_io.py): the router's entry point (router/__main__.py) and every worker rank
(worker/process.py) call ``freeze_heap`` just before they print READY. Standard library only.
"""
from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Leave what start-up made (every import, the tokenizer, a worker's model modules) out of the
    garbage collector's full collections, as vLLM does after its warm-up. With SmolLM2 loaded a
    full collection walked ~300k objects, ~120 ms on 2 vCPUs, holding the GIL and so a worker's
    engine thread (tens of ms of the router's loop); after this it walks only what serving made."""
    gc.collect()
    gc.freeze()
