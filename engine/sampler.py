"""Batched token sampling for the worker's engine loop (runs in every worker process).

One call turns the last-position logits of a batch ``[B, V]`` into one token per row, each
row under its own ``SamplingParams``. The order follows vLLM:

0. rows with a structured-output grammar get every token it forbids next set to -inf
   (``engine.structured``; vLLM applies this bitmask before its sampler too);
1. logprobs, when any row asks, come from the raw logits (``log_softmax`` before penalties
   and temperature: vLLM's default "raw logprobs");
2. repetition penalty over prompt + output tokens, then frequency and presence penalties
   over output tokens only;
3. greedy rows (temperature 0) take the argmax of the penalized logits;
4. random rows are divided by their temperature, filtered by top-k, top-p and min-p, and
   sampled by inverse CDF: one uniform ``u`` per row, the first token whose cumulative
   probability exceeds ``u x total``. The uniform of a row comes from that request's own
   generator when it has one, so a seed gives the same tokens whatever else shares the batch.
   (One draw per row instead of an exponential race over the whole vocabulary: drawing 49152
   exponentials per row took ~20% of a batch-16 decode step on CPU.) On CPU, step 4 after the
   draw runs in C (``engine/csrc/sampling.c``: a few passes over each row, top-p sorting only
   the tokens near the top) instead of a dozen full-vocabulary torch ops and a full sort; the
   torch path stays the rule's reference and the fallback when the library cannot be built.

Stop conditions (eos, stop ids, max_tokens) are the scheduler's job, not this module's.
The common case, an all-greedy batch with no penalties and no logprobs, is a single argmax.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

from engine.config import SamplingParams
from engine.native import CSRC, KernelBuildError, build
from engine.structured import GrammarState, apply_grammar_masks

logger = logging.getLogger(__name__)
SAMPLING_ABI_VERSION = 1


@dataclass
class SamplingRequest:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # from make_generator(params.seed); None = shared
    grammar: GrammarState | None = None       # the request's matcher when params.structured is set


@dataclass
class SamplerOutput:
    token_ids: list[int]                                 # one per row
    logprobs: list[float] | None                         # raw logprob of each sampled token;
                                                         # None when no row asked
    top_logprobs: list[list[tuple[int, float]]] | None   # per row, params.logprobs pairs
                                                         # (token_id, logprob), descending;
                                                         # [] for rows that did not ask


def advance_generator(generator: torch.Generator, vocab_size: int) -> None:
    """Consume exactly the random numbers one sampled row draws (see ``Sampler._sample``)."""
    torch.rand(1, dtype=torch.float32, device=generator.device, generator=generator)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for ``seed`` on ``device``; None when the request has no seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``counts[b, t]`` = occurrences of token t in ``token_ids[b]``, as float32 ``[B, V]``."""
    max_len = max(len(ids) for ids in token_ids)
    # Pad with an extra column V that is sliced off, so padding never counts.
    padded = torch.tensor([ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids],
                          dtype=torch.long).to(device, non_blocking=True)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def apply_penalties(logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; returns a new tensor (or ``logits``
    itself when no row has a penalty).

    Repetition (CTRL / HF): a token seen in the prompt or the output has its logit divided by
    the penalty when positive, multiplied when not. Frequency and presence (OpenAI) look at
    output tokens only: ``logit -= frequency * count + presence * (count > 0)``.
    """
    if not any(_has_penalties(r.params) for r in requests):
        return logits
    num_rows, vocab_size = logits.shape
    device = logits.device

    # Rows without a given penalty get an empty token list, so they build no mask for it.
    seen_ids = [r.prompt_token_ids + r.output_token_ids if r.params.repetition_penalty != 1.0
                else [] for r in requests]
    if any(seen_ids):
        seen = _token_counts(seen_ids, vocab_size, device) > 0
        rep = torch.tensor([r.params.repetition_penalty for r in requests],
                           dtype=torch.float32).to(device, non_blocking=True).unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)

    output_ids = [r.output_token_ids if r.params.presence_penalty != 0.0
                  or r.params.frequency_penalty != 0.0 else [] for r in requests]
    if any(output_ids):
        counts = _token_counts(output_ids, vocab_size, device)
        penalties = torch.tensor(
            [[r.params.frequency_penalty, r.params.presence_penalty] for r in requests],
            dtype=torch.float32).to(device, non_blocking=True)
        logits = (logits - penalties[:, :1] * counts
                  - penalties[:, 1:] * (counts > 0).to(torch.float32))
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Set filtered-out logits to -inf; returns a new tensor. Each knob is a ``[B]`` tensor
    on ``logits.device``, or None to skip it for every row.

    - top_k (long): keep the k largest logits; k <= 0 or k >= V disables. Ties with the
      k-th value are kept, so a row may keep more than k tokens.
    - top_p (float): of what top-k kept, keep the smallest prefix of the descending
      distribution (renormalized) whose mass reaches top_p; the top token always stays;
      ties are ordered by lower token id first. 1.0 disables.
    - min_p (float): drop tokens whose probability is below ``min_p * max_prob``. The ratio
      to the max does not change under renormalization, so it is measured on the top-k
      distribution. 0.0 disables.
    """
    vocab_size = logits.shape[1]
    # One stable descending sort serves all three filters; masks are built in sorted order
    # and scattered back to token order at the end.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)

    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k >= vocab_size), vocab_size, top_k)
        kth_value = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        drop |= sorted_logits < kth_value

    if top_p is not None or min_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        if top_p is not None:
            # Mass strictly before each position; a token stays while that is < top_p.
            # Shifting the cumsum keeps the first position at exactly 0.
            mass_before = torch.zeros_like(probs)
            mass_before[:, 1:] = probs.cumsum(dim=-1)[:, :-1]
            top_p = top_p.unsqueeze(1)
            # top_p == 1.0 must keep everything even when the cumsum rounds up to 1 early.
            drop |= (mass_before >= top_p) & (top_p < 1.0)
        if min_p is not None:
            drop |= probs < min_p.unsqueeze(1) * probs[:, :1]

    drop_by_token = torch.empty_like(drop).scatter_(1, sorted_ids, drop)
    return logits.masked_fill(drop_by_token, float("-inf"))


