"""The colocated engine on CUDA: model runner, Triton attention, GPU KV pool sizing and sampling.

The rest of tests/engine pins ``device="cpu"``; these run the same tiny checkpoints with
``device="cuda"`` and compare with transformers' float32 forward on the CPU, or with the same
engine on the CPU. Skipped without a CUDA device.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine.attention import triton_backend
from engine.config import SamplingParams, StructuredOutput
from tests.models import TINY_ARCHS, full_prompt_logits, greedy, hf_greedy, hf_logits, random_prompt, rel_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# float32 on the GPU: cuBLAS without TF32 (torch's default) and IEEE dots in the Triton kernels,
# so the same bound as the CPU engine's (tests/engine/test_models.py).
LOGITS_REL_TOL_F32 = 1e-5
# bfloat16 weights and activations against the float32 reference: bf16 keeps 8 mantissa bits
# (relative rounding 2**-9 = 2e-3 per value), compounded over two layers and the head.
LOGITS_REL_TOL_BF16 = 3e-2


@pytest.mark.parametrize("name", TINY_ARCHS)
def test_float32_prompt_logits_match_transformers(tiny_model_dir, hf_model, make_llm, name):
    llm = make_llm(tiny_model_dir(name), device="cuda")
    runner = llm.engine.runner
    assert runner.device.type == "cuda" and runner.kv_pool.tensor.is_cuda
    assert runner.model.layers[0].self_attn.backend is triton_backend
    prompt = random_prompt(seed=11, num_tokens=37)  # 3 blocks, the last one partial
    ours = full_prompt_logits(runner, llm.engine.allocator, prompt)
    assert ours.is_cuda and ours.dtype == torch.float32
    ref = hf_logits(hf_model(name), prompt)
    assert rel_error(ours.cpu(), ref) < LOGITS_REL_TOL_F32
    assert torch.equal(ours.argmax(-1).cpu(), ref.argmax(-1))
    assert llm.engine.allocator.num_used_blocks == 0


def test_bfloat16_prompt_logits_near_transformers_float32(tiny_model_dir, hf_model, make_llm):
    llm = make_llm(tiny_model_dir("llama"), device="cuda", dtype="bfloat16")
    prompt = random_prompt(seed=11, num_tokens=37)
    ours = full_prompt_logits(llm.engine.runner, llm.engine.allocator, prompt)
    err = rel_error(ours.cpu(), hf_logits(hf_model("llama"), prompt))
    assert 0 < err < LOGITS_REL_TOL_BF16, err


def test_greedy_in_mixed_chunked_batches_matches_transformers(tiny_model_dir, hf_model, make_llm):
    # chunked_prefill_size=8: steps mix prefill chunks (over a cached prefix) with decodes, so
    # both kernels run in one forward; decode contexts cross block boundaries.
    lengths, max_tokens = [3, 40, 17, 1, 64, 16, 33, 9], [16, 5, 12, 16, 3, 16, 8, 1]
    prompts = [random_prompt(seed=100 + i, num_tokens=n) for i, n in enumerate(lengths)]
    llm = make_llm(tiny_model_dir("llama"), device="cuda", chunked_prefill_size=8)
    outs = llm.generate(prompts, [greedy(m) for m in max_tokens])
    hf = hf_model("llama")
    for out, prompt, m in zip(outs, prompts, max_tokens):
        assert out.token_ids == hf_greedy(hf, prompt, m)
    assert llm.engine.allocator.num_used_blocks == 0


def test_long_context_decode_splits_and_matches_transformers(tiny_model_dir, hf_model, make_llm):
    # 560 prompt tokens in blocks of 4 (140 blocks, then 4 more while decoding): decode
    # contexts of 561..576 tokens, which the decode kernel splits in two (one split per 256
    # tokens at most), so the split-K merge runs inside the engine too.
    llm = make_llm(tiny_model_dir("llama"), device="cuda", block_size=4, max_model_len=640,
                   num_gpu_blocks_override=200)
    prompt = random_prompt(seed=21, num_tokens=560)
    assert triton_backend._num_decode_splits(1, 2, 561, llm.engine.runner.device) == 2
    [out] = llm.generate(prompt, greedy(16))
    assert out.token_ids == hf_greedy(hf_model("llama"), prompt, 16)


def test_kv_pool_is_sized_from_gpu_memory(tiny_model_dir, make_llm):
    utilization = 0.05
    llm = make_llm(tiny_model_dir("llama"), device="cuda", num_gpu_blocks_override=None,
                   gpu_memory_utilization=utilization)
    runner = llm.engine.runner
    total = torch.cuda.get_device_properties(runner.device).total_memory
    pool_nbytes = runner.kv_pool.nbytes
    assert pool_nbytes == runner.num_blocks * runner.layout.bytes_per_block
    # The pool fills what the profiled forward leaves of the budget: the tiny model's weights
    # and one 2048-token forward take well under 1 GiB.
    assert total * utilization - 2**30 < pool_nbytes <= total * utilization
    [out] = llm.generate(random_prompt(seed=3, num_tokens=20), greedy(4))
    assert len(out.token_ids) == 4


def test_seeded_sampling_is_reproducible_on_cuda(tiny_model_dir, make_llm):
    prompt = random_prompt(seed=13, num_tokens=20)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    llm = make_llm(tiny_model_dir("llama"), device="cuda")
    [alone] = llm.generate(prompt, seeded)
    batch = llm.generate([random_prompt(seed=14, num_tokens=9), prompt],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), seeded])
    assert batch[1].token_ids == alone.token_ids
    assert alone.token_ids != llm.generate(prompt, greedy(16))[0].token_ids


def test_structured_output_masks_cuda_logits_like_cpu(tiny_model_dir, make_llm):
    # The grammar mask goes through xgrammar's CUDA path here; greedy under the same mask must
    # pick the same tokens as the CPU engine.
    choices = ["yes", "no", "it depends"]
    params = SamplingParams(temperature=0.0, max_tokens=20,
                            structured=StructuredOutput("choice", json.dumps(choices)))
    prompts = [random_prompt(seed=30 + i, num_tokens=12) for i in range(3)]
    on_cuda = make_llm(tiny_model_dir("llama"), device="cuda").generate(prompts, params)
    on_cpu = make_llm(tiny_model_dir("llama"), device="cpu").generate(prompts, params)
    for gpu_out, cpu_out in zip(on_cuda, on_cpu):
        assert gpu_out.finish_reason == "stop" and gpu_out.text in choices
        assert gpu_out.token_ids == cpu_out.token_ids
