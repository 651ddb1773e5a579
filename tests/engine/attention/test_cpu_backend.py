"""The C paged-attention kernels (cpu_backend) against a float64 reference; picking the backend.

The reference is the torch path run in float64 on the same (possibly bfloat16) cache values, over
clean caches; the kernels then run over caches whose slots outside every context hold NaN, so a
read outside a context shows. Float32 must agree to 1e-5 relative (norm of the difference over
the norm of the reference); bfloat16 to 5e-3, which is what rounding the output to bfloat16
(8 significant bits, <= 2e-3 per element) leaves room for.
"""
from __future__ import annotations

import logging
import zlib

import pytest
import torch

from engine import native
from engine.attention import cpu_backend, cpu_kernels, torch_backend
from engine.config import ModelConfig
from engine.model_runner import attention_backend
from tests.engine.attention.paged import gather_context, make_paged_kv, naive_attention, rel_err

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
DTYPES = [torch.float32, torch.bfloat16]

# 1 token, block multiples (16, 64, 128), ragged lengths, and 300 = four 64-token key tiles + 44.
DECODE_SEQ_LENS = [37, 1, 16, 300, 13, 64, 128]
# (chunk length, context length incl. the chunk): fresh prompts, chunks over a cached prefix, a
# one-token chunk, an exact block; the last spans several query runs and key tiles.
PREFILL_CHUNKS = [(5, 5), (7, 20), (1, 9), (16, 16), (70, 100), (130, 300)]


@pytest.fixture
def gen(request) -> torch.Generator:
    """Fresh random inputs per case, reproducible from the test's id."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def threads():
    """Set torch's thread count for one test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------ helpers

def _decode_case(gen, seq_lens, *, group, num_kv_heads=2, head_dim=64, block_size=16,
                 dtype=torch.float32, partition_tokens=cpu_backend.DECODE_PARTITION_TOKENS,
                 query_scale=1.0):
    paged = make_paged_kv(gen, seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          block_size=block_size, dtype=dtype)
    query = (torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
             * query_scale).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    ref = torch_backend.decode_attention(query.double(), paged.k_cache.double(),
                                         paged.v_cache.double(), paged.block_tables, lens,
                                         max(seq_lens), scale)
    paged.poison(float("nan"))

    def run() -> torch.Tensor:
        return cpu_backend.decode_attention(query, paged.k_cache, paged.v_cache, paged.block_tables,
                                            lens, max(seq_lens), scale,
                                            partition_tokens=partition_tokens)
    return run, ref


def _prefill_case(gen, chunks, *, group, num_kv_heads=2, head_dim=64, block_size=16,
                  dtype=torch.float32):
    q_lens, seq_lens = (list(x) for x in zip(*chunks))
    paged = make_paged_kv(gen, seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          block_size=block_size, dtype=dtype)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    starts = (0, *torch.tensor(q_lens).cumsum(0).tolist())
    scale = head_dim ** -0.5
    ref = torch_backend.prefill_attention(query.double(), paged.k_cache.double(),
                                          paged.v_cache.double(), paged.block_tables, starts,
                                          tuple(seq_lens), scale)
    paged.poison(float("nan"))

    def run() -> torch.Tensor:
        return cpu_backend.prefill_attention(query, paged.k_cache, paged.v_cache,
                                             paged.block_tables, starts, tuple(seq_lens), scale)
    return run, ref


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"rel err {err:.2e}"


# ------------------------------------------------------------------------------------- decode

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128])   # bfloat16 values take 64 dims at a time, then 32
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_matches_float64_reference(gen, dtype, head_dim, group):
    run, ref = _decode_case(gen, DECODE_SEQ_LENS, group=group, head_dim=head_dim, dtype=dtype)
    _check(run(), ref, dtype)


