"""Decode linears read from GGUF blocks (engine/csrc/quant_linear.c) against float64 references
and against the dense weights the loader dequantizes."""
from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.loader import Checkpoint, resolve_model
from engine.models import quant_linear
from engine.models.quant_linear import QTYPES, QuantizedWeight
from engine.native import build
from tests.models import SMOLLM2

pytestmark = pytest.mark.skipif(quant_linear.load() is None, reason="needs AVX-512 and a C compiler")
TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
K_TYPES = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K]


def _assert_matches_reference(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """float32 sums of K products against float64, within 1e-5 of the sum of the products' sizes
    (float32 accumulation in this kernel's order errs by at most ~40 roundings of 6e-8 of it; a
    single wrong weight would miss by the size of its own product)."""
    ref = x.double() @ dense.double().T
    scale = x.double().abs() @ dense.double().abs().T
    error = (got.double() - ref).abs()
    assert bool((error <= 1e-5 * scale + 1e-12).all()), f"max error {error.max():.3g}, scale {scale.max():.3g}"


def _weight(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    dense = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = quantize(dense, qtype)
    return (QuantizedWeight.from_blocks(int(qtype), blocks, cols),
            torch.from_numpy(dequantize(blocks, qtype).reshape(rows, cols)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
def test_matches_float64_reference(qtype, rows):
    # 37 output features: a partial tile of 4; rows cover partial and whole tiles of 6.
    weight, dense = _weight(qtype, 37, 96)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    got = quant_linear.linear(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    _assert_matches_reference(got, x, dense)


def _k_quant_weight(qtype: GGMLQuantizationType, rows: int, cols: int,
                    seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """Random K-quant super-blocks (gguf cannot quantize to these): random bytes are valid blocks
    once their float16 scales are finite, and gguf's dequantization is the reference."""
    _, weights, nbytes = QTYPES[int(qtype)]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // weights, nbytes), dtype=np.uint8)
    scale_offsets = (0, 2) if qtype == GGMLQuantizationType.Q4_K else (208,)   # d, dmin / d
    for offset in scale_offsets:
        scale = rng.uniform(1e-3, 1e-2, (rows, cols // weights)).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // weights, 2)
    blocks = blocks.reshape(rows, -1)
    return (QuantizedWeight.from_blocks(int(qtype), blocks, cols),
            torch.from_numpy(dequantize(blocks, qtype).reshape(rows, cols)))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_k_quants_match_float64_reference(qtype, rows):
    weight, dense = _k_quant_weight(qtype, 9, 512)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    _assert_matches_reference(quant_linear.linear(x, weight), x, dense)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quants_dequantize_exactly(qtype):
    weight, dense = _k_quant_weight(qtype, 5, 256, seed=2)
    assert torch.equal(quant_linear.linear(torch.eye(256), weight), dense.T)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantizes_exactly(qtype):
    """Rows of the identity pick single weights: every value equals gguf's dequantization bit for bit."""
    weight, dense = _weight(qtype, 12, 64, seed=1)
    assert torch.equal(quant_linear.linear(torch.eye(64), weight), dense.T)


def test_strided_rows_bias_and_bfloat16():
    weight, dense = _weight(GGMLQuantizationType.Q4_1, 20, 64)
    wide = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))
    x, bias = wide[:, :64], torch.randn(20)
    _assert_matches_reference(quant_linear.linear(x, weight, bias) - bias, x, dense)
    x16 = wide.bfloat16()[:, :64]   # strided bfloat16 rows; the weights as a bfloat16 model holds them
    got = quant_linear.linear(x16, weight)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x16.float() @ dense.bfloat16().float().T, rtol=1e-2, atol=1e-2)
    assert quant_linear.linear(torch.empty(0, 64), weight).shape == (0, 20)


def _cpu_has_amx_bf16() -> bool:
    from engine.config import cpu_has_amx_bf16

    return cpu_has_amx_bf16()


@pytest.mark.parametrize("qtype", TYPES + K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 70])
def test_bfloat16_steps(qtype, rows):
    """bfloat16 in and out (the AMX kernel where the CPU has AMX, vdpbf16ps where it has only
    AVX512-BF16, the float32 kernel elsewhere):
    the products of x and the weights rounded to bfloat16, as the dense bfloat16 weights hold them,
    summed in float32 and rounded once. Rows cover partial and whole blocks of 16 and more than
    the 4 blocks one pass holds; 37 output features a partial tile."""
    if qtype in K_TYPES:
        weight, dense = _k_quant_weight(qtype, 37, 512, seed=rows)
    else:
        weight, dense = _weight(qtype, 37, 96, seed=rows)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = quant_linear.linear(x, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 37)
    w16 = dense.bfloat16().double()
    ref = x.double() @ w16.T
    scale = x.double().abs() @ w16.abs().T
    # one bfloat16 rounding of the result (2^-9 relative) plus float32 sums' order
    error = (got.double() - ref).abs()
    assert bool((error <= 2.0 ** -8 * ref.abs() + 1e-5 * scale + 1e-12).all()), f"max error {error.max():.3g}"


def test_bfloat16_kernel_is_the_amx_one_where_the_cpu_has_amx():
    """A CPU with AMX must not fall back silently to the float32 kernel (2-3x slower at 16 rows),
    nor one with AVX512-BF16 and no AMX (its vdpbf16ps kernel: ~2x the float32 one's products)."""
    from engine.config import cpu_has_native_bf16

    kernel = quant_linear.load()
    assert kernel.amx == _cpu_has_amx_bf16()
    assert kernel.bf16 == cpu_has_native_bf16()


def _on_one_and_two_threads(x: torch.Tensor, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_linear.linear(x, weight)
        torch.set_num_threads(2)
        return one, quant_linear.linear(x, weight)
    finally:
        torch.set_num_threads(previous)


def test_bfloat16_results_do_not_depend_on_threads():
    weight, _ = _weight(GGMLQuantizationType.Q4_1, 200, 576, seed=4)
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    one, two = _on_one_and_two_threads(x, weight)
    assert torch.equal(one, two)


def test_bad_blocks_are_refused():
    blocks = quantize(np.ones((2, 64), np.float32), GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="no quantized kernel"):
        QuantizedWeight.from_blocks(int(GGMLQuantizationType.Q5_K), blocks, 64)
    with pytest.raises(ValueError, match="no quantized kernel"):   # a K-quant row is whole super-blocks
        QuantizedWeight.from_blocks(int(GGMLQuantizationType.Q4_K), blocks, 64)
    with pytest.raises(ValueError, match="not rows of 96"):
        QuantizedWeight.from_blocks(int(GGMLQuantizationType.Q8_0), blocks, 96)
    q8 = QuantizedWeight.from_blocks(int(GGMLQuantizationType.Q8_0), blocks, 64)
    q4, _ = _weight(GGMLQuantizationType.Q4_1, 2, 64)
    assert QuantizedWeight.concat([q8, q4]) is None
    assert QuantizedWeight.concat([q8, q8]).rows == 4
    # The C side checks what it trusts: a row width that disagrees with K is an error, not a read.
    lying = QuantizedWeight(q8.qtype, q8.data, 96, q8.rows)
    with pytest.raises(ValueError, match="bad shape"):
        quant_linear.linear(torch.ones(1, 96), lying)


def test_without_avx512_the_kernel_says_so():
    path = build(cflags=("-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC"),
                 source_path=quant_linear.SOURCE)
    lib = ctypes.CDLL(str(path))
    kernel = quant_linear._Kernel(lib)
    assert not kernel.supported
    weight, _ = _weight(GGMLQuantizationType.Q8_0, 4, 32)
    with pytest.raises(ValueError, match="no AVX-512"):
        kernel(torch.ones(1, 32), weight, None)


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2_gguf):
    return Checkpoint(resolve_model(SMOLLM2))


def test_gguf_blocks_match_the_loaded_weights(smollm2_checkpoint):
    """Same values, same row order (q/k rows un-permuted for rotate-half rotary) as the dense load."""
    quantized = smollm2_checkpoint.quantized_weights()
    assert {w.name for w in quantized.values()} == {"Q4_1", "Q8_0"}
    wanted = {"embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
              "layers.3.mlp.down_proj.weight"}
    seen = set()
    for name, dense in smollm2_checkpoint.weights():
        if name in wanted:
            weight = quantized[name]
            identity = torch.eye(weight.in_features)
            assert torch.equal(quant_linear.linear(identity, weight).T, dense), name
            seen.add(name)
    assert seen == wanted


def _assert_greedy_same(llm, linears, switch) -> None:
    """Greedy answers to two chat prompts as the model stands, then after ``switch(lin)`` on every linear."""
    from engine.config import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[{"role": "user", "content": "What is the capital of France?"}],
               [{"role": "user", "content": "List three prime numbers."}]]
    dense = [out.token_ids for out in llm.chat(prompts, params)]
    for lin in linears:
        switch(lin)
    assert [out.token_ids for out in llm.chat(prompts, params)] == dense


def _assert_greedy_same_from_blocks(llm, linears) -> None:
    """... with the dense weights, then with every linear reading its blocks."""
    _assert_greedy_same(llm, linears, lambda lin: setattr(lin, "quant_max_batch", 64))


def test_smollm2_decodes_the_same_from_blocks(smollm2_checkpoint):
    from engine.llm import LLM

    llm = LLM(SMOLLM2, dtype="float32", device="cpu", max_model_len=512, num_gpu_blocks_override=80,
              gguf_kernels="off")
    try:
        model = llm.engine.runner.model
        assert all(lin.quant is None for lin in model.modules() if hasattr(lin, "quant"))
        linears = model.attach_quantized(smollm2_checkpoint.quantized_weights())
        assert len(linears) == 4 * model.config.num_layers + 1   # qkv, o, gate_up, down per layer; the head
        x = torch.randn(3, model.config.hidden_size)
        qkv = model.layers[0].self_attn.qkv_proj
        torch.testing.assert_close(qkv.quantized_forward(x), qkv.dense_forward(x), rtol=1e-4, atol=1e-4)
        _assert_greedy_same_from_blocks(llm, linears)
        max_batch, timings = quant_linear.measure_max_batch(linears, torch.float32, batches=(1, 4), repeats=1,
                                                            dense_bytes=1 << 20)
        assert max_batch in (0, 1, 4) and set(timings) <= {1, 4}
    finally:
        llm.close()


def test_smollm2_bfloat16_decodes_the_same_from_blocks(smollm2_checkpoint):
    """bfloat16: the AMX kernel (where the CPU has AMX) multiplies the weights the dense bfloat16
    model holds, so only the order of float32 sums differs; the interleaved vdpbf16ps kernel
    (AVX512-BF16 without AMX) the GGUF values themselves, closer to the checkpoint than the dense
    weights' bfloat16 roundings. Either way the greedy text stays the same."""
    from engine.llm import LLM

    llm = LLM(SMOLLM2, dtype="bfloat16", device="cpu", max_model_len=512, num_gpu_blocks_override=80,
              gguf_kernels="off")
    try:
        model = llm.engine.runner.model
        linears = model.attach_quantized(smollm2_checkpoint.quantized_weights())
        kernel = quant_linear.load()
        assert all(lin.quant.interleaved == kernel.x16 for lin in linears)
        exact = {name: w for name, w in smollm2_checkpoint.weights()
                 if name in ("layers.7.mlp.down_proj.weight", "embed_tokens.weight")}
        for lin, name in ((model.layers[7].mlp.down_proj, "layers.7.mlp.down_proj.weight"),
                          (model.packed_head, "embed_tokens.weight")):
            x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(7)).bfloat16()
            got = lin.quantized_forward(x)
            if lin.quant.interleaved:
                ref = x.double() @ exact[name].double().T
                scale = x.double().abs() @ exact[name].double().abs().T
                error = (got.double() - ref).abs()
                assert bool((error <= 2.0 ** -8 * ref.abs() + 1e-5 * scale + 1e-12).all()), name
                assert error.max() < (lin.dense_forward(x).double() - ref).abs().max(), name
            else:
                torch.testing.assert_close(got.float(), lin.dense_forward(x).float(), rtol=2 ** -7, atol=1e-2)
        _assert_greedy_same_from_blocks(llm, linears)
    finally:
        llm.close()


x16_only = pytest.mark.skipif(quant_linear.load() is None or not quant_linear.load().x16,
                              reason="the interleaved kernel runs on CPUs with AVX512-BF16 and no usable AMX")


@x16_only
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
def test_interleaved_matches_float64_of_the_gguf_values(qtype, rows):
    """The interleaved kernel multiplies the GGUF values themselves (d q + m in float32), not their
    bfloat16 roundings: within one rounding of the result plus float32 sums' order of the float64
    product, where the bfloat16 weights miss by 2^-9 of each product. 37 output features leave a
    partial group of 16; rows cover the 1-8 of one pass (1, 2 and 4 chains) and more than one
    pass; x has a row stride wider than K."""
    weight, dense = _weight(qtype, 37, 96, seed=rows)
    packed = quant_linear.interleaved_for(weight, torch.bfloat16)
    assert packed.interleaved and packed.rows == 37 and packed.in_features == 96
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()[:, 16:112]
    got = quant_linear.linear(x, packed)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 37)
    ref = x.double() @ dense.double().T
    scale = x.double().abs() @ dense.double().abs().T
    error = (got.double() - ref).abs()
    assert bool((error <= 2.0 ** -8 * ref.abs() + 1e-5 * scale + 1e-12).all()), f"max error {error.max():.3g}"
    bias = torch.randn(37).bfloat16()
    assert torch.equal(quant_linear.linear(x, packed, bias), got + bias)


@x16_only
def test_interleaved_blocks_of_a_smollm2_size_and_threads():
    """A SmolLM2-sized gate/up weight (3,072 x 576) at a decode batch: the same numbers on one
    thread as on two (each group of 16 rows is one thread's fixed-order sums)."""
    weight, dense = _weight(GGMLQuantizationType.Q4_1, 3072, 576, seed=3)
    packed = quant_linear.interleaved_for(weight, torch.bfloat16)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    one, two = _on_one_and_two_threads(x, packed)
    assert torch.equal(one, two)
    ref = x.double() @ dense.double().T
    assert (two.double() - ref).abs().max() <= 2.0 ** -8 * ref.abs().max()


@x16_only
def test_interleaving_keeps_what_it_cannot_hold_and_refuses_float32():
    q4_k, _ = _k_quant_weight(GGMLQuantizationType.Q4_K, 16, 256)
    assert quant_linear.interleaved_for(q4_k, torch.bfloat16) is q4_k         # K-quants: the tiled kernel
    q8, _ = _weight(GGMLQuantizationType.Q8_0, 16, 64)
    assert quant_linear.interleaved_for(q8, torch.float32) is q8              # float32 models: the tiled kernel
    packed = quant_linear.interleaved_for(q8, torch.bfloat16)
    assert packed is not q8 and quant_linear.interleaved_for(packed, torch.bfloat16) is packed
    with pytest.raises(ValueError, match="bfloat16 inputs"):
        quant_linear.linear(torch.ones(1, 64), packed)
    with pytest.raises(AssertionError, match="then interleave"):
        QuantizedWeight.concat([packed, packed])
    # The C side checks what it trusts: a width or row count that disagrees with the bytes is an
    # error, not a read past them.
    for width, rows in ((48, packed.rows), (96, packed.rows), (64, packed.rows + 16)):
        with pytest.raises(ValueError, match="bad shape"):
            quant_linear.linear(torch.ones(1, width, dtype=torch.bfloat16),
                                QuantizedWeight(packed.qtype, packed.data, width, rows, interleaved=True))


def test_types_table_matches_gguf():
    from gguf import GGML_QUANT_SIZES

    for qtype, (name, weights, nbytes) in QTYPES.items():
        assert GGMLQuantizationType(qtype).name == name
        assert GGML_QUANT_SIZES[GGMLQuantizationType(qtype)] == (weights, nbytes)


def test_the_block_kernels_are_timed_on_the_thread_that_steps(smollm2_checkpoint, monkeypatch, tmp_path):
    """A worker builds its engine on one torch thread and steps on an engine thread with N
    (worker/loop.py). Timing the GGUF blocks against the dense weights at build time measured the
    wrong thread count (on 2 cores the compute-bound blocks lost to the cache-bound dense weights
    at 1 thread, so served decode never used them): the choice is timed by the first step, or by
    ``LLMEngine.tune_kernels``, on the thread that steps, once."""
    import threading

    from engine.config import SamplingParams
    from engine.llm import LLM

    timed: list[tuple[str, int]] = []

    def measure(linears, dtype, *args, **kwargs):
        timed.append((threading.current_thread().name, torch.get_num_threads()))
        return 4, {1: (1.0, 2.0), 4: (1.0, 2.0)}

    monkeypatch.setattr(quant_linear, "measure_max_batch", measure)
    monkeypatch.setattr(quant_linear, "tuning_dir", lambda: tmp_path)   # nothing timed earlier
    monkeypatch.setattr(quant_linear, "cpu_share", lambda seconds, cpu_seconds: 1.0)   # an instant fake timing
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as worker/process.py builds
    try:
        llm = LLM(SMOLLM2, dtype="float32", device="cpu", max_model_len=512, num_gpu_blocks_override=80)
    finally:
        torch.set_num_threads(threads)
    try:
        assert timed == []   # nothing timed at build
        model = llm.engine.runner.model
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

        def step_on_two_threads() -> None:
            torch.set_num_threads(2)
            llm.generate([[1, 2, 3]], params)
            llm.generate([[4, 5, 6]], params)

        stepper = threading.Thread(target=step_on_two_threads, name="stepper")
        stepper.start()
        stepper.join(120)
        assert not stepper.is_alive()
        assert timed == [("stepper", 2)]   # once, by the first step, with the stepping thread's threads
        linears = [lin for lin in model.modules() if getattr(lin, "quant", None) is not None]
        assert linears and all(lin.quant_max_batch == 4 for lin in linears)
        llm.engine.tune_kernels()   # already timed: nothing more
        assert len(timed) == 1
    finally:
        llm.close()


def test_a_restart_reads_the_timing_from_the_tuning_cache(monkeypatch, tmp_path):
    """A worker that starts again (after a crash, a scale-up, the next ``tandem serve``) reads
    what the first start timed instead of timing it again (~5 s for SmolLM2 in float32 on 2
    cores, with the workers of a node taking turns). Anything the timing depends on, here the
    thread count or the shapes, times it again; so does an unreadable cache file."""
    from engine.models.layers import PackedLinear

    calls: list[int] = []

    def measure(linears, dtype, *args, **kwargs):
        calls.append(len(linears))
        return 4, {1: (1.0, 2.0), 4: (1.5, 2.5), 16: (3.0, 2.0)}

    monkeypatch.setattr(quant_linear, "measure_max_batch", measure)
    monkeypatch.setattr(quant_linear, "cpu_share", lambda seconds, cpu_seconds: 1.0)   # an instant fake timing
    monkeypatch.setattr(quant_linear, "tuning_dir", lambda: tmp_path / "tuning")
    linears = [PackedLinear(torch.zeros(64, 32), None), PackedLinear(torch.zeros(32, 64), None)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = quant_linear.tuned_max_batch("gguf-blocks", linears, torch.float32)
        assert first == (4, {1: (1.0, 2.0), 4: (1.5, 2.5), 16: (3.0, 2.0)}, None) and calls == [2]
        again = quant_linear.tuned_max_batch("gguf-blocks", linears, torch.float32)
        assert again[:2] == first[:2] and again[2] is not None and calls == [2]   # read, not timed
        assert again[2].parent == tmp_path / "tuning"

        assert quant_linear.tuned_max_batch("gguf-blocks", linears[:1], torch.float32)[2] is None   # shapes
        assert quant_linear.tuned_max_batch("amx-rows", linears, torch.float32)[2] is None          # what is timed
        torch.set_num_threads(2)
        assert quant_linear.tuned_max_batch("gguf-blocks", linears, torch.float32)[2] is None       # threads
        assert len(calls) == 4
        torch.set_num_threads(1)
        again[2].write_text("{not json")
        assert quant_linear.tuned_max_batch("gguf-blocks", linears, torch.float32)[2] is None       # timed again
        assert len(calls) == 5 and quant_linear.tuned_max_batch("gguf-blocks", linears, torch.float32)[2]
    finally:
        torch.set_num_threads(threads)


def test_a_timing_disturbed_by_another_process_is_taken_again_and_never_cached(monkeypatch, tmp_path):
    """Workers of one node start together: while one times its linears the other loads its
    weights on the same cores, and a timing taken then (SmolLM2 at 8 rows: 38.9 ms quantized vs
    15.4 dense, where alone it is 8.6 vs 15.0) must neither decide this start after a retry could
    nor be kept for every later start."""
    from engine.models.layers import PackedLinear

    calls: list[int] = []
    shares: list[float] = []

    def measure(linears, dtype, *args, **kwargs):
        calls.append(len(linears))
        return (4, {1: (1.0, 2.0)}) if len(calls) > 1 else (0, {1: (9.0, 2.0)})

    monkeypatch.setattr(quant_linear, "measure_max_batch", measure)
    monkeypatch.setattr(quant_linear, "cpu_share", lambda seconds, cpu_seconds: shares.pop(0))
    monkeypatch.setattr(quant_linear, "TUNE_RETRY_S", 0.0)
    monkeypatch.setattr(quant_linear, "tuning_dir", lambda: tmp_path / "tuning")
    linears = [PackedLinear(torch.zeros(64, 32), None)]

    shares[:] = [0.5, 0.97]                    # disturbed, then alone: the second timing decides and is kept
    assert quant_linear.tuned_max_batch("gguf-blocks", linears, torch.float32) == (4, {1: (1.0, 2.0)}, None)
    assert len(calls) == 2 and quant_linear.tuned_max_batch("gguf-blocks", linears, torch.float32)[2] is not None

    calls.clear()
    shares[:] = [0.5] * quant_linear.TUNE_ATTEMPTS   # disturbed every time: used once, not cached
    assert quant_linear.tuned_max_batch("amx-rows", linears, torch.float32)[2] is None
    assert len(calls) == quant_linear.TUNE_ATTEMPTS and not list((tmp_path / "tuning").glob("amx-rows-*"))


def test_the_cpu_share_tells_a_quiet_core_from_a_shared_one():
    """What the retry rests on: this process busy on its threads for a while is a share near 1;
    the same wall time with half the CPU time is not."""
    threads = torch.get_num_threads()
    assert quant_linear.cpu_share(2.0, 2.0 * threads) == pytest.approx(1.0)
    assert quant_linear.cpu_share(2.0, 1.0 * threads) < quant_linear.TUNE_MIN_CPU_SHARE
    started, cpu = time.perf_counter(), quant_linear._process_cpu_seconds()
    end = started + 0.3
    while time.perf_counter() < end:   # one thread busy: the share is 1 / threads, near 1 on one thread
        pass
    share = quant_linear.cpu_share(time.perf_counter() - started, quant_linear._process_cpu_seconds() - cpu)
    assert 0.5 / threads < share <= 1.1


amx_only = pytest.mark.skipif(not _cpu_has_amx_bf16(), reason="the AMX rows kernel needs a CPU with AMX (and bf16)")


@amx_only
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 70])
def test_amx_rows_match_float64_and_the_packed_weights(rows):
    """The dense bfloat16 weights, row-major, on AMX (PackedLinear.rows): bf16 products summed in
    float32 and rounded once, as oneDNN's packed weights give them. 37 output features leave a
    partial tile of rows; a strided x; rows past 4 blocks of 16 take two passes."""
    from engine.models.layers import PackedLinear

    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(37, 96, generator=gen) * 0.1).bfloat16()
    lin = PackedLinear(weight, None)
    assert lin.rows is not None
    x = torch.randn(rows, 128, generator=gen).bfloat16()[:, 16:112]   # row stride 128, not 96
    got = lin.rows_forward(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 37)
    ref = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    error = (got.double() - ref).abs()
    assert bool((error <= 2.0 ** -8 * ref.abs() + 1e-5 * scale + 1e-12).all()), f"max error {error.max():.3g}"
    dense = lin.dense_forward(x.contiguous()).double()
    assert error.max() <= 1.5 * (dense - ref).abs().max() + 1e-12   # no worse than oneDNN's own rounding