class Sampler:
    """Samples one token per row of a batch; holds only the shared generator(s)."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [B, V] with B={len(requests)} rows, "
                             f"got shape {tuple(logits.shape)}")
        if logits.dtype != torch.float32:
            logits = logits.float()
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            grammars = [g for i in constrained if (g := requests[i].grammar) is not None]
            logits = _mask_by_grammar(logits, constrained, grammars)
        params = [r.params for r in requests]
        wants_logprobs = any(p.logprobs is not None for p in params)

        if (all(p.greedy for p in params) and not wants_logprobs
                and not any(_has_penalties(p) for p in params)):
            return SamplerOutput(_argmax(logits).tolist(), None, None)

        penalized = apply_penalties(logits, requests)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            token_ids = _argmax(penalized)
        elif len(random_rows) == len(requests):
            token_ids = self._sample(penalized, requests)
        else:
            token_ids = _argmax(penalized)
            rows = torch.tensor(random_rows, dtype=torch.long).to(logits.device, non_blocking=True)
            token_ids[rows] = self._sample(penalized[rows], [requests[i] for i in random_rows])

        if not wants_logprobs:
            return SamplerOutput(token_ids.tolist(), None, None)
        sampled_logprobs, top_logprobs = _raw_logprobs(logits, token_ids, params)
        return SamplerOutput(token_ids.tolist(), sampled_logprobs, top_logprobs)

    @staticmethod
    def build_native() -> bool:
        """Compile (or find) the C sampler; whether CPU rows will use it."""
        return _native() is not None

    def _sample(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
        """Temperature, filters and the inverse-CDF draw for rows that all sample randomly."""
        uniform = self._uniforms(requests, logits.device)
        params = [r.params for r in requests]
        native = _native() if logits.device.type == "cpu" else None
        if native is not None:
            token_ids = native(logits, params, uniform)
            if token_ids is not None:
                return token_ids
        return sample_by_inverse_cdf(logits, params, uniform)

    def _uniforms(self, requests: list[SamplingRequest], device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row: from the request's own generator, else the shared one."""
        uniform = torch.empty(len(requests), 1, dtype=torch.float32, device=device)
        shared_rows = [i for i, r in enumerate(requests) if r.generator is None]
        if len(shared_rows) == len(requests):
            uniform.uniform_(generator=self._shared_generator(device))
        elif shared_rows:
            uniform[shared_rows] = torch.rand(len(shared_rows), 1, device=device,
                                              generator=self._shared_generator(device))
        for i, request in enumerate(requests):
            if request.generator is not None:
                uniform[i] = torch.rand(1, dtype=torch.float32, device=device, generator=request.generator)
        return uniform

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = make_generator(self._seed, device)
            assert generator is not None   # the shared seed is an int
            self._shared_generators[device] = generator
        return generator


