"""`tandem generate`: the README's main job, end to end in a real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRANCE = "What is the capital of France?"


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def hf_smollm2_greedy():
    """HF transformers' greedy ids for the France chat prompt on the same dequantized weights."""
    transformers = pytest.importorskip("transformers")
    import torch

    from engine.loader import Checkpoint, resolve_model
    from engine.tokenizer import Tokenizer

    checkpoint = Checkpoint(resolve_model("smollm2-135m-instruct"))
    a = checkpoint.arch
    config = transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta, max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()
    state = {("model." + n): t for n, t in checkpoint.weights()}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    prompt = Tokenizer.from_gguf(checkpoint.source.path).encode_chat([{"role": "user", "content": FRANCE}])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
    return prompt, out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_generate_json_matches_hf_greedy(hf_smollm2_greedy):
    prompt, expected = hf_smollm2_greedy
    proc = _tandem("generate", "--chat", "--prompt", FRANCE, "--max-tokens", "32", "--temperature", "0",
                   "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert set(record) == {"prompt_token_ids", "token_ids", "text", "finish_reason"}
    assert record["prompt_token_ids"] == prompt
    assert record["token_ids"] == expected
    assert record["text"].startswith("The capital of France is Paris.")
    assert record["finish_reason"] == "length"
    assert "num_blocks_global: " in proc.stderr
    assert "KV cache: " in proc.stderr and " concurrent requests at " in proc.stderr


def test_generate_bad_inputs_exit_2_with_one_clear_line(tmp_path):
    cases = [
        (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["--prompt", "x", "--logprobs", "21"], "logprobs must be in [0, 20], got 21"),
        (["--prompt", "x", "--model", str(tmp_path / "nope")], "not found"),
        (["--prompt-file", str(tmp_path / "missing.txt")], "cannot read --prompt-file"),
    ]
    for args, message in cases:
        proc = _tandem("generate", *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_generate_prompt_longer_than_max_model_len_names_both_numbers():
    proc = _tandem("generate", "--prompt", "one two three four five six seven eight nine ten",
                   "--max-model-len", "4", "--max-tokens", "1")
    assert proc.returncode == 2
    assert "longer than max_model_len=4" in proc.stderr and "the prompt has 10 tokens" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_help_lists_engine_flags():
    proc = _tandem("generate", "--help")
    assert proc.returncode == 0
    for flag in ("--max-num-seqs", "--max-running-requests", "--block-size", "--kv-cache-memory",
                 "--num-gpu-blocks-override", "--chunked-prefill-size", "--schedule-policy",
                 "--enable-prefix-caching", "--max-model-len", "--prompt-file", "--logprobs"):
        assert flag in proc.stdout