@amx_only
def test_amx_rows_need_whole_32_column_blocks():
    from engine.models.layers import PackedLinear

    assert PackedLinear(torch.zeros(16, 40, dtype=torch.bfloat16), None).rows is None   # stays on oneDNN
    assert PackedLinear(torch.zeros(16, 64), None).rows is None                          # float32: oneDNN
    assert PackedLinear(torch.zeros(16, 64, dtype=torch.bfloat16), torch.zeros(16)).rows is None   # a bias: oneDNN
    with pytest.raises(ValueError, match="bad shape"):
        quant_linear.rows_linear(torch.zeros(2, 40, dtype=torch.bfloat16), torch.zeros(16, 40, dtype=torch.bfloat16))


@amx_only
def test_smollm2_bfloat16_decodes_the_same_from_amx_rows():
    """Greedy answers with the oneDNN-packed weights, then with every linear on the AMX rows."""
    from engine.llm import LLM
    from engine.models.layers import PackedLinear

    llm = LLM(SMOLLM2, dtype="bfloat16", device="cpu", max_model_len=512, num_gpu_blocks_override=80,
              gguf_kernels="off")
    try:
        llm.engine.tune_kernels()
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
        for lin in linears:
            lin.rows_max_batch = 0
        _assert_greedy_same(llm, linears, lambda lin: setattr(lin, "rows_max_batch", 64)
                            if lin.rows is not None else None)
    finally:
        llm.close()