def sample_by_inverse_cdf(logits: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
    """Step 4 of the module docstring in torch, for rows that all sample randomly: divide by the
    temperature, filter, and take the first token whose cumulative probability exceeds ``u x
    total`` (``uniform``: ``[B, 1]``)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    logits = logits / temperature.to(device, non_blocking=True).unsqueeze(1)

    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    if use_top_k or use_top_p or use_min_p:
        logits = apply_top_k_top_p_min_p(
            logits,
            _row_tensor([p.top_k for p in params], torch.long, device) if use_top_k else None,
            _row_tensor([p.top_p for p in params], torch.float32, device) if use_top_p else None,
            _row_tensor([p.min_p for p in params], torch.float32, device) if use_min_p else None,
        )
    probs = logits.softmax(dim=-1)
    # Inverse CDF: the first token whose cumulative probability exceeds u * total (right=True:
    # a zero-probability token never matches, not even for u = 0).
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the match is a token whose probability is not zero.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


class _NativeSampler:
    """``sample_by_inverse_cdf`` in C on CPU (engine/csrc/sampling.c), with torch's threads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        if lib.tandem_sampling_abi_version() != SAMPLING_ABI_VERSION:
            raise KernelBuildError(f"sampling ABI {lib.tandem_sampling_abi_version()}, "
                                   f"expected {SAMPLING_ABI_VERSION}")
        self._rows = lib.tandem_sample_rows
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._rows.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, ctypes.c_int]
        self._rows.restype = ctypes.c_int

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 uniform: torch.Tensor) -> torch.Tensor | None:
        """The rows' tokens; None when a row has no token of probability above 0 (the caller
        takes the torch path, whatever that makes of it)."""
        logits = logits.contiguous()
        num_rows, vocab = logits.shape
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        uniform = uniform.reshape(-1).contiguous()
        out = torch.empty(num_rows, dtype=torch.int64)
        status = self._rows(logits.data_ptr(), logits.stride(0), num_rows, vocab, temperature.data_ptr(),
                            top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(), uniform.data_ptr(),
                            out.data_ptr(), torch.get_num_threads())
        if status == -2:
            raise MemoryError(f"sampling scratch for a vocabulary of {vocab}")
        return out if status == 0 else None


@lru_cache(maxsize=1)
def _native() -> _NativeSampler | None:
    try:
        return _NativeSampler(ctypes.CDLL(str(build(CSRC / "sampling.c"))))
    except (KernelBuildError, OSError) as exc:
        logger.warning("C sampler unavailable, sampling with torch ops: %s", exc)
        return None


def _mask_by_grammar(logits: torch.Tensor, rows: list[int], grammars: list[GrammarState]) -> torch.Tensor:
    """A copy of ``logits`` whose ``rows`` keep only the tokens their grammar allows next (the
    model runner's output is left as it was)."""
    logits = logits.clone()
    apply_grammar_masks(logits, rows, grammars)
    return logits


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (first index of the max, like torch). On CPU through NumPy, whose
    SIMD argmax is ~20x faster than torch's over a [64, 49152] float32 batch of logits."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _row_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _raw_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Logprob of each sampled token (every row) and the requested top-k pairs, taken from
    ``log_softmax`` of the raw logits."""
    logprobs = torch.log_softmax(logits, dim=-1)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    top_logprobs: list[list[tuple[int, float]]] = [[] for _ in params]
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if rows:
        max_k = max(params[i].logprobs or 0 for i in rows)
        # A stable sort rather than topk: ties come out lower token id first, every time.
        values, ids = logprobs[rows].sort(dim=-1, descending=True, stable=True)
        top_values, top_ids = values[:, :max_k].tolist(), ids[:, :max_k].tolist()
        for j, i in enumerate(rows):
            k = params[i].logprobs
            top_logprobs[i] = list(zip(top_ids[j][:k], top_values[j][:k]))
    return sampled, top_logprobs
