"""A lean GGUF parser: metadata and tensor views over one mmap, with bounds checks.

NOTE: `gguf.GGUFReader` builds a numpy memmap per element of every array field, which costs
~1.5 s for a 49k-token vocabulary on every load. We only need the scalar fields and the tensor
table: array fields are recorded as (type, count, offset) and decoded on demand, string arrays
are skipped by their length prefixes. Dequantization still goes through `gguf.quants`.

Layout (little endian): "GGUF" u32 version, u64 n_tensors, u64 n_kv, n_kv x (string key, u32 type,
value), n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset),
padding to `general.alignment` (32), tensor data.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value type -> struct format; 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file (bad magic, truncated, inconsistent)."""


@dataclass(slots=True)
class _Array:
    item_type: int      # GGUF value type of the elements
    count: int
    offset: int         # file offset of the first element


@dataclass(slots=True)
class GGUFTensor:
    name: str
    ggml_type: int      # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # torch order (outermost first): GGUF dims reversed
    data: np.ndarray    # raw view: float32/float16 elements, or uint8 bytes per row for quantized


class GGUFReader:
    """Parse `path`; `.fields` holds scalars (arrays lazily), `.tensors` the tensor views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.path.stat().st_size else b""
        self._size = len(self._mm)
        self._pos = 0
        if self._read(4) != b"GGUF":
            raise GGUFFormatError(f"not a GGUF file (bad magic): {self.path}")
        self.version = self._scalar(4)
        if self.version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {self.version} in {self.path}")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.fields.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def get(self, key: str, default: Any = None) -> Any:
        """A field's value; array fields decode to a list (strings) or a numpy array."""
        value = self.fields.get(key, default)
        return self._decode_array(value) if isinstance(value, _Array) else value

    def array_len(self, key: str) -> int | None:
        value = self.fields.get(key)
        return value.count if isinstance(value, _Array) else None

    # ------------------------------------------------------------------ parsing helpers

    def _read(self, n: int) -> bytes:
        end = self._pos + n
        if end > self._size:
            raise GGUFFormatError(f"truncated GGUF file {self.path}: needs byte {end}, "
                                  f"file has {self._size}")
        out = self._mm[self._pos:end]
        self._pos = end
        return out

    def _scalar(self, value_type: int) -> Any:
        fmt = _SCALARS[value_type]
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        raw = self._read(self._scalar(10))
        return raw.decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._scalar(4), self._scalar(10)
            arr = _Array(item_type, count, self._pos)
            if item_type == _STRING:
                for _ in range(count):  # skip: length-prefixed, so we must walk them
                    length = self._scalar(10)
                    self._pos += length
            elif item_type in _SCALARS:
                self._pos += count * struct.calcsize(_SCALARS[item_type])
            else:
                raise GGUFFormatError(f"unsupported GGUF array element type {item_type} in {self.path}")
            if self._pos > self._size:
                raise GGUFFormatError(f"truncated GGUF file {self.path} (inside an array field)")
            return arr
        if value_type not in _SCALARS:
            raise GGUFFormatError(f"unknown GGUF value type {value_type} in {self.path}")
        return self._scalar(value_type)

    def _decode_array(self, arr: _Array) -> Any:
        saved, self._pos = self._pos, arr.offset
        try:
            if arr.item_type == _STRING:
                return [self._string() for _ in range(arr.count)]
            return np.frombuffer(self._mm, dtype=_SCALARS[arr.item_type], count=arr.count, offset=arr.offset)
        finally:
            self._pos = saved

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar(4)
        dims = tuple(self._scalar(10) for _ in range(n_dims))
        return name, dims, self._scalar(4), self._scalar(10)

    def _tensor(self, data_start: int, name: str, dims: tuple[int, ...], ggml_type: int,
                offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: PLC0415
        from gguf.quants import quant_shape_to_byte_shape  # noqa: PLC0415

        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} in {self.path} has unknown ggml type {ggml_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims)) if dims else 1
        n_bytes = n_elems // block * type_size
        start = data_start + offset
        if start + n_bytes > self._size:
            raise GGUFFormatError(f"truncated GGUF file {self.path}: tensor {name} needs bytes "
                                  f"{start}..{start + n_bytes}, file has {self._size}")
        shape = tuple(reversed(dims))
        if qtype == GGMLQuantizationType.F32:
            data = np.frombuffer(self._mm, np.float32, n_elems, start).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = np.frombuffer(self._mm, np.float16, n_elems, start).reshape(shape)
        else:
            data = np.frombuffer(self._mm, np.uint8, n_bytes, start).reshape(
                quant_shape_to_byte_shape(shape, qtype))
        return GGUFTensor(name=name, ggml_type=ggml_type, shape=shape, data=data)


def open_gguf(path: Path) -> GGUFReader:
    """A GGUFReader for `path`; every parse failure is a GGUFFormatError naming the file."""
    try:
        return GGUFReader(path)
    except GGUFFormatError:
        raise
    except Exception as e:  # struct / unicode errors on a corrupt header
        raise GGUFFormatError(f"malformed GGUF file {path}: {type(e).__name__}: {e}") from None
