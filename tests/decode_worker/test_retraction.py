"""A decode worker whose pool cannot hold its batch retracts requests and still gives the
colocated reference's tokens.

The decode pool (block_size 4) holds just over two max_model_len sequences; eight requests
that each grow to 13-14 blocks are admitted on the expectation that not all of them reach
max_tokens at once (new_token_ratio, made optimistic with --schedule-conservativeness 0.3),
so the pool runs dry mid-decode. The retracted requests are recomputed on the decode worker
(prompt + tokens so far) and must continue exactly.
"""
from __future__ import annotations

from engine.config import SamplingParams
from tests.workers.harness import generate, greedy, pool_flags, prompts_for, run_concurrently, start_pair, wait_idle

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
DECODE_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE * 2 + 2   # 34
LENGTHS = [12, 9, 20, 15, 7, 18, 11, 14]
MAX_TOKENS = [40, 44, 36, 40, 48, 38, 42, 40]        # prompt + output: 52-56 tokens


def test_retraction_keeps_outputs_exact(spawn, tiny_dir, reference):
    common = ["--max-model-len", str(MAX_MODEL_LEN), "--log-interval-s", "0.5"]
    prefill, decode = start_pair(spawn, tiny_dir, *common, prefill_flags=tuple(pool_flags(256, BLOCK_SIZE)),
                                 decode_flags=(*pool_flags(DECODE_BLOCKS, BLOCK_SIZE),
                                               "--schedule-conservativeness", "0.3"))
    prompts = prompts_for(LENGTHS, seed=8000)
    expected = reference(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS],
                         block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    results = run_concurrently([
        (lambda i=i: generate(prefill, decode, f"retract-{i}", prompts[i], greedy(MAX_TOKENS[i])))
        for i in range(len(prompts))])
    stats = decode.stats()
    assert stats.kv_blocks_total == DECODE_BLOCKS
    assert stats.num_retractions > 0
    assert "decode out of memory happened" in decode.stderr()
    for i, (result, ref) in enumerate(zip(results, expected)):
        assert result.error is None, (i, result.error)
        assert result.token_ids == ref.token_ids, f"request {i}"
        assert result.final.finish_reason == "length"
        assert result.final.num_output_tokens == MAX_TOKENS[i]
    wait_idle(prefill, decode)
