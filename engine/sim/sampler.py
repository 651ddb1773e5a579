"""The simulated engine's sampler: the runner's next tokens as the sampler's output.

Runs with ``SimRunner`` in the engine thread. A row that asks for logprobs or follows a grammar
goes through the real ``Sampler`` on logits that put all the mass on its token (0 there,
``OTHER_LOGIT`` elsewhere): its logprobs are real numbers and its grammar really masks (a token
the grammar forbids gives way to what the grammar allows). Every other row takes its token as it
is -- what the real sampler picks from those logits at any sane temperature, without building a
``[batch, vocab]`` tensor each step. A random row still draws once from its generator, as the
real sampler does, so a seeded request's generator stays where a real engine's would be.
"""
from __future__ import annotations

import torch

from engine.sampler import Sampler, SamplerOutput, SamplingRequest, advance_generator

OTHER_LOGIT = -1e4   # e^-1e4 = 0 in float32: the runner's token is the only one sampled


class SimSampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.sampler = Sampler()

    def __call__(self, token_ids: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        tokens = token_ids.tolist()
        if len(tokens) != len(requests):
            raise ValueError(f"{len(tokens)} tokens for {len(requests)} rows")
        dense = [i for i, r in enumerate(requests) if r.params.logprobs is not None or r.grammar is not None]
        for i, request in enumerate(requests):
            if i not in dense and not request.params.greedy and request.generator is not None:
                advance_generator(request.generator, self.vocab_size)
        if not dense:
            return SamplerOutput(tokens, None, None)
        logits = torch.full((len(dense), self.vocab_size), OTHER_LOGIT, dtype=torch.float32)
        logits[torch.arange(len(dense)), torch.tensor([tokens[i] for i in dense])] = 0.0
        sampled = self.sampler(logits, [requests[i] for i in dense])
        logprobs: list[float] | None = [0.0] * len(tokens) if sampled.logprobs is not None else None
        top: list[list[tuple[int, float]]] | None = [[] for _ in tokens] if sampled.top_logprobs is not None else None
        for row, i in enumerate(dense):
            tokens[i] = sampled.token_ids[row]
            if logprobs is not None and sampled.logprobs is not None:
                logprobs[i] = sampled.logprobs[row]
            if top is not None and sampled.top_logprobs is not None:
                top[i] = sampled.top_logprobs[row]
        return SamplerOutput(tokens, logprobs, top)
