"""Tests for tensor parallelism in the engine: ParallelConfig, the sharded model, the rank-0
broadcast loop and LLM's follower processes (engine/tp/group.py, engine/tp/follower.py,
engine/tp/spawn.py).

The tiny random-weight checkpoints have 4 attention heads and 2 KV heads, so TP=2 gives each
rank one KV head: a wrong slice, a missing all-reduce or a follower that skips a step changes
the greedy tokens. Ranks > 0 are real processes over gloo on the 2-core machine.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engine.cli_args import config_from_args, config_to_args
from engine.config import CacheConfig, ModelConfig, ParallelConfig, SamplingParams, SchedulerConfig
from engine.tp.group import Leader, TPGroup, free_local_port
from tests.models import random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = [5, 40, 17, 70]     # 70 > chunked_prefill_size 64: a prompt prefilled in two chunks
MAX_TOKENS = [12, 6, 16, 9]


def _greedy(logprobs: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=logprobs) for m in MAX_TOKENS]


def _shm_pools(pid: int) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"tandem-kv-{pid}-*"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# qwen3_moe: every expert split in half; qwen2_moe: its shared expert too, and a dense layer.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_tp2_greedy_tokens_and_logprobs_match_tp1(arch, tiny_model_dir, make_llm):
    model = tiny_model_dir(arch)
    prompts = [random_prompt(seed=50 + i, num_tokens=n) for i, n in enumerate(LENGTHS)]
    options = {"block_size": 16, "chunked_prefill_size": 64}
    expected = make_llm(model, **options).generate(prompts, _greedy(logprobs=5))
    tp2 = make_llm(model, tensor_parallel_size=2, **options)
    assert tp2.engine.runner.kv_pool.layout.num_kv_heads == 1   # this rank's half of the 2 KV heads
    got = tp2.generate(prompts, _greedy(logprobs=5))
    assert len(got) == len(expected) == len(prompts)
    for ours, ref, max_tokens in zip(got, expected, MAX_TOKENS):
        assert ours.token_ids == ref.token_ids
        assert len(ours.logprobs) == len(ref.logprobs) == max_tokens
        for entry, ref_entry in zip(ours.logprobs, ref.logprobs):
            assert len(entry) == 5
            assert list(entry) == list(ref_entry)   # same sampled token and top 5, same order
            # float32 on both sides, different reduction order: at most 6e-6 apart measured.
            assert list(entry.values()) == pytest.approx(list(ref_entry.values()), abs=3e-5)
    # A second batch reuses the pool (prefix-cache hits on rank 0 must match followers' KV).
    again = tp2.generate(prompts[:2], _greedy()[:2])
    assert [r.token_ids for r in again] == [r.token_ids for r in expected[:2]]


def test_close_stops_followers_and_frees_their_pools(tiny_model_dir):
    from engine.llm import LLM

    # from_configs is what `tandem generate` uses.
    llm = LLM.from_configs(ModelConfig(str(tiny_model_dir("llama")), dtype="float32", device="cpu"),
                           CacheConfig(num_gpu_blocks_override=32), SchedulerConfig(), tensor_parallel_size=2)
    [pid] = llm.followers.pids()
    own_pool = llm.engine.runner.kv_pool.shm_path
    assert _pid_alive(pid) and _shm_pools(pid) and own_pool.exists()
    procs = list(llm.followers.procs)
    llm.close()
    assert [p.returncode for p in procs] == [0]   # left on rank 0's STOP, not killed
    assert not _pid_alive(pid)
    assert _shm_pools(pid) == []
    assert not own_pool.exists()
    llm.close()   # twice is harmless


def test_dead_follower_fails_generate_instead_of_hanging(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir("llama"), tensor_parallel_size=2)
    [proc] = llm.followers.procs
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    started = time.monotonic()
    # gloo's own error from the step's collective, or ours if the heartbeat saw the peer go first.
    with pytest.raises(RuntimeError, match="gloo|tensor-parallel follower is gone"):
        llm.generate([random_prompt(seed=1, num_tokens=20)], _greedy()[0])
    assert time.monotonic() - started < 35
    # The group is out of step for good: later calls fail at once, naming the cause.
    with pytest.raises(RuntimeError, match="tensor-parallel follower is gone"):
        llm.generate([random_prompt(seed=2, num_tokens=5)], _greedy()[0])


def test_tp_size_that_does_not_divide_the_heads_fails_before_spawning(tiny_model_dir, make_llm):
    with pytest.raises(ValueError, match="^tensor_parallel_size=3 does not divide") as info:
        make_llm(tiny_model_dir("llama"), tensor_parallel_size=3)
    assert str(info.value) == ("tensor_parallel_size=3 does not divide the model's 2 KV heads (and 4 attention "
                               "heads, intermediate_size 128); use --tensor-parallel-size 1 or 2")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ({"tensor_parallel_size": 2, "tp_rank": 2, "dist_init_address": "h:1"}, "tp_rank=2 is outside [0, 2)"),
    ({"tensor_parallel_size": 2}, "needs --dist-init-address"),
    ({"tensor_parallel_size": 2, "dist_init_address": "localhost"}, "is not host:port"),
    ({"tensor_parallel_size": 2, "dist_init_address": "h:70000"}, "is not host:port"),
])
def test_parallel_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**kwargs)


def test_config_flags_round_trip():
    import argparse

    from engine.cli_args import add_config_args

    configs = [ModelConfig(model="m", max_model_len=77), CacheConfig(enable_prefix_caching=False, block_size=8),
               SchedulerConfig(schedule_policy="lpm"), ParallelConfig(4, 3, "10.0.0.1:29500")]
    parser = argparse.ArgumentParser()
    for config in configs:
        add_config_args(parser, type(config))
    args = parser.parse_args([flag for config in configs for flag in config_to_args(config)])
    assert [config_from_args(type(c), args) for c in configs] == configs


def test_group_messages_and_min_reduce_between_two_ranks():
    """Rank 0 here, rank 1 in a thread: msgpack messages, int min-reduce, sum all-reduce."""
    import threading

    address = f"127.0.0.1:{free_local_port()}"
    got: dict[str, object] = {}

    def follower() -> None:
        group = TPGroup(ParallelConfig(2, 1, address), torch.device("cpu"))
        got["messages"] = [group.receive(), group.receive()]
        got["min"] = group.all_min([5, 1, 9])
        got["sum"] = group.all_reduce(torch.tensor([2.0, 3.0])).tolist()
        group.close()

    thread = threading.Thread(target=follower)
    thread.start()
    group = TPGroup(ParallelConfig(2, 0, address), torch.device("cpu"))
    leader = Leader(group)
    leader.send(2, {"ops": [["open", "req-1", b"\x00\x01"]], "reply": True})
    leader.send(3)
    assert group.all_min([4, 2, 10]) == [4, 1, 9]
    assert group.all_reduce(torch.tensor([1.0, 1.0])).tolist() == [3.0, 4.0]
    thread.join(30)
    group.close()
    assert got["messages"] == [(2, {"ops": [["open", "req-1", b"\x00\x01"]], "reply": True}), (3, None)]
    assert got["min"] == [4, 1, 9] and got["sum"] == [3.0, 4.0]
