"""A fast GGUF reader: metadata as Python values, tensors as memory-mapped bytes.

Runs wherever a GGUF model or its tokenizer is opened (workers, router, `tandem plan`).
The header is parsed with the standard library only (the router's tokenizer needs no numpy
or torch); tensors are located lazily with numpy and dequantized with ``gguf.quants``.
``gguf.GGUFReader`` builds a numpy view per array element, which takes seconds for a 49k-token
vocabulary; this reads the same header in tens of milliseconds.
"""
from __future__ import annotations

import array
import mmap
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
_STRING, _ARRAY, _BOOL = 8, 9, 7
# value type -> array typecode; all GGUF scalars are little-endian.
_TYPECODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_MAX_ARRAY_LEN = 1 << 26
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


class _HeaderReader:
    """Parses the key/value and tensor-info sections of a GGUF file from a byte buffer."""

    def __init__(self, buf: Any) -> None:
        self._buf = buf
        self.pos = 0

    def _take(self, nbytes: int) -> bytes:
        end = self.pos + nbytes
        if end > len(self._buf):
            raise ValueError("truncated header")
        data = bytes(self._buf[self.pos:end])
        self.pos = end
        return data

    def u32(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self._take(8))[0]

    def string(self) -> str:
        return self._take(self.u64()).decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.u32(), self.u64()
            if count > _MAX_ARRAY_LEN:
                raise ValueError(f"metadata array of {count} elements")
            if item_type in _TYPECODES:
                return self._numbers(item_type, count)
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            return [self.value(item_type) for _ in range(count)]
        if value_type in _TYPECODES:
            return self._numbers(value_type, 1)[0]
        raise ValueError(f"unknown metadata value type {value_type}")

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
            raise ValueError("not a GGUF file (bad magic)")
        version = self.u32()
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_kv = self.u64(), self.u64()
        meta = {}
        for _ in range(num_kv):
            key = self.string()
            meta[key] = self.value(self.u32())
        return meta, num_tensors

    def tensor_infos(self, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
        infos = []
        for _ in range(count):
            name = self.string()
            dims = tuple(self.u64() for _ in range(self.u32()))
            infos.append((name, dims, self.u32(), self.u64()))
        return infos


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of the GGUF file at ``path`` (standard library only)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _HeaderReader(buf).metadata()[0]
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        raise ValueError(f"{path} is not a valid GGUF file: {exc}") from exc


class GGUFFile:
    """A GGUF model file: ``metadata``, and ``tensors`` memory-mapped in place."""

    def __init__(self, path: str | Path) -> None:
        import numpy as np

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
            reader = _HeaderReader(memoryview(self._buf))  # type: ignore[arg-type]  # a memmap is a buffer
            self.metadata, num_tensors = reader.metadata()
            infos = reader.tensor_infos(num_tensors)
            self.tensors = self._locate_tensors(infos, reader.pos)
        except (ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            raise ValueError(f"{self.path} is not a valid GGUF file: {exc}") from exc

    def _locate_tensors(self, infos, header_end: int) -> list[GGUFTensor]:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-header_end // alignment) * alignment
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

    def kernel_tensors(self) -> list[GGUFTensor]:
        """The matrices stored in a type the quantized linear kernel reads (QTYPES)."""
        return [t for t in self.tensors if t.tensor_type in QTYPES and len(t.shape) == 2]

    def kernel_block_bytes(self) -> int:
        """Their bytes: what a CPU worker keeps beside its dense weights with --gguf-kernels auto
        (``Checkpoint.quantized_weights``)."""
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
            raise ValueError(f"{self.path}: tensor {tensor.name} uses {qtype.name}, which the gguf "
                             "package cannot dequantize") from exc
        out = np.asarray(out, dtype=np.float32).reshape(tensor.shape)
        return out if out.flags.writeable else out.copy()  # memory-mapped F32 tensors are read-only
