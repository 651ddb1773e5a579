"""Hugging Face ids resolved from a real HF cache layout, offline (engine/hf_hub.py, model_source).

The cache is built from the tiny random checkpoints (tests/models.py): repo
``tiny-org/tiny-llama`` has ``main`` at one commit (the ``llama`` checkpoint) and tag ``v2`` at
another (``llama_tied``, other weights). Every test runs with HF_HUB_OFFLINE=1, so nothing here
can reach a hub; the download path is tested against a local stand-in in tests/deploy/test_hub_models.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ModelConfig, SamplingParams
from engine.hf_hub import HubModelError, is_hub_id
from engine.model_source import ModelSource, resolve_model
from tests.engine.hub_fixtures import MAIN, TINY_REPO, V2, write_hf_cache


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _snapshot(cache: Path, commit: str) -> Path:
    return cache / "models--tiny-org--tiny-llama" / "snapshots" / commit


def test_id_resolves_to_its_cached_snapshot(hub_cache):
    source = resolve_model(TINY_REPO, download_dir=str(hub_cache))
    assert source == ModelSource("hf", _snapshot(hub_cache, MAIN))
    assert (source.path / "config.json").is_symlink()          # a real cache: links into blobs/


@pytest.mark.parametrize("revision, commit", [("v2", V2), (V2, V2), (MAIN, MAIN), ("main", MAIN)])
def test_revision_picks_a_snapshot(hub_cache, revision, commit):
    assert resolve_model(TINY_REPO, revision, str(hub_cache)).path == _snapshot(hub_cache, commit)


def test_missing_id_offline_names_it(hub_cache):
    with pytest.raises(HubModelError, match=r"model 'tiny-org/absent' \(revision 'main'\) is not in") as info:
        resolve_model("tiny-org/absent", download_dir=str(hub_cache))
    message = str(info.value)
    assert "'tiny-org/absent'" in message and "HF_HUB_OFFLINE" in message and str(hub_cache) in message
    assert isinstance(info.value, FileNotFoundError)       # every entry point reports these cleanly


def test_missing_revision_offline_names_it(hub_cache):
    with pytest.raises(HubModelError, match=r"'tiny-org/tiny-llama' \(revision 'v9'\) is not in"):
        resolve_model(TINY_REPO, "v9", str(hub_cache))


def test_snapshot_without_weights_is_not_used(tmp_path, tiny_model_dir):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_bytes((tiny_model_dir("llama") / "config.json").read_bytes())
    write_hf_cache(tmp_path / "cache", TINY_REPO, partial, MAIN)
    with pytest.raises(HubModelError, match="lacks config.json or weights"):
        resolve_model(TINY_REPO, download_dir=str(tmp_path / "cache"))


def test_sharded_snapshot_needs_every_shard(tmp_path, tiny_model_dir):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((tiny_model_dir("llama") / "config.json").read_bytes())
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"")
    (sharded / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    write_hf_cache(tmp_path / "cache", TINY_REPO, sharded, MAIN)
    with pytest.raises(HubModelError, match="its snapshot there lacks config.json or weights"):
        resolve_model(TINY_REPO, download_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("name, expected", [
    ("Qwen/Qwen2.5-0.5B-Instruct", True), ("meta-llama/Llama-3.1-8B", True), ("org/name_v1.5", True),
    ("gpt2", False), ("smollm2-135m", False), ("./org/name", False), ("/abs/org", False), ("a/b/c", False),
    ("org/model.gguf", False), ("org/../x", False), ("org--x/y", False), ("org/", False), ("", False),
])
def test_which_names_are_hub_ids(name, expected):
    assert is_hub_id(name) is expected


def test_local_directory_wins_over_an_id(hub_cache, tiny_model_dir, tmp_path, monkeypatch):
    local = tmp_path / "tiny-org" / "tiny-llama"
    local.parent.mkdir()
    local.symlink_to(tiny_model_dir("llama"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model(TINY_REPO, download_dir=str(hub_cache)) == ModelSource("hf", Path(TINY_REPO))


def test_non_ids_still_fail_as_missing_paths(hub_cache):
    with pytest.raises(FileNotFoundError, match="not a built-in name") as info:
        resolve_model("no/such/dir", download_dir=str(hub_cache))
    assert not isinstance(info.value, HubModelError)


def test_revision_is_refused_for_local_models(tiny_model_dir):
    with pytest.raises(ValueError, match="applies to Hugging Face ids"):
        resolve_model(str(tiny_model_dir("llama")), revision="main")
    with pytest.raises(ValueError, match="revision must be"):
        ModelConfig(model=TINY_REPO, revision=" ")


def test_engine_by_id_matches_local_path(hub_cache, tiny_model_dir, make_llm, one_torch_thread):
    """What every worker rank does: ModelRunner resolves ModelConfig(model, revision, download_dir)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [[5, 900, 1234, 77, 4321]]
    by_id = make_llm(TINY_REPO, download_dir=str(hub_cache)).generate(prompt, params)[0].token_ids
    by_path = make_llm(tiny_model_dir("llama")).generate(prompt, params)[0].token_ids
    v2 = make_llm(TINY_REPO, revision="v2", download_dir=str(hub_cache)).generate(prompt, params)[0].token_ids
    v2_path = make_llm(tiny_model_dir("llama_tied")).generate(prompt, params)[0].token_ids
    assert by_id == by_path and v2 == v2_path
    assert by_id != v2


def test_worker_flags_carry_revision_and_download_dir(hub_cache):
    from engine.cli_args import config_from_args
    from worker.process import parse_args

    args = parse_args("prefill", ["--model", TINY_REPO, "--revision", "v2", "--download-dir", str(hub_cache)])
    expected = ModelConfig(model=TINY_REPO, revision="v2", download_dir=str(hub_cache))
    assert config_from_args(ModelConfig, args) == expected
