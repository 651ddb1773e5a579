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


# Published config.json values (Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1), fields Tandem reads.
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "tie_word_embeddings": False}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False}


def test_qwen3_30b_a3b_counts_every_expert_by_hand(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    plan = _plan("--model", str(tmp_path), "--memory", "80GB", "--tensor-parallel-size", "2",
                 "--activation-memory", "2GiB")
    d, layers, vocab = 2048, 48, 151936
    attn = d * 128 * (2 * 32 + 2 * 4) + 2 * 128               # q/o, k/v, q/k norms
    experts = 128 * 3 * d * 768 + 128 * d                      # 128 gated experts and the router
    params = layers * (attn + experts + 2 * d) + 2 * vocab * d + d
    assert plan["num_params"] == params == 30_532_122_624      # "30.5B" on the model card
    active = params - layers * (128 - 8) * 3 * d * 768
    assert plan["num_active_params"] == active == 3_353_032_704   # "3.3B activated"
    assert plan["weight_bytes_per_gpu"] == -(-params * 2 // 2)    # bfloat16, every expert, split 2 ways
    assert plan["kv_bytes_per_token"] == 2 * layers * 2 * 128 * 2   # this rank's 2 of 4 KV heads
    assert plan["num_blocks"] == (int(80e9 * 0.9) - plan["weight_bytes_per_gpu"] - (2 << 30)) // (
        16 * plan["kv_bytes_per_token"])


def test_mixtral_8x7b_counts_every_expert_and_says_what_is_active(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    plan = _plan("--model", str(tmp_path), "--memory", "80GB", "--tensor-parallel-size", "2")
    d, f, layers = 4096, 14336, 32
    per_layer = d * 128 * (2 * 32 + 2 * 8) + 8 * 3 * d * f + 8 * d + 2 * d
    assert plan["num_params"] == layers * per_layer + 2 * 32000 * d + d == 46_702_792_704   # "46.7B"
    assert plan["num_active_params"] == plan["num_params"] - layers * 6 * 3 * d * f == 12_879_925_248
    text = subprocess.run([sys.executable, "-m", "deploy.cli", "plan", "--model", str(tmp_path), "--memory",
                           "80GB", "--tensor-parallel-size", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120).stdout
    assert text.splitlines()[0] == (f"model: {tmp_path} (MixtralForCausalLM, 46.70B params (12.88B active per "
                                    "token), bfloat16, TP 2)")
