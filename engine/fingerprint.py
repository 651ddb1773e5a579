"""Model fingerprints: what a prefill and a decode worker must share before KV blocks cross.

Runs in the worker processes (``worker_fingerprint``, at startup; reported in ``Stats`` and
exchanged in ``SetDestination``) and in the router (``model_identity`` and ``Fingerprint.parse``,
to refuse a worker of another model). Pure Python, no torch: the router imports it.

A fingerprint is two parts (docs/architecture.md#security):

- the **model identity**, which anyone holding the model's files can compute: the protocol
  version, the architecture, a digest of its hyper-parameters, and a digest of the weight
  files. The weights digest covers each file's size and 16 evenly spaced 64 KiB samples (the
  first holds the safetensors or GGUF header), not every byte: it costs ~1 MiB of reads per
  file at startup and tells apart different checkpoints, quantizations and fine-tunes, though not
  two files that differ only between samples. ``name`` (the weights' file or directory name) is
  a label for people and never compared, so one checkpoint under two paths matches itself.
- the **serving layout**, known only to a running worker: dtype, KV layout (layers x KV heads
  per rank x head dim / block size) and TP rank / size.

Its string form is one line of ``key=value`` pairs, stable across processes and hosts, e.g.
``proto=2 arch=LlamaForCausalLM config=1f0c... weights=9ab2... name=m.gguf dtype=float32
kv=30x3x64/16 tp=0/1``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.model_source import BUILTIN_MODELS, ModelSource, load_arch, resolve_model
from engine.models.arch import ArchConfig
from engine.sim.arch import sim_arch, sim_profile_of

PROTOCOL_VERSION = 2          # bump when the worker.proto handshake or KV transfer changes meaning (2: Session streams)
SAMPLES_PER_FILE = 16
SAMPLE_NBYTES = 64 << 10
DIGEST_NBYTES = 8             # 16 hex digits: a label that must not collide by chance
MAX_FINGERPRINT_CHARS = 1024  # a peer's string longer than this is refused unread
KEYS = ("proto", "arch", "config", "weights", "name", "dtype", "kv", "tp")


@dataclass(frozen=True)
class ModelIdentity:
    """What the model is, from its files alone (the part the router can check)."""

    protocol: int
    architecture: str
    config: str                          # digest of the ArchConfig
    weights: str                         # digest of the weight files (sizes + sampled bytes)
    name: str = field(default="", compare=False)

    def items(self) -> list[tuple[str, str]]:
        return [("proto", str(self.protocol)), ("arch", self.architecture), ("config", self.config),
                ("weights", self.weights), ("name", self.name)]

    def __str__(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.items())


@dataclass(frozen=True)
class Fingerprint:
    """A serving worker's model identity plus how it lays out and shards the KV cache."""

    model: ModelIdentity
    dtype: str                           # e.g. "float32", "bfloat16"
    kv: str                              # "{layers}x{kv_heads_per_rank}x{head_dim}/{block_size}"
    tp: str                              # "{rank}/{size}"

    def items(self) -> list[tuple[str, str]]:
        return [*self.model.items(), ("dtype", self.dtype), ("kv", self.kv), ("tp", self.tp)]

    def __str__(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.items())

    @classmethod
    def parse(cls, text: str) -> Fingerprint:
        """The inverse of ``str``; ValueError for anything else (a peer's string is untrusted)."""
        if len(text) > MAX_FINGERPRINT_CHARS:
            raise ValueError(f"a fingerprint of {len(text)} characters (at most {MAX_FINGERPRINT_CHARS})")
        pairs = dict(item.partition("=")[::2] for item in text.split(" "))
        if sorted(pairs) != sorted(KEYS) or not pairs["proto"].isdigit():
            raise ValueError(f"not a Tandem model fingerprint: {text!r}")
        model = ModelIdentity(int(pairs["proto"]), pairs["arch"], pairs["config"], pairs["weights"], pairs["name"])
        return cls(model, pairs["dtype"], pairs["kv"], pairs["tp"])

    def mismatch(self, other: Fingerprint) -> list[str]:
        """The compared fields that differ (``name`` is a label, never compared)."""
        return [key for (key, a), (_, b) in zip(self.items(), other.items()) if a != b and key != "name"]


