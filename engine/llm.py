"""In-process `LLM` API: ``LLM(model).generate(prompts, SamplingParams)``.

Runs in the caller's process and thread. It is the colocated twin of the disaggregated system:
the same engine loop (chunked prefill + continuous-batched decode) with no processes, except
that ``tensor_parallel_size=N`` spawns N - 1 follower rank processes (engine/tp/spawn.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import DEFAULT_MODEL, CacheConfig, ModelConfig, ParallelConfig, SamplingParams, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model_source import load_arch, resolve_model
from engine.models.llama import check_tensor_parallel
from engine.tp.spawn import LocalFollowers


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
                "text": self.text, "finish_reason": self.finish_reason}


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict, dict, dict, dict]:
    groups: tuple[dict, dict, dict, dict] = ({}, {}, {}, {})
    for key, value in kwargs.items():
        configs: tuple[type[Any], ...] = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)
        for group, cls in zip(groups, configs):
            if key in cls.__dataclass_fields__:
                group[key] = value
                break
        else:
            raise TypeError(f"LLM() got an unknown option {key!r}")
    return groups


class LLM:
    """Offline generation. Keyword options are fields of ModelConfig, CacheConfig and
    SchedulerConfig (e.g. ``dtype``, ``block_size``, ``max_num_seqs``), plus
    ``tensor_parallel_size``: with N > 1 this process is rank 0 and spawns ranks 1..N-1."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        model_kw, cache_kw, sched_kw, parallel_kw = _split_kwargs(kwargs)
        tensor_parallel_size = parallel_kw.pop("tensor_parallel_size", 1)
        if parallel_kw:
            raise TypeError(f"LLM() spawns its own TP ranks; {sorted(parallel_kw)} are for worker processes")
        self._start(ModelConfig(model=model, **model_kw), CacheConfig(**cache_kw), SchedulerConfig(**sched_kw),
                    tensor_parallel_size)

    @classmethod
    def from_configs(cls, model_config: ModelConfig, cache_config: CacheConfig,
                     scheduler_config: SchedulerConfig, parallel_config: ParallelConfig | None = None, *,
                     tensor_parallel_size: int | None = None) -> LLM:
        """The ranks are always local: of ``parallel_config`` only ``tensor_parallel_size``
        counts (or give ``tensor_parallel_size`` alone)."""
        llm = cls.__new__(cls)
        size = tensor_parallel_size or (1 if parallel_config is None else parallel_config.tensor_parallel_size)
        llm._start(model_config, cache_config, scheduler_config, size)
        return llm

    def _start(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
               tensor_parallel_size: int) -> None:
        self.followers: LocalFollowers | None = None
        parallel = ParallelConfig()
        if tensor_parallel_size > 1:
            # Fail before spawning anything when the heads cannot be split.
            source = resolve_model(model_config.model, model_config.revision, model_config.download_dir)
            check_tensor_parallel(load_arch(source), tensor_parallel_size)
            self.followers = LocalFollowers(model_config, cache_config, scheduler_config, tensor_parallel_size)
            parallel = self.followers.parallel
        try:
            self.engine = LLMEngine(model_config, cache_config, scheduler_config, parallel_config=parallel)
        except BaseException:
            if self.followers is not None:
                self.followers.stop(timeout_s=0)
            raise
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_lists, sampling_params)

    def chat(self, conversations: list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        token_lists = [self.tokenizer.encode_chat(messages) for messages in conversations]
        return self._run(token_lists, sampling_params)

    def _run(self, token_lists: list[list[int]],
             sampling_params: SamplingParams | list[SamplingParams] | None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError(f"{len(params)} sampling params for {len(token_lists)} prompts")
        results: dict[str, RequestOutput] = {}
        added: list[str] = []
        try:
            for tokens, p in zip(token_lists, params):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, tokens, p)
                added.append(request_id)
                results[request_id] = RequestOutput(request_id, list(tokens),
                                                    logprobs=[] if p.logprobs is not None else None)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    result = results[out.request_id]
                    result.token_ids += out.new_token_ids
                    if result.logprobs is not None:
                        result.logprobs += out.new_logprobs
                    if out.finished:
                        result.finish_reason = out.finish_reason
        except BaseException:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        for result in results.values():
            result.text = self.tokenizer.decode(result.token_ids)
        return [results[r] for r in added]

    def close(self) -> None:
        """Free the KV pool; with TP, stop the follower ranks and wait for them to exit."""
        try:
            self.engine.close()
        finally:
            if self.followers is not None:
                self.followers.stop()
