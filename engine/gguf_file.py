"""A fast GGUF reader: metadata as Python values, tensors as memory-mapped bytes.

Runs wherever a GGUF model or its tokenizer is opened (workers, router, `tandem plan`).
The header is parsed with the standard library only (the router's tokenizer needs no numpy
or torch); tensors are located lazily with numpy and dequantized with ``gguf.quants``.
``gguf.GGUFReader`` builds a numpy view per array element, which takes seconds for a 49k-token
vocabulary; this reads the same header in tens of milliseconds.
"""
from __future__ import annotations

import array
import math
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.math_utils import cdiv
from engine.model_errors import ModelFileError

_MAGIC = b"GGUF"
_STRING, _ARRAY, _BOOL = 8, 9, 7
# value type -> array typecode; all GGUF scalars are little-endian.
_TYPECODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# The fewest header bytes one array element takes: an array's count is checked against the bytes
# left before anything is built from it, so a forged count cannot allocate past the file's size.
_MIN_ITEM_NBYTES = {_STRING: 8, _ARRAY: 12, **{t: struct.calcsize(c) for t, c in _TYPECODES.items()}}
_MAX_ARRAY_DEPTH = 4         # arrays of arrays nest this deep at most (llama.cpp writes 1)
_MAX_DIMS = 4                # GGML_MAX_DIMS
# GGML type id -> (name, weights per block, bytes per block): the types the quantized linear
# kernel reads (engine/models/quant_linear.py).
QTYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
          14: ("Q6_K", 256, 210)}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]      # numpy order: (rows, cols) for a matrix
    tensor_type: int            # gguf.GGMLQuantizationType value
    data: Any                   # numpy uint8 [..., bytes per row], memory-mapped


