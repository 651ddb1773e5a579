"""A model file is user input: whatever its bytes, opening it either works or raises
ModelFileError naming the file and the field -- never RecursionError, ZeroDivisionError,
IndexError, MemoryError or any other traceback (engine/gguf_file.py, engine/loader.py,
engine/model_source.py). Hypothesis mutates the header bytes of a small valid GGUF file and of a
small valid safetensors file; the explicit cases below pin each field by name.
"""
from __future__ import annotations

import json
import re
import resource
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.loader import Checkpoint
from engine.model_errors import ModelFileError
from engine.model_source import ModelSource

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS = 16, 32, 64, 4, 2
FUZZ = settings(max_examples=150, deadline=2000, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _tiny_gguf(path: Path, **overrides) -> Path:
    """A 1-layer Llama GGUF (F32, F16 and Q8_0 tensors) of a few tens of KB."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    fields = {"context_length": 64, "embedding_length": HIDDEN, "block_count": 1, "feed_forward_length": FFN,
              "head_count": HEADS, "head_count_kv": KV_HEADS, **overrides}
    writer.add_context_length(fields["context_length"])
    writer.add_embedding_length(fields["embedding_length"])
    writer.add_block_count(fields["block_count"])
    writer.add_feed_forward_length(fields["feed_forward_length"])
    writer.add_head_count(fields["head_count"])
    writer.add_head_count_kv(fields["head_count_kv"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HEADS * head_dim, HIDDEN), "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32)
        if name == "blk.0.ffn_up.weight":
            values = values.astype(np.float16)
        if name == "blk.0.ffn_gate.weight":
            writer.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _open(source: ModelSource) -> None:
    """Everything a worker reads from a model file before it builds the model."""
    checkpoint = Checkpoint(source)
    for _ in checkpoint.weights():
        pass
    checkpoint.quantized_weights()
    checkpoint.rope_freq_factors()


def _open_bytes(path: Path, data: bytes, kind: str) -> None:
    path.write_bytes(data)
    _open(ModelSource(kind, path if kind == "gguf" else path.parent))


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    return _tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


def _header_end(data: bytes) -> int:
    """Where a GGUF header's tensor data begins: the fuzzer mutates the bytes before it."""
    from engine.gguf_file import _HeaderReader

    reader = _HeaderReader(memoryview(data))
    _, count = reader.metadata()
    reader.tensor_infos(count)
    return reader.pos


@pytest.fixture(autouse=True)
def _bounded_memory():
    """A forged count must be refused before anything is allocated from it: 4 GiB of address
    space over what the test process already maps is far more than any legal open needs here."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (4 << 30), hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_the_tiny_gguf_loads(tmp_path, gguf_bytes):
    path = tmp_path / "model.gguf"
    _open_bytes(path, gguf_bytes, "gguf")
    names = {name for name, _ in Checkpoint(ModelSource("gguf", path)).weights()}
    assert "layers.0.mlp.gate_proj.weight" in names and len(names) == 11


@FUZZ
@given(data=st.data())
def test_mutated_gguf_header_loads_or_raises_model_file_error(tmp_path, gguf_bytes, data):
    end = _header_end(gguf_bytes)
    mutated = bytearray(gguf_bytes)
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, end - 1))
        if data.draw(st.booleans()):
            mutated[pos] = data.draw(st.integers(0, 255))
        else:   # a whole little-endian count/length/type field set to something hostile
            value = data.draw(st.sampled_from([0, 1, 2, 9, 0xFF, 0xFFFF, 1 << 31, (1 << 32) - 1, 1 << 62,
                                               (1 << 64) - 1]))
            mutated[pos:pos + 8] = struct.pack("<Q", value)[:len(mutated[pos:pos + 8])]
    if data.draw(st.booleans()):
        mutated = mutated[:data.draw(st.integers(0, len(mutated)))]
    path = tmp_path / "model.gguf"
    try:
        _open_bytes(path, bytes(mutated), "gguf")
    except ModelFileError as exc:
        assert str(path) in str(exc)


# -- each named field -------------------------------------------------------------------------

def _kv(key: str, value_type: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", value_type) + payload


def _gguf(*kvs: bytes, tensors: bytes = b"", num_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, num_tensors, len(kvs)) + b"".join(kvs) + tensors


def _tensor_info(name: str, dims: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    return (struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, offset))


_ARCH = _kv("general.architecture", 8, struct.pack("<Q", 5) + b"llama")
_NESTED = _kv("deep", 9, struct.pack("<IQ", 9, 1) * 100_000 + struct.pack("<IQ", 4, 0))


@pytest.mark.parametrize("content, field, problem", [
    (_gguf(_NESTED), "metadata 'deep'", "arrays nested more than 4 deep"),
    (_gguf(_kv("general.alignment", 4, struct.pack("<I", 0))), "metadata 'general.alignment'",
     "0 is not a positive power of two"),
    (_gguf(_kv("general.alignment", 8, struct.pack("<Q", 2) + b"32")), "metadata 'general.alignment'",
     "'32' is not a positive power of two"),
    (_gguf(tensors=_tensor_info("w", ()), num_tensors=1), "tensor 'w'", "n_dims=0, expected 1 to 4"),
    (_gguf(tensors=_tensor_info("w", (4, 0)), num_tensors=1), "tensor 'w'", "a dimension is 0"),
    (_gguf(tensors=_tensor_info("w", (1 << 62, 1 << 62)), num_tensors=1), "tensor 'w'", "runs past the end"),
    (_gguf(tensors=_tensor_info("w", (33,), type_id=8), num_tensors=1), "tensor 'w'",
     "not a whole number of 32-weight blocks"),
    (_gguf(tensors=_tensor_info("w", (4,), type_id=999), num_tensors=1), "tensor 'w'", "unknown tensor type 999"),
    (_gguf(_kv("tokens", 9, struct.pack("<IQ", 8, 1 << 60))), "metadata 'tokens'",
     "an array of 1152921504606846976 elements is larger than the rest of the file"),
    (_gguf(_kv("ids", 9, struct.pack("<IQ", 4, 1 << 40))), "metadata 'ids'", "larger than the rest of the file"),
    (_gguf(_kv("k", 8, struct.pack("<Q", 1 << 63))), "metadata 'k'", "truncated"),
    (_gguf(_kv("k", 8, struct.pack("<Q", 2) + b"\xff\xfe")), "metadata 'k'", "not UTF-8"),
    (_gguf(_kv("k", 77, b"")), "metadata 'k'", "unknown metadata value type 77"),
    (_gguf(num_tensors=1 << 60), "tensor info #0", "truncated"),
    (b"", "magic", "the file is empty"),
    (b"GGUF\x03\x00", "version", "truncated"),
])
def test_malformed_gguf_names_the_file_and_field(tmp_path, content, field, problem):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError, match=re.escape(f"{path} is not a valid GGUF file: {field}: ")) as info:
        _open(ModelSource("gguf", path))
    assert problem in str(info.value)
    assert info.value.field == field


@pytest.mark.parametrize("override, field, problem", [
    ({"head_count": 0}, "architecture", "num_heads=0 must be positive"),
    ({"head_count_kv": 0}, "architecture", "num_kv_heads=0 must be positive"),
    ({"block_count": 1 << 30}, "metadata block_count", "1073741824 layers, but the file holds tensors for 1"),
    ({"embedding_length": 1 << 30}, "tensor 'token_embd.weight'", "does not match"),
])
def test_gguf_header_sizes_are_checked(tmp_path, override, field, problem):
    path = _tiny_gguf(tmp_path / "model.gguf", **override)
    with pytest.raises(ModelFileError, match=re.escape(f"{path} is not a valid GGUF file: {field}: ")) as info:
        _open(ModelSource("gguf", path))
    assert problem in str(info.value)


# -- safetensors --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def safetensors_bytes(tmp_path_factory) -> bytes:
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file({"model.norm.weight": torch.ones(8), "lm_head.weight": torch.zeros(4, 8, dtype=torch.float16)},
              str(path))
    return path.read_bytes()


def _hf_dir(tmp_path: Path, weights: bytes) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    path = tmp_path / "model.safetensors"
    path.write_bytes(weights)
    return path


def _read_safetensors(path: Path) -> None:
    from engine.loader import _iter_safetensors

    for _ in _iter_safetensors(path.parent):
        pass


@FUZZ
@given(data=st.data())
def test_mutated_safetensors_header_reads_or_raises_model_file_error(tmp_path, safetensors_bytes, data):
    end = 8 + struct.unpack("<Q", safetensors_bytes[:8])[0]
    mutated = bytearray(safetensors_bytes)
    for _ in range(data.draw(st.integers(1, 6))):
        mutated[data.draw(st.integers(0, end - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        mutated = mutated[:data.draw(st.integers(0, len(mutated)))]
    path = _hf_dir(tmp_path, bytes(mutated))
    try:
        _read_safetensors(path)
    except ModelFileError as exc:
        assert str(path) in str(exc)


def _safetensors(header: object, data: bytes = b"", header_nbytes: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_nbytes is None else header_nbytes) + raw + data


@pytest.mark.parametrize("content, field, problem", [
    (_safetensors({}, header_nbytes=1 << 62), "header", "header too large"),
    (_safetensors([1, 2]), "header", "invalid JSON in header"),
    (_safetensors({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}, bytes(16)), "header",
     "invalid shape, data type, or offset"),
    (_safetensors({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)), "header",
     "unknown variant `Q9`"),
    (_safetensors({"w": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, bytes(16)), "header",
     "invalid shape, data type, or offset"),
    (_safetensors({"w": {"dtype": "U32", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)), "tensor 'w'",
     "dtype torch.uint32 is not a floating-point type"),
])
def test_malformed_safetensors_names_the_file_and_field(tmp_path, content, field, problem):
    path = _hf_dir(tmp_path, content)
    with pytest.raises(ModelFileError, match=re.escape(f"{path} is not a valid safetensors file: {field}: ")) as info:
        _read_safetensors(path)
    assert problem in str(info.value)


@pytest.mark.parametrize("config, field, problem", [
    ({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 0, "hidden_size": 64, "vocab_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 1}, "architecture", "num_heads=0 must be positive"),
    ({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4}, "hidden_size", "missing"),
    ({"architectures": ["LlamaForCausalLM"], "num_attention_heads": [4], "hidden_size": 64}, "architecture",
     "int() argument"),
    ([1, 2], "config.json", "is not a JSON object"),
])
def test_malformed_config_json_names_the_file_and_field(tmp_path, config, field, problem):
    from engine.model_source import load_arch

    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "config.json"
    with pytest.raises(ModelFileError, match=re.escape(f"{path} is not a valid HF config file: {field}: ")) as info:
        load_arch(ModelSource("hf", tmp_path))
    assert problem in str(info.value)
