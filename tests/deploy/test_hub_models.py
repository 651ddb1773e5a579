"""`--model org/name` end to end: `tandem generate` / `plan` and a worker process, from a real HF
cache offline, and downloads from a local stand-in for the hub (HF_ENDPOINT -> FakeHub).

Subprocesses get a clean Hugging Face environment (HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT,
HF_TOKEN set by each test only), so nothing here can reach the real hub.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.cli import main as tandem_main
from tests.engine.hub_fixtures import MAIN, TINY_REPO, V2, FakeHub, write_hf_cache
from tests.models import hf_greedy

ROOT = Path(__file__).resolve().parents[2]
GENERATE = ["generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
            "--ignore-eos", "--json", "--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", "32"]
_HF_VARS = ("HF_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_TOKEN",
            "HUGGINGFACE_HUB_CACHE", "HF_HUB_ETAG_TIMEOUT")


def _env(**hf: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _HF_VARS}
    return {**env, "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1", **hf}


def _run(args: list[str], env: dict[str, str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def _tandem(*args: str, **hf: str) -> subprocess.CompletedProcess:
    return _run(["-m", "deploy.cli", *args], _env(**hf))


def _token_ids(stdout: str) -> list[int]:
    return json.loads(stdout.strip().splitlines()[-1])["token_ids"]


@pytest.fixture(scope="module")
def local_tokens(tiny_model_dir) -> dict[str, list[int]]:
    """`tandem generate` on the local checkpoint directories, in-process."""
    import contextlib
    import io

    tokens = {}
    for name in ("llama", "llama_tied"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert tandem_main([*GENERATE, "--model", str(tiny_model_dir(name))]) == 0
        tokens[name] = _token_ids(out.getvalue())
    assert tokens["llama"] != tokens["llama_tied"]
    return tokens


@pytest.fixture
def hub(tiny_model_dir) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add(TINY_REPO, MAIN, tiny_model_dir("llama"))
    fake.add("tiny-org/gated", MAIN, tiny_model_dir("llama"), token="hf_right")
    fake.start()
    yield fake
    fake.stop()


# -- offline, from the cache -------------------------------------------------------------------

def test_generate_by_id_offline_matches_local_path(hub_cache, local_tokens):
    proc = _tandem(*GENERATE, "--model", TINY_REPO, HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert _token_ids(proc.stdout) == local_tokens["llama"]


def test_generate_a_mixture_of_experts_model_by_path_and_by_id_offline(tmp_path, tiny_model_dir, hf_model):
    # A tiny random Qwen3-MoE (8 experts, top 2), as transformers saves it: the same tokens as
    # transformers' greedy generate, from the directory and from an HF cache by id.
    write_hf_cache(tmp_path, "tiny-org/tiny-qwen3-moe", tiny_model_dir("qwen3_moe"), MAIN)
    by_path = _tandem(*GENERATE, "--model", str(tiny_model_dir("qwen3_moe")))
    by_id = _tandem(*GENERATE, "--model", "tiny-org/tiny-qwen3-moe", HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    assert by_path.returncode == 0 and by_id.returncode == 0, by_path.stderr + by_id.stderr
    record = json.loads(by_path.stdout.strip().splitlines()[-1])
    assert record["token_ids"] == hf_greedy(hf_model("qwen3_moe"), record["prompt_token_ids"], 8)
    assert _token_ids(by_id.stdout) == record["token_ids"]
    assert "Qwen3MoeForCausalLM" in by_id.stderr


def test_generate_revision_picks_snapshot(hub_cache, local_tokens, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for revision, expected in (("v2", "llama_tied"), (V2, "llama_tied"), (MAIN, "llama")):
        assert tandem_main([*GENERATE, "--model", TINY_REPO, "--revision", revision,
                            "--download-dir", str(hub_cache)]) == 0
        assert _token_ids(capsys.readouterr().out) == local_tokens[expected], revision


def test_generate_missing_id_offline_is_a_clean_error(hub_cache):
    proc = _tandem(*GENERATE, "--model", "tiny-org/absent", HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    assert proc.returncode == 2
    assert "tandem generate: error: model 'tiny-org/absent' (revision 'main') is not in the Hugging Face cache" \
        in proc.stderr
    assert "HF_HUB_OFFLINE" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_by_id_offline_matches_local_path(hub_cache, tiny_model_dir):
    flags = ["plan", "--json", "--dtype", "float32", "--kv-cache-memory", "64MiB"]
    by_id = _tandem(*flags, "--model", TINY_REPO, "--revision", "v2", HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    by_path = _tandem(*flags, "--model", str(tiny_model_dir("llama_tied")))
    assert by_id.returncode == 0 and by_path.returncode == 0, by_id.stderr + by_path.stderr
    plan_id, plan_path = json.loads(by_id.stdout), json.loads(by_path.stdout)
    assert plan_id.pop("model") == TINY_REPO
    plan_path.pop("model")
    assert plan_id == plan_path


def test_worker_process_serves_an_id_offline(hub_cache, tmp_path):
    from deploy.launch import WorkerProcess

    with open(tmp_path / "stderr", "wb") as stderr:
        worker = WorkerProcess("prefill", ["--model", TINY_REPO, "--revision", "v2", "--port", "0",
                                           "--metrics-port", "-1",
                                           "--dtype", "float32", "--device", "cpu", "--num-threads", "1",
                                           "--num-gpu-blocks-override", "32", "--host", "127.0.0.1"],
                               stderr=stderr, env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"},
                               start_timeout_s=120, wait=False)
        try:
            info = worker.wait_ready(120)
        finally:
            worker.stop()
    assert info["role"] == "prefill" and info["grpc"].startswith("127.0.0.1:")
    log = (tmp_path / "stderr").read_text()
    assert f"model {TINY_REPO} (revision v2) from the HF cache: {hub_cache / 'models--tiny-org--tiny-llama'}" in log


# -- downloads from a local stand-in for the hub -------------------------------------------------

def test_download_once_then_from_cache(hub, tmp_path, tiny_model_dir):
    cache = tmp_path / "cache"
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    first = _tandem("plan", "--json", "--model", TINY_REPO, **env)
    assert first.returncode == 0, first.stderr
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / MAIN
    for file in tiny_model_dir("llama").iterdir():
        assert (snapshot / file.name).read_bytes() == file.read_bytes()
    assert hub.file_gets() == {f.name: 1 for f in tiny_model_dir("llama").iterdir()}
    asked = sum(hub.requests.values())
    second = _tandem("plan", "--json", "--model", TINY_REPO, **env)
    assert second.returncode == 0, second.stderr
    assert sum(hub.requests.values()) == asked          # cached: the hub is not asked again
    assert json.loads(second.stdout) == json.loads(first.stdout)


def test_processes_starting_together_download_once(hub, tmp_path, tiny_model_dir):
    """What the ranks and replicas of one node do when they start at once with a cold cache."""
    hub.file_delay_s = 0.5                               # every download overlaps the others' start
    env = _env(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="0")
    code = "import sys; from engine.model_source import resolve_model; print(resolve_model(sys.argv[1]).path)"
    procs = [subprocess.Popen([sys.executable, "-c", code, TINY_REPO], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outputs]
    assert {out.strip() for out, _ in outputs} == {str(tmp_path / "cache" / "models--tiny-org--tiny-llama"
                                                       / "snapshots" / MAIN)}
    assert hub.requests[f"GET /api/models/{TINY_REPO}/revision/main"] == 1
    assert hub.file_gets() == {f.name: 1 for f in tiny_model_dir("llama").iterdir()}


def test_gated_id_needs_hf_token(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
    denied = _tandem("plan", "--model", "tiny-org/gated", **env)
    assert denied.returncode == 2 and "Traceback" not in denied.stderr
    assert "model 'tiny-org/gated' is gated on the Hugging Face hub" in denied.stderr
    assert "set HF_TOKEN" in denied.stderr
    wrong = _tandem("plan", "--model", "tiny-org/gated", **env, HF_TOKEN="hf_wrong")
    assert wrong.returncode == 2 and "the token in HF_TOKEN has no access" in wrong.stderr
    allowed = _tandem("plan", "--json", "--model", "tiny-org/gated", **env, HF_TOKEN="hf_right")
    assert allowed.returncode == 0, allowed.stderr


def test_unknown_id_and_revision_online(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
    unknown = _tandem("plan", "--model", "tiny-org/nope", **env)
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "model 'tiny-org/nope' was not found on the Hugging Face hub" in unknown.stderr
    bad_rev = _tandem("plan", "--model", TINY_REPO, "--revision", "v9", **env)
    assert bad_rev.returncode == 2 and "model 'tiny-org/tiny-llama' has no revision 'v9'" in bad_rev.stderr


def test_unreachable_hub_names_the_id(tmp_path):
    import socket

    with socket.socket() as s:                         # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _tandem("plan", "--model", TINY_REPO, HF_ENDPOINT=f"http://127.0.0.1:{port}",
                   HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model 'tiny-org/tiny-llama' (revision 'main') is not in the Hugging Face cache" in proc.stderr
    assert "could not be downloaded" in proc.stderr


def test_serve_resolves_an_id_once_at_its_revision_before_starting_workers(hub_cache, monkeypatch):
    """`tandem serve --model org/name --revision v2` checks that snapshot (not main's) and hands
    its local path on for the router, which runs on the same node."""
    from deploy import serve
    from deploy.cli import build_parser

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(["serve", "--model", TINY_REPO, "--revision", "v2",
                                      "--download-dir", str(hub_cache)])
    arch, path = serve.check_model(args, {"prefill": 1, "decode": 1})
    assert path.name == V2 and path.parent.name == "snapshots"
    assert arch.tie_word_embeddings
    args = build_parser().parse_args(["serve", "--model", "tiny-org/absent", "--download-dir", str(hub_cache)])
    with pytest.raises(FileNotFoundError, match="tiny-org/absent"):
        serve.check_model(args, {"prefill": 1, "decode": 1})
