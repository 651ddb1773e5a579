"""`tandem plan`: the capacity arithmetic, checked against hand computation and a live worker."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA2_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False}


def _plan(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "plan", "--json", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_smollm2_cpu_pool_by_hand():
    plan = _plan("--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--input-len", "300",
                 "--output-len", "100")
    kv_per_token = 2 * 30 * 3 * 64 * 4                  # K and V, 30 layers, 3 KV heads x 64, float32
    assert plan["kv_bytes_per_token"] == kv_per_token == 46080
    blocks = (256 << 20) // (16 * kv_per_token)
    assert plan["num_blocks"] == blocks == 364
    assert plan["kv_tokens"] == blocks * 16
    assert plan["concurrency_at_max_model_len"] == blocks // (2048 // 16)
    assert plan["concurrency_at_workload"] == blocks // 25  # 400 tokens -> 25 blocks of 16
    assert plan["capacity_lines"] == ["num_blocks_global: 364",
                                      "KV cache: 364 blocks x 16 tokens = 5824 tokens; "
                                      "~2 concurrent requests at 2048 tokens/request"]


def test_llama2_70b_on_four_80gb_gpus_tp4_by_hand(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_70B))
    plan = _plan("--model", str(tmp_path), "--memory", "80GB", "--tensor-parallel-size", "4",
                 "--gpu-memory-utilization", "0.9", "--activation-memory", "2GiB", "--input-len", "1024",
                 "--output-len", "256")
    d, f, layers, vocab = 8192, 28672, 80, 32000
    attn = d * 128 * (2 * 64 + 2 * 8)
    params = layers * (attn + 3 * d * f + 2 * d) + 2 * vocab * d + d
    assert plan["num_params"] == params == 68_976_648_192
    weights = -(-params * 2 // 4)                        # bfloat16, sharded 4 ways
    assert plan["weight_bytes_per_gpu"] == weights
    kv_per_token = 2 * layers * 8 * 128 * 2 // 4          # this rank's 2 of 8 KV heads
    assert plan["kv_bytes_per_token"] == kv_per_token == 81920
    budget = int(80e9 * 0.9) - weights - (2 << 30)
    assert plan["kv_budget_bytes"] == budget
    assert plan["num_blocks"] == budget // (16 * kv_per_token)
    assert plan["concurrency_at_workload"] == plan["num_blocks"] // (1280 // 16)
    assert plan["concurrency_at_max_model_len"] == plan["num_blocks"] // (4096 // 16)
    assert plan["warnings"] == []


def test_warnings_name_numbers_and_knobs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_70B))
    plan = _plan("--model", str(tmp_path), "--memory", "80GB", "--tensor-parallel-size", "1")
    assert any("weights need 128.48 GiB per GPU" in w and "--tensor-parallel-size" in w for w in plan["warnings"])
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps({"prompt_len": n, "max_tokens": 200}) + "\n" for n in range(100, 1100, 10)))
    plan = _plan("--model", str(tmp_path), "--memory", "80GB", "--tensor-parallel-size", "8",
                 "--request-log", str(log))
    assert plan["recommended_max_model_len"] == 1090 + 200   # P99 prompt of 100 requests + max_tokens
    assert any("max_model_len=4096 exceeds what the request log needs (1290" in w for w in plan["warnings"])


def test_bad_tp_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "plan", "--tensor-parallel-size", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--tensor-parallel-size 2 does not divide the model's 3 KV heads" in proc.stderr


@pytest.mark.slow
def test_plan_agrees_with_a_started_worker():
    worker = subprocess.Popen([sys.executable, "-m", "decode_worker", "--kv-cache-memory", str(64 << 20),
                               "--max-model-len", "512", "--metrics-port", "-1", "--num-threads", "1"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = worker.stdout.readline()
        assert ready.startswith("TANDEM_WORKER_READY"), worker.stderr.read()
    finally:
        worker.terminate()
        _, stderr = worker.communicate(timeout=30)
    plan = _plan("--kv-cache-memory", str(64 << 20), "--max-model-len", "512")
    for line in plan["capacity_lines"]:
        assert line in stderr, (line, stderr)
