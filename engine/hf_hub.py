"""Hugging Face ids -> a local snapshot directory, the way vLLM resolves them (pure Python).

Runs in whichever process resolves a ``--model``: ``tandem generate`` / ``plan`` / ``serve``,
each worker rank and the router (docs/architecture.md#processes). The order is:

1. The local HF cache (``HF_HUB_CACHE``, or ``--download-dir``): a snapshot of the revision
   that holds the files Tandem loads is used as is, without asking the hub.
2. Otherwise, unless ``HF_HUB_OFFLINE`` is set, a download with ``huggingface_hub`` (``HF_TOKEN``
   and ``HF_ENDPOINT`` come from the environment, as huggingface_hub reads them), under a file
   lock per repo in the cache directory: the processes of one node that start together (TP
   ranks, replicas) download once, and the others find the snapshot in the cache when the
   lock is theirs.

Every way an id cannot be had -- not cached while offline, no such repo or revision, gated, the
hub unreachable -- is a ``HubModelError`` naming the id and what to do; it is a
``FileNotFoundError``, so every entry point reports it as a clean startup error.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# "org/name", as the hub spells repo ids. A bare "name" is never taken for an id, so a typo of a
# built-in model name is reported as such instead of becoming a hub request.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# What Tandem loads from an HF checkpoint: config, tokenizer files, safetensors weights. Files in
# subfolders (original/*.pth, onnx/, gguf variants) are never fetched.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
IGNORE_PATTERNS = ["*/*"]
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubModelError(FileNotFoundError):
    """A Hugging Face id that cannot be had on this node; the message says what to change."""


def is_hub_id(model: str) -> bool:
    """True for ``org/name`` strings that could be a hub repo (the caller checks local paths first)."""
    return (_HUB_ID.fullmatch(model) is not None and ".." not in model and "--" not in model
            and not model.endswith((".gguf", ".")))


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``), read now rather than at import."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def cache_dir(download_dir: str | None) -> Path:
    from huggingface_hub import constants

    return Path(download_dir or constants.HF_HUB_CACHE).expanduser()


def snapshot_path(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` (a branch, tag or commit;
    default ``main``), downloaded into ``download_dir`` (default: the HF cache) if missing."""
    revision = revision or "main"
    cache = cache_dir(download_dir)
    found = _cached(repo_id, revision, cache)
    if found is not None:
        logger.info("model %s (revision %s) from the HF cache: %s", repo_id, revision, found)
        return found
    if offline():
        raise HubModelError(
            f"model {repo_id!r} (revision {revision!r}) is not in the Hugging Face cache {cache} (or its "
            f"snapshot there lacks config.json or weights) and HF_HUB_OFFLINE is set, so it cannot be "
            f"downloaded: fetch it where the hub is reachable "
            f"(`hf download {repo_id}`), point HF_HUB_CACHE or --download-dir at a cache that holds it, "
            f"or unset HF_HUB_OFFLINE")
    with _repo_lock(cache, repo_id):
        # Another process of this node may have downloaded it while this one waited.
        found = _cached(repo_id, revision, cache)
        if found is not None:
            return found
        logger.info("downloading model %s (revision %s) into %s", repo_id, revision, cache)
        path = _download(repo_id, revision, cache)
        logger.info("model %s (revision %s) downloaded: %s", repo_id, revision, path)
        return path


def _cached(repo_id: str, revision: str, cache: Path) -> Path | None:
    """The cached snapshot if it holds a loadable checkpoint, else None (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                      allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    except LocalEntryNotFoundError:            # also IncompleteSnapshotError
        return None
    return path if not _missing_files(path) else None


def _download(repo_id: str, revision: str, cache: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    except GatedRepoError:
        has_token = bool(os.environ.get("HF_TOKEN"))
        raise HubModelError(
            f"model {repo_id!r} is gated on the Hugging Face hub and "
            + ("the token in HF_TOKEN has no access to it: accept its terms on the model's page with "
               "that token's account" if has_token else
               "no token was given: accept its terms on the model's page, then set HF_TOKEN to a "
               "token of that account")) from None
    except RevisionNotFoundError:
        raise HubModelError(f"model {repo_id!r} has no revision {revision!r} on the Hugging Face hub: "
                            f"give a branch, tag or commit that exists with --revision") from None
    except RepositoryNotFoundError:
        raise HubModelError(f"model {repo_id!r} was not found on the Hugging Face hub: check the id "
                            f"(a private repo also needs HF_TOKEN)") from None
    except LocalEntryNotFoundError as exc:     # the hub could not be reached, nothing usable cached
        raise HubModelError(f"model {repo_id!r} (revision {revision!r}) is not in the Hugging Face cache "
                            f"{cache} and could not be downloaded ({_first_line(exc)}): check the network "
                            f"and HF_ENDPOINT, or run with HF_HUB_OFFLINE=1 and a cache that holds it") from None
    except HfHubHTTPError as exc:
        raise HubModelError(f"model {repo_id!r}: download failed: {_first_line(exc)}") from None
    missing = _missing_files(path)
    if missing:
        raise HubModelError(
            f"model {repo_id!r} (revision {revision!r}) has no {' or '.join(missing)} at its top level: "
            f"Tandem loads Hugging Face safetensors checkpoints by id (for a GGUF repo, download the "
            f".gguf file and pass its path)")
    return path


def _missing_files(path: Path) -> list[str]:
    """What a snapshot lacks to be loaded: config.json, and the safetensors weights (every shard
    its index names)."""
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        import json

        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing += sorted(s for s in shards if not (path / s).is_file())
    elif not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    return missing


@contextlib.contextmanager
def _repo_lock(cache: Path, repo_id: str) -> Iterator[None]:
    """An exclusive flock per repo in the cache (released by the kernel if the holder dies)."""
    # Beside huggingface_hub's own per-file locks of this repo.
    lock_dir = cache / ".locks" / f"models--{repo_id.replace('/', '--')}"
    lock_dir.mkdir(parents=True, exist_ok=True)
    path = lock_dir / "tandem-snapshot.lock"
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process of this node to finish downloading %s", repo_id)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