class _HeaderError(ValueError):
    """What is wrong, and where (``field``); the caller adds the file's path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(problem)
        self.field = field


class _HeaderReader:
    """Parses the key/value and tensor-info sections of a GGUF file from a byte buffer.
    ``field`` names what is being read, so an error can say where the file is wrong."""

    def __init__(self, buf: Any) -> None:
        self._buf = buf
        self.pos = 0
        self.field = "magic"

    def _fail(self, problem: str) -> _HeaderError:
        return _HeaderError(self.field, problem)

    def _take(self, nbytes: int) -> bytes:
        end = self.pos + nbytes
        if end > len(self._buf):
            raise self._fail(f"truncated: {nbytes} bytes at offset {self.pos} run past the end "
                             f"of the file ({len(self._buf)} bytes)")
        data = bytes(self._buf[self.pos:end])
        self.pos = end
        return data

    def u32(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self._take(8))[0]

    def string(self) -> str:
        try:
            return self._take(self.u64()).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._fail(f"a string is not UTF-8 ({exc.reason})") from None

    def value(self, value_type: int, depth: int = 0) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            if depth >= _MAX_ARRAY_DEPTH:
                raise self._fail(f"arrays nested more than {_MAX_ARRAY_DEPTH} deep")
            item_type, count = self.u32(), self.u64()
            if item_type not in _MIN_ITEM_NBYTES:
                raise self._fail(f"unknown array element type {item_type}")
            if count * _MIN_ITEM_NBYTES[item_type] > len(self._buf) - self.pos:
                raise self._fail(f"an array of {count} elements is larger than the rest of the file")
            if item_type in _TYPECODES:
                return self._numbers(item_type, count)
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            return [self.value(item_type, depth + 1) for _ in range(count)]
        if value_type in _TYPECODES:
            return self._numbers(value_type, 1)[0]
        raise self._fail(f"unknown metadata value type {value_type}")

    def _numbers(self, value_type: int, count: int) -> list:
        # One bulk copy per array: 49k token types cost microseconds, not a Python loop.
        values = array.array(_TYPECODES[value_type])
        values.frombytes(self._take(count * values.itemsize))
        if sys.byteorder != "little":
            values.byteswap()
        if value_type == _BOOL:
            return [bool(v) for v in values]
        return values.tolist()

    def metadata(self) -> tuple[dict[str, Any], int]:
        """(key/value metadata, tensor count)."""
        if self._take(4) != _MAGIC:
            raise self._fail("not a GGUF file (bad magic)")
        self.field = "version"
        version = self.u32()
        if version not in (2, 3):
            raise self._fail(f"GGUF version {version} is not supported (2 or 3)")
        self.field = "tensor_count"
        num_tensors = self.u64()
        self.field = "metadata_kv_count"
        num_kv = self.u64()
        meta = {}
        for i in range(num_kv):
            self.field = f"metadata key #{i}"
            key = self.string()
            self.field = f"metadata {key!r}"
            meta[key] = self.value(self.u32())
        return meta, num_tensors

    def tensor_infos(self, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
        infos = []
        for i in range(count):
            self.field = f"tensor info #{i}"
            name = self.string()
            self.field = f"tensor {name!r}"
            num_dims = self.u32()
            if not 1 <= num_dims <= _MAX_DIMS:
                raise self._fail(f"n_dims={num_dims}, expected 1 to {_MAX_DIMS}")
            dims = tuple(self.u64() for _ in range(num_dims))
            infos.append((name, dims, self.u32(), self.u64()))
        return infos


def _alignment(metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise _HeaderError("metadata 'general.alignment'",
                           f"{alignment!r} is not a positive power of two")
    return alignment


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of the GGUF file at ``path`` (standard library only); a malformed
    file raises ModelFileError naming the field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise _HeaderError("magic", "the file is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _HeaderReader(buf).metadata()[0]
    except _HeaderError as exc:
        raise ModelFileError(path, exc.field, str(exc), "GGUF") from None


class GGUFFile:
    """A GGUF model file: ``metadata``, and ``tensors`` memory-mapped in place. A malformed
    file raises ModelFileError naming the field."""

    def __init__(self, path: str | Path) -> None:
        import numpy as np

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            if self.path.stat().st_size == 0:
                raise _HeaderError("magic", "the file is empty")
            self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
            reader = _HeaderReader(memoryview(self._buf))  # type: ignore[arg-type]  # a memmap is a buffer
            self.metadata, num_tensors = reader.metadata()
            infos = reader.tensor_infos(num_tensors)
            self.tensors = self._locate_tensors(infos, reader.pos)
        except _HeaderError as exc:
            raise ModelFileError(self.path, exc.field, str(exc), "GGUF") from None

    def _locate_tensors(self, infos, header_end: int) -> list[GGUFTensor]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        alignment = _alignment(self.metadata)
        data_start = cdiv(header_end, alignment) * alignment
        tensors = []
        for name, dims, type_id, offset in infos:
            field = f"tensor {name!r}"
            if type_id not in GGMLQuantizationType._value2member_map_:
                raise _HeaderError(field, f"unknown tensor type {type_id}")
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            shape = tuple(reversed(dims))   # GGUF lists the fastest-moving dim first
            if 0 in shape:
                raise _HeaderError(field, f"a dimension is 0 in {dims}")
            if shape[-1] % block_size:
                raise _HeaderError(field, f"row of {shape[-1]} weights is not a whole number of "
                                          f"{block_size}-weight blocks")
            row_nbytes = shape[-1] // block_size * type_size
            # Python ints: a forged shape cannot wrap around as numpy's int64 product would.
            start = data_start + offset
            end = start + math.prod(shape[:-1]) * row_nbytes
            if end > len(self._buf):
                raise _HeaderError(field, f"data ({dims} at offset {offset}) runs past the end of the file")
            data = self._buf[start:end].reshape(*shape[:-1], row_nbytes)
            tensors.append(GGUFTensor(name, shape, type_id, data))
        return tensors

    def kernel_tensors(self) -> list[GGUFTensor]:
        """The matrices stored in a type the quantized linear kernel reads (QTYPES)."""
        return [t for t in self.tensors if t.tensor_type in QTYPES and len(t.shape) == 2]

    def kernel_block_bytes(self) -> int:
        """Their bytes: what a CPU worker keeps beside its dense weights with --gguf-kernels auto
        (``Checkpoint.quantized_weights``); none for a mixture-of-experts file (a router tensor
        present), whose model attaches no blocks (``MoEForCausalLM.attach_quantized``)."""
        if any(t.name.endswith(".ffn_gate_inp.weight") for t in self.tensors):
            return 0
        return sum(t.data.nbytes for t in self.kernel_tensors())

    def dequantize(self, tensor: GGUFTensor) -> Any:
        """The tensor as float32 in its numpy shape."""
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(tensor.tensor_type)
        try:
            out = dequantize(np.asarray(tensor.data), qtype)
        except NotImplementedError as exc:
            raise ModelFileError(self.path, f"tensor {tensor.name!r}",
                                 f"uses {qtype.name}, which the gguf package cannot dequantize", "GGUF") from exc
        out = np.asarray(out, dtype=np.float32).reshape(tensor.shape)
        return out if out.flags.writeable else out.copy()  # memory-mapped F32 tensors are read-only