def check_peer(mine: str, peer: str, my_role: str, peer_role: str) -> str:
    """Why a ``peer_role`` worker with fingerprint ``peer`` cannot exchange KV with this one; "" if it can.
    The reason names both fingerprints."""
    try:
        differ = Fingerprint.parse(mine).mismatch(Fingerprint.parse(peer))
    except ValueError as exc:
        return f"the {peer_role} worker sent no valid model fingerprint ({exc}); this {my_role} worker is {mine}"
    if not differ:
        return ""
    return (f"model fingerprints differ in {', '.join(differ)}: "
            f"{peer_role} worker {peer} vs {my_role} worker {mine}")


def model_identity(model: str, weights: bool = True) -> ModelIdentity:
    """The identity of ``model`` (a built-in name, HF directory or .gguf file) from its files
    (``weights``: see ``identity_of``)."""
    source = resolve_model(model)
    arch = load_arch(source)
    return identity_of(source, arch if sim_profile_of(model) is None else sim_arch(arch), weights)


def local_model_identity(model: str, weights: bool = True) -> ModelIdentity | None:
    """``model_identity`` when ``model`` is a built-in name, an existing path or a simulated
    model (``sim:PROFILE``, engine/sim/arch.py), else None: a
    Hugging Face id is never resolved here (the caller, the router, does not know the workers'
    ``--revision`` and must not download weights)."""
    if model not in BUILTIN_MODELS and not Path(model).expanduser().exists() and sim_profile_of(model) is None:
        return None
    return model_identity(model, weights)


def identity_of(source: ModelSource, arch: ArchConfig, weights: bool = True) -> ModelIdentity:
    """``weights`` False: the model runs random weights (``--load-format dummy``), so its identity
    is that of its config with no weight files: it pairs with workers and routers of a directory
    holding only config.json, never with ones serving the checkpoint's real weights."""
    config = json.dumps(dataclasses.asdict(arch), sort_keys=True, default=str)
    config_digest = hashlib.blake2b(config.encode(), digest_size=DIGEST_NBYTES).hexdigest()
    if not weights:
        files = []
    elif source.kind == "gguf":
        files = [source.path]
    else:
        files = sorted(source.path.glob("*.safetensors"))
    name = "".join("_" if c.isspace() or c == "=" else c for c in source.path.name)  # one token in str()
    return ModelIdentity(PROTOCOL_VERSION, arch.architecture, config_digest, weights_digest(files), name)


def weights_digest(files: list[Path]) -> str:
    """Sizes and sampled bytes of ``files``, in order (see the module docstring)."""
    digest = hashlib.blake2b(digest_size=DIGEST_NBYTES)
    for path in files:
        size = path.stat().st_size
        digest.update(size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            for offset in _sample_offsets(size):
                f.seek(offset)
                digest.update(f.read(SAMPLE_NBYTES))
    return digest.hexdigest()


def _sample_offsets(size: int) -> list[int]:
    # The first sample starts at 0 (the header); the last one ends at the end of the file.
    last = max(size - SAMPLE_NBYTES, 0)
    return sorted({last * i // (SAMPLES_PER_FILE - 1) for i in range(SAMPLES_PER_FILE)})


def worker_fingerprint(engine) -> Fingerprint:
    """A worker's fingerprint from its ``engine.llm_engine.LLMEngine`` (after loading)."""
    layout = engine.kv_pool.layout
    kv = f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim}/{layout.block_size}"
    dtype = str(layout.dtype).removeprefix("torch.")
    tp = f"{engine.parallel.tp_rank}/{engine.parallel.tensor_parallel_size}"
    return Fingerprint(identity_of(engine.model_source, engine.arch, weights=not engine.dummy_weights), dtype, kv, tp)
