"""What a simulated model is: ``sim:PROFILE`` names and the architecture its workers report
(pure Python, no torch).

Used by the model resolution every process shares (engine/model_source.py: the router's
tokenizer, ``tandem serve``'s checks) and by the simulated runner. A simulated model serves the
vocabulary and tokenizer of the profile's ``tokenizer`` model (default: the built-in one) with a
one-layer, one-head KV of ``SIM_HEAD_DIM`` values per token: enough to hold (token, position) and
a prefix digest (engine/sim/tokens.py), little enough that 64 workers' pools fit in a few MB.
Its config digest therefore differs from the real model's, so a simulated worker and a real one
never pass each other's fingerprint check.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.models.arch import ArchConfig

SIM_PREFIX = "sim:"
SIM_HEAD_DIM = 4


def sim_profile_of(model: str) -> str | None:
    """The profile named by a ``sim:PROFILE`` model, else None."""
    return model[len(SIM_PREFIX):] if model.startswith(SIM_PREFIX) else None


def canonical_profile(name: str) -> str:
    """An existing profile file as an absolute path (workers may run in another directory);
    anything else (a shipped profile's name, or a path that is not there) unchanged."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_file() else name


def sim_arch(arch: ArchConfig) -> ArchConfig:
    """``arch`` (the tokenizer model's) with the simulator's tiny attention: one layer, one head."""
    return dataclasses.replace(arch, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=SIM_HEAD_DIM,
                               sliding_window=None)