# Split points inside and at the ends of 64-key tiles and 16-token blocks; 1 makes every key a
# partition. DECODE_SEQ_LENS's 300 then splits into 300 / p parts with a ragged last one.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("partition_tokens", [1, 16, 37, 64, 100, 299])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_split_contexts_match_float64_reference(gen, dtype, partition_tokens, group):
    run, ref = _decode_case(gen, DECODE_SEQ_LENS, group=group, num_kv_heads=3, dtype=dtype,
                            partition_tokens=partition_tokens)
    _check(run(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_split_merges_partitions_with_far_apart_maxima(gen, dtype):
    """Queries scaled up make each partition's maximum score differ by tens (log2 units) from
    the others': a merge that does not rescale every partition to the common maximum, or weighs
    sums and accumulators differently, is far off. Also the engine's shape: one long context
    among short ones, GQA 3."""
    seq_lens = [1100, 128, 5, 128, 77, 128, 128, 128]
    run, ref = _decode_case(gen, seq_lens, group=3, num_kv_heads=3, dtype=dtype, query_scale=8.0,
                            partition_tokens=100)
    _check(run(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_split_and_whole_contexts_agree(gen, threads, dtype):
    """The same inputs split at 64 keys and not at all, on 1 and 2 threads: the split results
    do not depend on the thread count, and split and whole agree with each other as closely as
    each does with the float64 reference."""
    seq_lens = [4096, 700, 64, 65]
    paged = make_paged_kv(gen, seq_lens, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    query = (torch.randn(4, 9, 64, generator=gen) * 4).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = torch_backend.decode_attention(query.double(), paged.k_cache.double(), paged.v_cache.double(),
                                         paged.block_tables, lens, 4096, 0.125)
    paged.poison(float("nan"))

    def run(partition_tokens: int) -> torch.Tensor:
        return cpu_backend.decode_attention(query, paged.k_cache, paged.v_cache, paged.block_tables,
                                            lens, 4096, 0.125, partition_tokens=partition_tokens)
    threads(1)
    whole, split_one = run(0), run(64)
    threads(2)
    split_two = run(64)
    assert torch.equal(split_one, split_two)
    _check(whole, ref, dtype)
    _check(split_two, ref, dtype)
    assert rel_err(split_two, whole) < TOLERANCE[dtype]


def test_negative_partition_length_is_refused(gen):
    run, _ = _decode_case(gen, [5], group=1, partition_tokens=-1)
    with pytest.raises(ValueError, match="partition_tokens=-1 must be >= 0"):
        run()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_decode_other_block_sizes(gen, dtype, block_size):
    run, ref = _decode_case(gen, DECODE_SEQ_LENS, group=3, num_kv_heads=3, block_size=block_size,
                            dtype=dtype)
    _check(run(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_head_dim_off_the_vector_width(gen, dtype):
    """head_dim 24 is not a multiple of 16: the portable loops, not the AVX-512 ones."""
    run, ref = _decode_case(gen, DECODE_SEQ_LENS, group=4, head_dim=24, dtype=dtype)
    _check(run(), ref, dtype)


def test_decode_matches_the_naive_token_by_token_reference(gen):
    seq_lens = [1, 16, 21]
    paged = make_paged_kv(gen, seq_lens, num_kv_heads=2, head_dim=64, block_size=4)
    query = torch.randn(3, 6, 64, generator=gen)
    expected = torch.cat([
        naive_attention(query[row:row + 1], gather_context(paged.k_cache, paged.block_tables[row], n),
                        gather_context(paged.v_cache, paged.block_tables[row], n), n - 1, 0.125)
        for row, n in enumerate(seq_lens)])
    out = cpu_backend.decode_attention(query, paged.k_cache, paged.v_cache, paged.block_tables,
                                       torch.tensor(seq_lens, dtype=torch.int32), 21, 0.125)
    assert rel_err(out, expected) < 1e-5


def test_decode_empty_context_yields_zeros(gen):
    """A padded batch row (seq_len 0) gives zeros and leaves its neighbours intact."""
    paged = make_paged_kv(gen, [70, 1], num_kv_heads=2, head_dim=64, block_size=16)
    query = torch.randn(3, 4, 64, generator=gen)
    table = torch.cat([paged.block_tables, paged.block_tables[:1]])
    lens = torch.tensor([70, 0, 1], dtype=torch.int32)
    ref = torch_backend.decode_attention(query.double(), paged.k_cache.double(),
                                         paged.v_cache.double(), table, lens, 70, 0.125)
    out = cpu_backend.decode_attention(query, paged.k_cache, paged.v_cache, table, lens, 70, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out[[0, 2]], ref[[0, 2]]) < 1e-5


def test_decode_reads_strided_queries_and_caches(gen):
    """Queries as views of a fused projection and caches as views of one pool, as in the model."""
    num_seqs, num_kv_heads, head_dim = 4, 2, 64
    paged = make_paged_kv(gen, [9, 40, 1, 17], num_kv_heads=num_kv_heads, head_dim=head_dim,
                          block_size=8)
    fused = torch.randn(num_seqs, 3, num_kv_heads * 3 * head_dim, generator=gen)
    query = fused[:, 1].view(num_seqs, num_kv_heads * 3, head_dim)
    assert not query.is_contiguous()
    pool = torch.stack([paged.k_cache, paged.v_cache], dim=1)  # [num_blocks, K/V, ...]
    lens = torch.tensor(paged.seq_lens, dtype=torch.int32)
    out = cpu_backend.decode_attention(query, pool[:, 0], pool[:, 1], paged.block_tables, lens,
                                       40, 0.125)
    ref = torch_backend.decode_attention(query.double(), paged.k_cache.double(),
                                         paged.v_cache.double(), paged.block_tables, lens, 40, 0.125)
    assert rel_err(out, ref) < 1e-5


# ------------------------------------------------------------------------------------ prefill

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128])   # bfloat16 products take 64 dims at a time, then 32
@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_matches_float64_reference(gen, dtype, head_dim, group):
    run, ref = _prefill_case(gen, PREFILL_CHUNKS, group=group, head_dim=head_dim, dtype=dtype)
    _check(run(), ref, dtype)


@pytest.mark.parametrize("chunks", [[(512, 512)], [(512, 1536)], [(1, 1000)]],
                         ids=["fresh_512", "512_over_1024_prefix", "1_over_999_prefix"])
def test_prefill_long_chunks(gen, chunks):
    run, ref = _prefill_case(gen, chunks, group=3, num_kv_heads=3, dtype=torch.bfloat16)
    _check(run(), ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_head_dim_off_the_vector_width(gen, dtype):
    run, ref = _prefill_case(gen, PREFILL_CHUNKS, group=3, head_dim=24, block_size=4, dtype=dtype)
    _check(run(), ref, dtype)


def test_prefill_matches_the_naive_token_by_token_reference(gen):
    chunks = [(5, 5), (3, 11), (6, 13)]
    q_lens, seq_lens = zip(*chunks)
    paged = make_paged_kv(gen, list(seq_lens), num_kv_heads=2, head_dim=32, block_size=4)
    query = torch.randn(sum(q_lens), 6, 32, generator=gen)
    starts = (0, 5, 8, 14)
    expected = torch.cat([
        naive_attention(query[starts[i]:starts[i + 1]],
                        gather_context(paged.k_cache, paged.block_tables[i], n),
                        gather_context(paged.v_cache, paged.block_tables[i], n), n - q, 32 ** -0.5)
        for i, (q, n) in enumerate(chunks)])
    out = cpu_backend.prefill_attention(query, paged.k_cache, paged.v_cache, paged.block_tables,
                                        starts, seq_lens, 32 ** -0.5)
    assert rel_err(out, expected) < 1e-5


def test_prefill_takes_offsets_and_lengths_as_tensors(gen):
    paged = make_paged_kv(gen, [3, 19], num_kv_heads=2, head_dim=32, block_size=4)
    query = torch.randn(7, 4, 32, generator=gen)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables)
    from_tuples = cpu_backend.prefill_attention(*args, (0, 3, 7), (3, 19), 0.25)
    from_tensors = cpu_backend.prefill_attention(*args, torch.tensor([0, 3, 7], dtype=torch.int32),
                                                 torch.tensor([3, 19]), 0.25)
    assert torch.equal(from_tuples, from_tensors)


# ------------------------------------------------------------------------- threads and errors

@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_one_and_two_threads_give_identical_results(gen, threads, kind):
    case = _decode_case if kind == "decode" else _prefill_case
    inputs = DECODE_SEQ_LENS if kind == "decode" else PREFILL_CHUNKS
    run, _ = case(gen, inputs, group=3, num_kv_heads=3, dtype=torch.bfloat16)
    threads(1)
    one = run()
    threads(2)
    two = run()
    assert torch.equal(one, two)


def test_decode_work_items_of_one_or_all_kv_heads_give_identical_results(gen, threads):
    """Two sequences on two threads: one KV head per work item; on one thread: all of a
    sequence's heads in one item. The same products in the same order either way, and both
    match the float64 reference."""
    run, ref = _decode_case(gen, [300, 45], group=3, num_kv_heads=3, dtype=torch.bfloat16)
    threads(2)
    per_head = run()
    threads(1)
    per_sequence = run()
    assert torch.equal(per_head, per_sequence)
    _check(per_sequence, ref, torch.bfloat16)


@pytest.mark.parametrize("chunks", [[(300, 300)], [(20, 50), (200, 520), (5, 5), (128, 128), (127, 200)]],
                         ids=["one long", "long and short mixed"])
def test_bfloat16_prefill_on_amx_sends_long_chunks_to_sdpa_and_stays_exact(gen, monkeypatch, chunks):
    """On AMX CPUs, bfloat16 chunks the AMX kernel cannot run take SDPA from SDPA_MIN_CHUNK tokens,
    the AVX-512 kernel below, in one output in the caller's row order (forced here, so any CPU
    checks it)."""
    run, ref = _prefill_case(gen, chunks, group=3, num_kv_heads=3, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_backend, "_AMX", True)
    monkeypatch.setattr(cpu_backend, "_amx_prefill", lambda query, k_cache, scale: False)
    calls = []
    sdpa = cpu_backend.torch_backend.prefill_attention
    monkeypatch.setattr(cpu_backend.torch_backend, "prefill_attention",
                        lambda query, *args: calls.append(query.shape[0]) or sdpa(query, *args))
    _check(run(), ref, torch.bfloat16)
    assert calls == [sum(q for q, _ in chunks if q >= cpu_backend.SDPA_MIN_CHUNK)]


amx_prefill = pytest.mark.skipif(
    not (cpu_backend._AMX and cpu_kernels.load().tandem_prefill_amx_ready()), reason="needs a CPU with AMX")


def _amx_kernel(query, k_cache, v_cache, block_tables, starts, seq_lens, scale):
    """tandem_paged_prefill_amx itself, so a case cannot pass on another kernel."""
    return cpu_backend._run(cpu_kernels.load().tandem_paged_prefill_amx, query, k_cache, v_cache, block_tables,
                            cpu_backend._int32(seq_lens), cpu_backend._int32(starts), scale)


@amx_prefill
@pytest.mark.parametrize("chunks", [PREFILL_CHUNKS, [(512, 512)], [(100, 1000)], [(17, 17)] * 9],
                         ids=["mixed", "fresh_512", "100_over_900_prefix", "nine_of_17"])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 3, 16), (128, 4, 32), (32, 1, 16), (64, 8, 64)])
def test_bfloat16_prefill_on_the_amx_kernel_matches_float64_reference(gen, monkeypatch, chunks, head_dim, group,
                                                                       block_size):
    """The AMX kernel over caches whose slots outside every context hold NaN; prefill_attention
    sends every chunk it can run to it."""
    run, ref = _prefill_case(gen, chunks, group=group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                             dtype=torch.bfloat16)
    calls, kernel_run = [], cpu_backend._run
    monkeypatch.setattr(cpu_backend, "_run", lambda fn, *args: calls.append(fn) or kernel_run(fn, *args))
    _check(run(), ref, torch.bfloat16)
    assert calls == [cpu_kernels.load().tandem_paged_prefill_amx]


@amx_prefill
@pytest.mark.parametrize("growth", [0.1, -0.0013], ids=["rising", "falling"])
def test_the_amx_prefill_kernel_stays_exact_when_scores_rise_or_fall_along_the_context(gen, growth):
    """Keys scaled by 1 + growth * position. Rising, the scores' max climbs ~240 (log2 units) along
    the 700-token context, far past the kernel's lazy-rescaling slack (8) and past float32's range
    (2^127): without rescaling the accumulator mid-context the weights overflow to inf. Falling,
    the first keys hold the max and later weights underflow towards 0."""
    chunks = [(300, 300), (40, 700)]
    q_lens, seq_lens = (list(x) for x in zip(*chunks))
    paged = make_paged_kv(gen, seq_lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    for row, seq_len in enumerate(seq_lens):
        for pos in range(seq_len):
            block, slot = int(paged.block_tables[row, pos // 16]), pos % 16
            paged.k_cache[block, slot] *= 1 + growth * pos
    query = torch.randn(sum(q_lens), 6, 64, generator=gen).bfloat16()
    starts = (0, *torch.tensor(q_lens).cumsum(0).tolist())
    ref = torch_backend.prefill_attention(query.double(), paged.k_cache.double(), paged.v_cache.double(),
                                          paged.block_tables, starts, tuple(seq_lens), 0.125)
    paged.poison(float("nan"))
    out = _amx_kernel(query, paged.k_cache, paged.v_cache, paged.block_tables, starts, seq_lens, 0.125)
    _check(out, ref, torch.bfloat16)


@amx_prefill
def test_the_amx_prefill_kernel_gives_the_same_results_on_one_and_two_threads(gen, threads):
    q_lens, seq_lens = zip(*PREFILL_CHUNKS)
    paged = make_paged_kv(gen, list(seq_lens), num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    query = torch.randn(sum(q_lens), 9, 64, generator=gen).bfloat16()
    starts = (0, *torch.tensor(q_lens).cumsum(0).tolist())
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, starts, seq_lens, 0.125)
    threads(1)
    one = _amx_kernel(*args)
    threads(2)
    assert torch.equal(one, _amx_kernel(*args))


def _bfloat16_prefill_case(gen, chunks, kernel, poison=False):
    """``kernel``'s output and the float64 reference on SmolLM2's heads (9 over 3 KV heads, 64
    dims), queries at twice the unit scale; ``poison``: the caches NaN outside every context."""
    q_lens, seq_lens = (list(x) for x in zip(*chunks))
    paged = make_paged_kv(gen, seq_lens, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    query = (2 * torch.randn(sum(q_lens), 9, 64, generator=gen)).bfloat16()
    starts = (0, *torch.tensor(q_lens).cumsum(0).tolist())
    ref = torch_backend.prefill_attention(query.double(), paged.k_cache.double(), paged.v_cache.double(),
                                          paged.block_tables, starts, tuple(seq_lens), 0.125)
    if poison:
        paged.poison(float("nan"))
    return kernel(query, paged.k_cache, paged.v_cache, paged.block_tables, starts, seq_lens, 0.125), ref


@amx_prefill
@pytest.mark.parametrize("chunks", [[(700, 700)], [(300, 700)]], ids=["fresh_700", "300_over_400"])
def test_the_amx_prefill_kernel_is_within_bfloat16s_own_rounding(gen, chunks):
    """Its softmax weights come from a short polynomial fitted for bfloat16 (they are rounded to
    it next): the output must stay within 1.5x of the error of rounding the float64 reference
    itself to bfloat16 (1.3x measured; the polynomial with its linear term off by 2% gives 2.2x,
    inside the general bfloat16 tolerance)."""
    out, ref = _bfloat16_prefill_case(gen, chunks, _amx_kernel)
    assert rel_err(out, ref) < 1.5 * rel_err(ref.bfloat16(), ref)


@amx_prefill
def test_the_amx_prefill_kernel_refuses_what_it_cannot_run(gen):
    """A head_dim off its 32-wide tiles is refused (prefill_attention never sends one), and so
    are a non-positive scale (a step's max is taken before scaling) and a block id outside the
    cache, before anything is computed."""
    paged = make_paged_kv(gen, [20], num_kv_heads=1, head_dim=48, block_size=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not supported here"):
        _amx_kernel(torch.randn(20, 1, 48).bfloat16(), paged.k_cache, paged.v_cache, paged.block_tables,
                    (0, 20), (20,), 0.1)
    assert not cpu_backend._amx_prefill(torch.randn(20, 1, 48).bfloat16(), paged.k_cache, 0.125)
    paged = make_paged_kv(gen, [20], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.bfloat16)
    query = torch.randn(20, 1, 64).bfloat16()
    with pytest.raises(ValueError, match="not supported here"):
        _amx_kernel(query, paged.k_cache, paged.v_cache, paged.block_tables, (0, 20), (20,), -0.1)
    assert not cpu_backend._amx_prefill(query, paged.k_cache, -0.1)
    table = paged.block_tables.clone()
    table[0, 1] = paged.k_cache.shape[0]
    with pytest.raises(ValueError, match="block table entry"):
        _amx_kernel(query, paged.k_cache, paged.v_cache, table, (0, 20), (20,), 0.1)


def test_block_id_outside_the_cache_is_refused(gen):
    paged = make_paged_kv(gen, [20], num_kv_heads=1, head_dim=16, block_size=16)
    table = paged.block_tables.clone()
    table[0, 1] = paged.k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="block table entry"):
        cpu_backend.decode_attention(torch.randn(1, 1, 16), paged.k_cache, paged.v_cache, table,
                                     torch.tensor([20], dtype=torch.int32), 20, 0.25)


def _prefill_kernel(query, k_cache, v_cache, block_tables, starts, seq_lens, scale):
    """tandem_paged_prefill itself (vdpbf16ps products for bfloat16 on CPUs with AVX512-BF16), not
    the AMX kernel or SDPA that prefill_attention may pick on an AMX CPU."""
    return cpu_backend._run(cpu_kernels.load().tandem_paged_prefill, query, k_cache, v_cache, block_tables,
                            cpu_backend._int32(seq_lens), cpu_backend._int32(starts), scale)


@pytest.mark.parametrize("chunks", [[(700, 700)], [(300, 700)], [(5, 70), (64, 64), (63, 129), (1, 65)]],
                         ids=["fresh_700", "300_over_400", "tile_edges"])
def test_the_bfloat16_prefill_kernel_is_within_bfloat16s_own_rounding(gen, chunks):
    """Its key tiles are packed once per call for all work items (an item may stop inside a
    tile another item reads further: 5 queries over a 70-token context, odd key counts): the
    output, over caches NaN outside every context, stays within 1.5x of the error of rounding
    the float64 reference itself to bfloat16."""
    out, ref = _bfloat16_prefill_case(gen, chunks, _prefill_kernel, poison=True)
    assert rel_err(out, ref) < 1.5 * rel_err(ref.bfloat16(), ref)


def test_the_bfloat16_prefill_kernel_refuses_a_block_id_outside_the_cache(gen):
    paged = make_paged_kv(gen, [40], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.bfloat16)
    table = paged.block_tables.clone()
    table[0, 1] = paged.k_cache.shape[0]
    with pytest.raises(ValueError, match="block table entry"):
        _prefill_kernel(torch.randn(40, 1, 64).bfloat16(), paged.k_cache, paged.v_cache, table, (0, 40), (40,), 0.1)


def test_context_longer_than_its_block_table_is_refused(gen):
    paged = make_paged_kv(gen, [20], num_kv_heads=1, head_dim=16, block_size=16,
                          extra_table_columns=0)
    with pytest.raises(ValueError, match="exceeds its block table"):
        cpu_backend.prefill_attention(torch.randn(1, 1, 16), paged.k_cache, paged.v_cache,
                                      paged.block_tables, (0, 1), (33,), 0.25)


def test_mismatched_shapes_are_refused_before_the_kernel(gen):
    paged = make_paged_kv(gen, [5, 9], num_kv_heads=2, head_dim=16, block_size=4)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"query \(2, 4, 32\) must be \[2, num_heads, 16\]"):
        cpu_backend.decode_attention(torch.randn(2, 4, 32), paged.k_cache, paged.v_cache,
                                     paged.block_tables, lens, 9, 0.25)
    with pytest.raises(ValueError, match="needs a row per sequence"):
        cpu_backend.decode_attention(torch.randn(2, 4, 16), paged.k_cache, paged.v_cache,
                                     paged.block_tables[:1], lens, 9, 0.25)
    with pytest.raises(ValueError, match=r"query \(6, 4, 16\) must be \[7, num_heads, 16\]"):
        cpu_backend.prefill_attention(torch.randn(6, 4, 16), paged.k_cache, paged.v_cache,
                                      paged.block_tables, (0, 3, 7), (5, 9), 0.25)


def test_float16_takes_the_torch_path(gen):
    paged = make_paged_kv(gen, [5, 17], num_kv_heads=2, head_dim=32, block_size=16,
                          dtype=torch.float16)
    query = torch.randn(2, 4, 32, generator=gen).half()
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables,
            torch.tensor([5, 17], dtype=torch.int32), 17, 0.25)
    assert torch.equal(cpu_backend.decode_attention(*args), torch_backend.decode_attention(*args))


@pytest.fixture(scope="module")
def portable_kernels(tmp_path_factory):
    """The kernels built without AVX-512: what a CPU without it runs (built into a private cache)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        path = native.build(cpu_kernels.SOURCE, cflags=(*native.CFLAGS, "-mno-avx512f"))
    return cpu_kernels.open_library(path)


@pytest.fixture(scope="module")
def no_bf16_kernels(tmp_path_factory):
    """The kernels built with AVX-512 but without AVX512-BF16: float32 products from bfloat16."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        path = native.build(cpu_kernels.SOURCE, cflags=(*native.CFLAGS, "-mno-avx512bf16"))
    return cpu_kernels.open_library(path)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["decode", "split decode", "prefill"])
@pytest.mark.parametrize("build", ["portable", "no avx512_bf16"])
def test_other_builds_match_float64_reference(gen, portable_kernels, no_bf16_kernels, monkeypatch,
                                              dtype, kind, build):
    lib = portable_kernels if build == "portable" else no_bf16_kernels
    monkeypatch.setattr(cpu_backend, "load_kernels", lambda: lib)
    if kind == "prefill":
        run, ref = _prefill_case(gen, PREFILL_CHUNKS, group=3, head_dim=64, dtype=dtype)
    else:
        run, ref = _decode_case(gen, DECODE_SEQ_LENS, group=3, head_dim=64, dtype=dtype,
                                partition_tokens=37 if kind == "split decode" else 0)
    _check(run(), ref, dtype)


# -------------------------------------------------------------------------- backend selection

def test_auto_picks_the_cpu_backend_on_cpu():
    assert attention_backend(ModelConfig(), torch.device("cpu")) is cpu_backend
    assert attention_backend(ModelConfig(attention_backend="cpu"), torch.device("cpu")) is cpu_backend
    assert attention_backend(ModelConfig(attention_backend="torch"), torch.device("cpu")) is torch_backend


def test_cpu_backend_needs_the_cpu_device():
    with pytest.raises(ValueError, match="attention_backend='cpu' needs --device cpu"):
        attention_backend(ModelConfig(attention_backend="cpu"), torch.device("cuda"))


def test_config_names_cpu_among_the_backends():
    with pytest.raises(ValueError, match="use auto, cpu, torch or triton"):
        ModelConfig(attention_backend="flash")


def test_broken_compiler_falls_back_to_torch_with_a_warning(kernel_cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):
        assert attention_backend(ModelConfig(), torch.device("cpu")) is torch_backend
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "using the slower torch backend" in warnings[0].getMessage()
    assert "CC='/bin/false'" in warnings[0].getMessage()


def test_broken_compiler_is_an_error_when_cpu_is_asked_for(kernel_cache, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.raises(cpu_backend.KernelBuildError, match="CC='/bin/false'"):
        attention_backend(ModelConfig(attention_backend="cpu"), torch.device("cpu"))
