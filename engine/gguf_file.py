"""A fast GGUF header reader: metadata and tensor locations, tensors as memory-mapped bytes.

Runs wherever a GGUF model or its tokenizer is opened (workers, router, `tandem plan`).
numpy only, no torch. ``gguf.GGUFReader`` builds a numpy view per array element, which takes
seconds for a 49k-token vocabulary; this reads the same header in tens of milliseconds and
leaves dequantization to ``gguf.quants``.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_MAX_STRING_NBYTES = 1 << 24
_MAX_ARRAY_LEN = 1 << 26


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]      # numpy order: (rows, cols) for a matrix
    tensor_type: int            # gguf.GGMLQuantizationType value
    data: np.ndarray            # uint8 [..., bytes per row], memory-mapped


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} not found")
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._view = memoryview(self._buf)
        self._pos = 0
        try:
            self.metadata, infos = self._read_header()
            self.tensors = self._locate_tensors(infos)
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path} is not a valid GGUF file: {exc}") from exc

    # -- header ---------------------------------------------------------------------------
    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._view):
            raise ValueError("truncated header")
        (value,) = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        if n > _MAX_STRING_NBYTES or self._pos + n > len(self._view):
            raise ValueError(f"string of {n} bytes runs past the file")
        text = bytes(self._view[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown metadata value type {value_type}")
        elem_type, count = self._unpack("<I"), self._unpack("<Q")
        if count > _MAX_ARRAY_LEN:
            raise ValueError(f"metadata array of {count} elements")
        if elem_type in _NUMPY:
            dtype = np.dtype(_NUMPY[elem_type]).newbyteorder("<")
            end = self._pos + count * dtype.itemsize
            if end > len(self._view):
                raise ValueError("array runs past the file")
            values = np.frombuffer(self._view[self._pos:end], dtype=dtype).tolist()
            self._pos = end
            return values
        if elem_type == _STRING:
            return self._string_array(count)
        return [self._value(elem_type) for _ in range(count)]

    def _string_array(self, count: int) -> list[str]:
        # Tight loop: vocabularies hold ~10^5 strings.
        view, pos, end = self._view, self._pos, len(self._view)
        unpack = struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            (n,) = unpack(view, pos)
            pos += 8
            if pos + n > end:
                raise ValueError("string array runs past the file")
            out.append(str(view[pos:pos + n], "utf-8", "replace"))
            pos += n
        self._pos = pos
        return out

    def _read_header(self) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
        if bytes(self._view[:4]) != _MAGIC:
            raise ValueError("missing GGUF magic bytes")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_kv = self._unpack("<Q"), self._unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            num_dims = self._unpack("<I")
            dims = tuple(self._unpack("<Q") for _ in range(num_dims))
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        return metadata, infos

    def _locate_tensors(self, infos) -> list[GGUFTensor]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        tensors = []
        for name, dims, type_id, offset in infos:
            qtype = GGMLQuantizationType(type_id)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            shape = tuple(reversed(dims))   # GGUF lists the fastest-moving dim first
            row_nbytes = shape[-1] // block_size * type_size
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            start = data_start + offset
            end = start + rows * row_nbytes
            if end > len(self._buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = self._buf[start:end].reshape(*shape[:-1], row_nbytes)
            tensors.append(GGUFTensor(name, shape, type_id, data))
        return tensors

    def dequantize(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor as float32 in its numpy shape."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(tensor.tensor_type)
        try:
            out = dequantize(np.asarray(tensor.data), qtype)
        except NotImplementedError as exc:
            raise ValueError(f"{self.path}: tensor {tensor.name} uses {qtype.name}, which the gguf "
                             "package cannot dequantize") from exc
        out = np.asarray(out, dtype=np.float32).reshape(tensor.shape)
        return out if out.flags.writeable else out.copy()  # memory-mapped F32 tensors are read-only
